"""kvpress 0.5.5's ``ExpectedAttentionStatsPress`` beside evalkit's ``expected_attention_stats``: the same tiny Llama
(tests/conftest.py's, saved once and loaded by both sides), prompt of distinct tokens and query statistics (a tiny
random file in kvpress' format, tests/test_expected_attention_stats.py's writer, read by both sides); do they keep the
same tokens per layer and KV head?

    .venv/bin/python benchmarks/parity_expected_attention_stats.py [--venv /tmp/kvpress-venv] \
        [--write tests/fixtures/kvpress_expected_attention_stats.json]

kvpress' press (``stats_folder`` the file) runs around the model over the prompt; each side maps its cache's keys to
the nearest key of a full-cache run of the prompt. ``--write`` stores kvpress' kept sets with the prompt and the
statistics file's digest as the fixture tests/test_expected_attention_stats.py checks evalkit against.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from parity_presses import full_keys, held  # noqa: E402

N = 60
STATS = {"layers": 2, "heads": 4, "head_dim": 16, "seed": 0}  # the tiny Llama's: 2 layers, 4 query heads of 16
CASES = {  # case: (compression_ratio, kvpress' settings, evalkit's)
    "default, ratio 0.5": (0.5, {}, {}),
    "no covariance, ratio 0.25": (0.25, {"use_covariance": False}, {"use_covariance": False}),
    "no vnorm, 16 future, sink 2": (0.5, {"use_vnorm": False, "n_future_positions": 16, "n_sink": 2},
                                    {"use_vnorm": False, "n_future_positions": 16, "sink": 2}),
    "epsilon 0.01, ratio 0.75": (0.75, {"epsilon": 0.01}, {"epsilon": 0.01}),
}


def capacity(ratio: float) -> int:
    """kvpress' ``ScorerPress`` keeps ``int(n * (1 - compression_ratio))`` of an ``n``-token prompt."""
    return int(N * (1 - ratio))


def prompt():
    """The prompt ``[1, N]``, distinct tokens."""
    import torch

    return (3 + torch.randperm(94, generator=torch.Generator().manual_seed(0))[:N])[None]


def digest(folder: Path) -> str:
    return hashlib.sha256((Path(folder) / "model.safetensors").read_bytes()).hexdigest()[:16]


def run_kvpress(folder: str, stats: str) -> dict:
    import torch
    from kvpress import ExpectedAttentionStatsPress
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()
    ids = prompt()
    full = full_keys(model, ids)
    out = {}
    for case, (ratio, settings, _) in CASES.items():
        press, cache = ExpectedAttentionStatsPress(compression_ratio=ratio, stats_folder=stats, **settings), DynamicCache()
        try:
            with torch.no_grad(), press(model):
                model(input_ids=ids, past_key_values=cache, use_cache=True)
        except Exception as error:  # noqa: BLE001 - kvpress' own failure is the result
            out[case] = f"{type(error).__name__}: {str(error).splitlines()[0]}"
            continue
        out[case] = [held(full[index], list(layer.keys[0])) for index, layer in enumerate(cache.layers)]
    return out


def run_evalkit(model, stats: str) -> dict:
    """evalkit's kept positions per case, layer and KV head (row 0 of a one-prompt batch)."""
    import evalkit.compression as ec

    ids, out = prompt(), {}
    full = full_keys(model, ids)
    for case, (ratio, _, settings) in CASES.items():
        session = ec.CompressionSession(model, ec.ExpectedAttentionStats(capacity=capacity(ratio), stats=stats,
                                                                         **settings))
        session.prefill(ids)
        out[case] = [held(full[index], [head[session.state.valid[0, : layer.keys.shape[-2]]] for head in layer.keys[0]])
                     for index, layer in enumerate(session.cache.layers)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", default="/tmp/kvpress-venv")
    parser.add_argument("--write", help="the fixture to write kvpress' kept sets to")
    parser.add_argument("--worker", choices=["kvpress"])
    parser.add_argument("--model")
    parser.add_argument("--stats")
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(run_kvpress(args.model, args.stats)))
        return
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE.parent / "tests"))
    from bench_vs_kvpress import kvpress_python, run_worker
    from conftest import tiny_model
    from test_expected_attention_stats import query_stats_folder

    python = kvpress_python(Path(args.venv))
    if python is None:
        return
    model, stats = tiny_model(), query_stats_folder(**STATS)
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        theirs = run_worker(python, Path(__file__), "kvpress", "--model", folder, "--stats", str(stats))
    ours = run_evalkit(model, str(stats))
    print(f"{'case':<32} heads agreeing  positions differing")
    for case, kept in theirs.items():
        if isinstance(kept, str):
            print(f"{case:<32} kvpress fails: {kept}")
            continue
        pairs = [(set(a), set(b)) for la, lb in zip(kept, ours[case]) for a, b in zip(la, lb)]
        same, differ = sum(a == b for a, b in pairs), sum(len(a ^ b) for a, b in pairs)
        print(f"{case:<32} {same}/{len(pairs):<13} {differ}")
    if args.write:
        fixture = {"reference": "kvpress 0.5.5", "prompt": prompt()[0].tolist(), "stats": STATS,
                   "stats_digest": digest(stats), "kept": theirs}
        Path(args.write).write_text(json.dumps(fixture, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
