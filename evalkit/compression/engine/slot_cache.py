"""The engine's static per-slot cache: ``[slots, kv_heads, slot_tokens, head_dim]`` per layer, written in place by
one decode step for every slot at once where each layer's layout says (:mod:`..layout`), and the decode step's
attention over it (registered with transformers as ``evalkit_decode``; the step hands it the cache as
``evalkit_cache``)."""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicLayer
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from ..attention import CACHE_ARGUMENT
from ..layout import DecodeStep, HeadLayout, HeadState, RowLayout, additive_mask, tensor_fields
from ..model_spec import attention_sinks, family_eager


def decode_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """sdpa for one query token per row, the query heads of a KV group packed as that group's queries (what
    transformers' sdpa does when not compiled). Compiled, transformers would copy the whole cache to every query
    head instead; this keeps the same arithmetic, compiled or not. A per-head layout masks each KV head by its own
    validity, and a decode-time eviction policy then frees the slots it names."""
    layer = kwargs.pop(CACHE_ARGUMENT).layers[module.layer_idx]
    attention_mask = layer.layout.packed_mask(layer, attention_mask)
    groups = query.shape[1] // key.shape[1]
    batch, _, _, dim = query.shape
    chosen = layer.layout.policy.decode_visible(query, key, attention_mask[:, :, -1], module.layer_idx,
                                                layer.slot_states)
    if chosen is not None:  # the slots the policy lets this step read (Quest), per query head: [B, Hkv, G, S]
        attention_mask = attention_mask & chosen.view(batch, key.shape[1], groups, -1)
    sinks = attention_sinks(module)
    if sinks is not None:  # learned sinks (gpt-oss): the family's own eager attention
        mask = (attention_mask.reshape(batch, query.shape[1], 1, -1) if chosen is not None else
                attention_mask.repeat_interleave(query.shape[1] // attention_mask.shape[1], dim=1))
        output, _ = family_eager(module, None)(module, query, key, value, additive_mask(mask, query.dtype),
                                               dropout=dropout, scaling=scaling, **kwargs)
    else:
        packed = query.reshape(batch, key.shape[1], groups, dim) if groups > 1 else query
        output = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=attention_mask,
                                                                  scale=scaling)
        output = output.reshape(batch, -1, 1, value.shape[-1]).transpose(1, 2).contiguous()
    layer.layout.after_attention(layer, layer.step, query, key, value, scaling, sinks, module)
    return output, None


DECODE_ATTENTION = "evalkit_decode"
AttentionInterface.register(DECODE_ATTENTION, decode_attention)
AttentionMaskInterface.register(DECODE_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


# -- the static per-slot cache ------------------------------------------------------------------------------------
class SlotLayer(DynamicLayer):
    """One layer of every slot: keys and values ``[slots, kv_heads, slot_tokens, D]``, a per-head layout's state
    ``heads``, written in place where its ``layout`` says."""

    is_compileable = True

    def __init__(self, step: DecodeStep, keys: torch.Tensor, values: torch.Tensor, heads: HeadState | None,
                 layout: RowLayout | HeadLayout):
        super().__init__()
        # ``step``: this step's per-slot inputs on this layer's device (see SlotCache).
        self.step, self.keys, self.values, self.heads, self.layout = step, keys, values, heads, layout
        # The policy's state per slot (``Policy.keeps_slot_state``; None: it keeps none), set at admission.
        self.slot_states = [None] * keys.shape[0] if layout.policy.keeps_slot_state else None
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True

    def update(self, key_states, value_states, *args, **kwargs):
        self.layout.write(self, self.step, key_states, value_states)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.keys.shape[-2]


class SlotCache(Cache):
    """``step``: per slot, this step's text position, the slot its token takes (row layouts), the tokens generated
    so far and whether it is active (on the engine's device). A model spread over devices gets a mirror of them on
    every other layer device, refreshed by :meth:`sync` once per step: the caches never move."""

    def __init__(self, layers: list[tuple], layouts: list[RowLayout | HeadLayout], step: DecodeStep):
        super().__init__(layers=[])
        self.step = step
        self.mirrors = {step.positions.device: step}
        for keys, _, _ in layers:
            if keys.device not in self.mirrors:
                self.mirrors[keys.device] = step.on(keys.device)
        self.layers = [SlotLayer(self.mirrors[keys.device], keys, values, heads, layout)
                       for (keys, values, heads), layout in zip(layers, layouts)]

    def sync(self) -> None:
        """Copy this step's inputs to the other layer devices (nothing to do on one device)."""
        for mirror in self.mirrors.values():
            if mirror is not self.step:
                for name, tensor in tensor_fields(self.step).items():
                    getattr(mirror, name).copy_(tensor, non_blocking=True)

    def state_tensors(self) -> list[torch.Tensor]:
        return [tensor for mirror in self.mirrors.values() for tensor in tensor_fields(mirror).values()]

    @property
    def is_compileable(self) -> bool:
        return True
