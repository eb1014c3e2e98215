"""NACL against a plain float64 port of KVCache-Factory's ``select_nacl_tokens`` (``pyramidkv/nacl.py``, commit
c97f9d706d63d1b56e980f8b81b2a924c21162b3): the positions kept per layer and KV head, the cache really shrunk to them,
and the generated tokens and logits of a full-cache run that hides the rest."""

from __future__ import annotations

import math

import pytest
import torch
from baseline_reference import causal_probabilities, full_run
from conftest import random_prompt
from masked_reference import _RECORD, module_scaling
from test_methods import held_positions, reference_keys
from transformers import DynamicCache

import evalkit.compression as ec
from evalkit.compression.model_spec import cache_kwargs

N = 60
# A cut between two values closer than this (relative) would hang on the CPU's float kernels.
GAP = 1e-9
CASES = {
    "proxy tokens only": lambda: ec.NACL(capacity=24, window=8),
    "sink and random": lambda: ec.NACL(capacity=24, sink=2, window=6, random_budget=6, seed=5),
    "cold draws, group max": lambda: ec.NACL(capacity=24, window=4, random_budget=10, random_temperature=0.25,
                                             gqa_reduce="max", seed=7),
    "uniform draws, all random": lambda: ec.NACL(capacity=20, sink=1, window=3, random_budget=40,
                                                 random_temperature=0.0, seed=3),
}


def reduced_proxy_scores(r, window: int, how: str, scaling: float) -> list[list[float]]:
    """``reduce_nacl_proxy_scores`` of the last ``window`` queries' softmax attention, per KV head the mean or max
    over its query heads."""
    kv_heads, n = r["key"].shape[:2]
    group = r["query"].shape[0] // kv_heads
    heads = []
    for h in range(kv_heads):
        per_query_head = [causal_probabilities(r["query"][h * group + g], r["key"][h], scaling)[n - window :].sum(0)
                          for g in range(group)]
        stacked = torch.stack(per_query_head)
        heads.append((stacked.amax(0) if how == "max" else stacked.mean(0)).tolist())
    return heads


def best(values: dict[int, float], count: int) -> list[int]:
    """The ``count`` keys of the highest values (ties to the earlier position), checking the cut is no near-tie."""
    order = sorted(values, key=lambda j: (-values[j], j))
    if 0 < count < len(order):
        inside, outside = values[order[count - 1]], values[order[count]]
        assert inside - outside > GAP * max(abs(inside), 1e-300), "a near-tie at the cut: pick other inputs"
    return order[:count]


def select_nacl(scores: list[float], uniform: list[float], policy) -> set[int]:
    """``select_nacl_tokens`` for one head: the protected tokens (first ``sink``, last ``window`` proxies), the top
    of the others, and ``_sample_without_replacement`` from the rest, with ``torch.multinomial``'s own algorithm
    (the largest ``weight / Exp(1)``, ``Exp(1) = -log u``) on these uniforms."""
    n = len(scores)
    if policy.capacity >= n:
        return set(range(n))
    protected = set(range(min(policy.sink, n))) | set(range(n - policy.window, n))
    random_keep = min(policy.random_budget, policy.capacity - len(protected))
    top_keep = policy.capacity - len(protected) - random_keep
    candidates = [j for j in range(n) if j not in protected]
    top = best({j: scores[j] for j in candidates}, top_keep)
    rest = [j for j in candidates if j not in top]
    temperature = policy.random_temperature
    if temperature <= 0:
        weights = [1.0] * len(rest)
    else:
        highest = max(scores[j] / temperature for j in rest)
        exps = [math.exp(scores[j] / temperature - highest) for j in rest]
        weights = [e / sum(exps) for e in exps]
    race = {j: w / -math.log(uniform[j]) for j, w in zip(rest, weights)}
    return protected | set(top) | set(best(race, random_keep))


