"""The attention hook: attention functions registered in transformers' ``AttentionInterface`` that delegate the
attention itself to the model's own implementation (sdpa or eager) and hand the session's cache what it needs: at the
end of prefill, the post-RoPE queries and the layer's keys (the policy scores them, the cache keeps its picks); while
decoding, each layer's mask and eviction from its layout (:mod:`.layout`).

The cache travels with the model call as the keyword argument ``evalkit_cache`` (transformers hands a forward's extra
keyword arguments down to every attention call): no global state, and a compiled step can read it.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from .kernels import attention_with_sums
from .layout import additive_mask
from .methods.think import attend_reduced
from .model_spec import attention_modules, attention_sinks, family_eager
from .prefill_store import LayerCall, RecordedPrefill

CACHE_ARGUMENT = "evalkit_cache"  # the model call's keyword argument that hands the attention its cache
MASK_CELLS = 1 << 22  # a later prefill chunk's attention: query rows per call so that its mask stays this small


def _later_chunk(cache, module, query, key, value, eager: bool) -> bool:
    """Whether this attention is a later chunk of a chunked prefill that :func:`chunk_attention` may compute: sdpa,
    a full-attention layer of a model with per-head keys (not a latent), no learned sinks."""
    return (cache is not None and cache.plan is not None and cache.plan.chunk_mode is not None
            and not eager and query.shape[2] < key.shape[2] and attention_sinks(module) is None
            and not getattr(module, "sliding_window", None) and query.shape[-1] == key.shape[-1] == value.shape[-1]
            and query.shape[1] % key.shape[1] == 0)


def chunk_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
    """Causal attention of a prefill chunk's queries (the last q of the n keys) over every key, a block of query rows
    at a time, each block's mask at most :data:`MASK_CELLS` cells (the chunk's own mask, q x n, is what would
    otherwise bound chunked prefill's memory: a 4k chunk at 32k tokens is 128M cells, 512 MB as sdpa's float mask).
    Returns ``[B, q, Hq, D]``, as transformers' sdpa attention does."""
    count, n = query.shape[2], key.shape[2]
    past = n - count
    rows = max(1, min(count, MASK_CELLS // n))
    blocks = []
    for begin in range(0, count, rows):
        end = min(count, begin + rows)
        visible = (torch.arange(past + end, device=query.device)[None, :]
                   <= torch.arange(past + begin, past + end, device=query.device)[:, None])
        blocks.append(torch.nn.functional.scaled_dot_product_attention(
            query[:, :, begin:end], key[:, :, : past + end], value[:, :, : past + end], attn_mask=visible[None, None],
            scale=scaling, enable_gqa=query.shape[1] != key.shape[1]))
    return torch.cat(blocks, dim=2).transpose(1, 2).contiguous()


def _fused_prefill(cache, module, query, key, value, eager: bool) -> bool:
    """Whether this attention is a whole unpadded prompt's, in a layer whose policy scores by attention sums and will
    compress it: :func:`attention_with_sums` then computes the output and the sums in one pass (sdpa models; a
    full-attention layer with per-head keys, no learned sinks)."""
    if cache is None or cache.plan is None or cache.plan.chunk_mode is not None or eager:
        return False
    plan, policy = cache.plan, cache.layer_policies[module.layer_idx]
    return (policy.sums_attention and plan.compress and query.shape[2] == key.shape[2] > 1
            and bool(plan.key_valid.all()) and attention_sinks(module) is None
            and not getattr(module, "sliding_window", None) and query.shape[-1] == key.shape[-1] == value.shape[-1]
            and query.shape[1] % key.shape[1] == 0 and module.layer_idx not in cache.compressed_layers)


def _hooked_attention(delegate, eager: bool):
    def attention(module, query, key, value, attention_mask, **kwargs):
        cache = kwargs.pop(CACHE_ARGUMENT, None)
        scaling = kwargs.get("scaling", module.scaling)
        if getattr(cache, "extra_pass", False):  # a policy's own pass after the prefill (.reconstruction)
            output = (family_eager(module, delegate) if eager else delegate)(module, query, key, value,
                                                                             attention_mask, **kwargs)
            cache.observe(module, query, key, value, scaling)
            return output
        if _later_chunk(cache, module, query, key, value, eager):
            output = chunk_attention(query, key, value, scaling)
            cache.prefill_attention(module.layer_idx, module, query, key, value, scaling)
            return output, None
        if _fused_prefill(cache, module, query, key, value, eager):
            _record(cache, module, query, key, value, scaling)
            output, sums = attention_with_sums(query, key, value, scaling)
            # The view then holds no queries: its sums are all of them (``prior_sums``), and nothing is recomputed.
            cache.compress_layer(module.layer_idx, module, query[:, :, :0], key, value, scaling, sums)
            return output, None
        decoding = cache is not None and cache.plan is None
        if decoding:  # the layer's layout masks the step (a per-head layout by each head's own validity)
            layer, step = cache.layers[module.layer_idx], cache.step.on(key.device)
            attention_mask = layer.layout.decode_mask(layer, step, attention_mask, query.shape[1],
                                                      query.dtype if eager else None)
            if layer.layout.policy.selects_while_decoding:
                attention_mask = _selected(layer, module, query, key, attention_mask, eager)
        forward = family_eager(module, delegate) if eager else delegate
        if decoding and layer.key_channels is not None:  # ThinK's reduced prompt keys, then full-width ones
            output = attend_reduced(query, key, layer.key_channels, layer.later_keys, value, attention_mask,
                                    scaling), None
        else:
            output = forward(module, query, key, value, attention_mask, **kwargs)
        if cache is not None and cache.plan is not None:
            _record(cache, module, query, key, value, scaling)
            cache.prefill_attention(module.layer_idx, module, query, key, value, scaling)
        elif decoding:
            layer.layout.after_attention(layer, step, query, key, value, scaling, attention_sinks(module), module)
        return output

    return attention


def _selected(layer, module, query, key, mask, eager: bool):
    """``mask`` (None: every slot; bool ``[B, 1 or H, q, S]``; additive under eager) narrowed to the slots the
    layer's policy lets this step read (:meth:`~.methods.base.Policy.decode_visible`, handed the layer's state per
    row)."""
    batch, slots = query.shape[0], key.shape[2]
    visible = (torch.ones(batch, 1, 1, slots, dtype=torch.bool, device=key.device) if mask is None
               else mask == 0 if eager else mask)
    chosen = layer.layout.policy.decode_visible(query, key, visible[:, :, -1], module.layer_idx, layer.slot_states)
    if chosen is None:
        return mask
    visible = visible & chosen[:, :, None]
    return additive_mask(visible, query.dtype) if eager else visible


def _record(cache, module, query, key, value, scaling: float) -> None:
    """Keep what this layer's prefill attention hands the cache, where the session records its prefill."""
    if cache.recording is not None:
        hidden = cache.layer_inputs.get(module.layer_idx)
        cache.recording.append(LayerCall(module.layer_idx, module, query, key, value, scaling,
                                         None if hidden is None else list(hidden)))


def replay(cache, recorded: RecordedPrefill, eager: bool) -> None:
    """A recorded prefill's layer calls into ``cache``, as the hook makes them (the fused attention-sum pass where
    this cache's policy takes it), without running the model."""
    for call in recorded.calls:
        key, value = cache.layers[call.layer_idx].update(call.key, call.value, call.layer_idx)
        if call.hidden is not None:
            cache.layer_inputs[call.layer_idx] = list(call.hidden)
        if _fused_prefill(cache, call.module, call.query, key, value, eager):
            _, sums = attention_with_sums(call.query, key, value, call.scaling)
            cache.compress_layer(call.layer_idx, call.module, call.query[:, :, :0], key, value, call.scaling, sums)
        else:
            cache.prefill_attention(call.layer_idx, call.module, call.query, key, value, call.scaling)


def _register_hooks() -> None:
    # Llama's eager attention is the one the Llama, Qwen2/3 and Mistral families share.
    from transformers.models.llama.modeling_llama import eager_attention_forward

    delegates = {"sdpa": sdpa_attention_forward, "eager": eager_attention_forward}
    for name, delegate in delegates.items():
        AttentionInterface.register(f"evalkit_{name}", _hooked_attention(delegate, eager=name == "eager"))
        AttentionMaskInterface.register(f"evalkit_{name}", ALL_MASK_ATTENTION_FUNCTIONS[name])


_register_hooks()


@contextlib.contextmanager
def attention_implementation(model, name: str | None):
    """Run the model's attention through the registered implementation ``name`` for the duration (None: leave it)."""
    original = model.config._attn_implementation
    if name is not None:
        model.config._attn_implementation = name
    try:
        yield
    finally:
        model.config._attn_implementation = original


def hooked(model):
    """Route the model's attention through the hook for the duration (each model call then hands it the cache as
    ``evalkit_cache``)."""
    return attention_implementation(model, f"evalkit_{model.config._attn_implementation}")


@contextlib.contextmanager
def recording_inputs(model, inputs: dict[int, list[torch.Tensor]], active: bool = True):
    """While active, append each attention layer's input hidden states to ``inputs[layer_idx]`` (a policy that
    scores tokens from them, as KVzap does, reads them in its view)."""
    if not active:
        yield
        return

    def record(module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        inputs.setdefault(module.layer_idx, []).append(hidden)

    handles = [module.register_forward_pre_hook(record, with_kwargs=True) for module in attention_modules(model)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        inputs.clear()
