"""Packed quantized KV (``kv_bits``): a session's layers hold codes packed into bytes, group scales and minima, and the
full-precision residual (:mod:`evalkit.compression.packed_kv`); the outputs are the dense format's bit for bit, and
the bytes held are the storage tensors' own, a fraction of the dense format's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import random_prompt, tiny_model

import evalkit.compression as ec
import evalkit.compression.session as session_module
from evalkit.compression import packed_kernels
from evalkit.compression.cache import _held_bytes
from evalkit.compression.packed_kv import PackedKV, pack_codes, unpack_codes

METHODS = {
    "full": lambda: ec.Full(),
    "snapstream": lambda: ec.SnapStream(capacity=48, window=8, sink=4, recent=12, kernel_size=5),
    "streaming_llm": lambda: ec.StreamingLLM(sink=4, window=28),
    "h2o": lambda: ec.H2O(capacity=40, recent=10),
    "adakv": lambda: ec.AdaKV(capacity=40, scorer=ec.SnapKV(capacity=40, window=8, kernel_size=5)),
    "rkv": lambda: ec.RKV(capacity=64, window=4, interval=8, kernel_size=3),
}


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_codes_pack_into_bytes_and_back(bits):
    codes = torch.randint(0, 2 ** bits, (3, 5, 16), generator=torch.Generator().manual_seed(bits))
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, 16 * bits // 8)
    assert torch.equal(unpack_codes(packed, bits).long(), codes)


@pytest.mark.parametrize("bits,group,dim", [(2, 8, 16), (4, 8, 16), (8, 16, 32), (4, 32, 64), (2, 32, 64)])
def test_the_compiled_dequantization_is_the_torch_paths_bit_for_bit(bits, group, dim, monkeypatch):
    """Codes, the keys' table entries per slot, the values' groups and the residual's rows: the one-pass kernel
    (built with the machine's C compiler) writes exactly what the torch path writes."""
    if not packed_kernels.library():
        pytest.skip("no C compiler: the torch path runs")
    generator = torch.Generator().manual_seed(bits * dim)
    keys, values = (torch.randn(2, 3, 70, dim, generator=generator) * 4 for _ in range(2))
    held = torch.rand(2, 3, 70, generator=generator) > 0.2
    packed = PackedKV.from_prompt(ec.KVFormat(bits, group, 2 * group), keys, values, held)
    packed.pad(74)  # the fields now views of a larger storage, four slots empty
    assert packed.room > packed.slots == 74 and not packed.key_codes.is_contiguous()
    packed.key_group[:, :, :10] = packed.key_group[:, :, 10:20]  # slots share entries out of order
    packed.key_fresh[:, :, -13:-4] = True
    packed.value_fresh[:, :, -9:-4] = True
    packed.residual_slot[:, :, -13:-4] = torch.arange(9, dtype=torch.int16).flip(0)
    packed.residual_keys.normal_(generator=generator)
    packed.residual_values.normal_(generator=generator)
    monkeypatch.delenv("EVALKIT_TORCH_PACKED", raising=False)
    compiled = [keys.new_full(packed.dense_shape, float("nan")) for _ in range(2)]
    packed.dequantize(*compiled)
    monkeypatch.setenv("EVALKIT_TORCH_PACKED", "1")
    reference = [keys.new_full(packed.dense_shape, float("nan")) for _ in range(2)]
    packed.dequantize(*reference)
    assert torch.equal(compiled[0], reference[0]) and torch.equal(compiled[1], reference[1])
    assert not torch.equal(compiled[0][:, :, :10], compiled[0][:, :, 10:20])  # the codes differ, not only tables


@pytest.mark.parametrize("damage", ["unwritable", "truncated"])
def test_a_kernel_that_cannot_be_built_or_loaded_leaves_the_torch_path(tmp_path, monkeypatch, damage):
    """A cache folder where a file stands (it cannot hold the kernel) or a damaged library file: no kernel, and
    dequantization still gives its values."""
    if not packed_kernels.library():
        pytest.skip("no C compiler: the torch path runs")
    if damage == "unwritable":
        (tmp_path / "kernels").write_text("a file where the folder goes")
    else:
        built = Path(packed_kernels.library()._name)
        (tmp_path / "kernels").mkdir()
        (tmp_path / "kernels" / built.name).write_bytes(built.read_bytes()[:100])
    monkeypatch.setenv("EVALKIT_CACHE", str(tmp_path))
    packed_kernels.library.cache_clear()
    try:
        assert packed_kernels.library() is None
        keys = torch.randn(1, 2, 40, 16)
        packed = PackedKV.from_prompt(ec.KVFormat(4, 8, 16), keys, keys, torch.ones(1, 2, 40, dtype=torch.bool))
        out = [keys.new_full(packed.dense_shape, float("nan")) for _ in range(2)]
        packed.dequantize(*out)
        assert not out[0].isnan().any() and (out[0] - keys).abs().max() < 1
    finally:
        packed_kernels.library.cache_clear()


def run(model, policy, prompts, steps: int, packed: bool, monkeypatch):
    """A left-padded batch prefilled, then ``steps`` teacher-forced decode steps: the logits of every step, and the
    session."""
    monkeypatch.setattr(session_module, "packs", lambda layer, cache: packed)
    width = max(p.numel() for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - prompt.numel():], mask[row, width - prompt.numel():] = prompt, 1
    session = ec.CompressionSession(model, policy)
    logits = [session.prefill(ids, attention_mask=mask)]
    forced = random_prompt(steps, seed=7)[0]
    for token in forced:
        logits.append(session.step(token.repeat(len(prompts), 1)))
    return torch.cat([step.reshape(len(prompts), -1) for step in logits], dim=-1), session


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("name", sorted(METHODS))
def test_the_packed_cache_gives_the_dense_formats_logits_bit_for_bit(model, name, bits, monkeypatch):
    """40 steps with a residual of 16: values leave the residual every step, keys in blocks of 16; rows of
    different lengths; ring, per-head and evicting layouts."""
    policy = METHODS[name]()
    policy.kv_format = ec.KVFormat(bits, 8, 16)
    prompts = [random_prompt(90, seed=1)[0], random_prompt(61, seed=2)[0]]
    dense, dense_session = run(model, policy, prompts, 40, False, monkeypatch)
    packed, packed_session = run(model, policy, prompts, 40, True, monkeypatch)
    assert torch.equal(packed, dense)
    layer = packed_session.cache.layers[0]
    assert layer.packed is not None and dense_session.cache.layers[0].packed is None
    assert layer.packed.key_codes.dtype == torch.uint8 and layer.packed.key_codes.shape[-1] == 16 * bits // 8
    plain, _ = run(model, METHODS[name](), prompts, 40, False, monkeypatch)
    assert (plain - dense).abs().max() > 1e-4  # the format changed what the model read


@pytest.mark.parametrize("name", ["snapstream", "adakv", "h2o"])
def test_the_compiled_bookkeeping_leaves_every_field_as_the_torch_paths(model, name, monkeypatch):
    """One-token steps write their token into the residual and quantize what leaves it in C: after 40 steps (values
    leaving every step, keys in blocks) every tensor of every layer is the torch path's, and the C calls ran."""
    if not packed_kernels.library():
        pytest.skip("no C compiler: the torch path runs")
    monkeypatch.delenv("EVALKIT_TORCH_PACKED", raising=False)
    calls = {"hold_token": 0, "settle_values": 0}
    for kernel in calls:
        original = getattr(packed_kernels, kernel)
        monkeypatch.setattr(packed_kernels, kernel, lambda *a, _f=original, _k=kernel: calls.__setitem__(
            _k, calls[_k] + 1) or _f(*a))
    prompts = [random_prompt(90, seed=1)[0], random_prompt(61, seed=2)[0]]
    policy = METHODS[name]()
    policy.kv_format = ec.KVFormat(4, 8, 16)
    compiled_logits, compiled = run(model, policy, prompts, 40, True, monkeypatch)
    assert calls["hold_token"] >= 40 * len(compiled.cache.layers) and calls["settle_values"] >= calls["hold_token"]
    monkeypatch.setenv("EVALKIT_TORCH_PACKED", "1")
    torch_logits, reference = run(model, policy, prompts, 40, True, monkeypatch)
    assert torch.equal(compiled_logits, torch_logits)
    for ours, theirs in zip(compiled.cache.layers, reference.cache.layers):
        for field, tensor in vars(ours.packed).items():
            if isinstance(tensor, torch.Tensor):
                assert torch.equal(tensor, getattr(theirs.packed, field)), field
    assert (compiled.cache.layers[0].packed.key_group > 0).any()  # keys were quantized along the way


@pytest.mark.parametrize("compiled", [True, False])
def test_a_token_written_where_the_residual_still_holds_one_is_refused_whole(compiled, monkeypatch):
    """A one-token step whose residual row another slot still reads: one line, and nothing written."""
    if compiled and not packed_kernels.library():
        pytest.skip("no C compiler: the torch path runs")
    monkeypatch.setenv("EVALKIT_TORCH_PACKED", "0" if compiled else "1")
    keys = torch.randn(1, 2, 10, 16, generator=torch.Generator().manual_seed(0))
    packed = PackedKV.from_prompt(ec.KVFormat(4, 8, 16), keys, keys, torch.ones(1, 2, 10, dtype=torch.bool))
    packed.pad(12)
    index = (torch.arange(1)[:, None, None], torch.arange(2)[None, :, None])
    token = torch.randn(1, 2, 1, 16)
    packed.hold((*index, torch.tensor([[[10]]])), torch.tensor([[[40]]]), token, token)
    before = [t.clone() for t in packed.tensors()]
    with pytest.raises(ValueError, match="overruns kv_bits' full-precision residual") as caught:
        # 57 % 17 == 40 % 17: the row slot 10's token still holds
        packed.hold((*index, torch.tensor([[[11]]])), torch.tensor([[[57]]]), token * 2, token * 2)
    assert "\n" not in str(caught.value)
    assert all(torch.equal(a, b) for a, b in zip(before, packed.tensors()))
    assert packed.residual_slot[0, :, 10].tolist() == [40 % 17] * 2 and packed.key_fresh[0, :, 10].all()


def test_the_bytes_held_are_the_packed_tensors_and_a_fraction_of_the_dense_formats(model, monkeypatch):
    policy = ec.Full()
    policy.kv_format = ec.KVFormat(4, 8, 16)
    prompt = [random_prompt(400, seed=3)[0]]
    _, dense = run(model, policy, prompt, 20, False, monkeypatch)
    _, packed = run(model, policy, prompt, 20, True, monkeypatch)
    for dense_layer, packed_layer in zip(dense.cache.layers, packed.cache.layers):
        storage = packed_layer.packed
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in storage.tensors()}
        assert _held_bytes(packed_layer) == sum(storages.values())  # the slots' views count their whole storage
        assert "_keys" not in vars(packed_layer) or packed_layer.__dict__["_keys"] is None  # no dense copy kept
        # a token and head: codes 8 + 8 bytes, value scales 16, key scales 16 (groups of 8), its entry and residual
        # index 6, against 128 dense; the format's price leaves the bookkeeping out
        priced = policy.kv_format.held_bytes(420 * 2, 2, 16, 16, 4, generated=20)
        assert priced < _held_bytes(packed_layer) < 1.25 * priced
        assert _held_bytes(packed_layer) < 0.5 * _held_bytes(dense_layer)
        assert torch.equal(packed_layer.keys, dense_layer.keys) and torch.equal(packed_layer.values,
                                                                                dense_layer.values)


def test_a_forked_packed_session_decodes_as_the_original(model, monkeypatch):
    policy = METHODS["snapstream"]()
    policy.kv_format = ec.KVFormat(4, 8, 16)
    _, session = run(model, policy, [random_prompt(80, seed=4)[0]], 10, True, monkeypatch)
    fork = session.fork()
    for token in random_prompt(25, seed=5)[0]:
        assert torch.equal(session.step(token.view(1, 1)), fork.step(token.view(1, 1)))


def test_a_step_of_more_tokens_than_the_residual_holds_is_one_line(model, monkeypatch):
    policy = ec.Full()
    policy.kv_format = ec.KVFormat(4, 8, 16)
    _, session = run(model, policy, [random_prompt(40, seed=6)[0]], 2, True, monkeypatch)
    session.step(random_prompt(10, seed=7))  # 12 generated tokens in a residual of 17 entries
    with pytest.raises(ValueError, match="overruns kv_bits' full-precision residual") as caught:
        session.step(random_prompt(20, seed=8))
    assert "\n" not in str(caught.value)
