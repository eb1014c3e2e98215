"""The zoo's methods against their plain definitions (zoo_reference.py): the kept positions per layer and KV head of
the model's own keys, and the cache really shrunk to them."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import zoo_reference as ref
from baseline_reference import full_run
from conftest import TINY_RECONSTRUCTION, VOCAB, tiny_model
from learned_files import duo_pattern, fastkvzip_gates, kvzap, lukv_curve, qfilters
from masked_reference import module_scaling
from test_methods import held_positions, reference_keys

import evalkit.compression as ec

N = 90


def surrogates(**shape) -> dict:
    from safetensors.torch import load_file

    return load_file(str(kvzap(**shape) / "model.safetensors"))


def distinct_prompt(seed: int = 0, n: int = N) -> torch.Tensor:
    return (3 + torch.randperm(VOCAB - 3, generator=torch.Generator().manual_seed(seed))[:n])[None]


def kvzip_prompts(prefix: int = 0):
    """KVzip's reconstruction prompt as ids of the tiny vocabulary; ``prefix``: the prompt's first tokens as a chat
    template's leading text."""
    return dataclasses.replace(TINY_RECONSTRUCTION, prefix=tuple(distinct_prompt()[0, :prefix].tolist()))


KVZIP_PROMPTS = kvzip_prompts()


def kept_by_evalkit(model, policy, prompt):
    session = ec.CompressionSession(model, policy)
    session.prefill(prompt)
    return held_positions(session, reference_keys(model, prompt)), session


