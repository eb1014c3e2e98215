"""The baseline methods: each cache holds exactly the tokens its definition names (checked against the plain
computations of baseline_reference.py), equals Full with room, is batch-independent, and stays within capacity."""

from __future__ import annotations

import dataclasses
from typing import ClassVar  # module level: dataclasses reads a method's ClassVar annotations from here

import pytest
import torch
from baseline_reference import kept_prompt, kept_snapkv_budgets, simulate_decoding
from conftest import SMALL_POLICIES, TINY_RECONSTRUCTION, random_prompt, registered, tiny_model
from learned_files import (
    duo_pattern,
    expected_attention_stats,
    fastkvzip_gates,
    headkv_scores,
    kvzap,
    lukv_curve,
    qfilters,
    restorekv,
)
from masked_reference import module_scaling

import evalkit.compression as ec
from evalkit.compression.cache import _held_bytes
from evalkit.compression.methods.base import named_settings

PREFILL = {
    "knorm": lambda: ec.KNorm(capacity=20),
    "random": lambda: ec.Random(capacity=20, selection_seed=3),
    "observed_attention": lambda: ec.ObservedAttention(capacity=20),
    "expected_attention": lambda: ec.ExpectedAttention(capacity=20, n_future_positions=16),
    "tova": lambda: ec.TOVA(capacity=21),
    "h2o": lambda: ec.H2O(capacity=21, recent=6),
    "adakv": lambda: ec.AdaKV.from_config(20, window=2, kernel_size=5, alpha_safeguard=0.5),
}
DECODING = {
    "h2o": lambda: ec.H2O(capacity=21, recent=6),
    "tova": lambda: ec.TOVA(capacity=21),
    "decoding_snapkv": lambda: ec.DecodingSnapKV.from_config(40, window=4, kernel_size=3, interval=8),
    "snapkv_d": lambda: ec.SnapKVD(capacity=21, window=4, kernel_size=3),
    "raas": lambda: ec.RaaS(capacity=40, alpha=0.02),
}
SIZED = {**PREFILL, **DECODING, "rkv": lambda: ec.RKV(capacity=40, window=4, interval=8, kernel_size=3),
         "headkv": lambda: ec.HeadKV.from_config(20, scores=str(headkv_scores())),
         "expected_attention_stats": lambda: ec.ExpectedAttentionStats(capacity=20, n_future_positions=16,
                                                                       stats=str(expected_attention_stats())),
         "pyramidkv": lambda: ec.PyramidKV.from_config(20, window=6, kernel_size=5),
         "per_layer": lambda: ec.PerLayer.from_config(20, window=4, kernel_size=5, weights=(1.5, 0.5)),
         "composed": lambda: ec.Composed(capacity=20, then={"name": "snapkv", "window": 4, "kernel_size": 5}),
         "chunkkv": lambda: ec.ChunkKV.from_config(20, window=4, kernel_size=5, chunk_length=5),
         "criticalkv": lambda: ec.CriticalKV.from_config(20, window=4, kernel_size=5),
         "criticaladakv": lambda: ec.CriticalAdaKV.from_config(20, window=4, kernel_size=5),
         "chunkwise": lambda: ec.ChunkWise.from_config(20, chunk_length=16, window=2, kernel_size=3),
         "simlayerkv": lambda: ec.SimLayerKV(lazy_threshold=0.05, n_recent=12),
         "qfilter": lambda: ec.QFilter(capacity=20, filters=str(qfilters())),
         "duo_attention": lambda: ec.DuoAttention(patterns=str(duo_pattern([[0.9, 0.1], [0.3, 0.7]], recent=8))),
         "kvzap": lambda: ec.KVzap(capacity=20, weights=str(kvzap())),
         "entropy_gated_chunkkv": lambda: ec.EntropyGatedChunkKV.from_config(20, window=4, kernel_size=5),
         "prefill_decoding": lambda: ec.PrefillDecoding.from_config(40, window=4, kernel_size=3, interval=8,
                                                                    prefill="knorm"),
         "fastkvzip": lambda: ec.FastKVzip(capacity=20, gates=str(fastkvzip_gates())),
         "lukv": lambda: ec.LUKV.from_config(20, curve=str(lukv_curve()), n_future_positions=16),
         "lacache": lambda: ec.LaCache(capacity=20, start_size=4, span=1),
         "key_rerotation": lambda: ec.KeyRerotation.from_config(20, window=4, kernel_size=5),
         "merging": lambda: ec.Merging.from_config(20, window=4, kernel_size=5),
         "gear": lambda: ec.GEAR.from_config(20, window=4, kernel_size=5, group_size=16, streaming_gap=16),
         "think": lambda: ec.ThinK.from_config(20, window=4, kernel_size=5, window_size=4),
         "threshold": lambda: ec.Threshold(threshold=0.0, sliding_window_size=4,
                                           scorer={"name": "kvzap", "weights": str(kvzap(hidden_dim=24))}),
         "kvzip": lambda: ec.KVzip(capacity=20, chunk_size=16).with_prompts(TINY_RECONSTRUCTION),
         "kvzip_plus": lambda: ec.KVzipPlus(capacity=20, chunk_size=16).with_prompts(TINY_RECONSTRUCTION),
         "kvgrad": lambda: ec.KVgrad(capacity=20, chunk_size=16).with_prompts(TINY_RECONSTRUCTION),
         "restorekv": lambda: ec.RestoreKV(capacity=20, chunk_size=16, adapter=str(restorekv()))
         .with_prompts(TINY_RECONSTRUCTION),
         "restorekv_plus": lambda: ec.RestoreKVPlus(capacity=20, chunk_size=16, adapter=str(restorekv()))
         .with_prompts(TINY_RECONSTRUCTION),
         "quest": lambda: ec.Quest(capacity=16, page_size=4, dense_layers=1),
         "shadowkv": lambda: ec.ShadowKV(capacity=16, rank=8, chunk_size=4, local_chunks=2, outlier_chunks=2),
         "minicache": lambda: ec.MiniCache(start_layer=0),
         "cam": lambda: ec.CaM.from_config(40, interval=8, merge_budget=4, scorer="tova")}
