"""Continuous batching against static batches, side by side in one run, reported as ratios.

    python benchmarks/bench_engine.py [--quick] [--device cuda --shape 8b --slots 64 --dtype bfloat16]

A reasoning-shaped workload (fixed seed): prompts of a few hundred to a few thousand tokens (log-uniform), output
lengths drawn from a lognormal whose 5th-95th percentiles are 10x apart. Every request is generated to its drawn length
(as if it ended with EOS there), so each scheme does the same useful work; generated tokens/s counts useful tokens only,
over the whole wall time (prefill included). Schemes, with the same number of sequences decoded together:

  * static:  today's batches before the engine: ec.generate over batches (longest prompts first), each batch running
             until its longest request is done; SnapStream at the budget;
  * engine:  ec.Engine, continuous batching, SnapStream at the budget;
  * engine+compile: the same with the decode step compiled (CUDA graphs on GPU);
  * hf full: transformers' model.generate with its full cache, in the same static batches.

Then peak memory: the engine's cache allocation and the process's RSS high-water mark after N/2 and after N requests
(flat: the engine holds per slot, not per request). On CUDA, the GPU memory per slot.
"""

from __future__ import annotations

import argparse
import math
import resource
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import evalkit.compression as ec

SHAPES = {
    # ~58M parameters: the CPU workhorse of evalkit's benchmarks
    "50m": dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=4),
    # Llama-3.1-8B's shapes, random weights
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0),
}


def model_arguments(parser: argparse.ArgumentParser) -> None:
    """``--device``, ``--shape`` and ``--dtype``: the random model a benchmark runs (see :func:`model_dtype`)."""
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="50m")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)


def model_dtype(args: argparse.Namespace) -> torch.dtype:
    """``--dtype``, by default bf16 on CUDA and fp32 elsewhere."""
    return getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))


def build_model(shape: str, device: str, dtype: torch.dtype) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=131072)
    config._attn_implementation = "sdpa"
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)
    model.generation_config.eos_token_id = None  # lengths come from the workload, not from random EOS draws
    model.generation_config.pad_token_id = 0
    return model


