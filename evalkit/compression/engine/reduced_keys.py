"""The engine's slots under ThinK's key-channel pruning: each slot holds its prompt's keys at the reduced width with the
channels it keeps per KV head, as a session's layer does (:meth:`..cache.CompressedLayer.remove_channels`), and full-
width keys for the tokens after them.

Per layer: the prompt block ``keys`` ``[slots, kv_heads, P, C]`` (``P`` the policy's prompt capacity, ``C`` the
channels kept), ``key_channels`` ``[slots, kv_heads, C]``, ``later_keys`` ``[slots, kv_heads, S - P, D]`` and the values
``[slots, kv_heads, S, D]``. A request whose prompt kept fewer than ``P`` tokens leaves the rest of the block empty (not
valid): its later tokens start at slot ``P`` (:func:`shift_row`), so every slot's later keys have the same place. The
decode step narrows each slot's queries to its channels for the prompt block (:func:`..methods.think.attend_reduced`):
the logits of the session's removed channels, which are the zeroed keys' (kvpress).
"""

from __future__ import annotations

import dataclasses

import torch

from ..methods.base import UNBOUNDED, Policy
from ..model_spec import attention_modules, attention_sinks, cache_geometry


@dataclasses.dataclass
class ReducedKeys:
    """A layer's keys: the prompt block at reduced width, its channels, and the full-width block after it."""

    prompt: torch.Tensor  # [slots, kv_heads, P, C]
    channels: torch.Tensor  # [slots, kv_heads, C] long
    later: torch.Tensor  # [slots, kv_heads, S - P, D]

    @property
    def device(self) -> torch.device:
        return self.prompt.device

    @classmethod
    def empty(cls, slots: int, heads: int, slot_tokens: int, block: int, kept: int, dim: int, dtype,
              device) -> ReducedKeys:
        channels = torch.arange(kept, device=device).expand(slots, heads, kept).clone()
        return cls(torch.zeros(slots, heads, block, kept, dtype=dtype, device=device), channels,
                   torch.zeros(slots, heads, slot_tokens - block, dim, dtype=dtype, device=device))


def reduced_channels(model, policy: Policy, layer_policies: list[Policy]) -> int | None:
    """The key channels a KV head keeps where the engine's slots hold ThinK's prompt keys reduced, else None (full
    width, the pruned channels zero): where a session removes them (a row layout without a ring or a quantized format,
    plain softmax attention: no learned sinks, no soft-capping), on every layer, the method sized once (not per
    prompt)."""
    if (not getattr(policy, "remove_channels", False) or policy.per_head or policy.kv_format is not None
            or policy.evicts_while_decoding or policy.removed is not None
            or any(layer_policy is not policy for layer_policy in layer_policies)):
        return None
    if int(policy.decode_layout(torch.ones(1, dtype=torch.long))[1][0]) < UNBOUNDED:
        return None
    if any(attention_sinks(module) is not None or getattr(getattr(module, "config", None), "attn_logit_softcapping",
                                                          None) is not None for module in attention_modules(model)):
        return None
    (_, key_dim, _), _ = cache_geometry(model.config)
    kept = policy.kept_channel_count(key_dim)
    return kept if kept < key_dim else None


def load_slot(target, slot: int, source) -> tuple[int, int]:
    """Row 0 of a session's layer with removed channels into slot ``slot`` of the slots' layer ``target``: its prompt
    block's keys and channels, its later keys and its values (those after the prompt block at ``P`` on). Returns the
    prompt tokens kept and the tokens after them."""
    if getattr(source, "key_channels", None) is None:
        raise RuntimeError("an admitted request's layer kept its key channels; the engine's slots hold them removed")
    kept, later = source.keys.shape[-2], source.values.shape[-2] - source.keys.shape[-2]
    block = target.keys.shape[-2]
    if kept > block or block + later > target.values.shape[-2]:
        raise ValueError(f"a request needs {block + later} cache slots after prefill (its prompt's {kept} kept after "
                         f"a block of {block}), more than the {target.values.shape[-2]} reserved per slot (raise "
                         "slot_tokens)")
    target.keys[slot, :, :kept] = source.keys[0]
    target.key_channels[slot] = source.key_channels[0]
    target.later_keys[slot, :, :later] = source.later_keys[0, :, :later]
    target.values[slot, :, :kept] = source.values[0, :, :kept]
    target.values[slot, :, block:block + later] = source.values[0, :, kept:kept + later]
    target.prompt_kept[slot] = kept
    return kept, later


def shift_row(row, kept: int, later: int, block: int) -> None:
    """A slot's row (:class:`.slot_pool.SlotRows`, one row) as the session left it (its prompt's ``kept`` slots, then
    ``later`` tokens) with the later tokens moved to slot ``block`` on: the slots between are empty."""
    valid, slot_pos = row.valid[0].clone(), row.slot_pos[0].clone()
    row.valid[0, kept:], row.slot_pos[0, kept:] = False, -1
    row.valid[0, block:block + later] = valid[kept:kept + later]
    row.slot_pos[0, block:block + later] = slot_pos[kept:kept + later]
    row.written[0] += block - kept