# Every registered method but those test_compression.py holds to its own references; a new one at its defaults.
EVERY = {name: SIZED.get(name) or registered(name, 20) for name in sorted(ec.POLICIES)
         if name not in ("full", "snapkv", "snapstream", "streaming_llm")}


def held_positions(session, reference_keys: dict[int, torch.Tensor], row: int = 0) -> dict[int, list[set[int]]]:
    """Per layer and KV head, the prompt positions whose key vectors the cache's valid slots hold (matched by
    content against the full run's keys)."""
    held = {}
    for index, layer in enumerate(session.cache.layers):
        heads = []
        for head in range(layer.keys.shape[1]):
            if layer.heads is not None:
                valid = layer.heads.valid[row, head]
            else:
                valid = session.state.valid[row, : layer.keys.shape[-2]]
            keys = layer.keys[row, head][valid].double()
            distances = torch.cdist(keys, reference_keys[index][head])
            assert bool((distances.min(dim=1).values < 1e-4).all()), "a cached key matches no prompt key"
            heads.append(set(distances.argmin(dim=1).tolist()))
        held[index] = heads
    return held


def reference_keys(model, prompt) -> dict[int, torch.Tensor]:
    from baseline_reference import full_run

    return {layer: r["key"] for layer, r in full_run(model, prompt).items()}


# -- prefill: exactly the tokens the definition names --------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(PREFILL))
def test_prefill_keeps_exactly_the_tokens_the_definition_names(llama, name):
    policy = PREFILL[name]()
    prompt = random_prompt(50, seed=11)
    session = ec.CompressionSession(llama, policy)
    session.prefill(prompt)
    expected = kept_prompt(llama, policy, prompt)
    held = held_positions(session, reference_keys(llama, prompt))
    assert held == expected
    budget = policy.prompt_capacity()
    per_head = [len(h) for heads in held.values() for h in heads]
    if name == "adakv":  # the layer's total is the budget; heads differ
        assert all(sum(len(h) for h in heads) == budget * len(heads) for heads in held.values())
        assert len(set(per_head)) > 1
    else:
        assert set(per_head) == {budget}
    for layer in session.cache.layers:  # real tensors of the kept size (AdaKV: padded to its largest head)
        assert layer.keys.shape[-2] == (max(per_head) if name != "h2o" and name != "tova" else policy.capacity)


