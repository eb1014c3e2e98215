"""DeepSeek's latent (MLA) cache: every policy compresses the latent itself, exactly, and the memory saved is the
memory DeepSeek really uses."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import VOCAB, random_prompt, registered
from masked_reference import _RECORD, plain_snapkv_scores
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    DynamicCache,
)

import evalkit.compression as ec
from evalkit import memory
from evalkit.compression.model_spec import cache_kwargs

KV_LORA_RANK, ROPE = 16, 8


def tiny_deepseek(version: int = 3, attn_implementation: str = "sdpa"):
    """A tiny random DeepSeek with MLA and a mixture of experts (the first layer dense, then 4 routed experts)."""
    torch.manual_seed(0)
    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                 n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=KV_LORA_RANK, q_lora_rank=None,
                 qk_rope_head_dim=ROPE, qk_nope_head_dim=8, v_head_dim=16, max_position_embeddings=1024)
    if version == 3:
        config, model_cls = DeepseekV3Config(**shape, n_group=1, topk_group=1), DeepseekV3ForCausalLM
    else:
        config, model_cls = DeepseekV2Config(**shape), DeepseekV2ForCausalLM
    config._attn_implementation = attn_implementation
    model = model_cls(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


# Sized for a 50-token prompt where a method's defaults are not; every other registered method that works on a
# latent cache runs at capacity 20 with its defaults.
SMALL = {
    "cam": lambda: ec.CaM.from_config(40, interval=8),  # refuses a latent cache
    "snapkv": lambda: ec.SnapKV(capacity=20, window=6, kernel_size=5),
    "snapstream": lambda: ec.SnapStream(capacity=28, sink=3, window=6, kernel_size=5, recent=8),
    "streaming_llm": lambda: ec.StreamingLLM(sink=4, window=12),
    "h2o": lambda: ec.H2O(capacity=21, recent=6),
    "adakv": lambda: ec.AdaKV.from_config(20, window=4),
    "pyramidkv": lambda: ec.PyramidKV.from_config(20, window=6, kernel_size=5),
    "decoding_snapkv": lambda: ec.DecodingSnapKV.from_config(40, window=4, kernel_size=3, interval=8),
    "rkv": lambda: ec.RKV(capacity=40, window=4, interval=8, kernel_size=3),  # refuses a latent cache
    "snapkv_d": lambda: ec.SnapKVD(capacity=21, window=4, kernel_size=3),  # refuses a latent cache
    "raas": lambda: ec.RaaS(capacity=21),  # refuses a latent cache
    "per_layer": lambda: ec.PerLayer.from_config(20, window=4, kernel_size=5, weights=(1.5, 0.5)),
    "composed": lambda: ec.Composed(capacity=20, then={"name": "snapkv", "window": 4, "kernel_size": 5}),
    "chunkkv": lambda: ec.ChunkKV.from_config(20, window=4, kernel_size=5, chunk_length=5),
    "chunkwise": lambda: ec.ChunkWise.from_config(20, chunk_length=16, window=2, kernel_size=3),
    "criticalkv": lambda: ec.CriticalKV.from_config(20, window=4),
    "criticaladakv": lambda: ec.CriticalAdaKV.from_config(20, window=4),
    "entropy_gated_chunkkv": lambda: ec.EntropyGatedChunkKV.from_config(20, window=4),
    "prefill_decoding": lambda: ec.PrefillDecoding.from_config(40, window=4, kernel_size=3, interval=8,
                                                                prefill="knorm"),
    "key_rerotation": lambda: ec.KeyRerotation.from_config(20, window=4),  # refuse a latent cache
    "merging": lambda: ec.Merging.from_config(20, window=4),
    "gear": lambda: ec.GEAR.from_config(20, window=4),  # refuses a latent cache
    "think": lambda: ec.ThinK.from_config(20, window=4),
}
POLICIES = {name: SMALL.get(name) or registered(name, 20) for name in sorted(ec.POLICIES)
            if name != "full" and (SMALL.get(name) or registered(name, 20))().supports_latent}


@pytest.mark.parametrize("version", [2, 3])
def test_full_matches_model_generate(version):
    model = tiny_deepseek(version)
    prompt = random_prompt(40)
    ours = ec.generate(model, prompt, ec.Full(), max_new_tokens=20)
    assert ours.sequences.tolist() == model.generate(prompt, max_new_tokens=20, do_sample=False).tolist()


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_the_latent_tensors_shrink_and_a_roomy_budget_is_full(name):
    model = tiny_deepseek()
    policy = POLICIES[name]()
    prompt = random_prompt(50, seed=3)
    session = ec.CompressionSession(model, policy)
    session.prefill(prompt)
    for layer in session.cache.layers:  # one shared latent head: the compressed KV and the shared RoPE key
        assert layer.keys.shape[:2] == layer.values.shape[:2] == (1, 1)
        assert (layer.keys.shape[-1], layer.values.shape[-1]) == (KV_LORA_RANK, ROPE)
        assert layer.keys.shape[2] < 50
    roomy = ec.StreamingLLM(sink=4, window=200) if name == "streaming_llm" else dataclasses.replace(policy, capacity=200)
    full = ec.generate(model, prompt, ec.Full(), max_new_tokens=25)
    out = ec.generate(model, prompt, roomy, max_new_tokens=25)
    assert out.sequences.tolist() == full.sequences.tolist()
    torch.testing.assert_close(out.logits, full.logits, atol=2e-5, rtol=1e-5)


@torch.no_grad()
def test_snapkv_keeps_the_latents_of_the_tokens_all_heads_score_best():
    """SnapKV over a latent cache scores with every query head as one group (the mean over all heads of each head's
    pooled SnapKV score) and keeps those tokens' latents, as a plain computation says."""
    model = tiny_deepseek()
    policy = ec.SnapKV(capacity=20, window=6, kernel_size=5, pooling="max")
    prompt = random_prompt(50, seed=3)
    original = model.config._attn_implementation
    model.config._attn_implementation = "reference_masked"
    _RECORD.clear()
    full = DynamicCache(config=model.config)
    try:
        model(input_ids=prompt, **cache_kwargs(model, full), use_cache=True)
        records = {layer: (_RECORD["queries"][layer][0], _RECORD["keys"][layer][0]) for layer in _RECORD["queries"]}
    finally:
        model.config._attn_implementation = original
        _RECORD.clear()
    session = ec.CompressionSession(model, policy)
    session.prefill(prompt)
    for index, (query, keys) in records.items():
        scaling = model.model.layers[index].self_attn.scaling  # (qk_nope + qk_rope) ** -0.5
        scores = plain_snapkv_scores(query, keys, 6, 5, "max", "mean", scaling).mean(dim=0)
        best = sorted(range(44), key=lambda j: (-float(scores[j]), j))[:14]
        expected = sorted(best + list(range(44, 50)))
        latents = full.layers[index].keys[0, 0]  # [50, kv_lora_rank]
        torch.testing.assert_close(session.cache.layers[index].keys[0, 0], latents[expected])
        torch.testing.assert_close(session.cache.layers[index].values[0, 0], full.layers[index].values[0, 0][expected])


