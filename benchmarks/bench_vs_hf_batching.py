"""evalkit's engine beside transformers' own continuous batching and its compiled static-cache generate, Full cache,
on the same requests, side by side in one run.

    python benchmarks/bench_vs_hf_batching.py --device cuda --shape 8b --requests 128 --slots 64 --new 256
    python benchmarks/bench_vs_hf_batching.py --quick          # a CPU smoke run

The workload (fixed seed): prompts log-uniform over ``--prompt-min``..``--prompt-max`` tokens, every request generating
``--new`` tokens (random weights: no EOS), greedy. Schemes, each after a warm-up on the same shapes (compilation and
CUDA graph capture not counted):

  * engine: ``ec.Engine`` with the full cache, ``--slots`` slots, the compiled step (CUDA graphs on a GPU);
  * transformers continuous batching: ``model.generate_batch`` (the paged continuous-batching manager of the installed
    transformers, its default configuration);
  * transformers static generate: ``model.generate`` with ``cache_implementation="static"`` in batches of ``--slots``
    prompts left-padded to one width (so its step compiles once; on CUDA generate compiles it itself).

Columns: output tokens/s over the wall time (prefill included), seconds, peak memory above the model (CUDA: max
allocated; CPU: the RSS high-water mark), and how many requests' tokens equal the engine's (bf16: different kernels
may part at near ties).
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
from transformers import GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import build_model, model_arguments, model_dtype, sync  # noqa: E402
from bench_long_prefill import memory_mark, peak_since  # noqa: E402

import evalkit.compression as ec  # noqa: E402


def prompts_of(count: int, low: int, high: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.empty(count).uniform_(math.log(low), math.log(high), generator=g).exp().round().long()
    return [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in lengths]


def engine_run(engine, prompts, new):
    done = engine.run([ec.Request(torch.tensor(p), max_new_tokens=new) for p in prompts])
    return [list(c.tokens) for c in done]


def batching_run(model, prompts, new):
    config = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    results = model.generate_batch(inputs=prompts, generation_config=config, max_new_tokens=new)
    by_id = sorted(results.values(), key=lambda r: int(str(r.request_id).rsplit("_", 1)[-1]))
    return [list(r.generated_tokens) for r in by_id]


def static_run(model, prompts, new, slots, width, device):
    out = []
    for start in range(0, len(prompts), slots):
        batch = prompts[start : start + slots]
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, p in enumerate(batch):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        generated = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=new,
                                   min_new_tokens=new, do_sample=False, cache_implementation="static")
        out += generated[:, width:].tolist()
    return out


def engine_row(model, prompts, warm, width: int, args):
    engine = ec.Engine(model, ec.Full(), slots=args.slots, slot_tokens=width + args.new, compile=True)
    engine_run(engine, warm, args.new)
    return measured(lambda: engine_run(engine, prompts, args.new), args.device)


def measured(fn, device: str):
    mark = memory_mark(device)
    start = time.perf_counter()
    tokens = fn()
    sync(device)
    return tokens, time.perf_counter() - start, peak_since(device, mark)


def report(name: str, rows: dict, args) -> None:
    """One scheme's figures as soon as it has them (a run stopped at its time limit keeps what it measured)."""
    _, seconds, peak = rows[name]
    print(f"{name}: {args.requests * args.new / seconds:.0f} tok/s, {seconds:.1f} s, peak {peak / 2**30:.2f} GiB",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_arguments(parser)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--prompt-min", type=int, default=100)
    parser.add_argument("--prompt-max", type=int, default=1000)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--skip", nargs="*", default=[], choices=["batching", "static"])
    parser.add_argument("--quick", action="store_true", help="a CPU smoke run")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.quick:
        args.requests, args.slots, args.prompt_min, args.prompt_max, args.new = 6, 3, 20, 60, 8
    model = build_model(args.shape, args.device, model_dtype(args))
    vocab = model.config.vocab_size
    prompts = prompts_of(args.requests, args.prompt_min, args.prompt_max, vocab, seed=0)
    warm = prompts_of(args.slots, args.prompt_min, args.prompt_max, vocab, seed=1)
    width = max(len(p) for p in prompts + warm)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{device_name}: random Llama {args.shape} ({model_dtype(args)}); {args.requests} requests, prompts "
          f"{args.prompt_min}..{args.prompt_max} tokens, {args.new} new tokens each, greedy, Full cache", flush=True)
    rows = {}
    rows["evalkit engine (compiled)"] = engine_row(model, prompts, warm, width, args)
    report("evalkit engine (compiled)", rows, args)
    gc.collect()
    torch._dynamo.reset()  # the engine's compiled step lets go of its cache
    if args.device == "cuda":
        torch.cuda.empty_cache()
    if "batching" not in args.skip:
        try:
            batching_run(model, warm, args.new)
            rows["transformers generate_batch (continuous)"] = measured(
                lambda: batching_run(model, prompts, args.new), args.device)
            report("transformers generate_batch (continuous)", rows, args)
        except Exception as error:  # noqa: BLE001  (the row says why it is missing)
            print(f"generate_batch failed: {type(error).__name__}: {str(error)[:300]}", flush=True)
    if "static" not in args.skip:
        static_run(model, warm, args.new, args.slots, width, args.device)
        rows["transformers generate, static cache"] = measured(
            lambda: static_run(model, prompts, args.new, args.slots, width, args.device), args.device)
        report("transformers generate, static cache", rows, args)
    reference = rows["evalkit engine (compiled)"][0]
    total = args.requests * args.new
    print(f"\n{'scheme':<44}{'tok/s':>10}{'seconds':>10}{'vs engine':>11}{'peak GiB':>10}{'same tokens':>13}")
    engine_seconds = rows["evalkit engine (compiled)"][1]
    for name, (tokens, seconds, peak) in rows.items():
        same = sum(a == b for a, b in zip(tokens, reference))
        print(f"{name:<44}{total / seconds:>10.0f}{seconds:>10.2f}{engine_seconds / seconds:>10.2f}x"
              f"{peak / 2**30:>10.2f}{same:>8}/{len(reference)}")
    if args.json:
        import transformers

        Path(args.json).write_text(json.dumps(dict(
            meta=dict(device=device_name, torch=torch.__version__, transformers=transformers.__version__,
                      args=vars(args), date=time.strftime("%Y-%m-%d")),
            rows={name: dict(seconds=s, tok_s=total / s, peak_bytes=p) for name, (_, s, p) in rows.items()}), indent=1))


if __name__ == "__main__":
    main()