def workload(count: int, prompt_min: int, prompt_max: int, median_new: int, max_new: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    log_prompt = torch.empty(count).uniform_(math.log(prompt_min), math.log(prompt_max), generator=g)
    sigma = math.log(10) / (2 * 1.6449)  # 5th to 95th percentile: 10x
    news = (torch.randn(count, generator=g) * sigma + math.log(median_new)).exp()
    requests = []
    for n, new in zip(log_prompt.exp().round().long().tolist(), news.round().long().clamp(8, max_new).tolist()):
        requests.append(ec.Request(torch.randint(0, vocab, (n,), generator=g), max_new_tokens=new))
    return requests


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def static_batches(requests, slots: int):
    """Today's batching: longest prompts first, ``slots`` at a time."""
    order = sorted(range(len(requests)), key=lambda i: -requests[i].input_ids.numel())
    return [[requests[i] for i in order[start : start + slots]] for start in range(0, len(order), slots)]


def padded(batch, device):
    width = max(r.input_ids.numel() for r in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for row, r in enumerate(batch):
        ids[row, width - r.input_ids.numel() :] = r.input_ids
        mask[row, width - r.input_ids.numel() :] = 1
    return ids.to(device), mask.to(device)


def run_static(model, policy, requests, slots, device) -> float:
    for batch in static_batches(requests, slots):
        ids, mask = padded(batch, device)
        ec.generate(model, ids, policy, attention_mask=mask, max_new_tokens=max(r.max_new_tokens for r in batch),
                    return_logits=False)
    return sum(r.max_new_tokens for r in requests)


def run_hf(model, requests, slots, device) -> float:
    for batch in static_batches(requests, slots):
        ids, mask = padded(batch, device)
        longest = max(r.max_new_tokens for r in batch)
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                       do_sample=False)
    return sum(r.max_new_tokens for r in requests)


def run_engine(engine, requests) -> float:
    completions = engine.run(requests)
    assert all(len(c.tokens) == r.max_new_tokens for c, r in zip(completions, requests))
    return sum(len(c.tokens) for c in completions)


def timed(fn, device) -> tuple[float, float]:
    sync(device)
    start = time.perf_counter()
    tokens = fn()
    sync(device)
    seconds = time.perf_counter() - start
    return tokens / seconds, seconds


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small workload (a smoke run)")
    model_arguments(parser)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--budget", default="4x")
    parser.add_argument("--max-context", type=int, default=4096)
    parser.add_argument("--prompt-min", type=int, default=200)
    parser.add_argument("--prompt-max", type=int, default=2000)
    parser.add_argument("--median-new", type=int, default=256)
    parser.add_argument("--max-new", type=int, default=2048)
    parser.add_argument("--skip", nargs="*", default=[], choices=["static", "compile", "hf"])
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.quick:
        args.requests, args.prompt_max, args.median_new, args.max_new = 12, 600, 48, 256
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = model_dtype(args)
    model = build_model(args.shape, args.device, dtype)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    requests = workload(args.requests, args.prompt_min, args.prompt_max, args.median_new, args.max_new,
                        model.config.vocab_size, seed=0)
    policy = ec.policy_from_budget("snapstream", args.budget, args.max_context)
    lengths = sorted(r.max_new_tokens for r in requests)
    prompts = sorted(r.input_ids.numel() for r in requests)
    print(f"model: random Llama {args.shape} ({params:.0f}M params, {dtype}) on {args.device}; {args.slots} slots; "
          f"SnapStream {args.budget} of {args.max_context} (capacity {policy.capacity})")
    print(f"workload: {len(requests)} requests; prompt tokens {prompts[0]}..{prompts[-1]} (median {prompts[len(prompts) // 2]}); "
          f"new tokens {lengths[0]}..{lengths[-1]} (median {lengths[len(lengths) // 2]}, total {sum(lengths)})")

    # Warm-up (allocator, kernels), then each scheme once on the same workload.
    warm = workload(2, 32, 64, 8, 8, model.config.vocab_size, seed=1)
    ec.Engine(model, policy, slots=args.slots).run(warm)
    rows = {}
    if "static" not in args.skip:
        rows["static batches (ec.generate)"] = timed(lambda: run_static(model, policy, requests, args.slots, args.device), args.device)
    engine = ec.Engine(model, policy, slots=args.slots)
    half = requests[: len(requests) // 2]
    run_engine(engine, half)
    rss_half = rss_mib()
    rows["engine"] = timed(lambda: run_engine(engine, requests), args.device)
    rss_full = rss_mib()
    if "compile" not in args.skip:
        compiled = ec.Engine(model, policy, slots=args.slots, compile=True)
        started = time.perf_counter()
        run_engine(compiled, warm)  # compiles once
        compile_seconds = time.perf_counter() - started
        rows["engine + compile"] = timed(lambda: run_engine(compiled, requests), args.device)
        print(f"compile: {compile_seconds:.1f} s once (not counted below)")
    if "hf" not in args.skip:
        rows["model.generate, full cache (static batches)"] = timed(lambda: run_hf(model, requests, args.slots, args.device), args.device)

    baseline = rows.get("static batches (ec.generate)", rows["engine"])[0]
    print(f"\n{'scheme':<46}{'tok/s':>10}{'seconds':>10}{'vs static':>11}")
    for name, (rate, seconds) in rows.items():
        print(f"{name:<46}{rate:>10.1f}{seconds:>10.1f}{rate / baseline:>10.2f}x")
    print(f"engine slot utilization: {engine.utilization():.2f} (busy slot-steps / all slot-steps)")
    cache_bytes = sum(t.numel() * t.element_size() for layer in engine.cache.layers for t in (layer.keys, layer.values))
    print(f"\nengine cache: {cache_bytes / 2**20:.1f} MiB for {args.slots} slots x {engine.slot_tokens} tokens, "
          f"{cache_bytes / args.slots / 2**20:.2f} MiB per slot, whatever the number of requests")
    print(f"process RSS high-water: {rss_half:.0f} MiB after {len(half)} requests, {rss_full:.0f} MiB after "
          f"{len(half) + len(requests)} (ratio {rss_full / rss_half:.3f})")
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        probe = ec.Engine(model, policy, slots=args.slots)
        run_engine(probe, warm)
        peak = torch.cuda.max_memory_allocated() - base
        print(f"GPU memory of a {args.slots}-slot engine (cache, buffers, step activations): {peak / 2**30:.2f} GiB, "
              f"{peak / args.slots / 2**20:.1f} MiB per slot")


if __name__ == "__main__":
    main()
