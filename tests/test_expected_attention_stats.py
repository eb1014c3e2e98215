"""ExpectedAttentionStats (kvpress 0.5.5 ``ExpectedAttentionStatsPress``): the tokens each layer and KV head keeps
against kvpress' own (tests/fixtures/kvpress_expected_attention_stats.json, written by
benchmarks/parity_expected_attention_stats.py in kvpress' environment on this tiny Llama and statistics file) and
against a plain float64 definition, the cache's real size, and one-line errors for a bad statistics file."""

from __future__ import annotations

import functools
import hashlib
import json
import math
from pathlib import Path

import learned_files
import pytest
import torch
from baseline_reference import full_run, future_rotation, group_mean
from test_methods import held_positions

import evalkit.compression as ec
from evalkit.compression.cache import _held_bytes
from evalkit.compression.learned_weights import LearnedFileError

FIXTURE_PATH = Path(__file__).parent / "fixtures" / "kvpress_expected_attention_stats.json"
CASES = {  # the fixture's cases: capacity (kvpress' int(60 * (1 - ratio))) and evalkit's settings
    "default, ratio 0.5": (30, {}),
    "no covariance, ratio 0.25": (45, {"use_covariance": False}),
    "no vnorm, 16 future, sink 2": (30, {"use_vnorm": False, "n_future_positions": 16, "sink": 2}),
    "epsilon 0.01, ratio 0.75": (15, {"epsilon": 0.01}),
}


@functools.lru_cache(maxsize=1)
def fixture() -> dict:
    return json.loads(FIXTURE_PATH.read_text())


def stats() -> str:
    folder = query_stats_folder(**fixture()["stats"])
    assert hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()[:16] == fixture()["stats_digest"]
    return str(folder)


def prompt() -> torch.Tensor:
    return torch.tensor([fixture()["prompt"]])


