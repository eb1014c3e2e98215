"""MiniCache against a float64 port of KVCache-Factory's ``pyramidkv/minicache.py`` (commit
c97f9d706d63d1b56e980f8b81b2a924c21162b3): on a tiny random Llama, each merged layer's restored keys and values, the
retained positions, the layers left alone, the bytes a pair holds, and the tokens generated from a plain cache holding
the reference's restored states."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import random_prompt, tiny_model
from transformers import DynamicCache

import evalkit.compression as ec
from evalkit.compression.methods.minicache import MergedPair, retained_tokens
from evalkit.compression.model_spec import cache_kwargs

N, NEW = 60, 12


# -- the reference, ported: its functions as KVCache-Factory writes them, run in float64 ----------------------------
def ref_minicache_slerp(current_states, previous_states, *, interpolation=0.6, eps=1e-6):
    def unit_and_magnitude(states):
        magnitude = states.norm(dim=-1, keepdim=True).clamp_min(eps)
        return states / magnitude, magnitude

    current_unit, current_magnitude = unit_and_magnitude(current_states)
    previous_unit, previous_magnitude = unit_and_magnitude(previous_states)
    cosine = (current_unit * previous_unit).sum(dim=-1, keepdim=True).clamp(min=-1.0 + eps, max=1.0 - eps)
    angle = torch.acos(cosine)
    sin_angle = torch.sin(angle)
    previous_weight = torch.sin((1.0 - interpolation) * angle) / sin_angle
    current_weight = torch.sin(interpolation * angle) / sin_angle
    slerp = previous_weight * previous_unit + current_weight * current_unit
    lerp = (1.0 - interpolation) * previous_unit + interpolation * current_unit
    shared_direction = torch.where(sin_angle.abs() > eps, slerp, lerp)
    shared_direction = shared_direction / shared_direction.norm(dim=-1, keepdim=True).clamp_min(eps)
    return shared_direction, current_magnitude, previous_magnitude, angle.squeeze(-1)


def ref_select_retention_indices(angular_distance, *, retention_ratio=0.05):
    seq_len = angular_distance.shape[-1]
    keep = min(seq_len, math.ceil(seq_len * retention_ratio))
    if keep == 0:
        return torch.empty((*angular_distance.shape[:2], 0), dtype=torch.long)
    _, indices = torch.topk(angular_distance, k=keep, dim=-1)
    return indices.sort(dim=-1).values


def ref_gather(states, indices):
    return states.gather(dim=2, index=indices.unsqueeze(-1).expand(*indices.shape, states.shape[-1]))


def ref_compress_pair(current_states, previous_states, *, interpolation=0.6, retention_ratio=0.05):
    shared, current_magnitude, previous_magnitude, angle = ref_minicache_slerp(
        current_states, previous_states, interpolation=interpolation)
    retained = ref_select_retention_indices(angle / math.pi, retention_ratio=retention_ratio)
    return (shared, current_magnitude, previous_magnitude, ref_gather(current_states, retained),
            ref_gather(previous_states, retained), retained)


def ref_restore_pair(shared, current_magnitude, previous_magnitude, current_retained, previous_retained, retained,
                     eps=1e-6):
    unit = shared / shared.norm(dim=-1, keepdim=True).clamp_min(eps)
    out = []
    for magnitude, tokens in ((current_magnitude, current_retained), (previous_magnitude, previous_retained)):
        states = unit * magnitude
        if retained.numel():
            states = states.scatter(dim=2, index=retained.unsqueeze(-1).expand_as(tokens), src=tokens)
        out.append(states)
    return tuple(out)


def reference_states(model, prompt, pairs, interpolation, retention_ratio):
    """Per layer: the plain full cache's keys and values ``[1, H, n, D]``, each merged pair's replaced by the ported
    restore of the ported merge (float64; the merged pair held in the model's dtype in between, as the cache holds
    it), and each merged layer's retained positions ``{(layer, "key"/"value"): [1, H, r]}``."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=prompt, use_cache=True, **cache_kwargs(model, cache))
    states = [[layer.keys, layer.values] for layer in cache.layers]
    retained = {}
    for previous, current in pairs:
        for which, name in enumerate(("key", "value")):
            dtype = states[current][which].dtype
            parts = ref_compress_pair(states[current][which].double(), states[previous][which].double(),
                                      interpolation=interpolation, retention_ratio=retention_ratio)
            held = [part.to(dtype) if part.is_floating_point() else part for part in parts]
            restored = ref_restore_pair(*(p.double() if p.is_floating_point() else p for p in held))
            states[current][which], states[previous][which] = (r.to(dtype) for r in restored)
            retained[(current, name)] = retained[(previous, name)] = parts[-1]
    return states, retained


