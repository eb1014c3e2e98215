"""AdaKV, PyramidKV and decoding-time re-application (DecodingSnapKV) over any scorer (kvpress' ``AdaKVPress(KnormPress())``): the allocation rule of the wrapper
with the ranking of the scorer, each kept set checked against the plain definitions of baseline_reference.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from baseline_reference import (
    full_run,
    kept_budgets_over,
    kept_prompt,
    scorer_head_scores,
    simulate_decoding,
    smallest_norms,
)
from conftest import VOCAB, random_prompt, tiny_model
from learned_files import expected_attention_stats, qfilters
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
    default = ec.CompressionSession(llama, ec.AdaKV.from_config(20, window=2, kernel_size=5, alpha_safeguard=0.5))
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
        (lambda: ec.AdaKV.from_config(48, window=8, scorer="knorm"), "AdaKV.window is a setting of the SnapKV score"),
        (lambda: ec.AdaKV.from_config(48, window=8, scorer="snapkv"), "AdaKV.window is a setting of the SnapKV score, "
                                                                      "unused with scorer=snapkv"),
        (lambda: ec.AdaKV(capacity=8, scorer={"name": "knorm", "window": 8}), r"AdaKV.scorer \(knorm\): KNorm.capacity"),
    ]:
        with pytest.raises(ValueError, match=message):
            build()


def test_a_config_chooses_the_scorer_and_the_rows_record_it():
    from test_harness import spec_for

    from evalkit.core.errors import ConfigError

    spec = spec_for("method=adakv", "method.scorer=knorm", "budget=tokens_4096", "model=llama31_8b_instruct")
    assert spec.policy.scorer == ec.KNorm(capacity=4096)
    row = spec.flat_config()
    assert '"scorer": {"name": "knorm"' in row["policy_params"] and row["window"] is None
    spec = spec_for("method=pyramidkv", "method.scorer={name: h2o, recent: 64}", "budget=tokens_4096")
    assert spec.policy.scorer == ec.H2O(capacity=4096, recent=64) and spec.policy.kept_window() == 64
    plain = spec_for("method=adakv", "budget=tokens_4096", "model=llama31_8b_instruct").flat_config()
    assert "scorer" not in plain["policy_params"]
    with pytest.raises(ConfigError, match="AdaKV.window is a setting of the SnapKV score, unused with scorer=knorm"):
        spec_for("method=adakv", "method.scorer=knorm", "method.window=8", "budget=tokens_4096")
    spec = spec_for("method=decoding_snapkv", "method.scorer={name: knorm, window: 8}", "method.window=16",
                    "method.interval=128", "budget=tokens_4096")
    assert spec.policy.scorer == ec.KNorm(capacity=4096 - 128, window=8) and spec.policy.query_window() == 16
    params = spec.flat_config()["policy_params"]
    assert '"scorer": {"name": "knorm", "sink": 0, "window": 8}' in params and '"window": 16' in params
    assert "kernel_size" not in params and "pooling" not in params
    assert "scorer" not in spec_for("method=decoding_snapkv", "budget=tokens_4096").flat_config()["policy_params"]
    with pytest.raises(ConfigError, match="DecodingSnapKV.scorer cannot be observed_attention: its score sums"):
        spec_for("method=decoding_snapkv", "method.scorer=observed_attention", "budget=tokens_4096")


# -- decoding-time re-application over a scorer (kvpress' DecodingPress(base_press=KnormPress())) -----------------
@pytest.mark.parametrize("scorer", ["knorm", {"name": "knorm", "sink": 2, "window": 3}])
def test_decoding_reapplication_over_a_scorer_follows_the_definition_at_every_step(llama, scorer):
    """Every ``interval`` steps each head keeps the scorer's forced tokens and its best others (KNorm: the smallest
    key norms) up to capacity - interval, by the plain definition replayed step by step; logits as the reference's."""
    policy = ec.DecodingSnapKV(capacity=40, window=4, interval=8, scorer=scorer)
    # Distinct tokens, the prompt's and those fed in alike (not this random model's generations, which repeat): RoPE
    # keeps a key's norm, so a repeated token ties with itself up to rounding, and KNorm's ranking would then hang on
    # the last bit, which differs with the CPU's float kernels (the reference checks every cut for such a near-tie).
    distinct = 3 + torch.randperm(VOCAB - 3, generator=torch.Generator().manual_seed(9))
    prompt, tokens = distinct[None, :30], distinct[30:91].tolist()
    settings = dataclasses.asdict(policy.scorer)
    sink, window = settings["sink"], settings["window"]
    # The forced prompt tokens, then the smallest norms among the others.
    prefill_kept = {layer: [set(range(sink)) | set(range(30 - window, 30)) | smallest_norms(
        keys, range(sink, 30 - window), policy.prompt_capacity() - sink - window) for keys in r["key"]]
        for layer, r in full_run(llama, prompt).items()}
    if not sink and not window:
        assert prefill_kept == kept_prompt(llama, ec.KNorm(capacity=policy.prompt_capacity()), prompt)
    reference_logits, history = simulate_decoding(llama, policy, prompt, tokens[:-1], prefill_kept)
    session = ec.CompressionSession(llama, policy)
    session.prefill(prompt)
    logits = []
    for step, token in enumerate(tokens[:-1]):
        logits.append(session.step(torch.tensor([[token]]))[0, -1])
        for index, layer in enumerate(session.cache.layers):
            heads = layer.heads
            assert int(heads.valid.sum(dim=-1).max()) <= policy.capacity
            held = [set(heads.positions[0, h][heads.valid[0, h]].tolist()) for h in range(heads.valid.shape[1])]
            assert held == history[step][index], f"step {step} layer {index}"
    torch.testing.assert_close(torch.stack(logits), reference_logits, atol=2e-4, rtol=1e-4)
    # Re-applications happened (the cache went back to capacity - interval) and kept different tokens per head.
    assert {len(h) for heads in history[7].values() for h in heads} == {policy.capacity - policy.interval}
    assert len({frozenset(h) for heads in history[-1].values() for h in heads}) > 1
    # The scorer decided: SnapKV's own re-application keeps other tokens.
    snap = ec.CompressionSession(llama, ec.DecodingSnapKV(capacity=40, window=4, interval=8))
    snap.prefill(prompt)
    for token in tokens[:-1]:
        snap.step(torch.tensor([[token]]))
    layer = snap.cache.layers[0].heads
    assert [set(layer.positions[0, h][layer.valid[0, h]].tolist()) for h in range(2)] != history[-1][0]