CASES = {
    "leverage": (lambda: ec.LeverageScore(capacity=30), lambda m, r, s: ref.kept_leverage(r, 30)),
    "leverage sketch 8 seed 3": (lambda: ec.LeverageScore(capacity=30, sketch_dimension=8, seed=3),
                                 lambda m, r, s: ref.kept_leverage(r, 30, 8, 3)),
    "non_causal_attention": (lambda: ec.NonCausalAttention(capacity=30, chunk_size=32),
                             lambda m, r, s: ref.kept_non_causal(r, 30, 32)),
    "non_causal_attention whole chunks": (lambda: ec.NonCausalAttention(capacity=30, chunk_size=45),
                                          lambda m, r, s: ref.kept_non_causal(r, 30, 45)),
    "compactor": (lambda: ec.Compactor(capacity=40, chunk_size=32), lambda m, r, s: ref.kept_compactor(r, 40, 32)),
    "qfilter": (lambda: ec.QFilter(capacity=30, filters=str(qfilters())),
                lambda m, r, s: ref.kept_qfilter(r, 30, torch.load_filters())),
    "chunkkv": (lambda: ec.ChunkKV.from_config(40, window=8, chunk_length=10),
                lambda m, r, s: ref.kept_chunkkv(r, 40, 8, 5, 10, s)),
    "chunkkv short chunk": (lambda: ec.ChunkKV.from_config(42, window=8, chunk_length=7),
                            lambda m, r, s: ref.kept_chunkkv(r, 42, 8, 5, 7, s)),
    "entropy_gated_chunkkv keydiff": (lambda: ec.EntropyGatedChunkKV(capacity=40, scorer="keydiff"),
                                      lambda m, r, s: ref.kept_entropy_gated_chunkkv(r, 40, 10, 4)),
    "entropy_gated_chunkkv keydiff 7/2": (lambda: ec.EntropyGatedChunkKV(capacity=41, scorer="keydiff", chunk_length=7,
                                                                         low_entropy_chunk_length=2),
                                          lambda m, r, s: ref.kept_entropy_gated_chunkkv(r, 41, 7, 2)),
    "lukv": (lambda: ec.LUKV.from_config(40, curve=str(lukv_curve()), n_future_positions=16),
             lambda m, r, s: ref.kept_lukv(m, r, 40, __import__("numpy").load(lukv_curve()), future=16)),
    "lukv 30 sink 2 window 3": (lambda: ec.LUKV.from_config(30, curve=str(lukv_curve(seed=1)), sink=2, window=3,
                                                            n_future_positions=16),
                                lambda m, r, s: ref.kept_lukv(m, r, 30, __import__("numpy").load(lukv_curve(seed=1)),
                                                              sink=2, window=3, future=16)),
    "fastkvzip": (lambda: ec.FastKVzip(capacity=30, gates=str(fastkvzip_gates())),
                  lambda m, r, s: ref.kept_fastkvzip(r, 30, torch.load(fastkvzip_gates())["module"])),
    "fastkvzip sink 2 window 0.1": (lambda: ec.FastKVzip(capacity=30, gates=str(fastkvzip_gates(seed=1)), sink=2,
                                                         window_ratio=0.1),
                                    lambda m, r, s: ref.kept_fastkvzip(r, 30, torch.load(fastkvzip_gates(seed=1))["module"],
                                                                       2, 0.1)),
    "criticalkv": (lambda: ec.CriticalKV.from_config(40, window=8),
                   lambda m, r, s: ref.kept_criticalkv(r, m, 40, 8, 5, s)),
    "criticaladakv": (lambda: ec.CriticalAdaKV.from_config(40, window=8),
                      lambda m, r, s: ref.kept_criticaladakv(r, m, 40, 8, 5, s)),
    "blockwise keydiff": (lambda: ec.BlockWise.from_config(30, block_size=16),
                          lambda m, r, s: ref.kept_blockwise_keydiff(r, 30, 16)),
    "capkv": (lambda: ec.CapKV(capacity=30), lambda m, r, s: ref.kept_capkv(m, r, 30)),
    "capkv tau 1 sink 2": (lambda: ec.CapKV(capacity=30, tau=1.0, sink=2, n_future_positions=16),
                           lambda m, r, s: ref.kept_capkv(m, r, 30, sink=2, tau=1.0, future=16)),
    "kvzap linear": (lambda: ec.KVzap(capacity=30, weights=str(kvzap())),
                     lambda m, r, s: ref.kept_kvzap(r, 30, surrogates(), mlp=False)),
    "kvzap mlp": (lambda: ec.KVzap(capacity=30, weights=str(kvzap(hidden_dim=24))),
                  lambda m, r, s: ref.kept_kvzap(r, 30, surrogates(hidden_dim=24), mlp=True)),
    "threshold kvzap": (lambda: ec.Threshold(threshold=0.0, sliding_window_size=8, scorer={
                            "name": "kvzap", "weights": str(kvzap(hidden_dim=24))}),
                        lambda m, r, s: ref.kept_threshold_kvzap(r, 0.0, 8, surrogates(hidden_dim=24), mlp=True)),
    "kvzip": (lambda: ec.KVzip(capacity=30, chunk_size=32).with_prompts(KVZIP_PROMPTS),
              lambda m, r, s: ref.kept_kvzip(m, distinct_prompt(), 30, KVZIP_PROMPTS, 32, s)),
    "kvzip layerwise sink 2": (lambda: ec.KVzip(capacity=30, chunk_size=50, sink=2,
                                                layerwise=True).with_prompts(KVZIP_PROMPTS),
                               lambda m, r, s: ref.kept_kvzip(m, distinct_prompt(), 30, KVZIP_PROMPTS, 50, s, sink=2,
                                                              layerwise=True)),
    "kvzip chat prefix": (lambda: ec.KVzip(capacity=30, chunk_size=40).with_prompts(kvzip_prompts(prefix=3)),
                          lambda m, r, s: ref.kept_kvzip(m, distinct_prompt(), 30, kvzip_prompts(prefix=3), 40, s)),
    "kvzip_plus": (lambda: ec.KVzipPlus(capacity=30, chunk_size=32).with_prompts(KVZIP_PROMPTS),
                   lambda m, r, s: ref.kept_kvzip(m, distinct_prompt(), 30, KVZIP_PROMPTS, 32, s, plus=True)),
    "chunkwise snapkv": (lambda: ec.ChunkWise.from_config(40, chunk_length=32, window=4),
                         lambda m, r, s: ref.kept_chunkwise_snapkv(r, 40, 32, 4, 5, s)),
}


