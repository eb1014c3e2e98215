"""The engine's slots hold what a method stores: under ``kv_bits`` every layer's slots packed (codes in bytes, group
tables, scales and minima, the residual) with the dense slots' tokens bit for bit; under ThinK each slot's prompt keys
at the reduced width with its channels. The rows' ``kv_cache_allocated_bytes`` are those tensors' bytes."""

from __future__ import annotations

import pytest
import torch
from test_engine import VOCAB, small_llama, stream
from torch._dynamo.testing import CompileCounter

import evalkit.compression as ec
import evalkit.compression.engine.slot_pool as slot_pool
from evalkit.compression.engine.packed_slots import packs_slots, table_entries
from evalkit.compression.engine.slot_cache import PackedSlotLayer, ReducedSlotLayer, SlotLayer

METHODS = {  # a ring that wraps, a growing row layout, per-head layouts with and without eviction while decoding
    "snapstream": lambda: ec.SnapStream(capacity=48, window=8, sink=4, recent=12, kernel_size=5),
    "streaming_llm": lambda: ec.StreamingLLM(sink=4, window=28),
    "snapkv": lambda: ec.SnapKV(capacity=40, window=8),
    "adakv": lambda: ec.AdaKV(capacity=40, scorer=ec.SnapKV(capacity=40, window=8, kernel_size=5)),
    "h2o": lambda: ec.H2O(capacity=40, recent=10),
}


@pytest.fixture(scope="module")
def model():
    return small_llama()


def quantized(name: str, bits: int):
    policy = METHODS[name]()
    policy.kv_format = ec.KVFormat(bits, 8, 16)  # values leave the residual every step, keys in blocks of 16
    return policy


def run(model, policy, requests, packed: bool, monkeypatch, **settings):
    """The engine's completions and the engine, its slots packed or (``packed`` False) dense as before."""
    monkeypatch.setattr(slot_pool, "packs_slots", packs_slots if packed else lambda *args: False)
    engine = ec.Engine(model, policy, slots=3, sync_every=3, **settings)
    return engine.run(requests), engine


