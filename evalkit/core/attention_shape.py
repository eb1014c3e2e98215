"""A model's attention as its config declares it, read once for the two that need it: the engine, which allocates the
cache (:func:`evalkit.compression.model_spec.cache_geometry`), and the memory simulator, which prices it
(:func:`evalkit.memory.geometry.from_hf_config`), so that what one prices is what the other allocates. Needs neither
torch nor pandas."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    """``attention``: ``gqa`` (MHA is GQA with kv_heads = heads) or ``mla`` (one latent per token: ``kv_lora_rank``
    values and the shared RoPE key part, ``qk_rope_head_dim``)."""

    layers: int
    heads: int
    kv_heads: int | None = None
    head_dim: int | None = None
    attention: str = "gqa"
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None


def config_reader(config):
    """``get(key, default=None)`` over a transformers config object or its dict."""
    return config.get if isinstance(config, dict) else lambda key, default=None: getattr(config, key, default)


def attention_shape(config) -> AttentionShape:
    """The attention of a transformers config (object or dict): MLA when it has ``kv_lora_rank``."""
    get = config_reader(config)
    layers, heads = get("num_hidden_layers"), get("num_attention_heads")
    if get("kv_lora_rank"):
        return AttentionShape(layers, heads, attention="mla", kv_lora_rank=get("kv_lora_rank"),
                              qk_rope_head_dim=get("qk_rope_head_dim") or 0)
    head_dim = get("head_dim") or (get("hidden_size") // heads if get("hidden_size") and heads else None)
    return AttentionShape(layers, heads, kv_heads=get("num_key_value_heads") or heads, head_dim=head_dim)