@pytest.fixture(autouse=True)
def _filters(monkeypatch):
    from safetensors.torch import load_file

    monkeypatch.setattr(torch, "load_filters", lambda: load_file(str(qfilters() / "model.safetensors"))["q_filters"]
                        .double(), raising=False)


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_head_keeps_what_the_definition_names(llama, case):
    build, reference = CASES[case]
    policy = build()
    prompt = distinct_prompt()
    held, session = kept_by_evalkit(llama, policy, prompt)
    expected = reference(llama, full_run(llama, prompt), module_scaling(llama))
    assert held == expected
    sizes = [len(head) for heads in held.values() for head in heads]
    assert max(sizes) < N  # compressed, and the cache's tensors hold no more than the largest head
    assert max(layer.keys.shape[-2] for layer in session.cache.layers) == max(sizes)


def test_simlayerkv_keeps_the_lazy_layers_short_and_the_others_whole(llama):
    prompt = distinct_prompt()
    run, scaling = full_run(llama, prompt), module_scaling(llama)
    attention = [ref.simlayerkv_attention(run[layer], 1, 4, 16, scaling) for layer in (0, 1)]
    threshold = sum(attention) / 2  # between the two layers: one is lazy, the other not
    policy = ec.SimLayerKV(lazy_threshold=threshold, n_recent=16)
    held, session = kept_by_evalkit(llama, policy, prompt)
    assert held == ref.kept_simlayerkv(run, threshold, 1, 4, 16, scaling)
    assert sorted(len(heads[0]) for heads in held.values()) == [4 + 15, N]
    out = ec.generate(llama, prompt, policy, max_new_tokens=3)
    assert sorted(out.stats[0]["kept_prompt_tokens"]) == [19, N]


def test_duo_attention_streams_the_lowest_scored_heads():
    model = tiny_model("llama")
    pattern = duo_pattern([[0.9, 0.1], [0.3, 0.7]], sink=4, recent=16)
    prompt = distinct_prompt()
    held, session = kept_by_evalkit(model, ec.DuoAttention(patterns=str(pattern), head_ratio=0.5), prompt)
    streaming = set(range(4)) | set(range(N - 16, N))
    assert held == {0: [set(range(N)), streaming], 1: [streaming, set(range(N))]}
    out = ec.generate(model, prompt, ec.DuoAttention(patterns=str(pattern), head_ratio=0.25), max_new_tokens=3)
    assert out.stats[0]["kept_prompt_tokens_per_head"] == [[N, 20], [N, N]]  # only the lowest score streams


@pytest.mark.parametrize("build, message", [
    (lambda: ec.QFilter(capacity=20), "qfilter needs its learned filters: set method.filters"),
    (lambda: ec.QFilter(capacity=20, filters="/nonexistent/qfilt"), "is neither a folder nor a Hugging Face"),
    (lambda: ec.QFilter(capacity=20, filters=str(qfilters(layers=3))), "filters for 3 layers, the model has 2"),
    (lambda: ec.DuoAttention(), "duo_attention needs its learned head patterns"),
    (lambda: ec.DuoAttention(patterns=str(duo_pattern([[0.1, 0.2]]))), "scores 1 layers, the model has 2"),
    (lambda: ec.KVzap(capacity=20), "kvzap needs its learned surrogates: set method.weights"),
    (lambda: ec.KVzap(capacity=20, weights=str(kvzap(layers=3))),
     r"surrogates for 3 layers \(n_modules\), the model has 2"),
    (lambda: ec.Threshold(threshold=None, scorer={"name": "kvzap", "weights": str(kvzap())}),
     "threshold needs method.threshold"),
    (lambda: ec.FastKVzip(capacity=20), "fastkvzip needs its learned gates: set method.gates"),
    (lambda: ec.FastKVzip(capacity=20, gates="/nonexistent/gates.pt"), "fastkvzip: no gate file /nonexistent"),
    (lambda: ec.FastKVzip(capacity=20, gates=str(fastkvzip_gates(layers=3))), "gates for 3 layers, the model has 2"),
    (lambda: ec.LUKV.from_config(40), "lukv needs its budget curve: set method.curve"),
    (lambda: ec.LUKV.from_config(40, curve="/nonexistent/curve.npy"), "lukv: no curve file /nonexistent"),
    (lambda: ec.LUKV.from_config(40, curve=str(lukv_curve(layers=3))), r"shape \[99, 3, 2\]; the model needs"),
])
def test_missing_or_mismatched_learned_weights_are_one_line(llama, build, message):
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        ec.CompressionSession(llama, build())


