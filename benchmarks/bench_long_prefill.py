"""Long prompts: prefill time and peak memory of every method at a budget, relative to Full, side by side in one run.

    python benchmarks/bench_long_prefill.py [--lengths 4096 16384 32768] [--methods full snapkv h2o ...]
    python benchmarks/bench_long_prefill.py --device cuda --shape 8b --lengths 32768 131072 --methods full snapkv snapstream h2o
    python benchmarks/bench_long_prefill.py --lengths 32768 --methods full snapkv --chunks 0 4096   # chunked prefill

Each (method, length) cell runs in a fresh process (so its peak memory is its own) on the same random model and prompt:
a warm-up prefill of a short prompt, then the measured one: prefill of ``length`` tokens plus ``--new`` decoded tokens
under ``policy_from_budget(method, budget, length)``. Prefill seconds come from the run's own statistics (time to the
first token); peak memory is above the model and what the warm-up left: ``torch.cuda.max_memory_allocated`` on a GPU,
the process's RSS high-water mark on CPU. A cell that runs out of memory or past ``--cell-timeout`` says so.
``--blockwise-too``: each attention-sum method (H2O, ObservedAttention, ...) also with its blockwise PyTorch sums
instead of the Triton kernels it uses on CUDA (the row ``<method>/blockwise``; ``same`` compares its tokens with the
fused row's). ``--chunks``: each method also prefilled that many tokens at a time (0: at once; ``--chunk-mode exact`` keeps the
kept tokens and outputs of the unchunked prefill, which the table checks: ``same`` compares the generated tokens).
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import build_model, model_arguments, model_dtype, sync  # noqa: E402

import evalkit.compression as ec  # noqa: E402


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def memory_mark(device: str) -> int:
    """Start a peak-memory measurement: what is held now (the CUDA peak counter reset)."""
    sync(device)
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    return rss_bytes()


def peak_since(device: str, mark: int) -> int:
    """The peak memory above ``mark`` since :func:`memory_mark` (CUDA: max allocated; CPU: the RSS high-water mark)."""
    sync(device)
    if device == "cuda":
        return max(torch.cuda.max_memory_allocated() - mark, 0)
    return max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - mark, 0)


def cell(args) -> dict:
    """One measurement, in this process."""
    if args.blockwise:  # the PyTorch reference path of the attention sums, not the Triton kernels
        from evalkit.compression import kernels
        kernels._triton = lambda *_, **__: None
    model = build_model(args.shape, args.device, model_dtype(args))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (1, args.length), generator=g).to(args.device)
    warm_policy = ec.policy_from_budget(args.method, None if args.method == "full" else args.budget, 1024)
    ec.generate(model, ids[:, :1024], warm_policy, max_new_tokens=2, return_logits=False)
    policy = ec.policy_from_budget(args.method, None if args.method == "full" else args.budget, args.length)
    mark = memory_mark(args.device)
    start = time.perf_counter()
    out = ec.generate(model, ids, policy, max_new_tokens=args.new, return_logits=False,
                      prefill_chunk=args.chunk or None, prefill_chunk_mode=args.chunk_mode)
    sync(args.device)
    seconds = time.perf_counter() - start
    peak = peak_since(args.device, mark)
    stats = out.stats[0]
    kept = stats["kept_prompt_tokens"]
    label = args.method + ("/blockwise" if args.blockwise else "")
    return dict(method=label, length=args.length, chunk=args.chunk, status="ok", prefill_s=stats["prefill_seconds"],
                total_s=seconds, peak_bytes=peak, kept=sum(kept) / len(kept),
                tokens=out.sequences[0, args.length:].tolist())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_arguments(parser)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--methods", nargs="+", default=["full", "snapkv", "snapstream", "streaming_llm", "pyramidkv",
                                                        "adakv", "knorm", "tova", "h2o", "observed_attention",
                                                        "expected_attention"])
    parser.add_argument("--budget", default="4x")
    parser.add_argument("--new", type=int, default=8)
    parser.add_argument("--chunks", type=int, nargs="+", default=[0], help="prefill chunk sizes (0: at once)")
    parser.add_argument("--chunk-mode", choices=list(ec.CHUNK_MODES), default="exact")
    parser.add_argument("--blockwise-too", action="store_true",
                        help="attention-sum methods also with their blockwise PyTorch sums (the Triton kernels' reference)")
    parser.add_argument("--cell-timeout", type=float, default=1800.0)
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--chunk", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--blockwise", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.method:  # a cell, run by the parent below
        try:
            row = cell(args)
        except torch.OutOfMemoryError as error:
            row = dict(method=args.method, length=args.length, chunk=args.chunk, status="out of memory",
                       error=str(error)[:200])
        print("CELL " + json.dumps(row))
        return
    unknown = sorted(set(args.methods) - set(ec.POLICIES))
    if unknown:
        raise SystemExit(f"unknown methods {unknown}; choose from {sorted(ec.POLICIES)}")
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{device_name}: random Llama {args.shape}; prefill of each length + {args.new} new tokens; "
          f"every method at {args.budget} (Full: the whole prompt)")
    rows = []
    cells = [(method, False) for method in args.methods]
    if args.blockwise_too:
        cells += [(method, True) for method in args.methods if ec.POLICIES[method].sums_attention]
    for length in args.lengths:
        for method, blockwise in cells:
            for chunk in args.chunks:
                command = [sys.executable, __file__, "--method", method, "--length", str(length), "--device",
                           args.device, "--shape", args.shape, "--budget", args.budget, "--new", str(args.new),
                           "--chunk", str(chunk), "--chunk-mode", args.chunk_mode] + ["--blockwise"] * blockwise
                if args.dtype:
                    command += ["--dtype", args.dtype]
                method = method + "/blockwise" * blockwise
                try:
                    done = subprocess.run(command, capture_output=True, text=True, timeout=args.cell_timeout)
                    lines = [line for line in done.stdout.splitlines() if line.startswith("CELL ")]
                    row = json.loads(lines[-1][5:]) if lines else dict(
                        method=method, length=length, chunk=chunk, status=f"failed (exit {done.returncode})",
                        error=done.stderr.strip().splitlines()[-1][:200] if done.stderr.strip() else "")
                except subprocess.TimeoutExpired:
                    row = dict(method=method, length=length, chunk=chunk, status=f"over {args.cell_timeout:.0f} s")
                rows.append(row)
                print(f"  {length:>7} {method:<20} chunk {chunk or '-':>6} {row['status']}"
                      + (f"  prefill {row['prefill_s']:.2f} s, peak {row['peak_bytes'] / 2**20:,.0f} MiB"
                         if row["status"] == "ok" else f"  {row.get('error', '')}"), flush=True)
    print(f"\n{'length':>8} {'method':<20}{'chunk':>7}{'prefill s':>11}{'x Full':>8}{'peak MiB':>11}{'x Full':>8}"
          f"{'x whole':>9}{'kept':>9}{'same':>6}")
    for length in args.lengths:
        full = next((r for r in rows if r["length"] == length and r["method"] == "full" and not r["chunk"]
                     and r["status"] == "ok"), None)
        for r in (r for r in rows if r["length"] == length):
            if r["status"] != "ok":
                print(f"{length:>8} {r['method']:<20}{r['chunk'] or '-':>7}  {r['status']}")
                continue
            whole = next((w for w in rows if w["length"] == length and w["method"] == r["method"].split("/")[0]
                          and not w["chunk"] and w["status"] == "ok"), None)
            time_ratio = r["prefill_s"] / full["prefill_s"] if full else math.nan
            memory_ratio = r["peak_bytes"] / full["peak_bytes"] if full and full["peak_bytes"] else math.nan
            own_ratio = r["peak_bytes"] / whole["peak_bytes"] if whole and whole["peak_bytes"] else math.nan
            same = "" if whole is None or whole is r else ("yes" if whole["tokens"] == r["tokens"] else "NO")
            print(f"{length:>8} {r['method']:<20}{r['chunk'] or '-':>7}{r['prefill_s']:>11.2f}{time_ratio:>8.2f}"
                  f"{r['peak_bytes'] / 2**20:>11,.0f}{memory_ratio:>8.2f}{own_ratio:>9.2f}{r['kept']:>9.0f}{same:>6}")
    if args.json:
        meta = dict(device=device_name, shape=args.shape, budget=args.budget, new=args.new, chunk_mode=args.chunk_mode,
                    torch=torch.__version__,
                    date=time.strftime("%Y-%m-%d"))
        Path(args.json).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
