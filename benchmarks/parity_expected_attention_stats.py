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

import hashlib
from pathlib import Path

from parity_presses import fixture_options, full_keys, held, kept_cells
from parity_runner import Parity, Side, from_tests, kvpress_environment, run_parity, write_fixture

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


def options(parser) -> None:
    fixture_options(parser)
    parser.add_argument("--stats")


SIDES = {"kvpress": Side(lambda args: run_kvpress(args.model, args.stats), reference=True)}


def compare(parity: Parity, args) -> None:
    model, stats = from_tests("conftest").tiny_model(), from_tests("test_expected_attention_stats").query_stats_folder(
        **STATS)
    model.save_pretrained(parity.folder)
    theirs = parity.run("kvpress", "--model", str(parity.folder), "--stats", str(stats))
    ours = run_evalkit(model, str(stats))
    print(f"{'case':<32} heads agreeing  positions differing")
    for case, kept in theirs.items():
        print(f"{case:<32} {kept_cells(kept, ours[case])}")
    if args.write:
        write_fixture(args.write, {"prompt": prompt()[0].tolist(), "stats": STATS, "stats_digest": digest(stats),
                                   "kept": theirs})


if __name__ == "__main__":
    run_parity(__file__, __doc__, SIDES, compare, options=options, environment=kvpress_environment)