def kept(session, model, ids) -> list[list[set[int]]]:
    held = held_positions(session, {layer: r["key"] for layer, r in full_run(model, ids).items()})
    return [held[layer] for layer in sorted(held)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_keeps_what_kvpress_keeps(llama, case):
    capacity, settings = CASES[case]
    theirs = fixture()["kept"][case]
    assert not isinstance(theirs, str), theirs
    session = ec.CompressionSession(llama, ec.ExpectedAttentionStats(capacity=capacity, stats=stats(), **settings))
    session.prefill(prompt())
    assert kept(session, llama, prompt()) == [[set(head) for head in layer] for layer in theirs]


def reference_scores(model, run, mean, cov, sink, future, use_covariance=True, use_vnorm=True, epsilon=0.0):
    """Per layer and KV head, the scores of the tokens after the first ``sink`` (float64, loops over heads): the
    file's ``mean``/``cov`` of each query head rotated by RoPE averaged over the ``future`` positions after the
    prompt, the softmax of ``k . R mu / sqrt(d) (+ k^T R S R^T k / 2d)`` over the keys, mean over the group."""
    out = {}
    for layer, r in run.items():
        dim = r["key"].shape[2]
        rotation = future_rotation(model.model.rotary_emb, r, future)

        def expected(query_head, kv_head, layer=layer, r=r, rotation=rotation, dim=dim):
            mu = rotation @ mean[layer, query_head].double()
            sigma = rotation @ cov[layer, query_head].double() @ rotation.T
            logits = torch.stack([k @ mu / math.sqrt(dim) + (k @ sigma @ k / dim / 2 if use_covariance else 0)
                                  for k in r["key"][kv_head, sink:]])
            return logits.softmax(dim=0)

        out[layer] = [(s + epsilon) * r["value"][h, sink:].norm(dim=-1) if use_vnorm else s
                      for h, s in enumerate(group_mean(r, expected))]
    return out


def top_clear_of_ties(scores: torch.Tensor, count: int, offset: int) -> set[int]:
    """The ``count`` best ``scores`` (float64), shifted by ``offset``; the cut must not hang on rounding."""
    order = scores.argsort(descending=True, stable=True)
    if 0 < count < len(order):
        inside, outside = float(scores[order[count - 1]]), float(scores[order[count]])
        assert inside - outside > 1e-5 * abs(inside), "the cut falls between two scores equal up to rounding"
    return {offset + int(i) for i in order[:count]}


@pytest.mark.parametrize("case", sorted(CASES))
def test_scores_and_kept_sets_are_the_float64_definition(llama, case):
    capacity, settings = CASES[case]
    policy = ec.ExpectedAttentionStats(capacity=capacity, stats=stats(), **settings)
    recorded, score = {}, policy.score
    policy.score = lambda view: recorded.setdefault(view.layer_idx, score(view))
    session = ec.CompressionSession(llama, policy)
    session.prefill(prompt())
    from safetensors.torch import load_file

    tensors = load_file(str(Path(stats()) / "model.safetensors"))
    run = full_run(llama, prompt())
    sink = policy.sink
    expected = reference_scores(llama, run, tensors["query_mean"], tensors["query_cov"], sink,
                                policy.n_future_positions, policy.use_covariance, policy.use_vnorm, policy.epsilon)
    for layer, heads in expected.items():
        torch.testing.assert_close(recorded[layer][0, :, sink:].double(), torch.stack(heads), rtol=1e-5, atol=1e-7)
    reference = [[set(range(sink)) | top_clear_of_ties(s, capacity - sink, sink) for s in expected[layer]]
                 for layer in sorted(expected)]
    assert kept(session, llama, prompt()) == reference
    for layer in session.cache.layers:  # real tensors of the kept size: [1, 2 KV heads, capacity, 16] fp32, twice
        assert tuple(layer.keys.shape) == (1, 2, capacity, 16)
        assert _held_bytes(layer) == 2 * 2 * capacity * 16 * 4


def test_reads_no_query_and_chunked_prefill_answers_as_one_prefill(llama):
    policy = ec.ExpectedAttentionStats(capacity=30, stats=stats())
    assert policy.prefill_queries() == 0  # the statistics are the file's: chunks keep no query
    whole = ec.generate(llama, prompt(), policy, max_new_tokens=4)
    chunked = ec.generate(llama, prompt(), policy, max_new_tokens=4, prefill_chunk=16)
    assert torch.equal(whole.sequences, chunked.sequences)
    torch.testing.assert_close(chunked.logits, whole.logits, atol=2e-5, rtol=1e-5)
    assert not torch.allclose(whole.logits, ec.generate(llama, prompt(), ec.Full(), max_new_tokens=4).logits)


def one_line_error(build, message: str, error=LearnedFileError):
    with pytest.raises(error, match=message) as caught:
        build()
    assert "\n" not in str(caught.value)


def test_bad_statistics_files_are_one_line(llama):
    good = query_stats_folder()
    one_line_error(lambda: ec.ExpectedAttentionStats(capacity=30).check_layers(2),
                   "needs its query statistics: set method.stats", ValueError)
    no_config = learned_files.copy_of(good)
    (no_config / "config.json").unlink()
    one_line_error(lambda: ec.ExpectedAttentionStats(capacity=30, stats=str(no_config)), "has no config.json")
    one_line_error(lambda: ec.ExpectedAttentionStats(capacity=30, stats="./nowhere"),
                   "neither a folder nor a Hugging Face repository id")
    wrong_config = learned_files.copy_of(good)
    (wrong_config / "config.json").write_text(json.dumps({"num_layers": 3, "num_heads": 4, "head_dim": 16}))
    one_line_error(lambda: ec.ExpectedAttentionStats(capacity=30, stats=str(wrong_config)),
                   r"query_mean has shape \[2, 4, 16\], its config.json says .* \[3, 4, 16\]")
    bad_cov = query_stats_folder(cov_shape=(2, 4, 16, 8))
    one_line_error(lambda: ec.ExpectedAttentionStats(capacity=30, stats=str(bad_cov)), r"query_cov has shape")
    nan = query_stats_folder(nan=True)
    one_line_error(lambda: ec.ExpectedAttentionStats(capacity=30, stats=str(nan)), "must be finite")
    three_layers = ec.ExpectedAttentionStats(capacity=30, stats=str(query_stats_folder(layers=3)))
    one_line_error(lambda: three_layers.check_layers(2), "has statistics for 3 layers, the model has 2")
    two_heads = ec.ExpectedAttentionStats(capacity=30, stats=str(query_stats_folder(heads=2)))
    one_line_error(lambda: ec.CompressionSession(llama, two_heads).prefill(prompt()),
                   r"query_mean is \[2, 2, 16\], the model's layer 0 has 4 query heads of 16")


# -- the statistics file ---------------------------------------------------------------------------------------------
def query_stats_folder(layers: int = 2, heads: int = 4, head_dim: int = 16, seed: int = 0,
                       cov_shape: tuple[int, ...] | None = None, nan: bool = False) -> Path:
    """Query statistics as kvpress' ``ExpectedAttentionStats`` (``PyTorchModelHubMixin``) saves them: ``config.json``
    (its init arguments) and ``model.safetensors`` (``query_mean [L, H, D]``, ``query_cov [L, H, D, D]``, fp32): a
    random mean and a random positive semi-definite covariance per layer and query head. ``cov_shape`` and ``nan``
    damage it."""
    from safetensors.torch import save_file

    folder = learned_files.ROOT / f"eastats-{layers}-{heads}-{head_dim}-{seed}-{cov_shape}-{nan}"
    if not folder.exists():
        folder.mkdir(parents=True)
        generator = torch.Generator().manual_seed(seed)
        # Multiples of 1/8 and 1/4, every product and sum exact: the same bytes whatever kernels torch picks.
        mean = torch.randint(-16, 17, (layers, heads, head_dim), generator=generator) / 8
        factor = torch.randint(-8, 9, (layers, heads, head_dim, head_dim), generator=generator) / 4
        cov = 4 * factor @ factor.transpose(-1, -2) / head_dim
        if cov_shape is not None:
            cov = torch.zeros(cov_shape)
        if nan:
            mean[0, 0, 0] = float("nan")
        save_file({"query_mean": mean.contiguous(), "query_cov": cov.contiguous()}, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps({
            "dataset_name": "kmfoda/booksum", "head_dim": head_dim, "model_name": "tiny-llama", "n_sink": 4,
            "num_heads": heads, "num_layers": layers, "num_samples": 100, "sample_seq_len": 1000}, indent=2))
    return folder
