"""On paper: the GPU-hours of AIME24 x 64 over the paper's grid (conf/experiment/paper_grid.yaml's methods and
budgets) with DeepSeek-R1-Distill-Llama-8B, one engine replica per H100, from the decode rows measured on an H100.

    python benchmarks/paper_grid_cost.py [--mean-trace 12000] [--gpus 64]

Per-replica throughput comes from what the H100 rows measured (docs/benchmarks.md, "On a GPU", 2026-11-23): the compiled engine's
decode step reads the weights and its whole static cache (attention reads every reserved slot) at an effective
bandwidth of bytes / step time, 2.42 TB/s (SnapStream 4x, 64 x 2048 tokens, 13.71 ms) and 2.48 TB/s (Full,
16 x 8192, 13.39 ms). A configuration's step reads 16.06 GB of bf16 weights plus its slots' reservations (a growing
cache reserves prompt + 32,768 new tokens; a fixed one its capacity, at most that) at 128 KiB per token (32 layers x
8 KV heads x 128 x K,V x bf16); its slots are as many as fit in 54 GiB of KV (80 GB less weights, activations and
CUDA's share), at most 64 (the measured engine's). Tokens: 30 problems x 64 samples x ``--mean-trace`` generated
tokens each (an assumption: replace it with the mean ``generated_tokens`` of a real run's samples table).
"""

from __future__ import annotations

import argparse

WEIGHT_BYTES = 16.06e9  # Llama-3.1-8B: 8.03B parameters in bf16
TOKEN_BYTES = 32 * 8 * 128 * 2 * 2  # per cached token: layers x KV heads x head dim x (K, V) x bf16
MEASURED = [(64 * 2048, 13.71e-3), (16 * 8192, 13.39e-3)]  # (cache tokens read per step, seconds per step), H100
KV_ROOM = 54 * 2**30
MAX_SLOTS = 64
MAX_CONTEXT, MAX_NEW, PROMPT = 131072, 32768, 160  # the model's context; AIME's cap on new tokens; a typical prompt
REQUESTS = 30 * 64
GRID = [("full", None), *[(m, b) for m in ("streaming_llm", "snapkv", "snapstream") for b in (2, 4, 8)]]


def effective_bandwidth() -> float:
    rates = [(WEIGHT_BYTES + tokens * TOKEN_BYTES) / seconds for tokens, seconds in MEASURED]
    return sum(rates) / len(rates)


def slot_tokens(method: str, budget: int | None) -> int:
    """What one request's slot reserves: SnapKV compresses the prompt only (AIME's are short), so it reserves as
    Full does; the fixed-capacity methods hold max_context / budget, never more than the request can fill."""
    grown = PROMPT + MAX_NEW
    return grown if method in ("full", "snapkv") else min(MAX_CONTEXT // budget, grown)


def replica_rate(slot: int, bandwidth: float) -> tuple[int, float]:
    slots = min(MAX_SLOTS, KV_ROOM // (slot * TOKEN_BYTES))
    step = (WEIGHT_BYTES + slots * slot * TOKEN_BYTES) / bandwidth
    return slots, slots / step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mean-trace", type=int, default=12000, help="mean generated tokens per sample (assumed)")
    parser.add_argument("--gpus", type=int, default=64)
    args = parser.parse_args()
    bandwidth = effective_bandwidth()
    tokens = REQUESTS * args.mean_trace
    print(f"effective bandwidth from the measured rows: {bandwidth / 1e12:.2f} TB/s; {REQUESTS} samples x "
          f"{args.mean_trace:,} tokens = {tokens / 1e6:.1f}M tokens per configuration\n")
    print("| method | budget | slot tokens | slots per GPU | tok/s per replica | GPU-hours |")
    print("|---|---|---|---|---|---|")
    total = 0.0
    for method, budget in GRID:
        slot = slot_tokens(method, budget)
        slots, rate = replica_rate(slot, bandwidth)
        hours = tokens / rate / 3600
        total += hours
        print(f"| {method} | {f'{budget}x' if budget else '-'} | {slot:,} | {slots} | {rate:,.0f} | {hours:.1f} |")
    print(f"\n{len(GRID)} configurations: {total:.0f} GPU-hours; on {args.gpus} GPUs {total / args.gpus:.1f} h of "
          "generation when every replica is kept busy")


if __name__ == "__main__":
    main()