@pytest.mark.parametrize("name", ["snapstream", "h2o", "adakv"])
def test_batch_with_left_padding_equals_each_prompt_alone(name):
    from test_compression import assert_batch_equals_alone

    assert_batch_equals_alone(tiny_deepseek(), POLICIES[name]())


@pytest.mark.parametrize("name", ["snapstream", "h2o", "decoding_snapkv"])
def test_engine_on_a_latent_cache_gives_the_tokens_alone(name):
    from test_compression import assert_engine_equals_alone

    assert_engine_equals_alone(tiny_deepseek(), POLICIES[name](), lengths=(50, 17, 33, 61), new_tokens=30)


def test_cache_bytes_are_what_the_memory_checker_prices_for_mla():
    model = tiny_deepseek()
    session = ec.CompressionSession(model, ec.SnapStream(capacity=28, sink=3, window=6, kernel_size=5, recent=8))
    session.prefill(random_prompt(50, seed=3))
    held = sum(t.numel() * t.element_size() for layer in session.cache.layers for t in (layer.keys, layer.values))
    per_token = memory.kv_bytes_per_token(model.config, dtype="fp32")
    assert per_token == 2 * (KV_LORA_RANK + ROPE) * 4  # layers x (kv_lora_rank + rope) x 4 bytes, no per-head K/V
    assert held == 20 * per_token  # the 20 prompt tokens kept, in the latent geometry


def test_expected_attention_is_refused_on_a_latent_cache_with_the_reason():
    with pytest.raises(ValueError, match="latent .MLA. cache: its query statistics assume RoPE on the whole query"):
        ec.CompressionSession(tiny_deepseek(), ec.ExpectedAttention(capacity=20))
