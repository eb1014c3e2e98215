"""evalkit beside kvpress on the everyday case, side by side in one run: SnapKV at 4x on a 4k-token prompt plus 32
new tokens, greedy, on the same random Llama (~58M, fp32, CPU), in interleaved fresh processes.

    python benchmarks/bench_vs_kvpress.py [--rounds 3] [--repeats 3] [--length 4096] [--new 32] [--venv .kvpress-venv]

kvpress (0.5.5 pins transformers < 5.3) lives in its own virtual environment, made on demand at ``--venv`` with this
torch and ``pip install kvpress==0.5.5``; where it cannot be installed (no network, no wheel) the script says so in
one line and exits 0. Both sides load the same saved model and prompt; kvpress runs ``model.generate`` inside
``SnapKVPress(compression_ratio=0.75, window_size=64, kernel_size=5)``, evalkit ``ec.generate`` with
``SnapKV(capacity=length/4, window=64, kernel_size=5, pooling=avg)`` (kvpress' scoring: average pooling, the mean
over a KV group's query heads). Each process warms up on a short prompt, then times ``--repeats`` generations end to
end (its time: their median) and reads its peak resident memory (VmHWM, reset before the timed calls); it also times
the model's own forward over the prompt (no compression, the floor of any prefill) and, on evalkit's side, the
prefill inside each generation, so the last line splits evalkit's time. The prompt tokens each layer and KV head kept are
compared (each process maps its compressed cache's keys back to the positions of an uncompressed prefill's keys), and
the generated tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
KVPRESS = "kvpress==0.5.5"
WINDOW, KERNEL = 64, 5


def _peak_rss() -> int:
    with open("/proc/self/status", encoding="ascii") as handle:
        return next(int(line.split()[1]) * 1024 for line in handle if line.startswith("VmHWM:"))


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


def _kept_positions(full_keys, kept_keys) -> list[list[list[int]]]:
    """Per layer and KV head, the prompt positions whose keys the compressed cache holds (sorted)."""
    import torch

    kept = []
    for full, compressed in zip(full_keys, kept_keys):
        layer = []
        for head in range(full.shape[1]):
            rows = full[0, head]  # [n, D]
            matches = (compressed[0, head][:, None, :] == rows[None, :, :]).all(dim=-1)  # [kept, n]
            layer.append(sorted(int(i) for i in matches.float().argmax(dim=-1)[matches.any(dim=-1)]))
        kept.append(layer)
    del torch
    return kept


def worker(side: str, model_dir: str, prompt_file: str, new: int, repeats: int = 1) -> dict:
    """One fresh process: load, warm up, time one generation, report time, peak memory, kept positions, tokens."""
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    torch.set_num_threads(torch.get_num_threads())
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    ids = torch.tensor([json.loads(Path(prompt_file).read_text())])
    n = ids.shape[1]
    if side == "evalkit":
        import evalkit.compression as ec

        def policy():
            return ec.SnapKV(capacity=n // 4, window=WINDOW, kernel_size=KERNEL, pooling="avg")

        def generate(tokens, count):  # the sequences, and the prefill's own seconds
            out = ec.generate(model, tokens, policy(), max_new_tokens=count, return_logits=False)
            return out.sequences, out.stats[0]["prefill_seconds"]

        def kept_keys():
            from evalkit.compression.generate import prefill

            session, _, _ = prefill(model, policy(), ids)
            return [layer.keys for layer in session.cache.layers]
    else:
        from kvpress import SnapKVPress

        press = SnapKVPress(compression_ratio=0.75, window_size=WINDOW, kernel_size=KERNEL)

        def generate(tokens, count):
            with torch.no_grad(), press(model):
                return model.generate(tokens, max_new_tokens=count, do_sample=False), None

        def kept_keys():
            cache = DynamicCache()
            with torch.no_grad(), press(model):
                model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            return [layer.keys for layer in cache.layers]

    generate(ids[:, :512], 4)  # warm-up: kernels, allocator, lazy imports
    forward_times = []  # the model's own forward over the prompt, no compression: the floor of any prefill
    with torch.no_grad():
        for _ in range(repeats):
            full = DynamicCache()
            start = time.perf_counter()
            model(ids, past_key_values=full, use_cache=True, logits_to_keep=1)
            forward_times.append(time.perf_counter() - start)
        full_keys = [layer.keys.clone() for layer in full.layers]
        del full
    _reset_peak()
    times, prefill_times = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        sequences, prefill_seconds = generate(ids, new)
        times.append(time.perf_counter() - start)
        prefill_times.append(prefill_seconds)
    seconds = statistics.median(times)
    peak = _peak_rss()
    return {"side": side, "seconds": seconds, "peak_rss_bytes": peak, "tokens": sequences[0, n:].tolist(),
            "forward_seconds": statistics.median(forward_times),
            "prefill_seconds": None if None in prefill_times else statistics.median(prefill_times),
            "kept": _kept_positions(full_keys, kept_keys()), "torch": torch.__version__}


def kvpress_python(venv: Path) -> Path | None:
    """The kvpress environment's python, made on demand; None (with a line saying why) when it cannot be."""
    return reference_python(venv, [KVPRESS], "import kvpress", "kvpress", "its own environment: it pins "
                            "transformers < 5.3")


