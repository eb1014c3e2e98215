"""The engine's slots under a quantized KV format (``kv_bits``): each layer holds every slot packed, as a session's
layer holds one row (:mod:`..packed_kv`: codes in bytes, the keys' group tables, the values' scales and minima, the
full-precision residual), instead of dense keys and values.

Admission prefills a request alone, its session packs the kept prompt, and :func:`load_slot` writes that one row into
the slot's fields. A decode step dequantizes the layer's slots into a workspace the cache lends (one layer at a time),
writes the step's tokens there and in the residual, attends and quantizes what leaves the residual, as a session's
step does: the workspace holds exactly the dense format's values, so the tokens are the dense slots' bit for bit.

The keys' group tables are sized once per slot (:func:`table_entries`) so that decoding does not reallocate them: a
row's quantized tokens use at most ``ceil(S / G) + 4`` entries at once (its kept prompt's groups in slot order and its
generated tokens' groups in the order they were written, each cut at most twice by the ring and once at the prompt's
end), entry 0 is never handed out, and a completed block takes ``R / G`` new ones before its slots give theirs up.
A per-head layout whose policy evicts anywhere while decoding (H2O, TOVA) can leave more groups partly held; its
tables then grow, as a session's do.
"""

from __future__ import annotations

import math

import torch

from ..kv_format import KVFormat
from ..packed_kv import SLOT_FIELDS, PackedKV


def packs_slots(fmt: KVFormat | None, key_dim: int, value_dim: int) -> bool:
    """Whether a layer under ``fmt`` holds its slots packed: a quantized format whose codes fill whole bytes of the
    head's width (else its slots hold the dense format, as a session's layer does)."""
    return fmt is not None and key_dim == value_dim and key_dim % (8 // fmt.bits) == 0


def table_entries(fmt: KVFormat, slot_tokens: int) -> int:
    """Entries of a slot's key-group tables (module docstring: the bound decoding never outgrows in row layouts)."""
    return math.ceil(slot_tokens / fmt.group_size) + fmt.residual // fmt.group_size + 5


def empty_slots(fmt: KVFormat, slots: int, heads: int, slot_tokens: int, dim: int, dtype: torch.dtype,
                device) -> PackedKV:
    """Every slot empty: codes, scales and minima zero (an empty slot reads as a zero key and value, as the dense
    slots' do), no residual entry, tables of :func:`table_entries`."""
    cells = (slots, heads, slot_tokens)
    width, groups, entries = dim * fmt.bits // 8, dim // fmt.group_size, table_entries(fmt, slot_tokens)

    def zeros(*shape, dtype=dtype):
        return torch.zeros(*shape, dtype=dtype, device=device)

    residual = (slots, heads, fmt.residual + 1, dim)
    return PackedKV(fmt, key_codes=zeros(*cells, width, dtype=torch.uint8),
                    value_codes=zeros(*cells, width, dtype=torch.uint8), key_scale=zeros(slots, heads, entries, dim),
                    key_min=zeros(slots, heads, entries, dim), key_group=zeros(*cells, dtype=torch.int32),
                    value_scale=zeros(*cells, groups), value_min=zeros(*cells, groups), residual_keys=zeros(*residual),
                    residual_values=zeros(*residual),
                    residual_slot=torch.full(cells, -1, dtype=torch.int16, device=device),
                    key_fresh=zeros(*cells, dtype=torch.bool), value_fresh=zeros(*cells, dtype=torch.bool))


def load_slot(target: PackedKV, slot: int, source: PackedKV | None, used: int) -> None:
    """Row 0 of a session's packed layer ``source`` into slot ``slot`` of ``target``: its first ``used`` slots, its
    group tables and its residual; the rest of the slot empty."""
    if source is None:
        raise RuntimeError("an admitted request's layer was not packed; the engine's packed slots take packed layers")
    for name, fill in SLOT_FIELDS:
        field = getattr(target, name)[slot]
        field.fill_(fill)
        field[:, :used] = getattr(source, name)[0, :, :used]
    entries = source.key_scale.shape[2]
    if entries > target.key_scale.shape[2]:  # a question stepped on top completed blocks of its own
        _grow_tables(target, entries)
    for name in ("key_scale", "key_min"):
        table = getattr(target, name)[slot]
        table.zero_()
        table[:, :entries] = getattr(source, name)[0]
    target.residual_keys[slot] = source.residual_keys[0]
    target.residual_values[slot] = source.residual_values[0]


def grow_slots(packed: PackedKV, slot_tokens: int) -> None:
    """Under ``grow``: room for ``slot_tokens`` a slot, new slots empty, and tables of that size's bound."""
    packed.pad(slot_tokens)
    _grow_tables(packed, table_entries(packed.fmt, slot_tokens))


def _grow_tables(packed: PackedKV, entries: int) -> None:
    for name in ("key_scale", "key_min"):
        table = getattr(packed, name)
        extra = entries - table.shape[2]
        if extra > 0:
            setattr(packed, name, torch.cat([table, table.new_zeros(*table.shape[:2], extra, table.shape[3])], dim=2))