@pytest.mark.parametrize("family", ["qwen3", "mistral", "qwen2"])
@pytest.mark.parametrize("name", ["expected_attention", "h2o", "adakv"])
def test_prefill_selection_is_exact_in_the_other_families(family, name):
    model = tiny_model(family)
    policy = PREFILL[name]()
    prompt = random_prompt(50, seed=11)
    session = ec.CompressionSession(model, policy)
    session.prefill(prompt)
    assert held_positions(session, reference_keys(model, prompt)) == kept_prompt(model, policy, prompt)


@pytest.mark.parametrize("name", ["adakv", "h2o", "tova", "pyramidkv"])
def test_eager_attention_gives_the_tokens_sdpa_gives(name):
    policy = EVERY[name]()
    prompt = random_prompt(50, seed=11)
    sdpa = ec.generate(tiny_model("llama"), prompt, policy, max_new_tokens=30)
    eager = ec.generate(tiny_model("llama", attn_implementation="eager"), prompt, policy, max_new_tokens=30)
    assert eager.sequences.tolist() == sdpa.sequences.tolist()
    torch.testing.assert_close(eager.logits, sdpa.logits, atol=2e-4, rtol=1e-4)


def test_pyramidkv_budgets_decrease_with_depth_and_keep_the_total():
    model = tiny_model("llama", num_hidden_layers=4)
    policy = ec.PyramidKV.from_config(20, window=6, kernel_size=5, pooling="max")
    prompt = random_prompt(50, seed=11)
    out = ec.generate(model, prompt, policy, max_new_tokens=5)
    # KVCache-Factory arithmetic for n=50, C=20, w=6, beta=20, L=4: min = 14 // 20 = 0, max = 2 * 14 - 0 = 28,
    # steps = 28 // 3 = 9: layers keep 28, 19, 10, 1 prompt tokens by score, plus the 6 window tokens.
    budgets = [34, 25, 16, 7]
    assert out.stats[0]["kept_prompt_tokens"] == budgets
    assert out.stats[0]["kept_prompt_tokens_per_head"] == [[b, b] for b in budgets]
    # The floored steps keep slightly more than SnapKV's 20 on average, and the statistics say so.
    assert out.stats[0]["peak_cache_tokens"] == pytest.approx(sum(budgets) / 4 + 4)
    session = ec.CompressionSession(model, policy)
    session.prefill(prompt)
    expected = kept_snapkv_budgets(__import__("baseline_reference").full_run(model, prompt), dict(enumerate(budgets)),
                                   6, 5, "max", module_scaling(model))
    assert held_positions(session, reference_keys(model, prompt)) == expected
    assert {layer.keys.shape[-2] for layer in session.cache.layers} == {34}  # padded to the largest layer


def test_reference_detects_a_wrong_selection(llama):
    """The plain definitions can fail: KNorm's largest norms are not what it keeps."""
    prompt = random_prompt(50, seed=11)
    session = ec.CompressionSession(llama, ec.KNorm(capacity=20))
    session.prefill(prompt)
    held = held_positions(session, reference_keys(llama, prompt))
    from baseline_reference import full_run, top

    largest = {layer: [top(k.norm(dim=-1).tolist(), 20) for k in r["key"]] for layer, r in full_run(llama, prompt).items()}
    assert held != largest


def test_adakv_realized_budget_is_the_budget_on_average(llama):
    out = ec.generate(llama, random_prompt(50, seed=11), ec.AdaKV.from_config(20, window=6, kernel_size=5), max_new_tokens=10)
    stats = out.stats[0]
    per_head = stats["kept_prompt_tokens_per_head"]
    assert len({k for heads in per_head for k in heads}) > 1
    assert stats["kept_prompt_tokens"] == [20, 20]
    assert stats["peak_cache_tokens"] == pytest.approx(20 + 9)  # 9 generated tokens fed back
    assert stats["realized_ratio"] == pytest.approx((50 + 9) / 29)