def reference_python(venv: Path, packages: list[str], check: str, name: str, why: str) -> Path | None:
    """The python of a reference's own environment ``venv`` (this torch, then ``packages``), made on demand where
    ``check`` does not run in it; None (with a line saying why, naming it ``name``) when it cannot be made."""
    import torch

    python = venv / "bin" / "python"
    checked = [str(python), "-c", check]
    if python.exists() and subprocess.run(checked, capture_output=True).returncode == 0:
        return python
    print(f"installing {' '.join(packages)} into {venv} ({why})...", flush=True)
    steps = [[sys.executable, "-m", "venv", str(venv)],
             [str(python), "-m", "pip", "install", "-q", f"torch=={torch.__version__.split('+')[0]}"],
             [str(python), "-m", "pip", "install", "-q", *packages]]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True)
        if done.returncode != 0:
            reason = (done.stderr.strip().splitlines() or ["no output"])[-1]
            print(f"{name} could not be installed ({' '.join(step[-2:])}: {reason}); skipped")
            return None
    return python if subprocess.run(checked, capture_output=True).returncode == 0 else None


def run_worker(python: Path, script: Path, side: str, *args: str) -> dict:
    """``script --worker side *args`` in ``python``'s environment (offline): what its worker :func:`report` ed."""
    done = subprocess.run([str(python), str(script), "--worker", side, *args], capture_output=True, text=True,
                          env={"PYTHONPATH": str(HERE.parent), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1",
                               "TOKENIZERS_PARALLELISM": "false"})
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise SystemExit(f"{side} worker failed: {done.stderr.strip()[-1500:]}")
    return json.loads(lines[-1][7:])


def report(result) -> None:
    """A worker's result, as the line :func:`run_worker` reads."""
    print("RESULT " + json.dumps(result))


def run_side(python: Path, side: str, model_dir: Path, prompt_file: Path, new: int, repeats: int) -> dict:
    return run_worker(python, Path(__file__), side, "--model", str(model_dir), "--prompt", str(prompt_file), "--new",
                      str(new), "--repeats", str(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="timed generations per process (their median)")
    parser.add_argument("--venv", default=str(HERE.parent / ".kvpress-venv"))
    parser.add_argument("--worker", choices=["evalkit", "kvpress"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--prompt", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        report(worker(args.worker, args.model, args.prompt, args.new, args.repeats))
        return
    python = kvpress_python(Path(args.venv))
    if python is None:
        return
    import torch

    sys.path.insert(0, str(HERE))
    from bench_engine import build_model

    with tempfile.TemporaryDirectory(prefix="evalkit-vs-kvpress-") as folder:
        model_dir, prompt_file = Path(folder) / "model", Path(folder) / "prompt.json"
        model = build_model("50m", "cpu", torch.float32)
        model.save_pretrained(model_dir)
        del model
        g = torch.Generator().manual_seed(0)
        prompt_file.write_text(json.dumps(torch.randint(3, 32000, (args.length,), generator=g).tolist()))
        print(f"SnapKV 4x (window {WINDOW}, kernel {KERNEL}, avg pooling), {args.length}-token prompt + {args.new} new "
              f"tokens, random Llama ~58M fp32 on CPU; {args.rounds} rounds of fresh processes, sides alternating")
        rounds = []
        for index in range(args.rounds):
            order = ("evalkit", "kvpress") if index % 2 == 0 else ("kvpress", "evalkit")
            results = {side: run_side(sys.executable if side == "evalkit" else python, side, model_dir, prompt_file,
                                      args.new, args.repeats) for side in order}
            rounds.append(results)
            ours, theirs = results["evalkit"], results["kvpress"]
            print(f"  round {index + 1}: evalkit {ours['seconds']:.3f} s, kvpress {theirs['seconds']:.3f} s, "
                  f"ratio {ours['seconds'] / theirs['seconds']:.3f}; peak RSS ratio "
                  f"{ours['peak_rss_bytes'] / theirs['peak_rss_bytes']:.3f}", flush=True)
    ratios = [r["evalkit"]["seconds"] / r["kvpress"]["seconds"] for r in rounds]
    memory = [r["evalkit"]["peak_rss_bytes"] / r["kvpress"]["peak_rss_bytes"] for r in rounds]
    same_kept = all(r["evalkit"]["kept"] == r["kvpress"]["kept"] for r in rounds)
    same_tokens = all(r["evalkit"]["tokens"] == r["kvpress"]["tokens"] for r in rounds)
    kept = rounds[0]["evalkit"]["kept"]
    print(f"evalkit / kvpress time: median {statistics.median(ratios):.3f} (rounds {', '.join(f'{x:.3f}' for x in ratios)});"
          f" faster in {sum(x < 1 for x in ratios)} of {len(ratios)}")
    print(f"evalkit / kvpress peak RSS: median {statistics.median(memory):.3f}")
    print(f"kept prompt tokens identical in every layer and KV head: {'yes' if same_kept else 'NO'} "
          f"({len(kept[0][0])} of {args.length} per head); generated tokens identical: {'yes' if same_tokens else 'NO'}")
    forward = statistics.median(r[side]["forward_seconds"] for r in rounds for side in r)
    prefill = statistics.median(r["evalkit"]["prefill_seconds"] for r in rounds)
    generation = statistics.median(r["evalkit"]["seconds"] for r in rounds)
    print(f"where evalkit's time goes (medians): the model's own forward over the prompt {forward:.3f} s (both "
          f"processes); evalkit's prefill with SnapKV's scoring {prefill:.3f} s, its {args.new - 1} decode steps "
          f"{generation - prefill:.3f} s ({(generation - prefill) / max(args.new - 1, 1) * 1000:.1f} ms a step)")


if __name__ == "__main__":
    main()
