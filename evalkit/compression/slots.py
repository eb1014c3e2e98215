"""The engine's static per-slot cache: ``[slots, kv_heads, slot_tokens, head_dim]`` per layer, written in place by
one decode step for every slot at once, and the decode step's attention over it (registered with transformers as
``evalkit_decode``)."""

from __future__ import annotations

import dataclasses

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicLayer
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from .cache import additive_mask, evict_after_step
from .layout import first_free, occupy, raised_peak
from .methods.base import Policy
from .model_spec import attention_sinks, cache_geometry, family_eager  # noqa: F401  (cache_geometry: also here)


def decode_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """sdpa for one query token per row, the query heads of a KV group packed as that group's queries (what
    transformers' sdpa does when not compiled). Compiled, transformers would copy the whole cache to every query
    head instead; this keeps the same arithmetic, compiled or not. A per-head layout masks each KV head by its own
    validity, and a decode-time eviction policy then frees the slots it names."""
    layer = ACTIVE_SLOTS[0].layers[module.layer_idx] if ACTIVE_SLOTS[0] is not None else None
    if layer is not None and layer.valid is not None:
        attention_mask = layer.valid[:, :, None, :]  # [B, Hkv, 1, T]: broadcast over the packed group queries
    groups = query.shape[1] // key.shape[1]
    batch, _, _, dim = query.shape
    sinks = attention_sinks(module)
    if sinks is not None:  # learned sinks (gpt-oss): the family's own eager attention
        mask = attention_mask.repeat_interleave(query.shape[1] // attention_mask.shape[1], dim=1)
        output, _ = family_eager(module, None)(module, query, key, value, additive_mask(mask, query.dtype),
                                               dropout=dropout, scaling=scaling, **kwargs)
    else:
        packed = query.reshape(batch, key.shape[1], groups, dim) if groups > 1 else query
        output = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=attention_mask,
                                                                  scale=scaling)
        output = output.reshape(batch, -1, 1, value.shape[-1]).transpose(1, 2).contiguous()
    if layer is not None and layer.valid is not None:
        layer.after_attention(query, key, scaling, sinks, value, module)
    return output, None


OUT_RING = 256  # columns of the engine's generated-token ring (at least 2 x (sync_every + 1))
ACTIVE_SLOTS: list = [None]  # the slot cache of the step running now (a plain list: compiled steps read it too)
DECODE_ATTENTION = "evalkit_decode"
AttentionInterface.register(DECODE_ATTENTION, decode_attention)
AttentionMaskInterface.register(DECODE_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


# -- the static per-slot cache ------------------------------------------------------------------------------------
class SlotLayer(DynamicLayer):
    is_compileable = True

    def __init__(self, step: dict, keys: torch.Tensor, values: torch.Tensor, heads: dict | None, policy: Policy,
                 rotary=None):
        super().__init__()
        # ``step``: this step's per-slot bookkeeping on this layer's device (see SlotCache).
        self.step, self.keys, self.values, self.policy = step, keys, values, policy
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        heads = heads or {}
        # Per-head layouts: validity, text positions, running scores, recent queries and peak per slot and KV head.
        self.valid, self.positions = heads.get("valid"), heads.get("positions")
        self.scores, self.queries, self.peak = heads.get("scores"), heads.get("queries"), heads.get("peak")
        self.rotary = rotary  # the model's rotary embedding: scorers re-applied while decoding read it

    def update(self, key_states, value_states, *args, **kwargs):
        # keys[row, :, write_slot[row]] = the row's new key: an in-place index_put_, which a compiled graph keeps
        # in place (a scatter_ there becomes a copy of the whole cache every step).
        step = self.step
        rows, heads = step["rows"], step["all_heads"]
        # The row's ring slot (row layouts), or each head's first free slot (per-head layouts): see .layout.
        slots = step["write_slot"][:, None] if self.valid is None else first_free(self.valid)  # [slots, kv_heads]
        self.keys.index_put_((rows, heads, slots), key_states[:, :, 0])
        self.values.index_put_((rows, heads, slots), value_states[:, :, 0])
        if self.valid is not None:
            occupy(self, (rows, heads, slots), step["position"][:, None])
            self.peak.copy_(raised_peak(self.peak, self.valid.sum(dim=-1), step["active"]))
        return self.keys, self.values

    def after_attention(self, query: torch.Tensor, keys: torch.Tensor, scaling: float, sinks=None, values=None,
                        module=None) -> None:
        """Hand this step's attention to a decode-time eviction policy and free the slots it names (in place)."""
        policy = self.policy
        if self.queries is not None:
            self.queries.copy_(torch.cat([self.queries[:, :, 1:], query], dim=2))
        if policy.evicts_while_decoding:
            evict_after_step(self, policy, query, keys, self.step["position"], self.step["steps"], scaling, sinks,
                             values=values, module=module, rotary=self.rotary)

    def get_seq_length(self) -> int:
        return self.keys.shape[-2]


class SlotCache(Cache):
    """``step``: per slot, where this step's token goes (``write_slot``, row layouts), its text ``position``, the
    tokens generated so far (``steps``) and whether it is ``active`` (``[slots]`` each, on the engine's device). A
    model spread over devices gets a mirror of them on every other layer device, refreshed by :meth:`sync` once per
    step: the caches never move."""

    def __init__(self, layers: list[tuple], policies: list[Policy], step: dict[str, torch.Tensor], rotary=None):
        super().__init__(layers=[])
        device = step["write_slot"].device
        step = {**step, "rows": torch.arange(len(step["write_slot"]), device=device)[:, None],  # [slots, 1]
                "all_heads": torch.arange(layers[0][0].shape[1], device=device)[None, :]}  # [1, kv_heads]
        self.mirrors = {device: step}
        for keys, _, _ in layers:
            if keys.device not in self.mirrors:
                self.mirrors[keys.device] = {name: tensor.to(keys.device) for name, tensor in step.items()}
        self.step = step
        self.layers = [SlotLayer(self.mirrors[keys.device], keys, values, heads, policy, rotary)
                       for (keys, values, heads), policy in zip(layers, policies)]

    def sync(self) -> None:
        """Copy this step's bookkeeping to the other layer devices (nothing to do on one device)."""
        for mirror in self.mirrors.values():
            if mirror is not self.step:
                for name in ("write_slot", "position", "steps", "active"):
                    mirror[name].copy_(self.step[name], non_blocking=True)

    def state_tensors(self) -> list[torch.Tensor]:
        return [tensor for mirror in self.mirrors.values() for tensor in mirror.values()]

    @property
    def is_compileable(self) -> bool:
        return True


@dataclasses.dataclass
class Resident:
    """Host-side record of the request a slot serves."""

    index: int
    request: object  # the engine's Request
    stats: dict
    written_at_start: int  # cache writes before the first decode step (to size a growing cache)
    held_at_start: int  # tokens the cache held after prefill
    limit: int  # most tokens the cache can hold (fixed + ring)
    ended_at_once: bool  # its first token ended it
    tokens: list[int] = dataclasses.field(default_factory=list)
    stop: object | None = None
    admitted_at: float = 0.0  # host clock when its first token was chosen (end of its admission)