# -- the registry --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(SMALL_POLICIES))
def test_every_registered_method_compresses_at_its_small_size(llama, name):
    """Each method the every-method tests run, at its small size, compresses a 200-token prompt (but Quest, which
    keeps the cache whole and reads part of it each step; a new method whose
    defaults do not fails here, by name: give it small settings in conftest.SMALL_SETTINGS)."""
    policy = SMALL_POLICIES[name]()
    session = ec.CompressionSession(llama, policy)
    session.prefill(random_prompt(200, seed=5))
    held = max(int(layer.heads.valid[0].sum(dim=-1).max()) if layer.heads is not None else layer.keys.shape[2]
               for layer in session.cache.layers)
    if name == "minicache":  # every token kept, adjacent layers merged: fewer bytes held (tests/test_minicache.py)
        dense = sum(2 * layer.keys.shape[1] * layer.slot_count * layer.keys.shape[-1] * layer.keys.element_size()
                    for layer in session.cache.layers)
        assert sum(_held_bytes(layer) for layer in session.cache.layers) < dense, f"{name} at {policy} merged nothing"
        return
    keeps_all = name == "full" or policy.selects_while_decoding  # Quest holds everything and reads part of it
    assert (held < 200) != keeps_all, f"{name} at {policy} holds {held} of 200 prompt tokens"


def test_every_registered_method_is_exported_under_its_class_name():
    assert {name: getattr(ec, cls.__name__, None) for name, cls in ec.POLICIES.items()} == ec.POLICIES
    assert {cls.__name__ for cls in ec.POLICIES.values()} <= set(ec.__all__)


# -- with room, every method is Full ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(EVERY))
def test_capacity_beyond_the_sequence_equals_full(llama, name):
    roomy = {
        "h2o": ec.H2O(capacity=200), "tova": ec.TOVA(capacity=200),
        "decoding_snapkv": ec.DecodingSnapKV(capacity=200, window=4, interval=8),
        "simlayerkv": ec.SimLayerKV(lazy_threshold=1.0),
        "duo_attention": ec.DuoAttention(patterns=str(duo_pattern([[0.9, 0.1], [0.3, 0.7]])), head_ratio=0),
        "threshold": ec.Threshold(threshold=-1e30, scorer={"name": "kvzap", "weights": str(kvzap())}),
        "think": ec.ThinK.from_config(200, window=4, kernel_size=5, key_channel_compression_ratio=0.0),
        "minicache": ec.MiniCache(start_layer=0, retention_ratio=1.0),  # every token retained unmerged
        "gear": ec.GEAR.from_config(200, window=4, kernel_size=5, group_size=16, streaming_gap=256),  # all exact
    }
    policy = roomy.get(name) or dataclasses.replace(EVERY[name](), capacity=200)
    prompt = random_prompt(40, seed=2)
    full = ec.generate(llama, prompt, ec.Full(), max_new_tokens=30)
    out = ec.generate(llama, prompt, policy, max_new_tokens=30)
    assert out.sequences.tolist() == full.sequences.tolist()
    torch.testing.assert_close(out.logits, full.logits, atol=2e-5, rtol=1e-5)


# -- batches -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(EVERY))
def test_batch_with_left_padding_equals_each_prompt_alone(llama, name):
    from test_compression import assert_batch_equals_alone

    assert_batch_equals_alone(llama, EVERY[name](), new_tokens=30)


