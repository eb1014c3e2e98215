"""Hybrid models (sliding-window and full-attention layers): the run's policy compresses the full-attention layers,
the sliding-window layers hold exactly the model's own window, and the statistics count every layer."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, random_prompt, tiny_model
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
)

import evalkit.compression as ec

WINDOW = 8


def tiny_gemma3(attn_implementation: str = "sdpa"):
    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                              sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"] * 2,
                              pad_token_id=0)
    config._attn_implementation = attn_implementation
    model = Gemma3ForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    return model


def tiny_gpt_oss():
    """gpt-oss: alternating sliding/full layers, learned attention sinks, a mixture of experts; eager attention."""
    torch.manual_seed(0)
    config = GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, max_position_embeddings=1024, sliding_window=WINDOW,
                          layer_types=["sliding_attention", "full_attention"], pad_token_id=0,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    config._attn_implementation = "eager"
    model = GptOssForCausalLM(config).eval()
    for layer in model.model.layers:  # sinks that matter (they start at zero)
        torch.nn.init.normal_(layer.self_attn.sinks, std=1.0)
    model.generation_config.eos_token_id = None
    return model


MODELS = {"gemma3": tiny_gemma3, "gpt_oss": tiny_gpt_oss}
SNAPSTREAM = dict(capacity=20, sink=2, window=4, kernel_size=3, recent=6)


@pytest.mark.parametrize("family", sorted(MODELS))
def test_full_matches_model_generate_and_sliding_layers_hold_the_window(family):
    model = MODELS[family]()
    prompt = random_prompt(30)
    out = ec.generate(model, prompt, ec.Full(), max_new_tokens=20)
    assert out.sequences.tolist() == model.generate(prompt, max_new_tokens=20, do_sample=False).tolist()
    stats = out.stats[0]
    full_layers = [i for i, kind in enumerate(model.config.layer_types) if kind == "full_attention"]
    assert stats["compressed_layers"] == full_layers
    # The model's own cache: the last window - 1 prompt tokens in sliding layers, everything in full layers.
    assert stats["kept_prompt_tokens"] == [30 if i in full_layers else WINDOW - 1 for i in range(len(model.config.layer_types))]
    # Every layer counts: sliding layers peak at the window, full layers at the whole sequence.
    expected_peak = sum(30 + 19 if i in full_layers else WINDOW for i in range(len(model.config.layer_types)))
    assert stats["peak_cache_tokens"] == pytest.approx(expected_peak / len(model.config.layer_types))


@pytest.mark.parametrize("family", sorted(MODELS))
def test_snapstream_compresses_only_the_full_attention_layers(family):
    model = MODELS[family]()
    prompt = random_prompt(40, seed=2)
    session = ec.CompressionSession(model, ec.SnapStream(**SNAPSTREAM))
    session.prefill(prompt)
    for kind, layer in zip(model.config.layer_types, session.cache.layers):
        if kind == "full_attention":  # the policy's prompt region: capacity - recent
            assert layer.heads is None and layer.keys.shape[-2] == 14
        else:  # the window: window - 1 prompt tokens valid, a slot free for the next token
            assert int(layer.heads.valid[0].sum(dim=-1).max()) == WINDOW - 1
    out = ec.generate(model, prompt, ec.SnapStream(**SNAPSTREAM), max_new_tokens=40)
    full = [i for i, kind in enumerate(model.config.layer_types) if kind == "full_attention"]
    assert out.stats[0]["compressed_layers"] == full
    assert out.stats[0]["peak_cache_tokens"] == pytest.approx((20 * len(full) + WINDOW * (len(model.config.layer_types) - len(full)))
                                                              / len(model.config.layer_types))


@pytest.mark.parametrize("family, name", [  # Gemma-3's cases are the slowest: the slow tier
    pytest.param(family, name, id=f"{name}-{family}", marks=pytest.mark.slow if family == "gemma3" else ())
    for name in ["snapstream", "h2o", "snapkv"] for family in sorted(MODELS)])
def test_roomy_budgets_equal_full_batches_equal_alone_and_the_engine_agrees(family, name):
    from test_compression import assert_batch_equals_alone, assert_engine_equals_alone

    model = MODELS[family]()
    build = {"snapstream": lambda c: ec.SnapStream(**{**SNAPSTREAM, "capacity": c}),
             "h2o": lambda c: ec.H2O(capacity=c, recent=4), "snapkv": lambda c: ec.SnapKV(capacity=c, window=4, kernel_size=3)}
    prompt = random_prompt(40, seed=2)
    full = ec.generate(model, prompt, ec.Full(), max_new_tokens=20)
    assert ec.generate(model, prompt, build[name](200), max_new_tokens=20).sequences.tolist() == full.sequences.tolist()
    policy = build[name](20)
    assert_batch_equals_alone(model, policy)
    assert_engine_equals_alone(model, policy)


def test_attention_sinks_without_eager_and_unknown_layer_kinds_are_refused_before_compute():
    model = tiny_gpt_oss()
    model.config._attn_implementation = "sdpa"
    with pytest.raises(ValueError, match="learned attention sinks, which sdpa does not compute"):
        ec.CompressionSession(model, ec.Full())
    llama = tiny_model("llama")
    llama.config.layer_types = ["chunked_attention", "full_attention"]
    with pytest.raises(ValueError, match=r"\['chunked_attention'\] layers; evalkit compresses full-attention layers"):
        ec.CompressionSession(llama, ec.Full())


def test_a_model_with_attention_sinks_loads_with_eager_attention(tmp_path):
    from evalkit.models import load_model
    from evalkit.models.train_tiny import build_tokenizer

    tiny_gpt_oss().save_pretrained(tmp_path)
    build_tokenizer().save_pretrained(tmp_path)
    model, _ = load_model(str(tmp_path), device="cpu")
    assert model.config._attn_implementation == "eager"
    ec.CompressionSession(model, ec.SnapStream(**SNAPSTREAM))  # accepted: the sinks are computed


def test_scores_see_the_attention_sinks_as_the_model_does():
    """gpt-oss' sink logits take a share of every query's softmax: the probabilities policies score with are the
    model's own attention weights, and SnapKV's ranking differs from one that ignores the sinks."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from evalkit.compression.kernels import attention_probabilities, snapkv_scores

    module = tiny_gpt_oss().model.layers[1].self_attn
    generator = torch.Generator().manual_seed(3)
    query, keys = torch.randn(1, 4, 12, 16, generator=generator), torch.randn(1, 2, 12, 16, generator=generator)
    causal = torch.ones(12, 12, dtype=torch.bool).tril()
    additive = torch.zeros(12, 12).masked_fill(~causal, float("-inf"))[None, None]
    _, weights = eager_attention_forward(module, query, keys, keys, additive, scaling=0.25)
    ours = attention_probabilities(query, keys, causal[None, None], 0.25, module.sinks.detach())
    torch.testing.assert_close(ours.reshape(1, 4, 12, 12), weights, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(attention_probabilities(query, keys, causal[None, None], 0.25).reshape(1, 4, 12, 12),
                              weights)
    with torch.no_grad():
        module.sinks.copy_(torch.tensor([6.0, -6.0, 0.0, 3.0]))  # heads of one group weighed differently
    valid = torch.ones(1, 12, dtype=torch.bool)
    seen = snapkv_scores(query[:, :, -4:], keys, valid, 0.25, 1, "max", "mean", module.sinks.detach())
    blind = snapkv_scores(query[:, :, -4:], keys, valid, 0.25, 1, "max", "mean")
    assert not torch.allclose(seen, blind)


def test_methods_that_read_pre_rope_states_rotate_as_the_global_layers_do():
    """Gemma 3's rotary embedding takes a layer type (global and sliding-window layers rotate by different bases):
    scorers that rotate queries or keys back (ExpectedAttention) use the global layers', the layers compressed."""
    from evalkit.compression.model_spec import rotary_embedding

    model = tiny_gemma3()
    states, positions = torch.randn(1, 5, 16), torch.arange(5)[None]
    cos, sin = rotary_embedding(model)(states, positions)
    global_cos, global_sin = model.model.rotary_emb(states, positions, "full_attention")
    assert torch.equal(cos, global_cos) and torch.equal(sin, global_sin)
    assert not torch.equal(cos, model.model.rotary_emb(states, positions, "sliding_attention")[0])
    prompt = random_prompt(40, seed=2)
    out = ec.generate(model, prompt, ec.policy_from_budget("expected_attention", "4x", 40), max_new_tokens=4)
    full = ec.generate(model, prompt, ec.Full(), max_new_tokens=4)
    assert out.sequences.shape == full.sequences.shape and out.stats[0]["peak_cache_tokens"] < full.stats[0][
        "peak_cache_tokens"]
