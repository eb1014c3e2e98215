"""An AIME-shaped evaluation stream through the engine: short prompts, long reasoning outputs, slots turning over and
admissions between decode steps; Full, SnapStream and a score-based method side by side in one run, each in the same
KV memory.

    python benchmarks/bench_stream.py --device cuda --shape 8b --slots 48 --prompts 30 --repeats 4 --fraction 0.0625
    python benchmarks/bench_stream.py --quick          # a CPU smoke run

The workload (fixed seed): ``--prompts`` x ``--repeats`` requests (AIME24 n=64 is 30 x 64); prompts log-uniform over
AIME's lengths under the R1 chat template (``--prompt-min``..``--prompt-max`` tokens); outputs drawn from a lognormal
(``--median-new``, ``--sigma``) capped so that prompt + output fits ``--max-context``: an assumed shape for
R1-Distill-Llama-8B's AIME traces (median 9k tokens, about 9% at the 32k cap), to be replaced by a fit to real
traces. ``--fraction`` scales every drawn output down to fit a short run; each slot keeps its full-size static cache,
so a decode step costs what it costs in the full workload (the compiled step reads every reserved slot).

Every method holds the same KV memory: a compressed method ``--slots`` slots of its capacity at ``--budget`` of
``--max-context``, Full as many slots of ``--max-context`` tokens as fit in the same bytes. Each runs the compiled
engine (CUDA graphs on a GPU) after a warm-up that compiles it, on the same requests. Columns: wall seconds, output
tokens/s over the wall time, slot utilization (busy slot-steps / all), admission's share of the wall time (the
engine's prefill phases), peak memory (CUDA: max allocated; CPU: the RSS high-water mark), and the run's own
measured cost rows (``evalkit.memory.measure.Throughput``, what every evalkit run records): its decode tok/s and step
against the benchmark's. The projection: the full workload's output tokens over the measured output tok/s.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import build_model, model_arguments, model_dtype, sync  # noqa: E402
from bench_long_prefill import memory_mark, peak_since  # noqa: E402

import evalkit.compression as ec  # noqa: E402
from evalkit.memory.measure import Throughput  # noqa: E402


def draw(args, vocab: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """Prompt and output lengths of the whole workload (before ``--fraction``)."""
    g = torch.Generator().manual_seed(seed)
    count = args.prompts * args.repeats
    prompts = torch.empty(args.prompts).uniform_(math.log(args.prompt_min), math.log(args.prompt_max), generator=g)
    prompt_lengths = prompts.exp().round().long().repeat(args.repeats).tolist()
    outputs = (torch.randn(count, generator=g) * args.sigma + math.log(args.median_new)).exp().round().long()
    caps = torch.tensor([args.max_context - p for p in prompt_lengths])
    return prompt_lengths, torch.minimum(outputs.clamp_min(16), caps).tolist()


def requests_of(prompt_lengths, output_lengths, fraction: float, vocab: int, seed: int = 0) -> list[ec.Request]:
    g = torch.Generator().manual_seed(seed)
    prompts = {}
    out = []
    for length, new in zip(prompt_lengths, output_lengths):
        if length not in prompts:  # repeats of a problem share its prompt
            prompts[length] = torch.randint(3, vocab, (length,), generator=g)
        out.append(ec.Request(prompts[length], max_new_tokens=max(8, round(new * fraction))))
    return out


def run_method(model, method: str, args, requests) -> dict:
    budget = None if method == "full" else args.budget
    policy = ec.policy_from_budget(method, budget, args.max_context)
    capacity = policy.cache_capacity()
    compressed = ec.policy_from_budget("snapstream", args.budget, args.max_context).cache_capacity()
    slots = args.slots if capacity else max(1, args.slots * compressed // args.max_context)  # the same KV bytes
    slot_tokens = capacity or args.max_context
    engine = ec.Engine(model, policy, slots=slots, slot_tokens=slot_tokens, compile=not args.eager)
    warm = requests_of([64, 96], [16, 16], 1.0, model.config.vocab_size, seed=1)
    started = time.perf_counter()
    engine.run(warm)  # compiles the step once
    compile_seconds = time.perf_counter() - started
    phases = {"prefill": 0.0, "decode": 0.0, "warm-up": 0.0}

    def on_step(phase, tokens, seconds):
        phases[phase] += seconds

    meter = Throughput()
    mark = memory_mark(args.device)
    device = torch.device(args.device)
    meter.start(device)
    started = time.perf_counter()
    done = engine.run(requests, on_finish=lambda c: meter.add(c.stats), on_step=on_step)
    sync(args.device)
    wall = time.perf_counter() - started
    meter.stop(engine, model)
    peak = peak_since(args.device, mark)
    generated = sum(len(c.tokens) for c in done)
    assert generated == sum(r.max_new_tokens for r in requests), "a request ended before its drawn length"
    rows = {row["metric"]: row["value"] for row in meter.rows()}
    decode_steps = engine.counters["decode_steps"]
    return dict(method=method, slots=slots, slot_tokens=slot_tokens, compile_s=compile_seconds,
                wall_s=wall, tokens=generated, tok_s=generated / wall, utilization=engine.utilization(),
                admission_share=phases["prefill"] / wall, peak_bytes=peak,
                step_ms=1000 * (wall - phases["prefill"]) / max(decode_steps, 1),
                run_decode_tok_s=rows.get("decode_tokens_per_s"),
                run_step_ms=1000 * rows["decode_step_seconds"] if "decode_step_seconds" in rows else None,
                run_peak_bytes=rows.get("peak_cuda_memory_bytes", rows.get("peak_rss_bytes")),
                kv_cache_bytes=rows.get("kv_cache_allocated_bytes"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_arguments(parser)
    parser.add_argument("--methods", nargs="+", default=["full", "snapstream", "h2o"])
    parser.add_argument("--budget", default="4x")
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=64)
    parser.add_argument("--prompt-min", type=int, default=90)
    parser.add_argument("--prompt-max", type=int, default=400)
    parser.add_argument("--median-new", type=int, default=9000)
    parser.add_argument("--sigma", type=float, default=0.8)
    parser.add_argument("--max-context", type=int, default=32768)
    parser.add_argument("--fraction", type=float, default=1.0, help="scale every output length by this")
    parser.add_argument("--eager", action="store_true", help="do not compile the decode step")
    parser.add_argument("--quick", action="store_true", help="a CPU smoke run")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.repeats, args.slots, args.max_context = 3, 2, 4, 1024
        args.median_new, args.prompt_min, args.prompt_max, args.fraction, args.eager = 200, 40, 80, 0.1, True
    model = build_model(args.shape, args.device, model_dtype(args))
    prompt_lengths, output_lengths = draw(args, model.config.vocab_size)
    requests = requests_of(prompt_lengths, output_lengths, args.fraction, model.config.vocab_size)
    full_tokens = sum(output_lengths)
    at_cap = sum(p + o >= args.max_context for p, o in zip(prompt_lengths, output_lengths)) / len(output_lengths)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{device_name}: random Llama {args.shape} ({model_dtype(args)}); {len(requests)} requests "
          f"({args.prompts} prompts x {args.repeats}); prompts {min(prompt_lengths)}..{max(prompt_lengths)} tokens; "
          f"outputs median {sorted(output_lengths)[len(output_lengths) // 2]}, mean {full_tokens / len(output_lengths):.0f}, "
          f"{at_cap:.0%} at the {args.max_context} cap; run at x{args.fraction} of those lengths "
          f"({sum(r.max_new_tokens for r in requests)} output tokens)", flush=True)
    rows = []
    for method in args.methods:
        try:
            row = run_method(model, method, args, requests)
        except torch.OutOfMemoryError as error:
            row = dict(method=method, error=f"out of memory: {str(error)[:160]}")
        rows.append(row)
        print(json.dumps(row), flush=True)
        gc.collect()
        torch._dynamo.reset()  # the compiled step of this method's engine lets go of its cache
        if args.device == "cuda":
            torch.cuda.empty_cache()
    print(f"\n{'method':<12}{'slots x tokens':>16}{'wall s':>9}{'tok/s':>9}{'util':>7}{'admit':>7}{'step ms':>9}"
          f"{'run step':>9}{'run tok/s':>10}{'peak GiB':>10}{'full run h':>11}")
    for r in rows:
        if "error" in r:
            print(f"{r['method']:<12}  {r['error']}")
            continue
        projected = full_tokens / r["tok_s"] / 3600
        print(f"{r['method']:<12}{r['slots']:>7} x {r['slot_tokens']:<6}{r['wall_s']:>9.1f}{r['tok_s']:>9.0f}"
              f"{r['utilization']:>7.2f}{r['admission_share']:>7.1%}{r['step_ms']:>9.2f}"
              f"{(r['run_step_ms'] or math.nan):>9.2f}{(r['run_decode_tok_s'] or math.nan):>10.0f}"
              f"{r['peak_bytes'] / 2**30:>10.1f}{projected:>11.2f}")
    print(f"\nfull run h: the whole workload ({full_tokens:,} output tokens) at the measured tok/s, one device")
    if args.json:
        meta = dict(device=device_name, shape=args.shape, torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
                    args=vars(args), full_output_tokens=full_tokens)
        Path(args.json).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
