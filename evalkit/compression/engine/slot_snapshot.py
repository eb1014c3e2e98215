"""A slot's row back into a session: what a chat's turn left in its slot (its prompt, its answer fed back, what the
method evicted or scored on the way), as the :class:`~evalkit.compression.session.CompressionSession` that continues
it, so that the next turn's tokens are prefilled on top as a session's are (``session.step``), then moved into the
slot again (:meth:`.SlotPool.admit` of a request over it).

The session is the one admission moved into the slot (same layers, layouts and policies, same prompt bookkeeping);
its tensors are replaced in place by copies of the slot's row, at the width the session itself would have grown to,
and its counters set from the slot's (text position, writes, decode steps). The slot must be read where the turn
ended, before any further step touches it (the engine looks after every step while it runs chats).
"""

from __future__ import annotations

import torch

from ..layout import HeadState, RowLayout
from .slot_cache import SlotLayer

CHAT_REFUSAL = "the engine runs a chat's turns in slots of dense keys and values"


def snapshot_refusal(pool) -> str | None:
    """Why the slots of ``pool`` cannot be copied back into a session (None: they can): packed quantized slots,
    ThinK's reduced prompt keys, or MiniCache's merged layers, which a session holds in a form of its own."""
    layers = pool.cache.layers if pool.cache is not None else []
    policies = [layout.policy for layout in pool.layouts]
    if any(policy.kv_format is not None for policy in policies):
        return f"{CHAT_REFUSAL}; a quantized KV format (kv_bits) is held otherwise"
    if pool.reduced is not None or any(type(layer) is not SlotLayer for layer in layers):
        return f"{CHAT_REFUSAL}; {pool.policy.name} holds its prompt keys at a reduced width"
    if any(hasattr(policy, "take_merged") for policy in policies):
        return f"{CHAT_REFUSAL}; {pool.policy.name} holds merged layers"
    return None


@torch.no_grad()
def copy_slot_into(pool, slot: int, session, fed_back: int) -> None:
    """Row ``slot`` of ``pool`` into ``session`` (the session admission moved into that slot), in place, after
    ``fed_back`` tokens were decoded into the slot (its answer but the last token)."""
    rows, state = pool.rows, session.state
    row_layout = isinstance(pool.layout, RowLayout)
    written = int(rows.written[slot])
    # a row layout's slots so far: its prompt's, then every write until the ring wraps
    row_width = max(state.slots, min(written, int(state.fixed[0]) + int(state.ring[0])))
    for layer, target in zip(pool.cache.layers, session.cache.layers):
        if target.packed is not None or target.key_channels is not None:
            raise ValueError(f"{CHAT_REFUSAL}; this session's layer {target.index} is held otherwise")
        if layer.heads is None:
            width = max(row_width, target.slot_count)
        else:
            held = layer.heads.valid[slot].any(dim=0).nonzero()
            width = max(target.slot_count, int(held.max()) + 1 if held.numel() else 0)
            target.heads = _head_state(layer.heads, slot, width, target.heads, fed_back)
        target.keys = layer.keys[slot:slot + 1, :, :width].clone()
        target.values = layer.values[slot:slot + 1, :, :width].clone()
        if layer.slot_states is not None:
            target.slot_states = [layer.slot_states[slot]]
    if row_layout:
        state.valid = rows.valid[slot:slot + 1, :row_width].clone()
        state.slot_pos = rows.slot_pos[slot:slot + 1, :row_width].clone()
        state.peak = torch.maximum(state.peak, state.valid.sum(dim=1).cpu())
    state.seq_len = rows.positions[slot].cpu().clone()
    state.written = rows.written[slot:slot + 1].cpu().clone()
    session.cache.decode_steps = int(rows.steps[slot]) - 1  # a row's steps count the one its next token takes


def _head_state(heads: HeadState, slot: int, width: int, before: HeadState, fed_back: int) -> HeadState:
    """Row ``slot`` of a slot layer's per-head state ``heads``, ``width`` slots wide, as a session's (``before``:
    the session's at admission, whose kept prompt stands; its query buffer filled by ``fed_back`` more)."""
    def row(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor[slot:slot + 1, :, :width].clone()

    queries = None
    if heads.queries is not None:  # a session's buffer holds the last queries it saw, up to the window
        count = min(heads.queries.shape[2], before.queries.shape[2] + fed_back)
        queries = heads.queries[slot:slot + 1, :, heads.queries.shape[2] - count:].clone()
    return HeadState(valid=row(heads.valid), positions=row(heads.positions), peak=heads.peak[slot:slot + 1].clone(),
                     kept_prompt=before.kept_prompt, scores=row(heads.scores), queries=queries)