# -- decoding: the evicted tokens are the ones the definition names, and the cache never outgrows its capacity ----
@pytest.mark.parametrize("name", sorted(DECODING))
def test_decode_eviction_follows_the_definition_at_every_step(llama, name):
    policy = DECODING[name]()
    prompt = random_prompt(30, seed=4)
    steps = 120
    tokens = ec.generate(llama, prompt, policy, max_new_tokens=steps).sequences[0, 30:].tolist()
    if name == "decoding_snapkv":
        prefill = kept_snapkv_budgets(__import__("baseline_reference").full_run(llama, prompt),
                                      {0: 32, 1: 32}, 4, 3, "max", module_scaling(llama))
    elif name == "raas":  # the prompt whole (it fits)
        prefill = {layer: [set(range(30)) for _ in range(2)] for layer in range(2)}
    elif name == "snapkv_d":
        prefill = kept_snapkv_budgets(__import__("baseline_reference").full_run(llama, prompt),
                                      {0: 20, 1: 20}, 4, 3, "avg", module_scaling(llama))
    else:
        prefill = kept_prompt(llama, policy, prompt)
    reference_logits, history = simulate_decoding(llama, policy, prompt, tokens[:-1], prefill)

    session = ec.CompressionSession(llama, policy)
    first = session.prefill(prompt)
    logits = []
    for step, token in enumerate(tokens[:-1]):
        logits.append(session.step(torch.tensor([[token]]))[0, -1])
        for index, layer in enumerate(session.cache.layers):
            heads = layer.heads
            assert layer.keys.shape[-2] == policy.capacity
            assert int(heads.valid.sum(dim=-1).max()) <= policy.capacity
            held = [set(heads.positions[0, h][heads.valid[0, h]].tolist()) for h in range(heads.valid.shape[1])]
            assert held == history[step][index], f"step {step} layer {index}"
    assert first.argmax(-1).item() == tokens[0]
    torch.testing.assert_close(torch.stack(logits), reference_logits, atol=2e-4, rtol=1e-4)
    # Evictions really happened, and differently per head where the method allows it.
    sizes = {len(h) for per_layer in history for heads in per_layer.values() for h in heads}
    assert max(sizes) <= policy.capacity
    if name == "raas":  # the prompt is never evicted; generated tokens are
        assert set(range(30)) <= history[-1][0][0] and len(history[-1][0][0]) < 30 + 119
    else:
        assert len(history[-1][0][0] & set(range(30))) < 30


@pytest.mark.parametrize("name", sorted(DECODING))
def test_decode_time_caches_stay_within_capacity_over_1000_tokens(name):
    model = tiny_model("llama", max_position_embeddings=2048)
    policy = DECODING[name]()
    out = ec.generate(model, random_prompt(30, seed=4), policy, max_new_tokens=1000, return_logits=False)
    stats = out.stats[0]
    assert stats["generated_tokens"] == 1000
    assert stats["peak_cache_tokens"] == policy.capacity
    assert stats["realized_ratio"] == pytest.approx((30 + 999) / policy.capacity)


def test_eviction_reference_detects_a_wrong_victim(llama):
    """The step-by-step check can fail: H2O with another recent window names other victims."""
    prompt = random_prompt(30, seed=4)
    policy, other = ec.H2O(capacity=21, recent=6), ec.H2O(capacity=21, recent=3)
    tokens = ec.generate(llama, prompt, policy, max_new_tokens=40).sequences[0, 30:].tolist()
    _, history = simulate_decoding(llama, other, prompt, tokens[:-1], kept_prompt(llama, other, prompt))
    session = ec.CompressionSession(llama, policy)
    session.prefill(prompt)
    mismatches = 0
    for step, token in enumerate(tokens[:-1]):
        session.step(torch.tensor([[token]]))
        heads = session.cache.layers[0].heads
        mismatches += [set(heads.positions[0, h][heads.valid[0, h]].tolist()) for h in range(2)] != history[step][0]
    assert mismatches > 0


# -- the harness ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(EVERY))
def test_every_method_config_builds_its_policy_with_the_documented_defaults(name):
    from test_harness import composed
    from yaml import safe_load

    from evalkit.core.paths import conf_dir
    from evalkit.run import validate

    sized = ec.POLICIES[name].takes_budget
    spec = validate(composed(f"method={name}", *(["+budget=tokens_4096"] if sized else []), "model=llama31_8b_instruct"))
    assert type(spec.policy) is ec.POLICIES[name]
    written = safe_load((conf_dir() / "method" / f"{name}.yaml").read_text())
    for key, value in written.items():
        if key != "name" and value is not None:
            built = spec.policy.settings()[key]
            if isinstance(built, dict) and isinstance(value, str):  # a method named: built with its own defaults
                assert built == named_settings(ec.policy_from_budget(value, "tokens_4096", 8192)), key
            else:
                assert built == value, key
    assert spec.flat_config()["policy_params"].count('"capacity": 4096') == (1 if sized else 0)