def kept_nacl(model, policy, prompt) -> dict[int, list[set[int]]]:
    """Per layer and KV head, the positions the reference keeps; layer ``l`` draws its uniforms ``[Hkv, n]`` from a
    generator seeded ``seed * 2**16 + l``."""
    kept, scaling = {}, module_scaling(model)
    for layer, r in full_run(model, prompt).items():
        kv_heads, n = r["key"].shape[:2]
        scores = reduced_proxy_scores(r, policy.window, policy.gqa_reduce, scaling)
        generator = torch.Generator().manual_seed(policy.seed * 2**16 + layer)
        uniform = torch.rand(kv_heads, n, dtype=torch.float64, generator=generator).tolist()
        kept[layer] = [select_nacl(scores[h], uniform[h], policy) for h in range(kv_heads)]
    return kept


@torch.no_grad()
def masked_logits(model, prompt: torch.Tensor, tokens: list[int], kept) -> torch.Tensor:
    """Logits of a full-cache run of ``prompt`` then ``tokens`` (teacher forced), each layer and head seeing only
    its ``kept`` prompt positions and every generated token."""
    original, cache, n = model.config._attn_implementation, DynamicCache(config=model.config), prompt.shape[1]
    model.config._attn_implementation = "reference_masked"
    _RECORD.clear()
    try:
        logits = [model(input_ids=prompt, **cache_kwargs(model, cache), use_cache=True).logits[0, -1]]
        for step, token in enumerate(tokens[:-1]):
            _RECORD["visible"] = {layer: torch.tensor([[j in h or j >= n for j in range(n + step + 1)] for h in heads])
                                  for layer, heads in kept.items()}
            logits.append(model(input_ids=torch.tensor([[token]]), **cache_kwargs(model, cache),
                                use_cache=True).logits[0, -1])
        return torch.stack(logits).float()
    finally:
        model.config._attn_implementation = original
        _RECORD.clear()


@pytest.mark.parametrize("case", sorted(CASES))
def test_nacl_keeps_what_the_reference_selector_keeps(llama, case):
    policy = CASES[case]()
    prompt = random_prompt(N, seed=11)
    session = ec.CompressionSession(llama, policy)
    session.prefill(prompt)
    expected = kept_nacl(llama, policy, prompt)
    assert held_positions(session, reference_keys(llama, prompt)) == expected
    for layer, heads in zip(session.cache.layers, expected.values()):  # the cache really holds that many
        assert {len(h) for h in heads} == {policy.capacity}
        assert layer.keys.shape[-2] == policy.capacity < N


@pytest.mark.parametrize("case", ["proxy tokens only", "sink and random"])
def test_nacl_generates_what_the_masked_reference_generates(llama, case):
    policy = CASES[case]()
    prompt = random_prompt(N, seed=11)
    out = ec.generate(llama, prompt, policy, max_new_tokens=12)
    tokens = out.sequences[0, N:].tolist()
    reference = masked_logits(llama, prompt, tokens, kept_nacl(llama, policy, prompt))
    assert reference.argmax(dim=-1).tolist() == tokens
    torch.testing.assert_close(out.logits[0], reference, atol=2e-4, rtol=1e-4)
    assert out.stats[0]["kept_prompt_tokens"] == [policy.capacity] * len(llama.model.layers)


def test_the_random_part_follows_its_seed_and_keeps_a_prompt_alone_or_batched(llama):
    from test_compression import assert_batch_equals_alone

    prompt = random_prompt(N, seed=11)
    drawn = {seed: kept_nacl(llama, ec.NACL(capacity=24, sink=2, window=6, random_budget=6, seed=seed), prompt)
             for seed in (5, 6)}
    assert drawn[5] != drawn[6]
    assert drawn[5] != kept_nacl(llama, ec.NACL(capacity=24, sink=2, window=6), prompt)
    assert_batch_equals_alone(llama, CASES["sink and random"](), new_tokens=12)


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match="NACL.capacity must be > sink \\+ window"):
        ec.NACL(capacity=8, window=8)
    with pytest.raises(ValueError, match="NACL.random_temperature must be a number >= 0"):
        ec.NACL(capacity=20, random_temperature=-1.0)
