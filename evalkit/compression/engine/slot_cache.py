"""The engine's static per-slot cache: ``[slots, kv_heads, slot_tokens, head_dim]`` per layer (packed under
``kv_bits``, :class:`PackedSlotLayer`; ThinK's prompt keys reduced, :class:`ReducedSlotLayer`), written in place by
one decode step for every slot at once where each layer's layout says (:mod:`..layout`), and the decode step's
attention over it (registered with transformers as ``evalkit_decode``; the step hands it the cache as
``evalkit_cache``)."""

from __future__ import annotations

import weakref

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicLayer
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from ..attention import CACHE_ARGUMENT
from ..layout import DecodeStep, HeadLayout, HeadState, RowLayout, additive_mask, tensor_fields
from ..methods.think import attend_reduced
from ..model_spec import attention_sinks, family_eager
from ..packed_kv import PackedKV, PackedStorage
from .packed_slots import grow_slots
from .reduced_keys import ReducedKeys


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
    if getattr(layer, "key_channels", None) is not None:  # ThinK's reduced prompt keys (slots without sinks only)
        output = attend_reduced(query, key, layer.key_channels, layer.later_keys, value, attention_mask,
                                query.shape[-1] ** -0.5 if scaling is None else scaling)
    elif sinks is not None:  # learned sinks (gpt-oss): the family's own eager attention
        mask = (attention_mask.reshape(batch, query.shape[1], 1, -1) if chosen is not None else
                attention_mask.repeat_interleave(query.shape[1] // attention_mask.shape[1], dim=1))
        output, _ = family_eager(module, None)(module, query, key, value, additive_mask(mask, query.dtype),
                                               dropout=dropout, scaling=scaling, **kwargs)
    else:
        packed = query.reshape(batch, key.shape[1], groups, dim) if groups > 1 else query
        output = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=attention_mask,
                                                                  scale=scaling)
        output = output.reshape(batch, -1, 1, value.shape[-1]).transpose(1, 2).contiguous()
    after = _after_packed if isinstance(layer, PackedSlotLayer) else layer.layout.after_attention
    after(layer, layer.step, query, key, value, scaling, sinks, module)
    return output, None


@torch._dynamo.disable  # a packed layer's step ends outside the compiled graphs (its settling is host-side)
def _after_packed(layer, *args) -> None:
    layer.layout.after_attention(layer, *args)


DECODE_ATTENTION = "evalkit_decode"
AttentionInterface.register(DECODE_ATTENTION, decode_attention)
AttentionMaskInterface.register(DECODE_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


# -- the static per-slot cache ------------------------------------------------------------------------------------
class SlotLayer(DynamicLayer):
    """One layer of every slot: keys and values ``[slots, kv_heads, slot_tokens, D]``, a per-head layout's state
    ``heads``, written in place where its ``layout`` says."""

    is_compileable = True

    def __init__(self, step: DecodeStep, keys: torch.Tensor | None, values: torch.Tensor | None,
                 heads: HeadState | None, layout: RowLayout | HeadLayout, like: torch.Tensor | None = None):
        super().__init__()
        like = keys if like is None else like  # what the slots are made like: their count, dtype and device
        # ``step``: this step's per-slot inputs on this layer's device (see SlotCache).
        self.step, self.keys, self.values, self.heads, self.layout = step, keys, values, heads, layout
        # The policy's state per slot (``Policy.keeps_slot_state``; None: it keeps none), set at admission.
        self.slot_states = [None] * like.shape[0] if layout.policy.keeps_slot_state else None
        self.dtype, self.device, self.is_initialized = like.dtype, like.device, True

    def update(self, key_states, value_states, *args, **kwargs):
        self.layout.write(self, self.step, key_states, value_states)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.keys.shape[-2]

    @property
    def kv_heads(self) -> int:
        return self.keys.shape[1]

    def grow_to(self, slot_tokens: int) -> None:
        extra = slot_tokens - self.get_seq_length()
        self.keys = torch.nn.functional.pad(self.keys, (0, 0, 0, extra))
        self.values = torch.nn.functional.pad(self.values, (0, 0, 0, extra))

    def tensors(self) -> list[torch.Tensor]:
        """The tensors the slots' keys and values are held in."""
        return [self.keys, self.values]

    def nbytes(self) -> int:
        return sum(tensor.numel() * tensor.element_size() for tensor in self.tensors())


class PackedSlotLayer(PackedStorage, SlotLayer):
    """A layer whose slots are held packed under a quantized KV format (:mod:`.packed_slots`): ``keys`` and
    ``values`` read the workspace a decode step dequantizes them into (its cache lends it, one layer at a time)."""

    def __init__(self, step: DecodeStep, packed: PackedKV, heads: HeadState | None, layout: RowLayout | HeadLayout,
                 cache: SlotCache):
        SlotLayer.__init__(self, step, None, None, heads, layout, like=packed.residual_keys)
        self.packed, self._cache = packed, weakref.ref(cache)

    @property
    def cache(self) -> SlotCache:
        return self._cache()

    def update(self, key_states, value_states, *args, **kwargs):
        return _write_packed(self, key_states, value_states)

    def held_slots(self) -> torch.Tensor:
        if self.heads is not None:
            return self.heads.valid
        return self.cache.valid[:, None, : self.packed.slots].to(self.device, non_blocking=True)

    def get_seq_length(self) -> int:
        return self.packed.slots

    def grow_to(self, slot_tokens: int) -> None:
        grow_slots(self.packed, slot_tokens)

    def tensors(self) -> list[torch.Tensor]:
        return self.packed.tensors()

    def nbytes(self) -> int:
        return self.packed.nbytes()


@torch._dynamo.disable
def _write_packed(layer: PackedSlotLayer, key_states: torch.Tensor, value_states: torch.Tensor):
    """Dequantize ``layer``'s slots into its workspace and write the step's tokens there and in the residual. A slot
    whose tokens count for nothing (a finished request's, a free slot's: its position stands still) holds none in
    its residual: its next token, at the same position or a new slot of its head, would overrun it."""
    layer.open_step()
    layer.layout.write(layer, layer.step, key_states, value_states)
    idle = ~layer.step.active[:, None, None]
    layer.packed.key_fresh.masked_fill_(idle, False)
    layer.packed.value_fresh.masked_fill_(idle, False)
    return layer.workspace


class ReducedSlotLayer(SlotLayer):
    """A layer whose slots hold ThinK's prompt keys at the reduced width (:mod:`.reduced_keys`): ``keys`` the prompt
    block ``[slots, kv_heads, P, C]``, ``key_channels`` each slot's channels, ``later_keys`` the full-width keys of
    slots ``P`` on; ``prompt_kept`` each slot's prompt tokens in the block (host ints, for its bytes)."""

    def __init__(self, step: DecodeStep, keys: ReducedKeys, values: torch.Tensor, heads: HeadState | None,
                 layout: RowLayout | HeadLayout):
        SlotLayer.__init__(self, step, keys.prompt, values, heads, layout)
        self.key_channels, self.later_keys = keys.channels, keys.later
        self.prompt_kept = [0] * values.shape[0]

    def update(self, key_states, value_states, *args, **kwargs):
        """Values at their slots, keys at full width in ``later_keys`` (every written slot is ``P`` or later; a free
        slot's throwaway token goes to the first)."""
        batch, heads = key_states.shape[:2]
        rows = torch.arange(batch, device=self.device)[:, None, None]
        index = (rows, torch.arange(heads, device=self.device)[None, :, None], self.step.slots[:, None, :])
        self.values.index_put_(index, value_states)
        self.later_keys.index_put_((*index[:2], (index[2] - self.keys.shape[-2]).clamp(min=0)), key_states)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.values.shape[-2]

    def grow_to(self, slot_tokens: int) -> None:
        extra = slot_tokens - self.get_seq_length()
        self.later_keys = torch.nn.functional.pad(self.later_keys, (0, 0, 0, extra))
        self.values = torch.nn.functional.pad(self.values, (0, 0, 0, extra))

    def tensors(self) -> list[torch.Tensor]:
        return [self.keys, self.key_channels, self.later_keys, self.values]


class SlotCache(Cache):
    """``step``: per slot, this step's text position, the slot its token takes (row layouts), the tokens generated
    so far and whether it is active (on the engine's device). A model spread over devices gets a mirror of them on
    every other layer device, refreshed by :meth:`sync` once per step: the caches never move. ``valid``: the rows'
    valid slots ``[slots, slot_tokens]`` (a packed row-layout layer settles by them).

    Each of ``layers`` is ``(keys, values, heads)``: dense keys and values; a :class:`.PackedKV` of every slot (values
    None); or :class:`.ReducedKeys` and the values."""

    def __init__(self, layers: list[tuple], layouts: list[RowLayout | HeadLayout], step: DecodeStep,
                 valid: torch.Tensor):
        super().__init__(layers=[])
        self.step, self.valid = step, valid
        self.mirrors = {step.positions.device: step}
        for keys, _, _ in layers:
            if keys.device not in self.mirrors:
                self.mirrors[keys.device] = step.on(keys.device)
        self.layers = [self._layer(self.mirrors[keys.device], keys, values, heads, layout)
                       for (keys, values, heads), layout in zip(layers, layouts)]

    def _layer(self, step: DecodeStep, keys, values, heads, layout) -> SlotLayer:
        if isinstance(keys, PackedKV):
            return PackedSlotLayer(step, keys, heads, layout, self)
        if isinstance(keys, ReducedKeys):
            return ReducedSlotLayer(step, keys, values, heads, layout)
        return SlotLayer(step, keys, values, heads, layout)

    def sync(self) -> None:
        """Copy this step's inputs to the other layer devices (nothing to do on one device)."""
        for mirror in self.mirrors.values():
            if mirror is not self.step:
                for name, tensor in tensor_fields(self.step).items():
                    getattr(mirror, name).copy_(tensor, non_blocking=True)

    def state_tensors(self) -> list[torch.Tensor]:
        return [tensor for mirror in self.mirrors.values() for tensor in tensor_fields(mirror).values()]

    def nbytes(self) -> int:
        """Bytes the slots' keys and values take, read off their tensors: dense keys and values; a packed layer's
        storage (codes, tables, scales and minima, bookkeeping, residual, its room included); ThinK's reduced prompt
        keys, their channels and the full-width keys after them. The workspace a packed layer's step is dequantized
        into (one layer's slots, lent to each in turn) is the step's working memory, as activations are: not counted."""
        return sum(layer.nbytes() for layer in self.layers)

    @property
    def is_compileable(self) -> bool:
        return True
