"""PerLayer (kvpress ``PerLayerCompressionPress``) and Composed (kvpress ``ComposedPress``), held to plain references:
each layer and KV head keeps exactly the positions the definition names, the cache really shrinks to them, and the
wrappers nest inside the others."""

from __future__ import annotations

import pytest
import torch
from baseline_reference import full_run, kept_snapkv_budgets, top
from conftest import VOCAB, random_prompt, tiny_model
from masked_reference import module_scaling, plain_snapkv_scores
from test_methods import held_positions, reference_keys

import evalkit.compression as ec
from evalkit.config.method_config import policy_from_config


@pytest.mark.parametrize("weights, layers, budgets", [
    ((2, 1, 0.5, 0.5), 4, [40, 20, 10, 10]),  # one weight per layer: floor(20 * w / mean(w)), mean(w) = 1
    ((1.5, 0.5), 4, [30, 30, 10, 10]),  # a profile stretched over the depth
])
def test_per_layer_keeps_each_layers_share_by_the_scorers_ranking(weights, layers, budgets):
    model = tiny_model("llama", num_hidden_layers=layers)
    policy = ec.PerLayer.from_config(20, window=6, kernel_size=5, pooling="max", weights=weights)
    prompt = random_prompt(50, seed=11)
    session = ec.CompressionSession(model, policy)
    session.prefill(prompt)
    expected = kept_snapkv_budgets(full_run(model, prompt), dict(enumerate(budgets)), 6, 5, "max",
                                   module_scaling(model))
    assert held_positions(session, reference_keys(model, prompt)) == expected
    assert session.realized(0)["kept_prompt_tokens"] == budgets
    assert {layer.keys.shape[-2] for layer in session.cache.layers} == {max(budgets)}  # padded to the largest
    assert max(budgets) == policy.prompt_slots(50, 2)  # what static caches are sized by


def test_per_layer_without_weights_is_its_scorer(llama):
    prompt = random_prompt(50, seed=3)
    plain = ec.generate(llama, prompt, ec.KNorm(capacity=20), max_new_tokens=20)
    wrapped = ec.generate(llama, prompt, ec.PerLayer(capacity=20, scorer="knorm"), max_new_tokens=20)
    assert wrapped.sequences.tolist() == plain.sequences.tolist()
    torch.testing.assert_close(wrapped.logits, plain.logits)
    assert wrapped.stats[0]["kept_prompt_tokens"] == [20, 20]


def composed_reference(model, prompt, first_capacity, first_window, capacity, window, kernel_size):
    """KNorm (``-||k||``, its last ``first_window`` forced) keeps ``first_capacity`` per head; SnapKV then scores
    those tokens alone, in text order, with the prompt's last ``window`` queries, and keeps ``capacity``."""
    kept = {}
    for layer, r in full_run(model, prompt).items():
        query, key = r["query"], r["key"]
        kv_heads, n = key.shape[:2]
        group = query.shape[0] // kv_heads
        heads = []
        for head in range(kv_heads):
            knorm = [float("inf") if j >= n - first_window else -float(key[head, j].norm()) for j in range(n)]
            first = sorted(top(knorm, first_capacity))
            sub_query = query[head * group:(head + 1) * group][:, first]
            scores = plain_snapkv_scores(sub_query, key[head:head + 1, first], window, kernel_size, "max", "mean",
                                         module_scaling(model))[0]
            chosen = top(scores.tolist(), capacity - window) | set(range(len(first) - window, len(first)))
            heads.append({first[i] for i in chosen})
        kept[layer] = heads
    return kept


def test_composed_applies_its_second_method_to_what_the_first_kept(llama):
    policy = ec.Composed(capacity=16, first={"name": "knorm", "window": 6}, then={"name": "snapkv", "window": 6,
                                                                                   "kernel_size": 5}, first_keeps=2)
    assert (policy.first.capacity, policy.then.capacity) == (32, 16)
    # Distinct tokens: RoPE keeps a key's norm, so a repeated token would tie with itself in KNorm's ranking.
    prompt = (3 + torch.randperm(VOCAB - 3, generator=torch.Generator().manual_seed(0))[:50])[None]
    session = ec.CompressionSession(llama, policy)
    session.prefill(prompt)
    expected = composed_reference(llama, prompt, 32, 6, 16, 6, 5)
    assert held_positions(session, reference_keys(llama, prompt)) == expected
    # Not either method alone: the composition changes what is kept.
    alone = kept_snapkv_budgets(full_run(llama, prompt), {0: 16, 1: 16}, 6, 5, "max", module_scaling(llama))
    assert expected != alone
    assert session.realized(0)["kept_prompt_tokens"] == [16, 16]
    assert {layer.keys.shape[-2] for layer in session.cache.layers} == {16}


