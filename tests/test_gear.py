"""GEAR against a float64 transcription of the official ``GEARLM/Simulated/compress_function.py`` (its ``.float()``
as ``.double()``, its ``.half()`` the identity): the reconstruction, the seeded power iteration, the cache a session
holds and the tokens it generates."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from baseline_reference import full_run
from conftest import VOCAB, tiny_model
from masked_reference import module_scaling
from transformers import DynamicCache
from zoo_reference import kept_snapkv_avg

import evalkit.compression as ec
from evalkit.compression.methods.gear import gear_one, power_iteration
from evalkit.compression.model_spec import cache_kwargs


def distinct_prompt(n: int = 90) -> torch.Tensor:
    return (3 + torch.randperm(VOCAB - 3, generator=torch.Generator().manual_seed(0))[:n])[None]


# -- the reference, transcribed ------------------------------------------------------------------------------------
def ref_cluster(x, levels):
    mx, mn = x.max(dim=-1)[0].unsqueeze(-1), x.min(dim=-1)[0].unsqueeze(-1)
    scale = (mx - mn) / levels
    return F.relu((x - mn) / scale).round_() * scale + mn


def ref_token_cluster(x, levels, group_size):  # fake_groupwise_token_asymmetric_quantization_cluster
    batch, heads, tokens, dim = x.shape
    flat = x.permute(0, 2, 1, 3).contiguous().view(batch, tokens, dim * heads)
    groups = flat.view(batch, tokens, dim * heads // group_size, group_size)
    return ref_cluster(groups, levels).view(batch, tokens, heads, dim).permute(0, 2, 1, 3)


def ref_channel_cluster(x, levels, group_size):  # fake_groupwise_channel_asymmetric_quantization_cluster
    batch, heads, tokens, dim = x.shape
    flat = x.permute(0, 2, 1, 3).contiguous().view(batch, tokens, heads * dim)
    groups = tokens // group_size
    fixed = flat[:, : groups * group_size].view(batch, groups, group_size, heads * dim)
    deq = ref_cluster(fixed.transpose(-1, -2), levels).transpose(-1, -2).reshape(batch, groups * group_size, -1)
    return torch.cat((deq, flat[:, groups * group_size:]), dim=1).view(batch, tokens, heads, dim).permute(0, 2, 1, 3)


def ref_sparse(x, bit, group_size, sparsity, keys):  # gears_channelQ / gears_tokenQ
    batch, heads, tokens, dim = x.shape
    k = int(int(batch * heads * tokens * dim * sparsity) / batch / tokens / 2)
    out = (x.permute(0, 1, 3, 2).contiguous().view(batch, dim * heads, tokens) if keys
           else x.permute(0, 2, 1, 3).contiguous().view(batch, tokens, dim * heads))
    small_v, small_i = torch.topk(out, k, dim=-1, largest=False)
    large_v, large_i = torch.topk(out, k, dim=-1, largest=True)
    avg = out.mean(dim=-1, keepdim=True).expand_as(out)
    out.scatter_(-1, small_i, avg.gather(-1, small_i))
    out.scatter_(-1, large_i, avg.gather(-1, large_i))
    if keys:
        out = ref_channel_cluster(out.view(batch, heads, dim, tokens).permute(0, 1, 3, 2), bit ** 2 - 1, group_size)
        out = out.permute(0, 1, 3, 2).contiguous().view(batch, dim * heads, tokens)
    else:
        out = ref_token_cluster(out.view(batch, tokens, heads, dim).permute(0, 2, 1, 3), bit ** 2 - 1, group_size)
        out = out.permute(0, 2, 1, 3).contiguous().view(batch, tokens, dim * heads)
    out.scatter_(-1, small_i, small_v)
    out.scatter_(-1, large_i, large_v)
    return (out.view(batch, heads, dim, tokens).permute(0, 1, 3, 2) if keys
            else out.view(batch, tokens, heads, dim).permute(0, 2, 1, 3))


def ref_power(x, loop, rank):  # fake_poweriteration_group, its draws from the global generator
    batch, d1, d2, d3 = x.shape
    p = torch.rand(batch, d1, d3, rank).double()
    torch.rand(batch, d1, d2, rank)
    for i in range(loop):
        if i == loop - 1:
            p = torch.linalg.qr(p).Q
        q = x @ p
        if i == loop - 1:
            q = torch.linalg.qr(q).Q
        p = torch.transpose(x, 2, 3) @ q
    return q @ torch.transpose(p, 2, 3)


def ref_gear(x, bit, group_size, sparsity, rank, loop, keys):  # gearslkivi_channelQ_new / gearslkivi_tokenQ_new
    x = x.double()
    cloned = x.clone()
    output = ref_sparse(x, bit, group_size, sparsity, keys)
    return output + ref_power(cloned - output, loop, rank)


# -- the functions ---------------------------------------------------------------------------------------------------
SHAPES = [(2, 40, 16, 2, 16, 0.02, 4, 3), (4, 64, 32, 4, 64, 0.1, 2, 1), (1, 37, 8, 2, 8, 0.25, 3, 2),
          (2, 24, 16, 4, 8, 0.0, 1, 3), (3, 50, 16, 2, 16, 0.5, 6, 2)]


@pytest.mark.parametrize("heads, tokens, dim, bits, group, ratio, rank, loop", SHAPES)
@pytest.mark.parametrize("keys", [True, False])
def test_reconstruction_equals_the_reference(heads, tokens, dim, bits, group, ratio, rank, loop, keys):
    x = torch.randn(heads, tokens, dim, generator=torch.Generator().manual_seed(tokens), dtype=torch.float64) * 3
    torch.manual_seed(7)
    expected = ref_gear(x[None].clone(), bits, group, ratio, rank, loop, keys)[0]  # it may write its input
    ours = gear_one(x, keys, bits, group, ratio, rank, loop, torch.Generator().manual_seed(7), torch.float64)
    torch.testing.assert_close(ours, expected, atol=1e-10, rtol=1e-10)
    assert (ours - x).abs().max() > 1e-3  # it compressed something
    torch.manual_seed(7)
    sparse = ref_sparse(x[None].clone(), bits, group, ratio, keys)[0]
    assert (ours - x).norm() < (sparse - x).norm()  # the low-rank part recovers part of the error


def test_seeded_power_iteration_is_the_references():
    error = torch.randn(3, 30, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    torch.manual_seed(11)
    expected = ref_power(error[None], 3, 4)[0]
    torch.testing.assert_close(power_iteration(error, 4, 3, torch.Generator().manual_seed(11)), expected,
                               atol=1e-12, rtol=1e-12)
    other = power_iteration(error, 4, 1, torch.Generator().manual_seed(12))
    assert not torch.allclose(other, power_iteration(error, 4, 1, torch.Generator().manual_seed(11)))


# -- in the cache ----------------------------------------------------------------------------------------------------
def build():
    return ec.GEAR.from_config(40, window=8, group_size=16, streaming_gap=16, outlier_ratio=0.2, rank=2, rankv=3)


def expected_cache(model, prompt, policy):
    run = full_run(model, prompt)
    kept = kept_snapkv_avg(run, 40, 8, 5, module_scaling(model))
    compressed = 40 - 40 % policy.streaming_gap
    cache = {}
    for layer, r in run.items():
        keys = torch.stack([r["key"][h, kept[layer][h]] for h in range(len(kept[layer]))])
        values = torch.stack([r["value"][h, kept[layer][h]] for h in range(len(kept[layer]))])
        torch.manual_seed(policy.seed + layer)
        for tensor, is_keys, rank in ((keys, True, policy.rank), (values, False, policy.rankv)):
            tensor[:, :compressed] = ref_gear(tensor[None, :, :compressed], policy.bits, policy.group_size,
                                              policy.outlier_ratio, rank, policy.loop, is_keys)[0]
        cache[layer] = (keys, values, r)
    return cache, kept


@pytest.fixture(scope="module")
def model64():
    return tiny_model("llama").double()


def test_the_cache_holds_the_references_reconstruction(model64):
    prompt, policy = distinct_prompt(), build()
    session = ec.CompressionSession(model64, policy)
    session.prefill(prompt)
    expected, kept = expected_cache(model64, prompt, policy)
    for index, layer in enumerate(session.cache.layers):
        keys, values, run = expected[index]
        torch.testing.assert_close(layer.keys[0], keys, atol=1e-6, rtol=1e-6)  # the run's keys differ by ~5e-8
        torch.testing.assert_close(layer.values[0], values, atol=1e-6, rtol=1e-6)
        own = torch.stack([run["value"][h, kept[index][h]] for h in range(len(kept[index]))])
        assert (layer.values[0] - own).abs().max() > 1e-3  # the kept values are not the originals
        torch.testing.assert_close(layer.values[0, :, 32:], own[:, 32:], atol=1e-6, rtol=1e-6)  # the exact tail
    # 32 tokens compressed, 8 exact; H*D = 32; 3 outliers each end: codes 64*32*2/8, outliers (6*32 + 6*32) * (2 + 4),
    # scales and minimums 2 * (2*32 + 32*2) * 2, the exact tail 2*8*32 * 2, factors 2 * (32 + 16) * (2 + 3) * 2
    assert policy.priced_bytes(40, 2, 16, 2) == 512 + 2304 + 512 + 1024 + 960  # above dense (5120) at this size
    dense = 2 * 4096 * 8 * 128 * 2  # a Llama-3-8B layer at 4096 kept tokens, fp16
    assert ec.GEAR(capacity=4096).priced_bytes(4096, 8, 128, 2) < 0.23 * dense


@torch.no_grad()
def test_generated_tokens_equal_a_replay_of_the_reconstructed_cache(model64):
    prompt, policy = distinct_prompt(), build()
    expected, _ = expected_cache(model64, prompt, policy)
    cache = DynamicCache(config=model64.config)
    out = model64(input_ids=prompt, **cache_kwargs(model64, cache), use_cache=True)
    for index, (keys, values, _) in expected.items():
        cache.layers[index].keys, cache.layers[index].values = keys[None].clone(), values[None].clone()
    tokens = [int(out.logits[0, -1].argmax())]
    for step in range(11):
        position = torch.tensor([[prompt.shape[1] + step]])
        out = model64(input_ids=torch.tensor([[tokens[-1]]]), position_ids=position,
                      **cache_kwargs(model64, cache), use_cache=True)
        tokens.append(int(out.logits[0, -1].argmax()))
    ours = ec.generate(model64, prompt, policy, max_new_tokens=12)
    assert ours.sequences[0, prompt.shape[1]:].tolist() == tokens
    full = ec.generate(model64, prompt, ec.Full(), max_new_tokens=12)
    assert full.sequences[0, prompt.shape[1]:].tolist() != tokens  # compressing changed the generation


def test_bad_settings_are_one_line(llama):
    with pytest.raises(ValueError, match="GEAR.bits must be 2 or 4"):
        ec.GEAR(capacity=128, bits=3)
    session = ec.CompressionSession(llama, ec.GEAR.from_config(40, window=8, group_size=48))
    with pytest.raises(ValueError, match=r"GEAR.group_size 48 must divide kv_heads \* head_dim = 32"):
        session.prefill(distinct_prompt())


def test_a_quantized_cache_is_refused_in_one_line():
    from test_harness import composed

    from evalkit.core.errors import ConfigError
    from evalkit.run import validate

    with pytest.raises(ConfigError, match="kv_bits < 16 does not combine with method=gear") as caught:
        validate(composed("method=gear", "+budget=tokens_4096", "kv_bits=4", "model=llama31_8b_instruct"))
    assert "\n" not in str(caught.value)
    policy = build()
    policy.kv_format = None
    assert policy.kv_format is None