def mixed_stream() -> list[ec.Request]:
    """Prompts of 20-150 tokens, 3-40 new tokens, admitted as slots free up, and a question after a context (its
    tokens and the ones generated after them within the residual: a session holds a question's tokens there as long as
    it decodes, so alone a longer one overruns it, in the engine as alone)."""
    requests = stream(count=9, seed=4)
    requests[4] = ec.Request(torch.randint(0, VOCAB, (120,), generator=torch.Generator().manual_seed(6)),
                             max_new_tokens=10, compress_prefix=116)
    return requests


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("name", sorted(METHODS))
def test_packed_slots_give_the_dense_slots_tokens_bit_for_bit(model, name, bits, monkeypatch):
    requests = mixed_stream()
    dense, dense_engine = run(model, quantized(name, bits), requests, False, monkeypatch)
    packed, engine = run(model, quantized(name, bits), requests, True, monkeypatch)
    assert [c.tokens for c in packed] == [c.tokens for c in dense]
    for ours, theirs in zip(packed, dense):
        for key in ("kept_prompt_tokens", "peak_cache_tokens", "kv_bytes_peak", "kv_quantized_tokens"):
            assert ours.stats[key] == theirs.stats[key], key
    assert all(isinstance(layer, PackedSlotLayer) for layer in engine.cache.layers)
    assert all(type(layer) is SlotLayer for layer in dense_engine.cache.layers)
    layer = engine.cache.layers[0]
    assert layer.packed.key_codes.dtype == torch.uint8 and layer.packed.key_codes.shape == (3, 2, engine.slot_tokens,
                                                                                            16 * bits // 8)
    assert (layer.packed.key_group > 0).any()  # keys were quantized along the way, generated ones in blocks
    # the bytes counted are the packed storage's (at these 16-wide heads and slots of a few dozen tokens, its
    # 17-token residual and tables cost about what 16 bits would: the CLI test below shows the saving)
    assert engine.cache.nbytes() == sum(layer.packed.nbytes() for layer in engine.cache.layers)
    if name == "streaming_llm":  # its ring wrapped: generated tokens overwrote older ones
        assert any(r.input_ids.numel() + r.max_new_tokens > 32 for r in requests)


@pytest.mark.parametrize("name", ["snapstream", "snapkv", "adakv"])
def test_the_key_tables_are_sized_once(model, name, monkeypatch):
    """Row layouts and per-head layouts that do not evict while decoding never outgrow the tables allocated with
    the slots (:func:`table_entries`): every layer's tables are the same tensors after the stream."""
    policy = quantized(name, 4)
    engine = ec.Engine(model, policy, slots=3, sync_every=3)
    requests = mixed_stream()
    engine.pool.prepare(requests, None)
    tables = [layer.packed.key_scale for layer in engine.cache.layers]
    engine.run(requests)
    assert [layer.packed.key_scale for layer in engine.cache.layers] == tables
    assert tables[0].shape[2] == table_entries(policy.kv_format, engine.slot_tokens)


def test_growing_slots_pad_the_packed_fields(model, monkeypatch):
    requests = mixed_stream()
    static, _ = run(model, quantized("snapkv", 4), requests, False, monkeypatch)
    grown, engine = run(model, quantized("snapkv", 4), requests, True, monkeypatch, grow=True)
    assert [c.tokens for c in grown] == [c.tokens for c in static]
    packed = engine.cache.layers[0].packed
    assert packed.slots == engine.slot_tokens > 64 and packed.room >= packed.slots  # it grew past its first 64


@pytest.mark.parametrize("name", ["snapstream", "h2o"])
def test_a_compiled_step_over_packed_slots_gives_the_eager_tokens(model, name, monkeypatch):
    """The packed layer's work (compiled C, host-side bookkeeping) runs outside the compiled graphs: the graph breaks
    there, the step compiles once per piece and the tokens are the eager step's."""
    requests = stream(count=5, seed=2)
    eager, _ = run(model, quantized(name, 4), requests, True, monkeypatch)
    counter = CompileCounter()
    compiled, engine = run(model, quantized(name, 4), requests, True, monkeypatch, compile=True,
                           compile_backend=counter)
    assert [c.tokens for c in compiled] == [c.tokens for c in eager]
    frames = counter.frame_count
    assert frames > 1  # the graph breaks at the packed layers' work
    engine.run(stream(count=4, seed=3))
    assert counter.frame_count == frames  # a later stream reuses every piece


def think(remove: bool = True) -> ec.ThinK:
    policy = ec.ThinK.from_config(40, window=8, window_size=8)
    policy.remove_channels = remove
    return policy


def test_think_slots_hold_the_prompt_keys_reduced_with_the_zeroed_keys_tokens(model):
    """Each slot's prompt keys at half width with its own channels, full-width keys after them; the tokens equal the
    zeroed keys' (the dense slots before) and running alone, a question after a context and a shared context's
    request included; the prompt keys take half the bytes."""
    requests = mixed_stream()
    prefix, _ = ec.prefill_context(model, think(), requests[0].input_ids[None, :-6])
    requests.append(ec.Request(requests[0].input_ids[-6:], max_new_tokens=7, prefix=prefix))
    engine = ec.Engine(model, think(), slots=3, sync_every=3)
    reduced = engine.run(requests)
    zeroed = ec.Engine(model, think(False), slots=3, sync_every=3).run(requests)
    assert [c.tokens for c in reduced] == [c.tokens for c in zeroed]
    for request, completion in zip(requests[:-1], reduced):
        alone = ec.generate(model, request.input_ids[None], think(), max_new_tokens=request.max_new_tokens,
                            compress_prefix=request.compress_prefix, return_logits=False)
        assert completion.tokens == alone.sequences[0, request.input_ids.numel():].tolist()
        assert completion.stats["peak_cache_tokens"] == alone.stats[0]["peak_cache_tokens"]
    layer = engine.cache.layers[0]
    assert isinstance(layer, ReducedSlotLayer) and layer.keys.shape == (3, 2, 40, 8)
    assert layer.later_keys.shape == (3, 2, engine.slot_tokens - 40, 16)
    assert len({tuple(channels.tolist()) for channels in layer.key_channels.flatten(0, 1)}) > 1  # per slot and head
    snapkv = ec.Engine(model, ec.SnapKV(capacity=40, window=8), slots=3, sync_every=3)
    snapkv.run(requests)
    assert snapkv.slot_tokens == engine.slot_tokens
    prompt_keys = snapkv.cache.layers[0].keys[:, :, :40]
    assert layer.keys.nbytes == prompt_keys.nbytes // 2
    index = layer.key_channels.nbytes
    assert snapkv.cache.nbytes() - engine.cache.nbytes() == 2 * (prompt_keys.nbytes // 2 - index)
    assert prefix.cache.layers[0].key_channels is not None  # the shared context itself is left as it was


def cli_rows(tmp_path, *extra) -> dict:
    from helpers import evalkit

    from evalkit.results import read_table

    results = tmp_path / "_".join(extra).replace("=", "")
    result = evalkit("limit=2", "batch_size=4", f"results_dir={results}", *extra, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    metrics = read_table(results, "metrics").set_index("metric")["value"]
    return {**metrics.to_dict(), "slot_tokens": int(read_table(results, "samples")["reserved_cache_tokens"].max())}


def test_the_cli_rows_count_the_packed_slots_bytes(tmp_path):
    """`evalkit method=snapstream +budget=2x kv_bits=4 kv_residual=32` against 16 bits: the cache allocated is what the
    packed tensors hold, under 0.75x the dense slots' (4x with a residual of 32 on this tiny model: 0.81x, the
    residual's 33 full-precision tokens a head are most of it), and the decode step's bytes fall by as much."""
    common = ("method=snapstream", "+budget=2x")
    dense, packed = cli_rows(tmp_path, *common), cli_rows(tmp_path, *common, "kv_bits=4", "kv_residual=32")
    slots, layers, heads, dim, tokens = 4, 2, 2, 64, dense["slot_tokens"]  # the built-in model: fp32, 64-wide heads
    assert dense["kv_cache_allocated_bytes"] == slots * layers * heads * tokens * dim * 4 * 2
    fmt = ec.KVFormat(4, 32, 32)
    per_head = (tokens * (dim + 2 * 4 * dim // 32 + 4 + 2 + 2)  # codes, value scales and minima, entry, index, flags
                + 2 * (fmt.residual + 1) * dim * 4 + 2 * table_entries(fmt, tokens) * dim * 4)  # residual, tables
    assert packed["kv_cache_allocated_bytes"] == slots * layers * heads * per_head
    assert packed["kv_cache_allocated_bytes"] < 0.75 * dense["kv_cache_allocated_bytes"]
    saved = dense["kv_cache_allocated_bytes"] - packed["kv_cache_allocated_bytes"]
    assert dense["decode_step_bytes"] - packed["decode_step_bytes"] == saved


def test_the_cli_rows_count_thinks_reduced_keys(tmp_path):
    """`evalkit method=think +budget=2x` (ratio 0.5) against SnapKV at the same budget: the prompt keys take half
    the bytes (less the channel index), read off the slots' tensors."""
    snapkv, think_rows = cli_rows(tmp_path, "method=snapkv", "+budget=2x"), cli_rows(tmp_path, "method=think",
                                                                                      "+budget=2x")
    assert snapkv["slot_tokens"] == think_rows["slot_tokens"]
    slots, layers, heads, dim, prompt = 4, 2, 2, 64, 128  # 2x of the built-in model's 256 tokens
    prompt_keys = slots * layers * heads * prompt * dim * 4
    index = slots * layers * heads * (dim // 2) * 8
    assert snapkv["kv_cache_allocated_bytes"] - think_rows["kv_cache_allocated_bytes"] == prompt_keys // 2 - index
