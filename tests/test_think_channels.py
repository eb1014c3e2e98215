"""ThinK removes the pruned key channels in the session: the same tokens and logits as the zeroed keys kvpress keeps,
at the reduced width, and the bytes freed are measured."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompt, tiny_model

import evalkit.compression as ec
from evalkit.compression.engine import Request

CAPACITY, PROMPT, NEW = 40, 120, 10


def think(remove: bool = True) -> ec.ThinK:
    policy = ec.ThinK.from_config(CAPACITY, window=8, window_size=8)
    policy.remove_channels = remove
    return policy


def test_the_zeroed_form_is_what_the_pruned_channels_would_be():
    model = tiny_model("llama")
    ids = random_prompt(PROMPT)
    removed = ec.generate(model, ids, think(), max_new_tokens=1, keep_session=True).session.cache.layers[0]
    zeroed = ec.generate(model, ids, think(False), max_new_tokens=1, keep_session=True).session.cache.layers[0]
    assert removed.key_channels is not None and zeroed.key_channels is None
    index = removed.key_channels[:, :, None].expand(-1, -1, CAPACITY, -1)
    assert torch.equal(zeroed.keys.gather(-1, index), removed.keys)
    assert int((zeroed.keys != 0).any(dim=2).sum()) <= removed.key_channels.numel()  # the rest is zero


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("batch, compress_prefix", [(1, None), (2, PROMPT - 6)])
def test_removed_channels_give_the_zeroed_tokens_and_logits(attention, batch, compress_prefix):
    model = tiny_model("llama", attn_implementation=attention)
    ids = random_prompt(PROMPT, batch=batch)
    outputs = [ec.generate(model, ids, think(remove), max_new_tokens=NEW, compress_prefix=compress_prefix,
                           keep_session=True) for remove in (True, False)]
    removed, zeroed = outputs
    assert removed.session.cache.layers[0].key_channels is not None
    assert zeroed.session.cache.layers[0].key_channels is None
    assert torch.equal(removed.sequences, zeroed.sequences)
    torch.testing.assert_close(removed.logits, zeroed.logits, rtol=1e-5, atol=1e-5)


def test_the_prompt_keys_are_stored_at_the_reduced_width():
    model = tiny_model("llama")
    session = ec.generate(model, random_prompt(PROMPT), think(), max_new_tokens=4, keep_session=True).session
    dim = model.config.hidden_size // model.config.num_attention_heads
    pruned = int(dim * 0.5)
    for layer in session.cache.layers:
        full = 1 * model.config.num_key_value_heads * CAPACITY * dim * 4
        assert layer.keys.shape == (1, model.config.num_key_value_heads, CAPACITY, dim - pruned)
        assert layer.keys.nbytes == full * (dim - pruned) // dim
        assert layer.key_channels.shape == (1, model.config.num_key_value_heads, dim - pruned)
        assert layer.later_keys.shape[-1] == dim and layer.later_keys.shape[-2] == 3  # the tokens fed back
        assert layer.values.shape[-2] == CAPACITY + 3


def test_the_reported_bytes_fall_by_the_removed_channels():
    model = tiny_model("llama")
    context, query = random_prompt(PROMPT), random_prompt(6, seed=2)[0]
    stats = [ec.generate_shared(model, context, [query], think(remove), max_new_tokens=NEW).stats[0]
             for remove in (True, False)]
    heads, dim = model.config.num_key_value_heads, model.config.hidden_size // model.config.num_attention_heads
    pruned = int(dim * 0.5)
    per_layer = heads * CAPACITY * pruned * 4 - heads * (dim - pruned) * 8  # less the channel index (int64)
    layers = model.config.num_hidden_layers
    assert stats[1]["kv_bytes_peak"] - stats[0]["kv_bytes_peak"] == layers * per_layer
    assert stats[0]["kv_bytes_full"] == stats[1]["kv_bytes_full"]
    prefill = [ec.generate(model, context, think(remove), max_new_tokens=1).stats[0]["kv_bytes_prefill_peak"]
               for remove in (True, False)]
    assert prefill[0] < prefill[1]


def test_the_engine_holds_the_zeroed_keys_with_the_same_tokens():
    model = tiny_model("llama")
    ids = random_prompt(PROMPT)
    alone = ec.generate(model, ids, think(), max_new_tokens=NEW).sequences[0, PROMPT:].tolist()
    engine = ec.Engine(model, think(), slots=2)
    assert engine.run([Request(ids[0], max_new_tokens=NEW)])[0].tokens == alone
    prefix, _ = ec.prefill_context(model, think(), ids[:, :-6])
    assert prefix.cache.layers[0].key_channels is not None
    continued = engine.run([Request(ids[0, -6:], max_new_tokens=NEW, prefix=prefix)])[0].tokens
    assert continued == ec.generate(model, ids, think(), max_new_tokens=NEW,
                                    compress_prefix=PROMPT - 6).sequences[0, PROMPT:].tolist()
    assert prefix.cache.layers[0].key_channels is not None  # the prefix itself is left as it was


def test_what_it_kept_is_read_over_both_key_blocks():
    """kept_positions after decode steps: the prompt block's kept tokens and every token fed back, the same
    positions removed or zeroed."""
    model = tiny_model("llama")
    ids = random_prompt(PROMPT)
    held = [ec.kept_positions(ec.generate(model, ids, think(remove), max_new_tokens=5, keep_session=True))
            for remove in (True, False)]
    assert all(torch.equal(a, b) for layer_a, layer_b in zip(*held) for a, b in zip(layer_a, layer_b))
    assert all(len(head) == CAPACITY + 4 and head[-4:].tolist() == list(range(PROMPT, PROMPT + 4))
               for layer in held[0] for head in layer)