def test_a_wrong_definition_is_caught(llama):
    """The references can fail: ChunkKV with chunks of 5 is not what chunks of 10 keep."""
    prompt = distinct_prompt()
    held, _ = kept_by_evalkit(llama, ec.ChunkKV.from_config(40, window=8, chunk_length=10), prompt)
    assert held != ref.kept_chunkkv(full_run(llama, prompt), 40, 8, 5, 5, module_scaling(llama))


@pytest.mark.parametrize("build, message", [
    (lambda: ec.BlockWise.from_config(100, scorer="snapkv"), "it reads the prompt's queries"),
    (lambda: ec.ChunkWise.from_config(20, scorer="h2o"), "ChunkWise.scorer cannot be h2o"),
    (lambda: ec.SimLayerKV(n_recent=1), r"SimLayerKV.n_recent must be > n_last"),
    (lambda: ec.DuoAttention(head_ratio=2), r"DuoAttention.head_ratio must be a number in \[0, 1\]"),
])
def test_bad_settings_are_named(build, message):
    with pytest.raises(ValueError, match=message):
        build()


REWRITING = {
    "key_rerotation": (lambda: ec.KeyRerotation.from_config(40, window=8),
                       lambda m, r, kept: (ref.rerotated_keys(m, r, kept), None)),
    "merging": (lambda: ec.Merging.from_config(40, window=8), lambda m, r, kept: (None, ref.merged_values(r, kept))),
    "merging threshold 0.3 fraction 0.5": (
        lambda: ec.Merging.from_config(40, window=8, similarity_threshold=0.3, merge_fraction=0.5),
        lambda m, r, kept: (None, ref.merged_values(r, kept, 0.3, 0.5))),
    "think": (lambda: ec.ThinK.from_config(40, window=8), lambda m, r, kept: (ref.think_keys(r, kept, 0.5, 32), None)),
    "think 0.25 window 8": (lambda: ec.ThinK.from_config(40, window=8, key_channel_compression_ratio=0.25,
                                                         window_size=8),
                            lambda m, r, kept: (ref.think_keys(r, kept, 0.25, 8), None)),
}


@pytest.mark.parametrize("case", sorted(REWRITING))
def test_rewriting_wrappers_hold_the_keys_and_values_the_definition_gives(llama, case):
    """SnapKV's tokens kept (the inline scorer), then the keys or values rewritten: the cache holds exactly the
    reference's tensors, and they differ from the tokens' own (the rewrite did something)."""
    build, reference = REWRITING[case]
    prompt = distinct_prompt()
    session = ec.CompressionSession(llama, build())
    session.prefill(prompt)
    run = full_run(llama, prompt)
    kept = ref.kept_snapkv_avg(run, 40, 8, 5, module_scaling(llama))
    keys, values = reference(llama, run, kept)
    for index, layer in enumerate(session.cache.layers):
        if layer.key_channels is not None:  # ThinK's removed channels, back to the zeroed full width
            layer.widen()
        assert layer.keys.shape[-2] == 40
        for head in range(layer.keys.shape[1]):
            own_keys, own_values = run[index]["key"][head, kept[index][head]], run[index]["value"][head, kept[index][head]]
            expected_keys = own_keys if keys is None else keys[index][head]
            expected_values = own_values if values is None else values[index][head]
            torch.testing.assert_close(layer.keys[0, head].double(), expected_keys, atol=2e-5, rtol=1e-5)
            torch.testing.assert_close(layer.values[0, head].double(), expected_values, atol=2e-5, rtol=1e-5)
        changed = keys[index] if keys is not None else values[index]
        own = run[index]["key" if keys is not None else "value"]
        assert any((changed[h] - own[h, kept[index][h]]).abs().max() > 1e-3 for h in range(len(changed)))


