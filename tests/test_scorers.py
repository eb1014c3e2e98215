"""AdaKV and PyramidKV over any scorer (kvpress' ``AdaKVPress(KnormPress())``): the allocation rule of the wrapper
with the ranking of the scorer, each kept set checked against the plain definitions of baseline_reference.py."""

from __future__ import annotations

import pytest
import torch
from baseline_reference import full_run, kept_budgets_over, kept_prompt, scorer_head_scores
from conftest import random_prompt, tiny_model
from masked_reference import module_scaling
from test_methods import held_positions, reference_keys

import evalkit.compression as ec
from evalkit.compression.generate import prefill

OVER = {
    "adakv_knorm": lambda: ec.AdaKV(capacity=20, scorer="knorm", alpha_safeguard=0.5),
    "adakv_h2o": lambda: ec.AdaKV(capacity=20, scorer={"name": "h2o", "recent": 4}, alpha_safeguard=0.5),
    "adakv_observed": lambda: ec.AdaKV(capacity=20, scorer=ec.ObservedAttention(capacity=20, window=3)),
}


@pytest.mark.parametrize("name", sorted(OVER))
def test_adakv_over_a_scorer_keeps_exactly_what_the_definition_names(llama, name):
    policy = OVER[name]()
    prompt = random_prompt(50, seed=11)
    session = ec.CompressionSession(llama, policy)
    session.prefill(prompt)
    held = held_positions(session, reference_keys(llama, prompt))
    assert held == kept_prompt(llama, policy, prompt)
    # AdaKV's rule: the layer's total is the budget, spread over the heads by score (unevenly where the heads' scores
    # differ in scale, as key norms do; this random model's near-uniform attention gives every head about the same).
    assert all(sum(len(h) for h in heads) == 20 * len(heads) for heads in held.values())
    if name == "adakv_knorm":
        assert len({len(h) for heads in held.values() for h in heads}) > 1
    # The scorer decided the ranking: SnapKV's score (the default) keeps other tokens.
    default = ec.CompressionSession(llama, ec.AdaKV(capacity=20, window=2, kernel_size=5, alpha_safeguard=0.5))
    default.prefill(prompt)
    assert held != held_positions(default, reference_keys(llama, prompt))


def test_pyramidkv_over_a_scorer_takes_its_budgets_and_the_scorers_ranking():
    model = tiny_model("llama", num_hidden_layers=4)
    policy = ec.PyramidKV(capacity=20, scorer="observed_attention")
    prompt = random_prompt(50, seed=11)
    out = ec.generate(model, prompt, policy, max_new_tokens=5)
    # KVCache-Factory arithmetic for n=50, C=20, w=0 (ObservedAttention forces nothing), beta=20, L=4:
    # min = 20 // 20 = 1, max = 2 * 20 - 1 = 39, steps = 38 // 3 = 12: layers keep 39, 27, 15, 3.
    budgets = [39, 27, 15, 3]
    assert out.stats[0]["kept_prompt_tokens"] == budgets
    session = ec.CompressionSession(model, policy)
    session.prefill(prompt)
    expected = kept_budgets_over(full_run(model, prompt), dict(enumerate(budgets)),
                                 scorer_head_scores({"name": "observed_attention"}, module_scaling(model)))
    assert held_positions(session, reference_keys(model, prompt)) == expected
    assert {layer.keys.shape[-2] for layer in session.cache.layers} == {39}  # padded to the largest layer


@pytest.mark.parametrize("name", ["adakv_h2o", "adakv_knorm"])
def test_a_wrapper_prefills_in_exact_chunks_as_at_once(name):
    """The scorer's chunked-prefill needs (attention sums for H2O, nothing for KNorm) come through the wrapper."""
    model = tiny_model("llama", seed=2)
    prompt = random_prompt(173, seed=4)
    whole, _, _ = prefill(model, OVER[name](), prompt)
    chunked, _, _ = prefill(model, OVER[name](), prompt, prefill_chunk=45)
    for a, b in zip(whole.cache.layers, chunked.cache.layers):
        assert a.keys.shape == b.keys.shape
        torch.testing.assert_close(b.keys, a.keys, rtol=1e-5, atol=1e-5)
        assert torch.equal(a.heads.positions, b.heads.positions) and torch.equal(a.heads.valid, b.heads.valid)


def test_the_scorer_is_one_recorded_spelling_and_bad_scorers_name_the_problem():
    by_name = ec.AdaKV(capacity=48, scorer="knorm")
    assert by_name == ec.AdaKV(capacity=48, scorer={"name": "knorm"}) == ec.AdaKV(capacity=48, scorer=ec.KNorm(capacity=9))
    assert by_name.config() == {"method": "adakv", "capacity": 48, "alpha_safeguard": 0.2,
                                "scorer": {"name": "knorm", "sink": 0, "window": 0}}  # SnapKV's unused fields left out
    assert "scorer" not in ec.AdaKV(capacity=96).config()  # the default records as before (earlier digests hold)
    for build, message in [
        (lambda: ec.AdaKV(capacity=48, scorer="pyramidkv"), "AdaKV.scorer cannot be pyramidkv: it allocates budgets"),
        (lambda: ec.PyramidKV(capacity=48, scorer="streaming_llm"), "cannot be streaming_llm: it does not score"),
        (lambda: ec.AdaKV(capacity=48, scorer="h3o"), "AdaKV.scorer: unknown method 'h3o'; choose one of"),
        (lambda: ec.AdaKV(capacity=48, scorer={"name": "knorm", "kernel_size": 3}),
         r"AdaKV.scorer.kernel_size is not a setting of knorm \(its settings: \['sink', 'window'\]\)"),
        (lambda: ec.AdaKV(capacity=48, window=8, scorer="knorm"), "AdaKV.window is a setting of the SnapKV score"),
        (lambda: ec.AdaKV(capacity=8, scorer={"name": "knorm", "window": 8}), r"AdaKV.scorer \(knorm\): KNorm.capacity"),
    ]:
        with pytest.raises(ValueError, match=message):
            build()


def test_a_config_chooses_the_scorer_and_the_rows_record_it():
    from test_harness import spec_for

    from evalkit.run.errors import ConfigError

    spec = spec_for("method=adakv", "method.scorer=knorm", "budget=tokens_4096", "model=llama31_8b_instruct")
    assert spec.policy.scorer == {"name": "knorm", "sink": 0, "window": 0}
    row = spec.flat_config()
    assert '"scorer": {"name": "knorm"' in row["policy_params"] and row["window"] is None
    spec = spec_for("method=pyramidkv", "method.scorer={name: h2o, recent: 64}", "budget=tokens_4096")
    assert spec.policy.scoring == ec.H2O(capacity=4096, recent=64) and spec.policy.kept_window() == 64
    plain = spec_for("method=adakv", "budget=tokens_4096", "model=llama31_8b_instruct").flat_config()
    assert "scorer" not in plain["policy_params"]
    with pytest.raises(ConfigError, match="AdaKV.window is a setting of the SnapKV score, unused with scorer=knorm"):
        spec_for("method=adakv", "method.scorer=knorm", "method.window=8", "budget=tokens_4096")
