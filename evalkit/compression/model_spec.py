"""What evalkit assumes about a model, in one place: which attention it can hook, the kind of each layer (full or
sliding-window), the cache's geometry, learned attention sinks, the family's own eager attention, and the device of
each layer. A new model family that breaks an assumption breaks it here, with one line saying which."""

from __future__ import annotations

import functools
import inspect
import sys

import torch

from evalkit.core.attention_shape import attention_shape

SUPPORTED_ATTENTION = ("sdpa", "eager")
LAYER_KINDS = ("full_attention", "sliding_attention")


def layer_kinds(config) -> list[str]:
    """The kind of each decoder layer (``full_attention``, ``sliding_attention`` on hybrid models): the config's
    ``layer_types``, or every layer full."""
    return list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)


def cache_kwargs(model, cache) -> dict:
    """The keyword argument that hands a model call its KV cache: ``cache`` (transformers' current name) or, in
    releases from before the rename, ``past_key_values``."""
    return {_cache_keyword(type(model)): cache}


@functools.cache
def _cache_keyword(model_class) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def returned_cache(output):
    """The KV cache a model call returned, under either name."""
    return output["cache"] if "cache" in output else output.past_key_values


def rotary_embedding(model):
    """The model's rotary embedding (``rotary(x, position_ids) -> (cos, sin)``, on its decoder stack), or None. Where
    it takes a layer type (Gemma 3: global and sliding-window layers rotate by different bases), the global layers'
    rotation: the only layers compressed."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    rotary = getattr(decoder, "rotary_emb", None)
    if rotary is not None and "layer_type" in inspect.signature(rotary.forward).parameters:
        return functools.partial(rotary, layer_type="full_attention")
    return rotary


def attention_sinks(module) -> torch.Tensor | None:
    """The learned attention-sink logits of an attention module (gpt-oss: one per query head), else None."""
    return getattr(module, "sinks", None)


def family_eager(module, default):
    """The model family's own eager attention (gpt-oss adds its sinks, Gemma-2 its soft-capping), else Llama's."""
    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", default)


def attention_modules(model) -> list[torch.nn.Module]:
    """The model's attention modules, one per decoder layer (those with a ``layer_idx``), in layer order."""
    found = {}
    for module in model.modules():
        index = getattr(module, "layer_idx", None)
        if index is not None and index not in found and type(module).__name__.endswith("Attention"):
            found[index] = module
    return [found[i] for i in sorted(found)]


def layer_devices(model) -> list[torch.device]:
    """The device of each decoder layer's attention: one device, or several for a model loaded with a device map.
    Layers offloaded to ``meta``/disk are refused (their weights move in at every step; their cache would have no
    device)."""
    devices: dict[int, torch.device] = {}
    for module in attention_modules(model):
        parameter = next(module.parameters(), None)
        if parameter is not None:
            devices[module.layer_idx] = parameter.device
    offloaded = sorted(i for i, device in devices.items() if device.type == "meta")
    if offloaded:
        raise ValueError(f"layers {offloaded} are offloaded (their weights are on 'meta'); evalkit needs every layer "
                         "on a device: give device_map only GPUs and cpu, or more GPU memory (max_memory)")
    return [devices.get(i, model.device) for i in range(model.config.num_hidden_layers)]


def cache_geometry(config) -> tuple[tuple[int, int, int], int]:
    """((cached heads, key width, value width), query width) of a model's cache, read as the memory simulator reads it
    (:mod:`evalkit.core.attention_shape`), so that what it prices is what the engine allocates. A latent (MLA) cache holds
    one shared head: the compressed KV (``kv_lora_rank``) as keys and the shared RoPE key part as values, which
    attention expands to per-head keys of ``qk_nope_head_dim + qk_rope_head_dim``."""
    geometry = attention_shape(config)
    if geometry.attention == "mla":
        return (1, geometry.kv_lora_rank, geometry.qk_rope_head_dim), config.qk_nope_head_dim + geometry.qk_rope_head_dim
    return (geometry.kv_heads, geometry.head_dim, geometry.head_dim), geometry.head_dim


def check_hookable(model) -> None:
    """Fail before any compute if this model's attention cannot go through the hook."""
    config = model.config
    implementation = config._attn_implementation
    if implementation not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"attention implementation {implementation!r} cannot be compressed; load the model with "
            f"attn_implementation in {list(SUPPORTED_ATTENTION)}"
        )
    attention_modules = [m for m in model.modules() if type(m).__name__.endswith("Attention")]
    if not attention_modules or any(getattr(m, "layer_idx", None) is None for m in attention_modules):
        raise ValueError(f"{type(model).__name__} has no attention modules with a layer_idx; it cannot be hooked")
    layer_types = layer_kinds(config)
    unknown = sorted(set(layer_types) - set(LAYER_KINDS))
    if unknown:
        raise ValueError(
            f"{type(model).__name__} has {unknown} layers; evalkit compresses full-attention layers and keeps "
            "sliding-window layers as they are, and knows no other kind"
        )
    if "sliding_attention" in layer_types and not getattr(config, "sliding_window", None):
        raise ValueError(f"{type(model).__name__} has sliding-window layers but no sliding_window in its config")
    if implementation != "eager" and any(attention_sinks(m) is not None for m in attention_modules):
        raise ValueError(
            f"{type(model).__name__} has learned attention sinks, which sdpa does not compute; load it with "
            "attn_implementation='eager'"
        )