def test_rewriting_wrappers_refuse_what_they_cannot_rewrite():
    with pytest.raises(ValueError, match="Merging.scorer cannot be adakv: it takes a scorer's ranking"):
        ec.Merging(capacity=64, scorer="adakv")
    with pytest.raises(ValueError, match="AdaKV.scorer cannot be think: it rewrites the cache it keeps"):
        ec.AdaKV(capacity=64, scorer="think")
    with pytest.raises(ValueError, match="Composed.then cannot be merging: it rewrites the cache it keeps"):
        ec.Composed(capacity=128, then="merging")
    assert "rewrite the tokens key_rerotation already rewrote" in ec.chunk_mode_refusal(
        ec.KeyRerotation.from_config(128), "compress")


def test_prefill_decoding_prefills_with_one_method_and_reapplies_another(llama):
    """KNorm keeps the prompt's capacity - interval tokens; SnapKV is re-applied every 10 steps (the cache falls back
    to 32 per head each time, never above 42); the engine gives the tokens of running alone; with the decoding
    scorer at prefill too it is DecodingSnapKV, token for token."""
    from baseline_reference import kept_knorm
    from conftest import random_prompt

    policy = ec.PrefillDecoding.from_config(42, window=8, kernel_size=3, interval=10, prefill="knorm")
    prompt = random_prompt(50, seed=2)
    session = ec.CompressionSession(llama, policy)
    session.prefill(prompt)
    assert held_positions(session, reference_keys(llama, prompt)) == kept_knorm(full_run(llama, prompt), 32)
    tokens = torch.randperm(llama.config.vocab_size, generator=torch.Generator().manual_seed(1))[:24].tolist()
    for step, token in enumerate(tokens, start=1):
        session.step(torch.tensor([[token]]))
        held = {int(n) for layer in session.cache.layers for n in layer.heads.valid[0].sum(dim=-1)}
        assert held == {32 + step % 10}, (step, held)
    engine = ec.Engine(llama, policy, slots=2).run([ec.Request(prompt[0], max_new_tokens=20),
                                                    ec.Request(prompt[0, :20], max_new_tokens=30)])
    alone = ec.generate(llama, prompt, policy, max_new_tokens=20, return_logits=False)
    assert engine[0].tokens == alone.sequences[0, 50:].tolist()
    same = ec.PrefillDecoding.from_config(42, window=8, kernel_size=3, interval=10)
    reference = ec.DecodingSnapKV.from_config(42, window=8, kernel_size=3, interval=10)
    ours, theirs = (ec.generate(llama, prompt, p, max_new_tokens=30) for p in (same, reference))
    assert ours.sequences.tolist() == theirs.sequences.tolist()
    torch.testing.assert_close(ours.logits, theirs.logits)
    assert alone.sequences.tolist() != theirs.sequences[:, :70].tolist()  # KNorm's prefill changed the generation


def test_prefill_decoding_refuses_what_it_cannot_prefill_with():
    with pytest.raises(ValueError, match="PrefillDecoding.prefill cannot be h2o: it acts while decoding"):
        ec.PrefillDecoding.from_config(600, interval=100, prefill="h2o")
    with pytest.raises(ValueError, match="cannot be observed_attention: its fused attention-sum pass"):
        ec.PrefillDecoding.from_config(600, interval=100, prefill="observed_attention")