def reference_tokens(model, prompt, states, count: int) -> list[int]:
    """Greedy tokens of a plain cache holding ``states`` after the prompt (the prompt's logits are the full cache's:
    a layer is merged only after its attention ran)."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = model(input_ids=prompt, use_cache=True, **cache_kwargs(model, DynamicCache(config=model.config))).logits
        for index, (keys, values) in enumerate(states):
            cache.update(keys, values, index)
        tokens = [int(logits[0, -1].argmax())]
        for step in range(count - 1):
            out = model(input_ids=torch.tensor([[tokens[-1]]]), position_ids=torch.tensor([[prompt.shape[1] + step]]),
                        use_cache=True, **cache_kwargs(model, cache))
            tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


CASES = {  # (layers, policy, merged pairs)
    "defaults: from the middle layer": (4, lambda: ec.MiniCache(), [(2, 3)]),
    "from layer 1, the last alone": (6, lambda: ec.MiniCache(start_layer=1), [(1, 2), (3, 4)]),
    "t 0.3, retaining a fifth": (4, lambda: ec.MiniCache(start_layer=0, interpolation=0.3, retention_ratio=0.2),
                                 [(0, 1), (2, 3)]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_merged_layers_equal_the_references_restored_states_and_the_rest_stay_whole(case):
    layers, make, pairs = CASES[case]
    model, prompt, policy = tiny_model("llama", num_hidden_layers=layers), random_prompt(N, seed=3), make()
    assert policy.pairs(layers) == pairs
    expected, retained = reference_states(model, prompt, pairs, policy.interpolation, policy.retention_ratio)
    whole, _ = reference_states(model, prompt, [], 0.0, 0.0)
    session = ec.CompressionSession(model, policy)
    session.prefill(prompt)
    merged = {layer for pair in pairs for layer in pair}
    for index, layer in enumerate(session.cache.layers):
        for which, held in enumerate((layer.keys, layer.values)):
            held = held[:, :, :N]
            assert torch.equal(held, expected[index][which]), (index, which)
            original = whole[index][which]
            if index not in merged:
                assert torch.equal(held, original)
                continue
            # merged: every position but the retained ones changed; the retained ones are the layer's own
            kept = retained[(index, ("key", "value")[which])]
            same = (held == original).all(dim=-1)
            assert torch.equal(same, torch.zeros_like(same).scatter(-1, kept, True)), (index, which)
            assert kept.shape[-1] == math.ceil(N * policy.retention_ratio)
    # what the pairs hold: one direction [H, n, D], two magnitudes [H, n, 1], the retained tokens and their indices
    heads, dim = 2, 16
    r = math.ceil(N * policy.retention_ratio)
    pair_bytes = 2 * (heads * N * dim * 4 + 2 * heads * N * 4 + 2 * heads * r * dim * 4 + heads * r * 8)
    assert policy.merged_bytes() == {"kv_bytes_merged": len(pairs) * pair_bytes,
                                     "kv_bytes_dense": len(pairs) * 2 * 2 * heads * N * dim * 4}
    assert policy.merged_bytes()["kv_bytes_merged"] < policy.merged_bytes()["kv_bytes_dense"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_generated_tokens_equal_a_plain_cache_holding_the_references_states(case):
    layers, make, pairs = CASES[case]
    model, prompt, policy = tiny_model("llama", num_hidden_layers=layers), random_prompt(N, seed=3), make()
    expected, _ = reference_states(model, prompt, pairs, policy.interpolation, policy.retention_ratio)
    out = ec.generate(model, prompt, policy, max_new_tokens=NEW)
    tokens = out.sequences[0, N:].tolist()
    assert tokens == reference_tokens(model, prompt, expected, NEW)
    full = ec.generate(model, prompt, ec.Full(), max_new_tokens=NEW)
    assert not torch.allclose(out.logits[0, 1:], full.logits[0, 1:], atol=1e-3)  # the merge changed what decoding reads
    assert out.stats[0]["kept_prompt_tokens"] == [N] * layers


def test_retained_positions_are_the_references_and_ties_go_to_the_earlier_token():
    generator = torch.Generator().manual_seed(0)
    current, previous = (torch.randn(2, 3, 50, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    for ratio in (0.0, 0.05, 0.3, 1.0):
        *_, expected = ref_compress_pair(current, previous, retention_ratio=ratio)
        for row in range(2):
            assert torch.equal(MergedPair.merge(current[row], previous[row], 0.6, ratio).retained, expected[row])
    tied = torch.tensor([[0.5, 0.9, 0.2, 0.9, 0.9, 0.1]])
    assert retained_tokens(tied, 0.5).tolist() == [[1, 3, 4]]
    assert retained_tokens(tied, 0.3).tolist() == [[1, 3]]


def test_retaining_every_token_is_full_and_a_batch_gives_each_prompt_what_it_gets_alone():
    from test_compression import assert_batch_equals_alone

    model, prompt = tiny_model("llama", num_hidden_layers=4), random_prompt(40, seed=2)
    full = ec.generate(model, prompt, ec.Full(), max_new_tokens=20)
    out = ec.generate(model, prompt, ec.MiniCache(start_layer=0, retention_ratio=1.0), max_new_tokens=20)
    assert out.sequences.tolist() == full.sequences.tolist()
    torch.testing.assert_close(out.logits, full.logits, atol=2e-5, rtol=1e-5)
    assert_batch_equals_alone(model, ec.MiniCache(start_layer=0), new_tokens=16)


def test_the_engine_gives_each_request_what_it_gets_alone():
    from test_compression import assert_engine_equals_alone

    assert_engine_equals_alone(tiny_model("llama", num_hidden_layers=4), ec.MiniCache(start_layer=1))


def test_settings_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^MiniCache.start_layer=1 leaves no pair of adjacent layers to merge in a "
                                         r"2-layer model$"):
        ec.CompressionSession(tiny_model("llama"), ec.MiniCache())
    for bad in ({"interpolation": 1.5}, {"retention_ratio": -0.1}, {"start_layer": -1}):
        with pytest.raises(ValueError, match=r"^MiniCache\.\w+ must be") as error:
            ec.MiniCache(**bad)
        assert "\n" not in str(error.value)


def test_the_paritys_evalkit_side_agrees_with_the_port_bit_for_bit():
    """`benchmarks/parity_minicache.py` with the port in the reference's place: every pair's retained positions and
    restored states identical in float64, and within fp32 rounding as shipped."""
    import sys
    import types
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import parity_minicache

    def compress(current, previous, *, interpolation, retention_ratio):
        shared, current_magnitude, previous_magnitude, current_kept, previous_kept, retained = ref_compress_pair(
            current, previous, interpolation=interpolation, retention_ratio=retention_ratio)
        return shared, current_magnitude, previous_magnitude, None, current_kept, previous_kept, retained

    def restore(shared, current_magnitude, previous_magnitude, *, current_retained, previous_retained,
                retained_indices):
        return ref_restore_pair(shared, current_magnitude, previous_magnitude, current_retained, previous_retained,
                                retained_indices)

    port = types.SimpleNamespace(compress_minicache_pair=compress, restore_minicache_pair=restore)
    rows = parity_minicache.rows(port, parity_minicache.cache_states())
    assert len(rows) == 4
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert cells[2:4] == ["2/2 heads", "identical"], row
        assert cells[4] == "2/2 heads" and (cells[5] == "identical" or float(cells[5].split()[-1]) < 1e-6), row


def _held(layers) -> int:
    from evalkit.compression.cache import _held_bytes

    return sum(_held_bytes(layer) for layer in layers)


def _dense(layers) -> int:
    """What the layers' slots take held dense: keys and values of every slot, in the cache's dtype."""
    return sum(2 * layer.keys.shape[1] * layer.slot_count * layer.keys.shape[-1] * layer.keys.element_size()
               for layer in layers)


def test_merged_layers_hold_each_direction_once_and_the_held_bytes_fall_by_the_merged_share():
    """A session's merged layers hold what MiniCache holds (the direction and retained positions once per pair, each
    layer its magnitudes and retained tokens, its generated tokens dense): the measured held bytes, after prefill and
    after decode steps (past a growth of the slots), are the dense layers' less the merged share; a fork shares
    its pairs as the session does."""
    from evalkit.compression.merged_storage import MergedKV

    model, prompt, policy = tiny_model("llama", num_hidden_layers=6), random_prompt(N, seed=3), ec.MiniCache(start_layer=1)
    session = ec.CompressionSession(model, policy)
    session.prefill(prompt)
    layers = session.cache.layers
    assert [isinstance(layer.packed, MergedKV) for layer in layers] == [False, True, True, True, True, False]
    assert all(a is b for a, b in zip(layers[1].packed.rows[0], layers[2].packed.rows[0]))
    merged = policy.merged_bytes()
    share = merged["kv_bytes_dense"] - merged["kv_bytes_merged"]
    heads, dim, r = 2, 16, math.ceil(N * policy.retention_ratio)
    assert share == 2 * 2 * (2 * heads * N * dim * 4 - (heads * N * dim * 4 + 2 * heads * N * 4
                                                       + 2 * heads * r * dim * 4 + heads * r * 8))
    full = ec.CompressionSession(model, ec.Full())
    full.prefill(prompt)
    assert _held(layers) == _held(full.cache.layers) - share == _dense(layers) - share
    token = torch.tensor([[5]])
    for step in range(70):
        session.step(token)
        if step in (0, 3, 69):
            assert _held(layers) == _dense(layers) - share, step
            assert all(layer.workspace is None for layer in layers)
    assert layers[1].slot_count > N + 64  # the slots grew: the dense blocks with them
    fork = session.fork()
    assert all(a is b for a, b in zip(fork.cache.layers[3].packed.rows[0], fork.cache.layers[4].packed.rows[0]))
    assert fork.cache.layers[3].packed.rows[0][0] is not layers[3].packed.rows[0][0]
    assert torch.equal(fork.step(token), session.step(token))


def test_the_engine_holds_its_slots_dense_and_prices_the_merged_share():
    """Engine slots hold keys and values dense (as under kv_bits): its admission keeps the layers restored, and
    ``kv_bytes_peak`` prices the merged layers as MiniCache holds them, as a session's accounting counts them."""
    from evalkit.compression.engine.accounting import held_bytes

    model, prompt = tiny_model("llama", num_hidden_layers=4), random_prompt(N, seed=3)[0]
    policy = ec.MiniCache(start_layer=0, retention_ratio=0.1)
    stats = ec.Engine(model, policy, slots=1).run([ec.Request(prompt, max_new_tokens=NEW)])[0].stats
    merged = policy.merged_bytes()
    share = merged["kv_bytes_dense"] - merged["kv_bytes_merged"]
    full = ec.Engine(model, ec.Full(), slots=1).run([ec.Request(prompt, max_new_tokens=NEW)])[0].stats
    assert stats["kv_bytes_peak"] == full["kv_bytes_peak"] - share
    assert stats["kv_bytes_full"] == full["kv_bytes_full"]
    session = ec.CompressionSession(model, policy)
    session.prefill(prompt[None])
    dense = held_bytes(session.cache.layers, 0, N, N, 0, N)["kv_bytes_peak"]
    assert dense == full["kv_bytes_full"] * N // (N + NEW - 1) - share == _held(session.cache.layers)


def test_a_quantized_kv_format_packs_the_restored_layers():
    """Under kv_bits the merged layers are held restored and packed as the format holds them (no merged storage)."""
    from evalkit.compression.packed_kv import PackedKV

    policy = ec.MiniCache(start_layer=0)
    policy.kv_format = ec.KVFormat(4, 8, 16)
    session = ec.CompressionSession(tiny_model("llama", num_hidden_layers=4), policy)
    session.prefill(random_prompt(N, seed=3))
    assert all(isinstance(layer.packed, PackedKV) for layer in session.cache.layers)
    session.step(torch.tensor([[5]]))