@pytest.mark.slow
def test_cli_rows_carry_each_method_and_its_realized_budget(tmp_path, random_model_dir):
    import pandas as pd
    from helpers import evalkit

    results = tmp_path / "results"
    for args in (["method=adakv", "method.window=32"], ["method=h2o"], ["method=decoding_snapkv", "method.interval=16", "method.window=8"]):
        result = evalkit(*args, "+budget=4x", "task=kv_retrieval", f"model.pretrained={random_model_dir}", "limit=3",
                         f"results_dir={results}", cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-2000:]
    samples = pd.read_parquet(results / "samples")
    assert set(samples["method"]) == {"adakv", "h2o", "decoding_snapkv"}
    fixed = samples[samples["method"] != "adakv"]
    assert (fixed["peak_cache_tokens"] <= fixed["capacity"]).all() and (fixed["realized_ratio"] > 1).all()
    adakv = samples[samples["method"] == "adakv"]
    assert (adakv["kept_prompt_tokens"] <= 64).all() and adakv["policy_params"].str.contains("alpha_safeguard").all()


def test_memory_rows_price_the_budget_each_method_realizes_at_the_deployment_context():
    from test_harness import composed

    from evalkit.run import validate

    def cached(method: str) -> int:
        spec = validate(composed(f"method={method}", "+budget=4x", "model=llama31_8b_instruct",
                                 "deployment=llama31_8b_tp1_128k"))
        return spec.memory.cached_tokens

    # 4x of 131072 is 32768. PyramidKV at n = 131072, C = 32768, w = 32, beta = 20, 32 layers (KVCache-Factory):
    # min = 32736 // 20 = 1636, max = 65472 - 1636 = 63836, steps = 62200 // 31 = 2006; mean over layers
    # = 63836 - 15.5 * 2006 + 32 = 32775 (the floored steps), rounded up.
    assert cached("pyramidkv") == 32775
    for method in ("snapkv", "adakv", "h2o", "tova", "decoding_snapkv", "knorm"):
        assert cached(method) == 32768, method


def test_attention_sums_do_not_depend_on_the_chunking():
    from evalkit.compression.kernels import causal_attention_sums

    g = torch.Generator().manual_seed(0)
    query, keys = torch.randn(2, 4, 37, 8, generator=g), torch.randn(2, 2, 37, 8, generator=g)
    valid = torch.ones(2, 37, dtype=torch.bool)
    valid[1, :9] = False  # a left-padded row
    view = ec.PrefillView(query, keys, keys, valid, 0.35, 0, 1, None, torch.arange(37).expand(2, -1))
    whole = causal_attention_sums(view)
    chunked = causal_attention_sums(view, budget=2 * 4 * 37 * 5)  # 5 queries at a time
    torch.testing.assert_close(chunked, whole)
    assert whole[1, :, :, :9].abs().max() == 0  # padding keys receive nothing
    torch.testing.assert_close(whole[0].sum(dim=-1), torch.full((2, 2), 37.0))  # each real query spends 1


