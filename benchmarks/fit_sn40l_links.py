"""Fit SN40L's two unpublished link figures, ``link_bandwidth`` and ``link_latency``, to SambaNova's public speeds.

No public figure gives SN40L's socket-to-socket bandwidth or latency. Two public speeds of DeepSeek-R1 on 16 sockets
(deployment ``deepseek_r1_tp16_128k``, SnapStream's 4x budget) pin them:
  * per user, batch 1: 198 tok/s (SambaNova's DAC 2025 talk) and "exceeding 250" (SambaNova's blog): we take 224,
    the middle;
  * the whole node, the largest batch that fits: up to 1,832 tok/s (SnapStream, arXiv 2511.03092).
A step's communication is ``hops x link_latency + bytes / link_bandwidth`` (evalkit.memory.interconnect), so each speed
is one linear equation in ``link_latency`` and ``1 / link_bandwidth``: two equations, two unknowns, solved exactly.
Batch 1 sends little (its step is mostly latency), the large batch a lot (mostly bandwidth). The fitted figures are
effective ones: they also absorb what the simulator does not price (compute, routing skew, anything else the
published speeds pay for).

    python benchmarks/fit_sn40l_links.py      # prints the two values for conf/hardware/sn40l.yaml, then checks them
"""

from __future__ import annotations

import dataclasses
import math

from evalkit import memory
from evalkit.memory import interconnect

PER_USER = (198, 250)  # tok/s per user at batch 1: SambaNova DAC 2025 talk; SambaNova blog ("exceeding 250")
PER_USER_TARGET = sum(PER_USER) / 2
AGGREGATE = 1832  # tok/s, whole node: SnapStream (arXiv 2511.03092)
BUDGET = "4x"


def with_links(d: memory.Deployment, link_bandwidth: float, link_latency: float) -> memory.Deployment:
    hardware = dataclasses.replace(d.hardware, link_bandwidth=link_bandwidth, link_latency=link_latency)
    return dataclasses.replace(d, hardware=hardware)


def fit(d: memory.Deployment) -> tuple[float, float]:
    """(link_bandwidth in bytes/s, link_latency in s) that put the two speeds of ``d`` exactly on their targets."""
    capacity = memory.capacity_for_budget(BUDGET, d.context)
    rows = []
    for batch, rate in ((1, PER_USER_TARGET), (memory.price(d, capacity).max_batch, AGGREGATE)):
        at = dataclasses.replace(d, batch=batch)
        verdict = memory.price(at, capacity)
        reads = verdict.step_seconds / at.slowdown - verdict.comm_seconds  # the memory part of the step
        hops = interconnect.step_seconds(with_links(at, math.inf, 1.0))  # hops in a row (1 s each)
        sent = interconnect.step_seconds(with_links(at, 1.0, 0.0))  # bytes over each socket's link
        rows.append((hops, sent, batch * at.tokens_per_step / rate / at.slowdown - reads))
    (h1, s1, c1), (h2, s2, c2) = rows
    determinant = h1 * s2 - h2 * s1
    latency, inverse_bandwidth = (c1 * s2 - c2 * s1) / determinant, (h1 * c2 - h2 * c1) / determinant
    if latency < 0 or inverse_bandwidth <= 0:
        raise SystemExit(f"no physical fit: latency {latency:.3g} s, 1/bandwidth {inverse_bandwidth:.3g} s/B")
    return 1 / inverse_bandwidth, latency


def speeds(d: memory.Deployment) -> dict:
    capacity = memory.capacity_for_budget(BUDGET, d.context)
    return {"per user, batch 1, full cache": memory.price(d).decode_tokens_per_s,
            f"per user, batch 1, {BUDGET}": memory.price(d, capacity).decode_tokens_per_s,
            f"node, best batch, {BUDGET}": memory.best_throughput(d, capacity)[1]}


def main() -> None:
    shipped = memory.load_deployment("deepseek_r1_tp16_128k", hardware="sn40l")
    bandwidth, latency = fit(shipped)
    print(f"exact fit: link_bandwidth {bandwidth / 1e9:.1f} GB/s, link_latency {latency * 1e6:.3f} us")
    print(f"conf/hardware/sn40l.yaml: link_bandwidth {shipped.hardware.link_bandwidth / 1e9:.1f} GB/s, "
          f"link_latency {shipped.hardware.link_latency * 1e6:.3f} us, which give:")
    for name, rate in speeds(shipped).items():
        low, high = (PER_USER[0] / 1.5, PER_USER[1] * 1.5) if name.startswith("per user") else \
            (AGGREGATE / 1.5, AGGREGATE * 1.5)
        print(f"  {name}: {rate:,.0f} tok/s ({'within' if low <= rate <= high else 'OUTSIDE'} {low:,.0f}-{high:,.0f})")


if __name__ == "__main__":
    main()
