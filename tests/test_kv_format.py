"""Quantized KV storage (KIVI's format) under any method: its numerics against a plain definition written from KIVI's
``quant/new_pack.py`` (``benchmarks/parity_kivi.py`` runs KIVI's own functions beside it: bit-identical), when it
quantizes (the prompt at prefill; a generated token's value once it leaves the residual, its key when its block is
complete), the engine equal to running alone, and the bytes the rows and the simulator price."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompt, tiny_model

import evalkit.compression as ec

FORMAT = ec.KVFormat(4, 8, 16)  # the tiny models' heads are 16 wide


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def kivi_keys(keys: torch.Tensor, group: int, bits: int) -> torch.Tensor:
    """KIVI's ``quant_and_pack_kcache`` then ``unpack_and_dequant_kcache``, without the packing: per channel, min and
    max over each group of ``group`` tokens."""
    batch, heads, tokens, dim = keys.shape
    data = keys.view(batch, heads, tokens // group, group, dim)
    low, high = data.min(dim=-2, keepdim=True)[0], data.max(dim=-2, keepdim=True)[0]
    scale = (high - low) / (2 ** bits - 1)
    codes = ((data - low) / scale).clamp(0, 2 ** bits - 1).round()
    return (codes * scale + low).view(keys.shape)


def kivi_values(values: torch.Tensor, group: int, bits: int) -> torch.Tensor:
    """KIVI's ``quant_and_pack_vcache`` then ``unpack_and_dequant_vcache``: per token, groups of ``group`` channels."""
    data = values.view(*values.shape[:-1], values.shape[-1] // group, group)
    low, high = data.min(dim=-1, keepdim=True)[0], data.max(dim=-1, keepdim=True)[0]
    scale = (high - low) / (2 ** bits - 1)
    return (((data - low) / scale).clamp(0, 2 ** bits - 1).round() * scale + low).view(values.shape)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_whole_prompt_is_quantized_as_kivi_quantizes_it(bits, dtype):
    generator = torch.Generator().manual_seed(bits)
    keys = (torch.randn(2, 3, 64, 32, generator=generator) * 3).to(dtype)
    values = torch.randn(2, 3, 64, 32, generator=generator).to(dtype)
    held = torch.ones(2, 3, 64, dtype=torch.bool)
    ours_k, ours_v = ec.KVFormat(bits, 16, 64).quantize_prompt(keys, values, held)
    assert torch.equal(ours_k, kivi_keys(keys, 16, bits)) and torch.equal(ours_v, kivi_values(values, 16, bits))
    assert not torch.equal(ours_k, keys) and not torch.equal(ours_v, values)  # it did quantize
    # each channel of a group holds at most 2**bits levels
    assert all(ours_k[0, 0, :16, c].unique().numel() <= 2 ** bits for c in range(32))


def test_a_group_of_equal_values_is_held_exactly_and_only_held_tokens_are_grouped():
    keys = torch.ones(1, 1, 8, 8)
    values = torch.ones(1, 1, 8, 8)
    ours_k, ours_v = FORMAT.quantize_prompt(keys, values, torch.ones(1, 1, 8, dtype=torch.bool))
    assert torch.equal(ours_k, keys) and torch.equal(ours_v, values)  # KIVI's zero scale would give NaN
    keys = torch.randn(1, 1, 16, 8, generator=torch.Generator().manual_seed(0))
    held = torch.arange(16) % 2 == 0  # 8 held tokens: one group of them, the others untouched
    ours_k, _ = FORMAT.quantize_prompt(keys, keys.clone(), held[None, None])
    assert torch.equal(ours_k[..., ~held, :], keys[..., ~held, :])
    assert torch.equal(ours_k[..., held, :], kivi_keys(keys[..., held, :], 8, 4))


def test_generated_tokens_keep_kivis_full_precision_residual(model):
    """After 40 generated tokens with a residual of 16: the values of the last 16 and the keys of the unfinished
    block are the model's own (equal to an unquantized run's), every older one is quantized."""
    prompt = random_prompt(30)
    plain, quantized = ec.Full(), ec.Full()
    quantized.kv_format = FORMAT
    new = 40
    runs = {}
    for name, policy in (("plain", plain), ("quantized", quantized)):
        session = ec.CompressionSession(model, policy)
        last = session.prefill(prompt)[0]
        tokens = random_prompt(new, seed=9)[0].tolist()  # teacher forced: the same tokens either way
        for token in tokens[:-1]:
            session.step(torch.tensor([[token]]))
        runs[name] = session.cache.layers[0]
    del last
    keys, values = runs["quantized"].keys[0], runs["quantized"].values[0]
    plain_keys, plain_values = runs["plain"].keys[0], runs["plain"].values[0]
    seen = 30 + new - 1  # positions 0..68; generated from 30
    fresh_values = torch.arange(seen) > seen - 1 - 16
    complete = 30 + ((seen - 30) // 16) * 16  # generated keys before this are in complete blocks
    fresh_keys = torch.arange(seen) >= complete
    assert torch.equal(values[:, fresh_values], plain_values[:, fresh_values])
    assert not (values[:, ~fresh_values] == plain_values[:, ~fresh_values]).all(dim=-1).any()
    assert torch.equal(keys[:, fresh_keys], plain_keys[:, fresh_keys])
    assert not torch.equal(keys[:, 30:complete], plain_keys[:, 30:complete])


@pytest.mark.parametrize("make", [lambda: ec.SnapStream(capacity=64, window=8, sink=4, recent=16, kernel_size=5),
                                  lambda: ec.H2O(capacity=40, recent=10), lambda: ec.Full(),
                                  lambda: ec.RKV(capacity=64, window=4, interval=8, kernel_size=3)],
                         ids=["snapstream", "h2o", "full", "rkv"])
def test_the_engine_with_a_quantized_cache_gives_the_tokens_of_running_alone(model, make):
    policy = make()
    policy.kv_format = FORMAT
    prompts = [random_prompt(n, seed=s)[0] for s, n in ((1, 90), (2, 30), (3, 70))]
    engine = ec.Engine(model, policy, slots=2)
    done = engine.run([ec.Request(p, max_new_tokens=40) for p in prompts])
    for prompt, completion in zip(prompts, done):
        alone = ec.generate(model, prompt[None], policy, max_new_tokens=40)
        assert completion.tokens == alone.sequences[0, prompt.numel():].tolist()
        stats = completion.stats
        element, width = 4, 2 * 16  # float32; a token's key and value per head
        unquantized_peak = stats["peak_cache_tokens"] * 2 * 2 * width * element  # 2 layers, 2 KV heads
        assert stats["kv_bytes_peak"] < unquantized_peak  # priced as the format stores it
    first = ec.generate(model, prompts[0][None], policy, max_new_tokens=40)
    plain = ec.generate(model, prompts[0][None], make(), max_new_tokens=40)
    assert (first.logits - plain.logits).abs().max() > 1e-4  # the quantized cache changed what the model read


def test_kv_bytes_are_what_the_format_stores():
    fmt = ec.KVFormat(4, 32, 128)
    # a token of one head, 128 wide, bf16 scales: 128 bytes of codes, 8 + 8 bytes of value scale/min pairs and keys'
    assert fmt.token_bytes(128, 128, 2) == 128 + 2 * 2 * (4 + 4)
    # 1000 tokens of 8 heads: the last 128 per head at full precision
    full = 2 * 128 * 2
    assert fmt.held_bytes(8000, 8, 128, 128, 2) == 8000 * fmt.token_bytes(128, 128, 2) + 8 * 128 * (full - 160)
    assert ec.kv_format(16) is None and ec.kv_format(4) == ec.KVFormat(4)
    with pytest.raises(ValueError, match="kv_bits must be 2, 4, 8 or 16"):
        ec.KVFormat(3)
    with pytest.raises(ValueError, match="kv_residual must be a positive multiple of kv_group_size"):
        ec.KVFormat(4, 32, 48)


def test_the_simulator_prices_the_format_as_the_rows_do():
    """Llama-3.1-8B at a 32k-token cache of 4x: 4-bit KV (groups of 32, residual 128) holds 1/12.4 of the full cache
    per request once 128 generated tokens are held at full precision (1/14.5 with groups of 128: the scales and the
    residual are what keeps it from 1/16), 1/12.8 and 1/15.1 right after prefill (the kept prompt quantized whole);
    the deployment verdict fits a larger batch."""
    import dataclasses

    from evalkit import memory

    geometry = memory.resolve_model("llama31_8b")
    full = geometry.request_kv_bytes(32768, 1, "bf16")
    for group, decoding, prefilled in ((32, 12.4, 12.8), (128, 14.5, 15.06)):
        fmt = ec.KVFormat(4, group, 128)
        quantized = geometry.request_kv_bytes(32768, 300, "bf16", prompt_capacity=8192, cache_capacity=8192,
                                              kv_format=fmt)
        assert full / quantized == pytest.approx(decoding, rel=0.01)
        quantized = geometry.request_kv_bytes(32768, 1, "bf16", prompt_capacity=8192, kv_format=fmt)
        assert full / quantized == pytest.approx(prefilled, rel=0.01)
    deployment = memory.load_deployment("llama31_8b_tp1_128k")
    plain = memory.price(deployment, 32768)
    packed = memory.price(dataclasses.replace(deployment, kv_format=ec.KVFormat(4, 32, 128)), 32768)
    assert packed.kv == pytest.approx(plain.kv * 160 / 512) and packed.max_batch >= 3 * plain.max_batch


def test_a_run_with_kv_bits_quantizes_in_the_engine_and_prices_what_it_held(tmp_path):
    """`evalkit method=snapstream kv_bits=4 +budget=4x`: the rows say kv_bits=4, the bytes held are what the
    simulator predicted (a fixed-size cache: exactly), and less than the same run at 16 bits; kv_bits=16 is the
    unquantized run itself (the same config digest: it resumes, generating nothing)."""
    from helpers import evalkit

    from evalkit.results import read_table

    common = ["method=snapstream", "+budget=4x", "limit=4", "model.dtype=bfloat16", f"results_dir={tmp_path / 'r'}"]
    for extra in (["kv_bits=4", "kv_residual=32"], [], ["kv_bits=16"]):
        result = evalkit(*common, *extra, cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-2000:]
    assert "already has results" in result.stdout + result.stderr  # kv_bits=16: the run above
    samples = read_table(tmp_path / "r", "samples")
    quantized, plain = samples[samples["kv_bits"] == 4], samples[samples["kv_bits"].isna()]
    assert len(quantized) == len(plain) == 4
    assert (quantized["kv_bytes_peak"] == quantized["kv_bytes_predicted"]).all()
    assert (quantized["kv_bytes_peak"].to_numpy() < plain["kv_bytes_peak"].to_numpy()).all()
    assert (quantized["peak_cache_tokens"].to_numpy() == plain["peak_cache_tokens"].to_numpy()).all()
    assert set(quantized["kv_residual"]) == {32} and set(quantized["kv_group_size"]) == {32}


@pytest.mark.parametrize("extra, message", [
    (["kv_bits=3"], "kv_bits must be 2, 4, 8 or 16"),
    (["kv_bits=4", "compression_scope=context"], "kv_bits < 16 takes compression_scope=prompt"),
    (["kv_bits=4", "kv_group_size=24"], "kv_residual must be a positive multiple of kv_group_size"),
    (["kv_bits=4", "kv_group_size=0"], "kv_group_size must be a positive integer"),
])
def test_bad_kv_settings_are_one_line_config_errors(extra, message):
    from test_harness import composed

    from evalkit.core.errors import ConfigError
    from evalkit.run import validate

    with pytest.raises(ConfigError, match=message):
        validate(composed("method=snapstream", "+budget=4x", *extra), method_explicit=True)


def test_a_group_the_model_cannot_take_is_one_line_before_any_generation(tmp_path):
    from helpers import evalkit

    result = evalkit("method=snapstream", "+budget=4x", "limit=1", f"results_dir={tmp_path}", "kv_bits=4",
                     "kv_group_size=128", "kv_residual=128", cwd=tmp_path)
    assert result.returncode != 0 and "kv_group_size 128 must divide the head dimension 64" in result.stderr
    assert not (tmp_path / "samples").exists()


def test_the_quantizers_agree_bit_for_bit_with_the_shipped_records_of_kivis_and_transformers():
    """`benchmarks/parity_kivi.py` against its records of KIVI's own quant/new_pack.py outputs (float32 and float16,
    2/4/8 bits, keys and values) and of transformers' quanto layer (2/4 bits): every tensor identical."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    result = subprocess.run([sys.executable, str(root / "benchmarks" / "parity_kivi.py")], capture_output=True,
                            text=True, timeout=300, cwd=root)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith(("kivi ", "transformers "))]
    assert len(rows) == 12 + 8 and all(row[4] == "True" for row in rows), result.stdout