@pytest.mark.parametrize("build, message", [
    (lambda: ec.KNorm(capacity=4, sink=2, window=2), r"KNorm.capacity must be > sink \+ window"),
    (lambda: ec.Random(capacity=20, selection_seed=-1), "Random.selection_seed must be an integer >= 0"),
    (lambda: ec.ExpectedAttention(capacity=20, n_future_positions=0), "ExpectedAttention.n_future_positions"),
    (lambda: ec.ExpectedAttention(capacity=20, use_vnorm="yes"), "ExpectedAttention.use_vnorm must be true or false"),
    (lambda: ec.PyramidKV.from_config(20, window=6, beta=0), "PyramidKV.beta must be an integer >= 1"),
    (lambda: ec.AdaKV.from_config(20, window=4, alpha_safeguard=1.5), "AdaKV.alpha_safeguard must be a number in"),
    (lambda: ec.H2O(capacity=21, recent=20), r"H2O.recent must be an integer in \[1, 19\]"),
    (lambda: ec.TOVA(capacity=1), "TOVA.capacity must be an integer >= 2"),
    (lambda: ec.DecodingSnapKV(capacity=64), r"DecodingSnapKV.capacity must be > interval \+ window"),
    (lambda: ec.DecodingSnapKV(capacity=600, window=64, interval=64), "DecodingSnapKV.interval must be > window"),
])
def test_bad_method_settings_name_the_field(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_snapkv_family_capacity_errors_name_the_method_used():
    with pytest.raises(ValueError, match=r"^AdaKV.capacity must be > window \(64\), got 20$"):
        ec.AdaKV(capacity=20)


def _dense_attention_sums(query, keys, key_valid, scaling, sinks=None, last=None):
    """The n x n reference in fp64: every query's causal softmax over the prompt, summed per key."""
    batch, q_heads, n, _ = query.shape
    kv_heads = keys.shape[1]
    q = query.double().reshape(batch, kv_heads, q_heads // kv_heads, n, -1)
    logits = q @ keys.double().unsqueeze(2).transpose(-1, -2) * scaling
    visible = torch.ones(n, n, dtype=torch.bool).tril() & key_valid[:, None, None, None, :]
    logits = logits.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink = sinks.double().reshape(1, kv_heads, -1, 1, 1).expand(batch, -1, -1, n, 1)
        probabilities = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]
    else:
        probabilities = logits.softmax(dim=-1)
    probabilities = torch.nan_to_num(probabilities) * key_valid[:, None, None, :, None]
    start = 0 if last is None else n - last
    return probabilities[..., start:, :].sum(dim=-2)


@pytest.mark.parametrize("padded, with_sinks, last", [(False, False, None), (True, False, None), (False, True, None),
                                                       (False, False, 1), (True, True, 3)])
def test_blockwise_attention_sums_equal_the_dense_matrix(padded, with_sinks, last, monkeypatch):
    """Blocks of a few queries over only the keys they can see (a budget small enough for ~20 blocks) sum to what
    the whole n x n matrix gives, with padding, attention sinks and a last-queries window."""
    from types import SimpleNamespace

    from evalkit.compression import kernels

    g = torch.Generator().manual_seed(0)
    batch, q_heads, kv_heads, n, dim = 2, 4, 2, 96, 16
    query, keys = torch.randn(batch, q_heads, n, dim, generator=g), torch.randn(batch, kv_heads, n, dim, generator=g)
    key_valid = torch.ones(batch, n, dtype=torch.bool)
    if padded:
        key_valid[1, :17] = False  # left padding of the second row
    sinks = torch.randn(q_heads, generator=g) if with_sinks else None
    monkeypatch.setattr(kernels, "attention_sinks", lambda module: sinks)
    view = SimpleNamespace(query=query, keys=keys, key_valid=key_valid, scaling=dim ** -0.5, module=None, prior_sums=None)
    blockwise = kernels.causal_attention_sums(view, last=last, budget=batch * q_heads * 500)
    dense = _dense_attention_sums(query, keys, key_valid, dim ** -0.5, sinks, last)
    assert blockwise.dtype == torch.float32 and blockwise.shape == dense.shape
    torch.testing.assert_close(blockwise.double(), dense, rtol=1e-5, atol=1e-5)


def test_a_new_method_is_its_class_it_registers_itself_and_claims_no_latent_support():
    """A method = a Policy subclass that names itself: budgets and configs find it by name; a latent (MLA) cache is
    refused until the method opts in; a second class with a taken name is an error."""
    import dataclasses

    from test_mla import tiny_deepseek

    from evalkit.compression.methods.base import REGISTRY

    @dataclasses.dataclass
    class Newest(ec.Policy):
        name: ClassVar[str] = "newest_tokens"
        needs_scores: ClassVar[bool] = True
        capacity: int = 0

        def prompt_capacity(self) -> int:
            return self.capacity

        def score(self, view):
            return view.positions[:, None, :].float().expand(-1, view.keys.shape[1], -1)

    try:
        assert ec.POLICIES["newest_tokens"] is Newest and ec.method_params("newest_tokens") == ()
        policy = ec.policy_from_budget("newest_tokens", "4x", 256)
        assert policy.capacity == 64
        out = ec.generate(tiny_model("llama"), random_prompt(100), policy, max_new_tokens=3)
        assert out.stats[0]["kept_prompt_tokens"] == [64, 64]
        with pytest.raises(ValueError, match="not been tested on a latent"):
            ec.generate(tiny_deepseek(), random_prompt(100), policy, max_new_tokens=3)
        with pytest.raises(TypeError, match="two methods named 'newest_tokens'"):
            type("Impostor", (ec.Policy,), {"name": "newest_tokens", "__module__": "elsewhere"})
    finally:
        REGISTRY.pop("newest_tokens", None)
    assert "newest_tokens" not in ec.POLICIES


@pytest.mark.parametrize("length", [37, 300])
def test_one_pass_attention_and_sums_equal_sdpa_and_the_blockwise_sums(length):
    """The fused prefill of attention-sum methods: its output is sdpa's causal attention (to float rounding) and its
    sums are the score's own blockwise sums, bit for bit (so the same tokens are kept); small blocks as well."""
    from evalkit.compression.kernels import attention_with_sums, causal_attention_sums
    from evalkit.compression.views import PrefillView

    generator = torch.Generator().manual_seed(length)
    query, keys, values = (torch.randn(2, heads, length, 16, generator=generator) for heads in (4, 2, 2))
    expected = torch.nn.functional.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=0.25,
                                                                enable_gqa=True).transpose(1, 2)
    view = PrefillView(query, keys, values, torch.ones(2, length, dtype=torch.bool), 0.25, 0, 1, torch.nn.Module(),
                       torch.arange(length).expand(2, -1))
    for budget in (None, 4096):
        output, sums = attention_with_sums(query, keys, values, 0.25, budget=budget)
        torch.testing.assert_close(output, expected, atol=1e-5, rtol=1e-5)
        assert torch.equal(sums, causal_attention_sums(view, budget=budget))


