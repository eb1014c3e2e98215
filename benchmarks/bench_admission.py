"""Engine admission: the compressed prompt written straight into its slot against copied from a session cache, side by
side (peak memory of admitting one long prompt; the same tokens either way).

    python benchmarks/bench_admission.py [--lengths 8192 32768] [--method snapstream] [--budget 4x]
    python benchmarks/bench_admission.py --device cuda --shape 8b --lengths 32768 131072

Each (length, mode) cell runs in a fresh process on the same random model and prompt: an engine of ``--slots`` slots
admits the prompt and decodes ``--new`` tokens. ``slot`` is the engine as it is (each layer's kept tokens are written
into the request's slot as the layer is compressed); ``copy`` turns that off, so the admission holds every layer's
kept tokens in a session cache and copies them into the slot at the end (the engine before the change). Peak memory
is above what the process held before the run (the engine's cache allocation included in both):
``torch.cuda.max_memory_allocated`` on a GPU, the RSS high-water mark on CPU. ``kept KV`` is one request's
compressed cache (the most the two can differ by).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import build_model, model_arguments, model_dtype  # noqa: E402
from bench_long_prefill import memory_mark, peak_since  # noqa: E402

import evalkit.compression as ec  # noqa: E402
from evalkit.compression.cache import CompressedCache  # noqa: E402


def cell(args) -> dict:
    if args.mode == "copy":
        CompressedCache.write_through = lambda self, layer_idx: None  # the copy the engine made before
    model = build_model(args.shape, args.device, model_dtype(args))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (args.length,), generator=g)
    policy = ec.policy_from_budget(args.method, args.budget, args.length)
    engine = ec.Engine(model, policy, slots=args.slots, slot_tokens=policy.cache_capacity() or None)
    engine.run([ec.Request(ids[:512], max_new_tokens=2)])  # warm-up, and the engine's cache allocated
    mark = memory_mark(args.device)
    done = engine.run([ec.Request(ids, max_new_tokens=args.new)])[0]
    peak = peak_since(args.device, mark)
    layer = engine.cache.layers[0]
    kept = done.stats["kept_prompt_tokens"]
    per_token = (layer.keys[0, :, 0].numel() + layer.values[0, :, 0].numel()) * layer.keys.element_size()
    return dict(length=args.length, mode=args.mode, status="ok", peak_bytes=peak,
                kept_bytes=sum(kept) * per_token, prefill_s=done.stats["prefill_seconds"], tokens=done.tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_arguments(parser)
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--method", default="snapstream")
    parser.add_argument("--budget", default="4x")
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--new", type=int, default=8)
    parser.add_argument("--mode", choices=["slot", "copy"], help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        print("CELL " + json.dumps(cell(args)))
        return
    if args.method not in ec.POLICIES or ec.POLICIES[args.method].per_head:
        raise SystemExit(f"--method must be a row-layout method (per-head layouts are copied), got {args.method!r}")
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{device_name}: random Llama {args.shape}; {args.method} at {args.budget}; one prompt admitted into an "
          f"engine of {args.slots} slots, + {args.new} new tokens")
    print(f"{'length':>8}{'slot MiB':>11}{'copy MiB':>11}{'slot/copy':>11}{'kept KV MiB':>13}{'same':>6}")
    for length in args.lengths:
        rows = {}
        for mode in ("slot", "copy"):
            command = [sys.executable, __file__, "--mode", mode, "--length", str(length), "--device", args.device,
                       "--shape", args.shape, "--method", args.method, "--budget", args.budget,
                       "--slots", str(args.slots), "--new", str(args.new)] + (["--dtype", args.dtype] if args.dtype else [])
            done = subprocess.run(command, capture_output=True, text=True)
            lines = [line for line in done.stdout.splitlines() if line.startswith("CELL ")]
            if not lines:
                raise SystemExit(f"{mode} at {length} failed: {done.stderr.strip()[-500:]}")
            rows[mode] = json.loads(lines[-1][5:])
        slot, copy = rows["slot"], rows["copy"]
        print(f"{length:>8}{slot['peak_bytes'] / 2**20:>11,.0f}{copy['peak_bytes'] / 2**20:>11,.0f}"
              f"{slot['peak_bytes'] / max(copy['peak_bytes'], 1):>11.2f}{slot['kept_bytes'] / 2**20:>13,.0f}"
              f"{'yes' if slot['tokens'] == copy['tokens'] else 'NO':>6}", flush=True)


if __name__ == "__main__":
    main()