def test_wrappers_nest_through_composed_and_per_layer(llama):
    """DecodingSnapKV over PerLayer over KNorm, and Composed whose first stage is AdaKV: built from a config, they
    compress, and the decoding one stays within its slots at every step."""
    nested = policy_from_config({"name": "decoding_snapkv", "window": 4, "interval": 8,
                                 "scorer": {"name": "per_layer", "scorer": "knorm", "weights": [1.5, 0.5]}},
                                "tokens_48", 4096)
    assert (nested.scorer.capacity, nested.scorer.scorer.capacity) == (40, 40)
    out = ec.generate(llama, random_prompt(60, seed=2), nested, max_new_tokens=30)
    assert out.stats[0]["kept_prompt_tokens"] == [60, 20]  # 40 * 1.5, 40 * 0.5
    assert out.stats[0]["peak_cache_tokens"] <= nested.slot_capacity(2)
    composed = policy_from_config({"name": "composed", "first": {"name": "adakv", "window": 6, "kernel_size": 5},
                                   "then": {"name": "knorm"}, "first_keeps": 2}, "tokens_12", 4096)
    session = ec.CompressionSession(llama, composed)
    session.prefill(random_prompt(60, seed=2))
    assert session.realized(0)["kept_prompt_tokens"] == [12, 12]
    per_head = session.realized(0)["kept_prompt_tokens_per_head"]
    assert all(count <= 24 for heads in per_head for count in heads)


@pytest.mark.parametrize("config, message", [
    ({"first": "knorm", "then": "snapkv"}, "Composed: snapkv reads the prompt's last 32 queries"),
    ({"first": None, "then": "observed_attention"}, "Composed.then cannot be observed_attention"),
    ({"first": "h2o"}, "Composed.first cannot be h2o: it acts while decoding"),
    ({"then": "observed_attention"}, "Composed.then cannot be observed_attention: its score sums the attention"),
    ({"first": "full"}, "Composed.first cannot be full: it keeps every token"),
    ({"first_keeps": 0.5}, "Composed.first_keeps must be a number >= 1"),
])
def test_composed_refuses_what_it_cannot_compose(config, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ec.Composed(capacity=40, **{"first": {"name": "knorm", "window": 32}, **config})


@pytest.mark.parametrize("weights, message", [
    ([], "PerLayer.weights must be a list of numbers >= 0"),
    ([1, -1], "PerLayer.weights must be a list of numbers >= 0"),
    ([1, 0], "PerLayer: its lightest layer keeps 0 tokens"),
    ([0, 0], "PerLayer: its lightest layer keeps 0 tokens"),
    ([8, 0.1], "PerLayer: its lightest layer keeps 2 tokens, not more than the 64 snapkv always keeps"),
])
def test_per_layer_refuses_bad_weights(weights, message):
    with pytest.raises(ValueError, match=message):
        ec.PerLayer.from_config(100, weights=weights)


def test_per_layer_refuses_a_profile_that_does_not_divide_the_layers(llama):
    with pytest.raises(ValueError, match="PerLayer.weights gives 3 shares, and the model's 2 layers are not a multiple"):
        ec.CompressionSession(llama, ec.PerLayer(capacity=40, scorer="knorm", weights=(2, 1, 0.5)))
    nested = ec.DecodingSnapKV(capacity=80, window=4, interval=8,
                               scorer={"name": "per_layer", "scorer": "knorm", "weights": [2, 1, 0.5]})
    with pytest.raises(ValueError, match="PerLayer.weights gives 3 shares"):  # asked through the wrappers
        ec.CompressionSession(llama, nested)


def test_the_lm_eval_adapter_refuses_the_profile_before_any_request(llama):
    from evalkit.lm import EvalkitLM
    from evalkit.models.train_tiny import build_tokenizer

    with pytest.raises(ValueError, match="PerLayer.weights gives 3 shares"):
        EvalkitLM(model=llama, tokenizer=build_tokenizer(), max_context=256,
                  policy=ec.PerLayer(capacity=40, scorer="knorm", weights=(2, 1, 0.5)))