@pytest.mark.parametrize("scaling", [0.125, 0.35])
def test_a_block_scales_its_logits_as_the_plain_product_does(scaling):
    """A block's probabilities are those of ``(q k^T) * scaling`` to the bit: a power-of-two scaling is applied to
    the queries before the product (exact), any other after it; the buffer holds no more than the queries asked."""
    from evalkit.compression.kernels import _block_buffer, _unpadded_block

    generator = torch.Generator().manual_seed(7)
    batch, q_heads, kv_heads, n, dim, begin = 1, 4, 2, 50, 64, 30
    query, keys = torch.randn(batch, q_heads, n, dim, generator=generator), torch.randn(batch, kv_heads, n, dim,
                                                                                     generator=generator)
    buffer = _block_buffer(batch * q_heads, n - begin, n, 1 << 24, query.device)
    assert buffer.numel() == batch * q_heads * (n - begin) * n  # not the whole budget for a few queries
    block = _unpadded_block(query[:, :, begin:], keys, begin, n, scaling, buffer)
    grouped = query[:, :, begin:].reshape(batch, kv_heads, q_heads // kv_heads * (n - begin), dim)
    logits = torch.matmul(grouped, keys.transpose(-1, -2)).mul_(scaling).view(block.shape)
    hidden = torch.arange(n)[None, :] > torch.arange(begin, n)[:, None]
    assert torch.equal(block, logits.masked_fill(hidden, float("-inf")).softmax(dim=-1))


def test_attention_sum_methods_prefill_an_unpadded_prompt_in_one_pass(llama, monkeypatch):
    """H2O's prefill takes the one-pass path in every layer of an unpadded prompt (its kept tokens are checked against
    the plain definition above); a padded batch goes through sdpa and the score's own pass."""
    import evalkit.compression.attention as cache

    calls = []
    fused = cache.attention_with_sums
    monkeypatch.setattr(cache, "attention_with_sums", lambda *args, **kwargs: (calls.append(1), fused(*args, **kwargs))[1])
    ec.generate(llama, random_prompt(50, seed=11), ec.H2O(capacity=21, recent=6), max_new_tokens=2)
    assert len(calls) == llama.config.num_hidden_layers
    padded = torch.ones(2, 50, dtype=torch.long)
    padded[0, :7] = 0
    calls.clear()
    ec.generate(llama, random_prompt(50, seed=11, batch=2), ec.H2O(capacity=21, recent=6), max_new_tokens=2,
                attention_mask=padded)
    assert calls == []
