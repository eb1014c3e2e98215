"""Decode step time against the memory roofline at equal KV memory, side by side in one run, and the simulator beside it.

    python benchmarks/bench_decode.py [--device cuda --shape 8b --slots 64 --context 8192 --budget 4x] [--json F]

Every scheme holds the same KV bytes: SnapStream at ``--budget`` keeps ``capacity = context / ratio`` tokens in each of
``--slots`` slots; Full and transformers keep ``context`` tokens for ``slots / ratio`` sequences (what fits in the
same memory). Schemes:

  * engine, SnapStream: ec.Engine, ``slots`` slots, eager and with the compiled step (CUDA graphs on GPU);
  * engine, Full: ``slots / ratio`` slots of ``context`` tokens, eager and compiled;
  * transformers: ``model.generate`` into a ``StaticCache(max_cache_len=context)``, batch ``slots / ratio``; on CUDA
    generate compiles its decode step itself (torch.compile, CUDA graphs): the best transformers offers.

Each decodes after prompts of ``--prompt`` tokens; the step time is the difference of two runs that differ only in
how many tokens they decode, over the difference of decode steps (prefill and the first token cancel out). Tokens/s
at full occupancy = sequences / step time. Roofline: the bytes a step must read (every weight but the input
embedding once, every slot's reserved KV) / step time, as a share of the device's peak bandwidth (the hardware
entry's datasheet figure) and of a measured device-to-device copy; ``roof ms`` is the step those bytes take at the
copy's bandwidth, the prediction every evalkit run records beside its measured step (``decode_step_seconds_roofline``). Simulator: ``evalkit.memory``'s step for the
same geometry, batch and cache at efficiency 1, and the decode_efficiency this run measures (predicted / measured).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import build_model, model_arguments, model_dtype, sync  # noqa: E402

import evalkit.compression as ec  # noqa: E402
from evalkit import memory  # noqa: E402
from evalkit.core.budget import factor  # noqa: E402
from evalkit.memory.geometry import from_hf_config, kv_bytes_per_token  # noqa: E402
from evalkit.memory.measure import copy_bandwidth, weight_bytes_read  # noqa: E402
from evalkit.memory.simulator import Deployment, price  # noqa: E402

REPEATS = 3  # each estimate a pair of runs; the median is reported, the spread is max - min


def prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g) for _ in range(count)]


def engine_step(model, policy, slots: int, slot_tokens: int, prompt: int, steps: int, compile: bool, device: str):
    """Seconds per decode step of an engine whose every slot decodes (``REPEATS`` estimates), and its peak GPU memory."""
    engine = ec.Engine(model, policy, slots=slots, slot_tokens=slot_tokens, compile=compile)
    batch = prompts(slots, prompt, model.config.vocab_size)
    short, long = 1 + engine.sync_every, 1 + engine.sync_every + steps

    def run(new: int) -> tuple[float, int]:
        before = engine.counters["decode_steps"]
        sync(device)
        start = time.perf_counter()
        engine.run([ec.Request(p, max_new_tokens=new) for p in batch])
        sync(device)
        return time.perf_counter() - start, engine.counters["decode_steps"] - before

    started = time.perf_counter()
    run(long)  # allocation, kernels, and for compile=True the graph (the token buffer is sized by the longest)
    run(short)
    warm = time.perf_counter() - started
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    estimates = []
    for _ in range(REPEATS):
        (t0, d0), (t1, d1) = run(short), run(long)
        estimates.append((t1 - t0) / (d1 - d0))
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else math.nan
    return estimates, peak, warm, engine


def hf_step(model, batch: int, context: int, prompt: int, steps: int, device: str):
    """Seconds per decode step of model.generate into a static cache of ``context`` tokens (``REPEATS`` estimates)."""
    from transformers import StaticCache

    ids = torch.stack(prompts(batch, prompt, model.config.vocab_size)).to(device)
    cache = StaticCache(config=model.config, max_cache_len=context)

    def run(new: int) -> float:
        cache.reset()
        sync(device)
        start = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=new,
                       min_new_tokens=new, do_sample=False)
        sync(device)
        return time.perf_counter() - start

    started = time.perf_counter()
    run(2)
    run(2 + steps)  # transformers compiles on the first decode steps
    warm = time.perf_counter() - started
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    estimates = []
    for _ in range(REPEATS):
        t0, t1 = run(2), run(2 + steps)
        estimates.append((t1 - t0) / steps)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else math.nan
    return estimates, peak, warm


def default_hardware(device: str) -> str | None:
    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return "h200_141g" if "H200" in name else "h100_80g" if "H100" in name else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small run (a smoke run)")
    model_arguments(parser)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--budget", default="4x")
    parser.add_argument("--context", type=int, default=4096, help="tokens a full cache holds per sequence")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64, help="decode steps timed per run")
    parser.add_argument("--hardware", default=None, help="conf/hardware entry for the peak bandwidth and the simulator")
    parser.add_argument("--skip", nargs="*", default=[], choices=["eager", "compile", "full", "hf"])
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args()
    if args.quick:
        args.slots, args.context, args.prompt, args.steps = 8, 512, 64, 16
    dtype = model_dtype(args)
    dtype_name = str(dtype).removeprefix("torch.")
    ratio = factor(args.budget)
    if not float(ratio).is_integer() or args.slots % int(ratio):
        raise SystemExit(f"--budget must be an integer ratio that divides --slots, got {args.budget} and {args.slots}")
    ratio = int(ratio)
    capacity = args.context // ratio
    few = args.slots // ratio
    model = build_model(args.shape, args.device, dtype)
    weights, per_token = weight_bytes_read(model), kv_bytes_per_token(model.config, dtype_name)
    hardware_name = args.hardware or default_hardware(args.device)
    hardware = memory.load_hardware(hardware_name) if hardware_name else None
    bandwidth = copy_bandwidth(args.device)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{device_name}: random Llama {args.shape} ({sum(p.numel() for p in model.parameters()) / 1e9:.2f}B params, "
          f"{dtype}); a step reads {weights / 2**30:.2f} GiB of weights; KV {per_token / 2**10:.0f} KiB per token")
    print(f"KV memory of every scheme: {args.slots} x {capacity} = {few} x {args.context} tokens = "
          f"{args.slots * capacity * per_token / 2**30:.2f} GiB; prompts of {args.prompt}, {args.steps} steps timed")
    print(f"device copy: {bandwidth / 1e12:.2f} TB/s (read + written)"
          + (f"; {hardware.name} peak {hardware.hbm_bandwidth / 1e12:.2f} TB/s" if hardware else ""))

    snapstream = ec.policy_from_budget("snapstream", args.budget, args.context)
    plans = []
    for compile in (False, True):
        if ("compile" if compile else "eager") in args.skip:
            continue
        plans.append((f"engine SnapStream {args.budget}", snapstream, args.slots, capacity, compile))
        if "full" not in args.skip:
            plans.append(("engine Full", ec.Full(), few, args.context, compile))
    rows = []
    for name, policy, slots, slot_tokens, compile in plans:
        estimates, peak, warm, engine = engine_step(model, policy, slots, slot_tokens, args.prompt, args.steps,
                                                    compile, args.device)
        assert engine.slot_tokens == slot_tokens, (engine.slot_tokens, slot_tokens)
        rows.append(dict(scheme=name, compiled=compile, sequences=slots, cache_tokens=slot_tokens,
                         step_s=statistics.median(estimates), spread=max(estimates) - min(estimates),
                         peak_gib=peak / 2**30, warm_s=warm))
        print(f"  {name}{' compiled' if compile else ''}: {[round(e * 1e3, 2) for e in estimates]} ms/step "
              f"(warm-up {warm:.0f} s)", flush=True)
    if "hf" not in args.skip:
        estimates, peak, warm = hf_step(model, few, args.context, args.prompt, args.steps, args.device)
        rows.append(dict(scheme="transformers generate, StaticCache", compiled=args.device == "cuda", sequences=few,
                         cache_tokens=args.context, step_s=statistics.median(estimates),
                         spread=max(estimates) - min(estimates), peak_gib=peak / 2**30, warm_s=warm))

    geometry = from_hf_config(model.config, name=f"random llama {args.shape}",
                              params=float(sum(p.numel() for p in model.parameters())))
    best_hf = max((r["sequences"] / r["step_s"] for r in rows if r["scheme"].startswith("transformers")), default=None)
    for row in rows:
        row["tokens_per_s"] = row["sequences"] / row["step_s"]
        row["bytes_per_step"] = weights + row["sequences"] * row["cache_tokens"] * per_token
        achieved = row["bytes_per_step"] / row["step_s"]
        row["of_copy_bandwidth"] = achieved / bandwidth
        row["roofline_step_s"] = row["bytes_per_step"] / bandwidth  # what an evalkit run predicts on this device
        row["of_peak_bandwidth"] = achieved / hardware.hbm_bandwidth if hardware else math.nan
        row["vs_best_hf"] = row["tokens_per_s"] / best_hf if best_hf else math.nan
        if hardware:
            deployment = Deployment(model=geometry, hardware=hardware, tp=1, batch=row["sequences"],
                                    context=row["cache_tokens"], weight_dtype=dtype_name, kv_dtype=dtype_name,
                                    kernel_looping=True)
            verdict = price(deployment)
            ideal = verdict.step_seconds * deployment.efficiency
            row["simulated_step_s"] = verdict.step_seconds
            row["measured_efficiency"] = ideal / row["step_s"]
    print(f"\n{'scheme':<38}{'compiled':>9}{'seqs':>6}{'cache':>7}{'ms/step':>9}{'±':>6}{'tok/s':>9}"
          f"{'vs HF':>7}{'%peak':>7}{'%copy':>7}{'roof ms':>8}{'sim ms':>8}{'peak GiB':>9}")
    for r in rows:
        print(f"{r['scheme']:<38}{str(r['compiled']):>9}{r['sequences']:>6}{r['cache_tokens']:>7}"
              f"{r['step_s'] * 1e3:>9.2f}{r['spread'] * 1e3:>6.2f}{r['tokens_per_s']:>9.0f}{r['vs_best_hf']:>7.2f}"
              f"{100 * r['of_peak_bandwidth']:>7.1f}{100 * r['of_copy_bandwidth']:>7.1f}"
              f"{r['roofline_step_s'] * 1e3:>8.2f}{r.get('simulated_step_s', math.nan) * 1e3:>8.2f}{r['peak_gib']:>9.2f}")
    if hardware:
        print(f"simulator: {hardware.name} decode_efficiency {hardware.decode_efficiency}; measured efficiency per "
              "scheme (simulated step at efficiency 1 / measured step): "
              + ", ".join(f"{r['scheme']}{' compiled' if r['compiled'] else ''} {r['measured_efficiency']:.3f}"
                          for r in rows))
    if args.json:
        meta = dict(device=device_name, shape=args.shape, dtype=str(dtype), budget=args.budget, context=args.context,
                    prompt=args.prompt, steps=args.steps, copy_bandwidth=bandwidth, torch=torch.__version__,
                    hardware=hardware_name, date=time.strftime("%Y-%m-%d"))
        Path(args.json).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
