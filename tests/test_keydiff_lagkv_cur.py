"""KeyDiff, LagKV and CUR (kvpress' KeyDiffPress, LagKVPress, CURPress) against plain references: scores recomputed
here in float64 loops from the keys and values the model produced, the kept positions compared per layer and KV
head, the cache really shrunk to them. (benchmarks/parity_scores.py compares the same methods with kvpress' own code.)"""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from baseline_reference import full_run, top
from conftest import VOCAB
from test_methods import held_positions, reference_keys

import evalkit.compression as ec

N = 50


def distinct_prompt(seed: int = 0) -> torch.Tensor:
    """Distinct tokens: RoPE keeps a key's norm, so a repeated token would tie with itself in a norm-based score."""
    return (3 + torch.randperm(VOCAB - 3, generator=torch.Generator().manual_seed(seed))[:N])[None]


def keydiff_scores(keys: torch.Tensor) -> list[float]:
    unit = [k / k.norm() for k in keys]
    anchor = sum(unit) / len(unit)
    return [-float(k @ anchor / (k.norm() * anchor.norm())) for k in keys]


def lagkv_scores(keys: torch.Tensor, values: torch.Tensor, sink: int, lag: int, cross: bool) -> list[float]:
    n = keys.shape[0]
    score = [1.0] * n
    if n < sink + 2 * lag:
        return score[:sink] + [i / (n - sink) for i in range(n - sink)]
    parts = (n - sink) // lag

    def stand_out(states: torch.Tensor, p: int) -> list[float]:
        reference = states[sink + (p + 1) * lag : sink + (p + 2) * lag]
        low, high = reference.min(dim=0).values, reference.max(dim=0).values
        spread = [statistics.stdev(((states[j] - low) / (high - low)).tolist()) for j in
                  range(sink + p * lag, sink + (p + 1) * lag)]
        total = sum(math.exp(s) for s in spread)
        return [math.exp(s) / total for s in spread]

    for p in range(parts - 1):
        both = [(a + b) / 2 for a, b in zip(stand_out(keys, p), stand_out(values, p))]
        if not cross:
            order = sorted(range(lag), key=lambda i: both[i])
            both = [order.index(i) / lag for i in range(lag)]
        score[sink + p * lag : sink + (p + 1) * lag] = both
    return score


def cur_scores(keys: torch.Tensor, values: torch.Tensor, window: int) -> list[float]:
    def local(squares: list[float]) -> list[float]:
        out = []
        for start in range(0, len(squares), window):
            chunk = squares[start : start + window]
            out += [s / sum(chunk) for s in chunk]
        return out

    k2, v2 = local([float(k @ k) for k in keys]), local([float(v @ v) for v in values])
    product = [a * b for a, b in zip(k2, v2)]
    return [p / sum(product) for p in product]


def expected(model, prompt, capacity: int, sink: int, score) -> dict[int, list[set[int]]]:
    """Per layer and KV head: the first ``sink`` forced, then the best of ``score(keys, values)`` (ties to the
    earlier token), ``capacity`` in all."""
    kept = {}
    for layer, r in full_run(model, prompt).items():
        kept[layer] = [set(range(sink)) | top([-math.inf] * sink + score(k, v)[sink:], capacity - sink)
                       for k, v in zip(r["key"], r["value"])]
    return kept


CASES = {
    "keydiff": (ec.KeyDiff(capacity=20), 0, lambda k, v: keydiff_scores(k)),
    "lagkv": (ec.LagKV(capacity=30, lag_size=8), 4, lambda k, v: lagkv_scores(k, v, 4, 8, False)),
    "lagkv cross": (ec.LagKV(capacity=25, lag_size=8, cross_scoring=True), 4,
                    lambda k, v: lagkv_scores(k, v, 4, 8, True)),
    "lagkv short": (ec.LagKV(capacity=20), 4, lambda k, v: lagkv_scores(k, v, 4, 128, False)),
    "cur": (ec.CUR(capacity=20), 4, lambda k, v: cur_scores(k, v, 16)),
    "cur whole": (ec.CUR(capacity=20, local_window_size=0, leverage_type="kv_avg"), 4, None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_head_keeps_the_tokens_the_reference_names(llama, case):
    policy, sink, score = CASES[case]
    if score is None:  # CUR without windows (the squared norms unnormalized), keys and values averaged
        def score(k, v):
            mean = [(float(a @ a) + float(b @ b)) / 2 for a, b in zip(k, v)]
            return [m / sum(mean) for m in mean]
    prompt = distinct_prompt()
    session = ec.CompressionSession(llama, policy)
    session.prefill(prompt)
    held = held_positions(session, reference_keys(llama, prompt))
    assert held == expected(llama, prompt, policy.capacity, sink, score)
    assert {layer.keys.shape[-2] for layer in session.cache.layers} == {policy.capacity}  # really shrunk


def test_the_references_can_fail(llama):
    """KeyDiff keeping the keys *most* like the anchor is not what evalkit keeps."""
    prompt = distinct_prompt()
    session = ec.CompressionSession(llama, ec.KeyDiff(capacity=20))
    session.prefill(prompt)
    opposite = expected(llama, prompt, 20, 0, lambda k, v: [-s for s in keydiff_scores(k)])
    assert held_positions(session, reference_keys(llama, prompt)) != opposite


@pytest.mark.parametrize("build, message", [
    (lambda: ec.LagKV(capacity=20, lag_size=0), "LagKV.lag_size must be an integer >= 1, got 0"),
    (lambda: ec.CUR(capacity=20, leverage_type="kv_sum"), "CUR.leverage_type must be one of"),
    (lambda: ec.CUR(capacity=20, local_window_size=-1), "CUR.local_window_size must be an integer >= 0"),
])
def test_bad_settings_are_named(build, message):
    with pytest.raises(ValueError, match=message):
        build()
