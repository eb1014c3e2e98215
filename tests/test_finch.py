"""kvpress 0.5.5's ``FinchPress`` (finch): the tokens each layer and KV head keeps, and the re-rotated keys, against
kvpress' own (tests/fixtures/kvpress_finch.json, written by benchmarks/parity_finch.py in kvpress' environment on
this tiny Llama); the score against a float64 definition; the cache's held size."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from baseline_reference import full_run
from masked_reference import module_scaling

import evalkit.compression as ec

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from parity_finch import CASES, evalkit_method  # noqa: E402

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "kvpress_finch.json").read_text())
PROMPT = torch.tensor([FIXTURE["prompt"]])
N = PROMPT.shape[1]


def kept(session) -> list[list[list[int]]]:
    """Per layer and KV head, the text positions the cache holds (row 0)."""
    return [[head.tolist() for head in layer] for layer in ec.kept_positions(session)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_finch_keeps_what_kvpress_keeps(llama, case):
    policy = evalkit_method(case)
    session = ec.CompressionSession(llama, policy)
    session.prefill(PROMPT)
    assert kept(session) == FIXTURE["kept"][case]
    if case in FIXTURE["keys"]:  # kvpress' re-rotated keys, each head's in text order
        ours = torch.stack([layer.keys[0, :, : policy.capacity] for layer in session.cache.layers])
        torch.testing.assert_close(ours, torch.tensor(FIXTURE["keys"][case]), atol=1e-5, rtol=1e-5)


def finch_reference(model, prompt: torch.Tensor, window: int, normalize: bool = True) -> dict[int, torch.Tensor]:
    """FINCH's score in float64, per layer ``[Hkv, n - window]``: each of the last ``window`` queries' softmax over
    the keys it sees, cut to the context, times its position if ``normalize``; averaged over those queries, then over
    the query heads of each KV head."""
    n, scaling = prompt.shape[1], module_scaling(model)
    out = {}
    for layer, r in full_run(model, prompt).items():
        kv_heads, group = r["key"].shape[0], r["query"].shape[0] // r["key"].shape[0]
        heads = []
        for q_head in range(kv_heads * group):
            rows = [(r["query"][q_head, i] @ r["key"][q_head // group, : i + 1].T * scaling).softmax(0)[: n - window]
                    * (i if normalize else 1) for i in range(n - window, n)]
            heads.append(torch.stack(rows).mean(0))
        out[layer] = torch.stack(heads).reshape(kv_heads, group, -1).mean(1)
    return out


@pytest.mark.parametrize("normalize", [True, False])
def test_finch_scores_and_keeps_by_its_float64_definition(llama, normalize):
    window, capacity = 10, 24
    policy = ec.Finch(capacity=capacity, window=window, normalize_scores=normalize, rerotate_keys=False)
    scores = {}

    def record(view):  # the method's own score, kept per layer
        scores[view.layer_idx] = ec.Finch.score(policy, view)
        return scores[view.layer_idx]

    policy.score = record
    session = ec.CompressionSession(llama, policy)
    session.prefill(PROMPT)
    reference = finch_reference(llama, PROMPT, window, normalize)
    for layer, expected in reference.items():
        torch.testing.assert_close(scores[layer][0, :, : N - window].double(), expected, atol=1e-6, rtol=1e-5)
        best = [sorted(sorted(range(N - window), key=lambda j: (-float(head[j]), j))[: capacity - window])
                + list(range(N - window, N)) for head in expected]
        assert kept(session)[layer] == best


def test_finch_evicts_the_cache_it_holds(llama):
    policy = ec.Finch(capacity=20, window=6)
    session = ec.CompressionSession(llama, policy)
    session.prefill(PROMPT)
    held = [layer.keys.shape[2] for layer in session.cache.layers]
    assert held == [20] * len(held) and session.realized(0)["kept_prompt_tokens"] == [20.0] * len(held)
    full = ec.CompressionSession(llama, ec.Full())
    full.prefill(PROMPT)
    assert session.cache.prefill_peak_bytes > 0
    assert sum(layer.keys.numel() for layer in session.cache.layers) * 3 == sum(
        layer.keys.numel() for layer in full.cache.layers)


def test_bad_settings_are_one_line(llama):
    for build, message in [
        (lambda: ec.Finch(capacity=8, window=8), "capacity must be > window"),
        (lambda: ec.Finch(capacity=32, chunk_length=0), "chunk_length"),
        (lambda: ec.Finch(capacity=32, normalize_scores=1), "normalize_scores must be true or false"),
    ]:
        with pytest.raises(ValueError, match=message):
            build()
    session = ec.CompressionSession(llama, ec.Finch(capacity=30, window=8, chunk_length=10))
    with pytest.raises(ValueError, match="chunk_length 10 must exceed"):
        session.prefill(PROMPT)