def test_the_engine_reapplies_a_scorer_as_running_alone(llama):
    policy = ec.DecodingSnapKV(capacity=48, window=4, interval=8, scorer="knorm")
    requests = [ec.Request(random_prompt(n, seed=n)[0], max_new_tokens=m, seed=i)
                for i, (n, m) in enumerate([(30, 40), (70, 25), (12, 33), (55, 9)])]
    completions = ec.Engine(llama, policy, slots=2, sync_every=3).run(requests)
    for request, completion in zip(requests, completions):
        alone = ec.generate(llama, request.input_ids[None], policy, max_new_tokens=request.max_new_tokens,
                            return_logits=False)
        assert completion.tokens == alone.sequences[0, request.input_ids.numel():].tolist()
        assert completion.stats["peak_cache_tokens"] == alone.stats[0]["peak_cache_tokens"] <= 48


def test_decoding_reapplication_refuses_what_it_cannot_score_with():
    with pytest.raises(ValueError, match="cannot be h2o: its score sums the attention of every query"):
        ec.DecodingSnapKV(capacity=1024, interval=128, scorer="h2o")
    with pytest.raises(ValueError, match=r"window \(8: the recent queries kept for the scorer\) must be >= the 16"):
        ec.DecodingSnapKV(capacity=1024, interval=128, window=8, scorer={"name": "snapkv", "window": 16})
    with pytest.raises(ValueError, match="kernel_size is a setting of the SnapKV score, unused with scorer=knorm"):
        ec.DecodingSnapKV.from_config(1024, interval=128, kernel_size=3, scorer="knorm")
    with pytest.raises(ValueError, match="cannot be compactor: it reads every query of the sequence"):
        ec.DecodingSnapKV(capacity=1024, interval=128, scorer="compactor")
    with pytest.raises(ValueError, match="cannot be kvzap: it scores from hidden states, which decoding does not keep"):
        ec.DecodingSnapKV(capacity=1024, interval=128, scorer="kvzap")
    with pytest.raises(ValueError, match="cannot be decoding_snapkv: it takes a scorer itself"):
        ec.AdaKV(capacity=64, scorer="decoding_snapkv")


@pytest.mark.parametrize("name", [n for n in __import__("evalkit.compression.methods.wrapper", fromlist=["scorers"]).scorers()
                                  if not (ec.POLICIES[n].sums_attention or ec.POLICIES[n].reads_hidden_states
                                          or ec.POLICIES[n].reads_every_query)])
def test_every_scorer_can_be_reapplied_while_decoding(llama, name):
    """Each scorer a wrapper can take (but the attention-sum ones) re-applied every 10 steps: the cache falls back to
    capacity - interval per head at each re-application, never exceeds the capacity, and the engine gives the tokens
    of running alone."""
    settings = {"name": name, **({"window": 4, "kernel_size": 3} if name in ("snapkv", "snapstream") else {}),
                **({"filters": str(qfilters())} if name == "qfilter" else {}),
                **({"stats": str(expected_attention_stats())} if name == "expected_attention_stats" else {})}
    policy = ec.DecodingSnapKV(capacity=42, window=8, interval=10, scorer=settings)
    prompt = random_prompt(50, seed=2)
    session = ec.CompressionSession(llama, policy)
    session.prefill(prompt)
    tokens = torch.randperm(llama.config.vocab_size, generator=torch.Generator().manual_seed(1))[:24].tolist()
    for step, token in enumerate(tokens, start=1):
        session.step(torch.tensor([[token]]))
        held = {int(n) for layer in session.cache.layers for n in layer.heads.valid[0].sum(dim=-1)}
        assert held == {32 + step % 10}, (step, held)
    request = ec.Request(prompt[0], max_new_tokens=20)
    engine = ec.Engine(llama, policy, slots=2).run([request, ec.Request(prompt[0, :20], max_new_tokens=30)])
    alone = ec.generate(llama, prompt, policy, max_new_tokens=20, return_logits=False)
    assert engine[0].tokens == alone.sequences[0, 50:].tolist()


def test_decoding_over_adakv_over_knorm_fits_its_static_cache_and_the_engine_gives_the_tokens_of_alone(llama):
    """Nested wrappers in the engine: AdaKV's unequal head shares of ``capacity - interval``, plus the ``interval``
    tokens generated before the next re-application, fit the slot axis the policy asks for (its largest share plus
    the interval, beyond ``capacity``), and every request decodes as it does alone."""
    from test_compression import assert_engine_equals_alone

    policy = ec.DecodingSnapKV(capacity=42, window=8, interval=10, scorer={"name": "adakv", "scorer": "knorm"})
    kv_heads = llama.config.num_key_value_heads
    assert policy.slot_capacity(kv_heads) == policy.scorer.prompt_slots(10**9, kv_heads) + 10 > 42
    assert_engine_equals_alone(llama, policy, lengths=(60, 45, 70), new_tokens=30)
