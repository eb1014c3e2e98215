"""``multi_request`` in the engine: queries over one shared compressed context (``ec.prefill_context`` once, each
query a ``Request(prefix=session)``) against the same queries sent whole (context + query, ``compress_prefix`` the
context), side by side in one run, on a random Llama of a chosen shape (bf16 on a GPU).

    python benchmarks/bench_multi_request.py --device cuda --shape 8b --context 16384 --queries 32 --slots 32
    python benchmarks/bench_multi_request.py --quick          # a CPU smoke run

Both ways compress the context alone, so each answer is the same (fp32; bf16 kernels of other shapes may part at
near ties, counted). Per method and way: prefill tokens computed, wall seconds, time to first token per call (the
shared way charges the context's one prefill to its first call, as evalkit's rows do), peak memory above the model.
Each way runs the compiled engine after a warm-up on the same shapes.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import build_model, model_arguments, model_dtype, sync  # noqa: E402
from bench_long_prefill import memory_mark, peak_since  # noqa: E402

import evalkit.compression as ec  # noqa: E402


def workload(args, vocab: int, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    context = torch.randint(3, vocab, (args.context,), generator=g)
    lengths = torch.randint(args.query_min, args.query_max + 1, (args.queries,), generator=g).tolist()
    return context, [torch.randint(3, vocab, (n,), generator=g) for n in lengths]


def whole(context, queries, new):
    return [ec.Request(torch.cat([context, q]), max_new_tokens=new, compress_prefix=len(context)) for q in queries]


def shared(model, policy, context, queries, new, device):
    session, seconds = ec.prefill_context(model, policy, context[None].to(device))
    return [ec.Request(q, max_new_tokens=new, prefix=session) for q in queries], seconds


def timed_run(engine, requests, device, context_seconds=0.0):
    mark = memory_mark(device)
    started = time.perf_counter()
    done = engine.run(requests)
    sync(device)
    wall = time.perf_counter() - started + context_seconds
    ttft = [c.stats["time_to_first_token_s"] for c in done]
    ttft[0] += context_seconds  # the first call is charged the context's prefill
    computed = sum(c.stats.get("prefill_tokens_computed", c.stats["prompt_tokens"]) for c in done)
    return [list(c.tokens) for c in done], dict(wall_s=wall, ttft_s=ttft, prefill_tokens=computed,
                                                peak_bytes=peak_since(device, mark))


def run_method(model, method: str, args, context, queries, warm) -> dict:
    budget = None if method == "full" else args.budget
    longest = args.context + args.query_max + args.new
    policy = ec.policy_from_budget(method, budget, longest)
    slot_tokens = policy.cache_capacity() or longest
    engine = ec.Engine(model, policy, slots=args.slots, slot_tokens=slot_tokens, compile=not args.eager)
    engine.run(whole(*warm, args.new))  # compiles the step; warms the shared way's shapes too
    engine.run(shared(model, policy, *warm, args.new, args.device)[0])
    tokens_whole, row_whole = timed_run(engine, whole(context, queries, args.new), args.device)
    started = time.perf_counter()
    requests, context_seconds = shared(model, policy, context, queries, args.new, args.device)
    sync(args.device)
    context_seconds = max(context_seconds, time.perf_counter() - started)
    tokens_shared, row_shared = timed_run(engine, requests, args.device, context_seconds)
    row_shared["prefill_tokens"] += len(context)
    same = sum(a == b for a, b in zip(tokens_whole, tokens_shared))
    return dict(method=method, slots=args.slots, slot_tokens=slot_tokens, whole=row_whole, shared=row_shared,
                context_prefill_s=context_seconds, same_answers=same, queries=len(queries))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_arguments(parser)
    parser.add_argument("--methods", nargs="+", default=["full", "snapkv", "snapstream"])
    parser.add_argument("--budget", default="4x")
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--queries", type=int, default=32)
    parser.add_argument("--query-min", type=int, default=32)
    parser.add_argument("--query-max", type=int, default=128)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--eager", action="store_true", help="do not compile the decode step")
    parser.add_argument("--quick", action="store_true", help="a CPU smoke run")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.quick:
        args.context, args.queries, args.query_min, args.query_max, args.new, args.slots, args.eager = (
            256, 4, 8, 16, 4, 2, True)
    torch.set_grad_enabled(False)
    model = build_model(args.shape, args.device, model_dtype(args))
    vocab = model.config.vocab_size
    context, queries = workload(args, vocab, seed=0)
    warm_args = argparse.Namespace(**{**vars(args), "queries": min(args.queries, args.slots)})
    warm = workload(warm_args, vocab, seed=1)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{device_name}: random Llama {args.shape} ({model_dtype(args)}); a {args.context}-token context, "
          f"{args.queries} queries of {args.query_min}..{args.query_max} tokens, {args.new} new tokens each, "
          f"{args.slots} slots, greedy", flush=True)
    rows = []
    for method in args.methods:
        rows.append(run_method(model, method, args, context, queries, warm))
        print(json.dumps(rows[-1]), flush=True)
        gc.collect()
        torch._dynamo.reset()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    print(f"\n{'method':<12}{'prefill tokens whole':>21}{'shared':>9}{'wall s whole':>13}{'shared':>8}{'speed-up':>9}"
          f"{'TTFT ms whole (median)':>23}{'shared: 1st':>12}{'later':>8}{'peak GiB whole':>15}{'shared':>8}{'same':>7}")
    for r in rows:
        w, s = r["whole"], r["shared"]
        later = statistics.median(s["ttft_s"][1:]) if len(s["ttft_s"]) > 1 else float("nan")
        print(f"{r['method']:<12}{w['prefill_tokens']:>21}{s['prefill_tokens']:>9}{w['wall_s']:>13.2f}{s['wall_s']:>8.2f}"
              f"{w['wall_s'] / s['wall_s']:>8.2f}x{1000 * statistics.median(w['ttft_s']):>23.1f}"
              f"{1000 * s['ttft_s'][0]:>12.1f}{1000 * later:>8.1f}{w['peak_bytes'] / 2**30:>15.2f}"
              f"{s['peak_bytes'] / 2**30:>8.2f}{r['same_answers']:>4}/{r['queries']}")
    if args.json:
        meta = dict(device=device_name, shape=args.shape, torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
                    args=vars(args))
        Path(args.json).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
