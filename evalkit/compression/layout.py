"""Where tokens go in a cache, for the session's cache (:mod:`.cache`) and the engine's per-slot cache
(:mod:`.engine.slot_cache`) alike, so that a token lands in the same slot either way (the engine-equals-alone tests
hold them to it). Each layer gets one layout, chosen once from its policy (:func:`layout_of`):

* :class:`RowLayout`: every KV head of a row holds the same slots; the first ``fixed`` slots are never overwritten,
  then a ring of ``ring`` slots is written oldest first (the row's bookkeeping is shared by all such layers);
* :class:`HeadLayout` (policies with ``per_head``): each layer keeps the validity and text position of every slot per
  KV head (:class:`HeadState`), a new token takes each head's first free slot, the layer masks its own attention and
  a decode-time eviction policy frees slots after it.

The peak is the most tokens a row (or head) held at once, counted for active rows only. Everything a decode step
calls is shape-static (no host sync), so a compiled step can call it.
"""

from __future__ import annotations

import dataclasses

import torch

from .kernels import attention_probabilities, slots_visible
from .methods.base import UNBOUNDED, Policy
from .views import DecodeView


def ring_slot(index: torch.Tensor, fixed: torch.Tensor, ring: torch.Tensor) -> torch.Tensor:
    """The slot of the ``index``-th write (counting from 0, wrapped writes included) of a row with ``fixed`` slots
    kept and a ring of ``ring`` after them; the arguments broadcast."""
    return torch.where(index < fixed, index, fixed + (index - fixed) % ring)


def first_free(valid: torch.Tensor, count: int) -> torch.Tensor:
    """Each head's first ``count`` free slots in slot order, ``[..., heads, count]`` of ``valid [..., heads, slots]``
    (slot 0 where a head has none: callers check). One slot is an argmax, cheaper than the sort."""
    if count == 1:
        return (~valid).to(torch.uint8).argmax(dim=-1, keepdim=True)
    return valid.to(torch.uint8).argsort(dim=-1, stable=True)[..., :count]


def raised_peak(peak: torch.Tensor, held: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """``peak`` raised to ``held`` where the row is ``active`` (``active [B]`` broadcast over trailing head axes)."""
    active = active.reshape(active.shape + (1,) * (peak.dim() - active.dim()))
    return torch.where(active, torch.maximum(peak, held), peak)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask (True: attend) as the additive float mask eager attention takes."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


def put_tokens(layer, slots: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple:
    """keys/values[b, h, slots[b, h, i]] = the i-th new token's (``slots`` broadcast over heads; key and value widths
    may differ: MLA latents). An in-place ``index_put_``, which a compiled graph keeps in place (a ``scatter_`` there
    becomes a copy of the whole cache every step). Returns the index written, ``(rows, heads, slots)``."""
    batch, heads = key_states.shape[:2]
    index = (torch.arange(batch, device=slots.device)[:, None, None],
             torch.arange(heads, device=slots.device)[None, :, None], slots)
    layer.keys.index_put_(index, key_states)
    layer.values.index_put_(index, value_states)
    return index


def tensor_fields(state) -> dict[str, torch.Tensor]:
    """The tensors a dataclass of state holds, by field name (fields left None skipped)."""
    return {f.name: getattr(state, f.name) for f in dataclasses.fields(state)
            if isinstance(getattr(state, f.name), torch.Tensor)}


@dataclasses.dataclass
class DecodeStep:
    """One decode step's per-row inputs, on one device: what the layouts read while the model runs."""

    positions: torch.Tensor  # [B, q] long: text positions of this step's tokens
    steps: torch.Tensor  # [B] long: decode steps each row has taken, this one included
    active: torch.Tensor  # [B] bool: rows whose tokens count in the statistics (finished rows still run)
    slots: torch.Tensor | None = None  # [B, q] long: the slot each token takes in row layouts
    all_visible: bool = False  # one new token per row that sees every slot: row layouts need no mask
    # [B, slots] long: row layouts' text position of each slot's token written after prefill (-1: a prompt slot)
    slot_positions: torch.Tensor | None = None

    def on(self, device: torch.device) -> DecodeStep:
        """This step on ``device`` (a model spread over devices keeps each layer's cache on that layer's device; the
        step goes to it, never the cache)."""
        if self.positions.device == device:
            return self
        moved = {name: tensor.to(device, non_blocking=True) for name, tensor in tensor_fields(self).items()}
        return dataclasses.replace(self, **moved)


@dataclasses.dataclass
class HeadState:
    """Per-layer, per-KV-head bookkeeping of a :class:`HeadLayout`: ``[B, Hkv, slots]`` (the engine: ``[slots, Hkv,
    slot_tokens]``), on the layer's device."""

    valid: torch.Tensor  # [B, Hkv, slots] bool
    positions: torch.Tensor  # [B, Hkv, slots] long: text position of the slot's token; -1 when empty
    peak: torch.Tensor  # [B, Hkv] most tokens held at once
    kept_prompt: torch.Tensor | None = None  # [B, Hkv] prompt tokens kept after prefill (the session's)
    scores: torch.Tensor | None = None  # [B, Hkv, slots] running score of an accumulating policy (H2O)
    queries: torch.Tensor | None = None  # [B, Hq, w, D] the last w queries (a policy's ``query_window``)

    def pad_to(self, slots: int) -> None:
        extra = slots - self.valid.shape[-1]
        if extra > 0:
            self.valid = torch.nn.functional.pad(self.valid, (0, extra), value=False)
            self.positions = torch.nn.functional.pad(self.positions, (0, extra), value=-1)
            if self.scores is not None:
                self.scores = torch.nn.functional.pad(self.scores, (0, extra))

    def occupy(self, index: tuple[torch.Tensor, ...], positions: torch.Tensor) -> None:
        """Mark the slots ``index`` (``(rows, heads, slots)``, the slots ``[B, Hkv, count]``) as holding new tokens at
        text ``positions`` (broadcast like the slots): valid, their positions set, their running score (if any) zero."""
        slots = index[-1]
        self.valid.index_put_(index, torch.ones_like(slots, dtype=torch.bool))
        self.positions.index_put_(index, positions.expand_as(slots))
        if self.scores is not None:
            self.scores.index_put_(index, torch.zeros_like(slots, dtype=self.scores.dtype))

    def free(self, freed: torch.Tensor) -> None:
        """Free the slots ``freed`` ``[B, Hkv, slots]`` (bool), in place."""
        freed = freed & self.valid
        self.valid.logical_and_(~freed)
        self.positions.masked_fill_(freed, -1)
        if self.scores is not None:
            self.scores.masked_fill_(freed, 0.0)

    def remember(self, query: torch.Tensor, window: int) -> None:
        """Keep the last ``window`` queries (in place once the buffer is full: a compiled step's buffers stay put)."""
        recent = torch.cat([self.queries, query], dim=2)[:, :, -window:]
        if recent.shape == self.queries.shape:
            self.queries.copy_(recent)
        else:
            self.queries = recent

    def load(self, slot: int, source: HeadState, used: int) -> None:
        """Copy row 0 of ``source`` (a session's layer) into row ``slot``, its first ``used`` slots; the rest empty."""
        for name, empty in (("valid", False), ("positions", -1), ("scores", 0.0)):
            target = getattr(self, name)
            if target is not None:
                target[slot] = empty
                target[slot, :, :used] = getattr(source, name)[0, :, :used]
        self.peak[slot] = source.peak[0]
        if self.queries is not None:  # the most recent last, as remember() keeps them: a short prompt's fill the end
            recent = source.queries[0, :, -self.queries.shape[2]:]
            self.queries[slot] = 0
            self.queries[slot, :, self.queries.shape[2] - recent.shape[1]:] = recent


class RowLayout:
    """Every KV head of a row holds the same slots: the first ``fixed`` are never overwritten, then a ring is written
    oldest first (:class:`.cache.RowState`, shared by all the row-layout layers, picks the slot)."""

    per_head = False

    def __init__(self, policy: Policy):
        self.policy = policy

    # -- the session's cache ---------------------------------------------------------------------------------------
    def row_plan(self, cache, real_len: torch.Tensor, keep: int, head_slots: int):
        """After prefill: the row's slots, and per row its kept prompt tokens, fixed slots and ring size."""
        kept = torch.minimum(real_len, torch.tensor(keep, device=real_len.device)).cpu()
        return keep, kept, *self.policy.decode_layout(kept)

    def wraps(self, state, count: int) -> bool:
        return state.wraps(count)

    def advance(self, state, count: int, active: torch.Tensor):
        """Reserve the next ``count`` slots of every row: ``(slots, mask, all_visible)`` (see :meth:`RowState.plan`)."""
        return state.plan(count, active)

    def slots_needed(self, layer, count: int, row_slots: int) -> int:
        return row_slots

    def after_compress(self, cache, layer_idx: int, view, query, indices, counts, raw) -> None:
        cache.write_through(layer_idx)

    def realized(self, layer, row: int, state, prefill_slots: int) -> tuple[list[int], float]:
        """Prompt tokens kept per KV head, and the most tokens held at once."""
        count = min(int(state.kept_prompt[row]), prefill_slots)
        return [count] * layer.keys.shape[1], float(state.peak[row])

    # -- both caches -------------------------------------------------------------------------------------------------
    def write(self, layer, step: DecodeStep, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        hold_packed(layer, put_tokens(layer, step.slots[:, None, :], key_states, value_states), step, key_states,
                    value_states)

    def decode_mask(self, layer, step: DecodeStep, mask, query_heads: int, dtype):
        """The layer's attention mask: the row mask the model was given (none where every slot is visible)."""
        return None if step.all_visible else mask

    def packed_mask(self, layer, mask: torch.Tensor) -> torch.Tensor:
        """The mask of the engine's packed-group attention: the row mask."""
        return mask

    def after_attention(self, layer, step: DecodeStep, query, keys, values, scaling: float, sinks, module) -> None:
        settle_format(layer, self.policy, step.slot_positions[:, None, : layer.get_seq_length()], step)

    # -- the engine's slots ------------------------------------------------------------------------------------------
    def allocate(self, rows: int, kv_heads: int, size: int, query_shape: tuple[int, int], dtype, device):
        return None

    def used(self, layer) -> int:
        """Slots a session's layer uses (what admission copies; reduced prompt keys widened to the slots' width)."""
        if getattr(layer, "key_channels", None) is not None:
            layer.widen()
        return layer.get_seq_length()

    def load(self, target, slot: int, source, used: int) -> None:
        return None

    def slot_row(self, state, width: int) -> tuple[torch.Tensor, int, int]:
        """A slot's row bookkeeping from a session's row 0: its valid slots ``[width]``, fixed slots and ring."""
        valid = torch.zeros(width, dtype=torch.bool, device=state.valid.device)
        valid[: state.slots] = state.valid[0]
        return valid, int(state.fixed[0]), int(state.ring[0])

    def held(self, layer, slot: int, row_peak: int) -> tuple[float, int]:
        """The most tokens a slot held at once: the mean per KV head, and the sum over KV heads."""
        return row_peak, row_peak * layer.kv_heads


class HeadLayout:
    """Each KV head keeps its own valid slots and their text positions (:class:`HeadState`): heads and layers may
    hold different numbers of tokens (PyramidKV, AdaKV: the slot axis is padded to the largest head) and free
    different slots while decoding (H2O, TOVA, SnapKV re-applied)."""

    per_head = True

    def __init__(self, policy: Policy, rotary=None):
        self.policy, self.rotary = policy, rotary

    # -- the session's cache ---------------------------------------------------------------------------------------
    def row_plan(self, cache, real_len: torch.Tensor, keep: int, head_slots: int):
        """After prefill the row only counts tokens and positions: every layer's slots, its most kept tokens."""
        kept = torch.stack([layer.heads.kept_prompt.amax(dim=1).cpu() for layer in cache.layers]).amax(dim=0)
        return head_slots, kept, kept.clone(), torch.full_like(kept, UNBOUNDED)

    def wraps(self, state, count: int) -> bool:
        return False

    def advance(self, state, count: int, active: torch.Tensor):
        state.seq_len += count
        state.written += count
        return None, None, False

    def slots_needed(self, layer, count: int, row_slots: int) -> int:
        """The layer's slots once every head has ``count`` free ones (growing by at least 64 at a time)."""
        shortfall = count - int((~layer.heads.valid).sum(dim=-1).min())
        if shortfall <= 0:
            return layer.slot_count
        if self.policy.cache_capacity() is not None:
            raise RuntimeError(f"{self.policy.name} left no free slot in a full cache; its eviction is broken")
        return layer.slot_count + max(shortfall, 64)

    def after_compress(self, cache, layer_idx: int, view, query, indices, counts, raw) -> None:
        """The compressed layer's validity and text positions per head (kept tokens first, then empty slots)."""
        kept = torch.arange(indices.shape[-1], device=indices.device) < counts[..., None]
        positions = view.positions[:, None, :].expand(-1, indices.shape[1], -1).gather(2, indices)
        heads = HeadState(valid=kept, positions=positions.masked_fill(~kept, -1), peak=counts.clone(),
                          kept_prompt=counts)
        if self.policy.accumulates:
            heads.scores = raw.gather(2, indices).masked_fill(~kept, 0.0)
        window = self.policy.query_window()
        if window:
            heads.queries = query[:, :, -window:]
        cache.layers[layer_idx].heads = heads
        if self.policy.evicts_while_decoding and self.policy.reads_hidden_states and view.module is not None:
            hand_decode_inputs(view.module)

    def realized(self, layer, row: int, state, prefill_slots: int) -> tuple[list[int], float]:
        return layer.heads.kept_prompt[row].tolist(), float(layer.heads.peak[row].float().mean())

    # -- both caches -------------------------------------------------------------------------------------------------
    def write(self, layer, step: DecodeStep, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Each head's new tokens go to its first free slots."""
        heads = layer.heads
        index = put_tokens(layer, first_free(heads.valid, key_states.shape[2]), key_states, value_states)
        hold_packed(layer, index, step, key_states, value_states)
        heads.occupy(index, step.positions[:, None, :])
        heads.peak.copy_(raised_peak(heads.peak, heads.valid.sum(dim=-1), step.active))

    def decode_mask(self, layer, step: DecodeStep, mask, query_heads: int, dtype):
        """The layer's own mask ``[B, Hq, q, slots]`` from each head's validity (additive in ``dtype``, if given)."""
        visible = slots_visible(layer.heads.valid, layer.heads.positions, step.positions)
        visible = visible.repeat_interleave(query_heads // visible.shape[1], dim=1)
        return visible if dtype is None else additive_mask(visible, dtype)

    def packed_mask(self, layer, mask: torch.Tensor) -> torch.Tensor:
        """One token per row sees every valid slot: ``[B, Hkv, 1, slots]``, broadcast over a group's queries."""
        return layer.heads.valid[:, :, None, :]

    def after_attention(self, layer, step: DecodeStep, query, keys, values, scaling: float, sinks, module) -> None:
        """Keep the queries a decode-time policy looks back at, hand it this step's attention (every valid slot is
        visible to the step's token) and free, in place, the slots it names."""
        heads, policy = layer.heads, self.policy
        window = policy.query_window()
        if window:
            heads.remember(query, window)
        if not policy.evicts_while_decoding:
            return settle_format(layer, policy, heads.positions, step)
        probabilities = attention_probabilities(query, keys, heads.valid[:, :, None, :], scaling, sinks)
        batch, kv_heads, groups, _, slots = probabilities.shape  # [B, Hkv, G, 1, S]
        view = DecodeView(
            probabilities=probabilities.reshape(batch, kv_heads * groups, slots), valid=heads.valid,
            positions=heads.positions, position=step.positions[:, -1], scores=heads.scores,
            query_buffer=heads.queries, keys=keys, scaling=scaling, steps=step.steps,
            capacity=policy.cache_capacity(), sinks=sinks, values=values, module=module, rotary=self.rotary,
            hidden=getattr(layer, "decode_input", None),
        )
        if view.hidden is not None:
            layer.decode_input = None  # the step's own: not held past it
        freed = policy.decode_evict(view)
        if freed is not None:
            heads.free(freed)
        settle_format(layer, policy, heads.positions, step)

    # -- the engine's slots ------------------------------------------------------------------------------------------
    def allocate(self, rows: int, kv_heads: int, size: int, query_shape: tuple[int, int], dtype, device):
        """Empty per-head state for ``rows`` slots of ``size`` tokens (``query_shape``: query heads, width)."""
        heads = HeadState(valid=torch.zeros(rows, kv_heads, size, dtype=torch.bool, device=device),
                          positions=torch.full((rows, kv_heads, size), -1, dtype=torch.long, device=device),
                          peak=torch.zeros(rows, kv_heads, dtype=torch.long, device=device))
        heads.valid[:, :, 0] = True  # an empty slot attends to one zero key, as in row layouts
        if self.policy.accumulates:
            heads.scores = torch.zeros(rows, kv_heads, size, device=device)
        if self.policy.query_window():
            query_heads, query_dim = query_shape
            heads.queries = torch.zeros(rows, query_heads, self.policy.query_window(), query_dim, dtype=dtype,
                                        device=device)
        return heads

    def used(self, layer) -> int:
        """Slots a session's layer uses: it may have grown past its last token (question chunks)."""
        held = layer.heads.valid[0].any(dim=0).nonzero()
        return int(held.max()) + 1 if held.numel() else 0  # a layer may keep nothing (a global budget spent elsewhere)

    def load(self, target, slot: int, source, used: int) -> None:
        target.heads.load(slot, source.heads, used)

    def slot_row(self, state, width: int) -> tuple[torch.Tensor, int, int]:
        """Each layer masks by its own validity; the row's slot is unused: kept in range."""
        return torch.ones(width, dtype=torch.bool, device=state.valid.device), 0, width

    def held(self, layer, slot: int, row_peak: int) -> tuple[float, int]:
        peak = layer.heads.peak[slot]
        return float(peak.float().mean()), int(peak.sum())


def hold_packed(layer, index: tuple[torch.Tensor, ...], step: DecodeStep, key_states: torch.Tensor,
                value_states: torch.Tensor) -> None:
    """A packed layer's new tokens (written at ``index`` of its workspace) into its residual (:mod:`.packed_kv`)."""
    if getattr(layer, "packed", None) is not None:
        layer.packed.hold(index, step.positions[:, None, :], key_states, value_states)


def hand_decode_inputs(module: torch.nn.Module) -> None:
    """Once per attention module: a forward pre-hook that hands each decode step's attention input to the layer of
    the cache the step runs with (``layer.decode_input``, read into :attr:`DecodeView.hidden`), where the layer's
    policy scores new tokens from it. It stays on the module and does nothing for other policies."""
    if not getattr(module, "evalkit_hands_inputs", False):
        module.register_forward_pre_hook(_hand_decode_input, with_kwargs=True)
        module.evalkit_hands_inputs = True


def _hand_decode_input(module, args, kwargs) -> None:
    cache = kwargs.get("evalkit_cache")  # the attention hook's cache argument (``attention.CACHE_ARGUMENT``)
    if cache is None or getattr(cache, "plan", None) is not None or getattr(cache, "extra_pass", False):
        return  # not a decode step
    layer = cache.layers[module.layer_idx]
    policy = layer.layout.policy
    if policy.evicts_while_decoding and policy.reads_hidden_states:
        layer.decode_input = kwargs.get("hidden_states", args[0] if args else None)


def settle_format(layer, policy: Policy, positions: torch.Tensor, step: DecodeStep) -> None:
    """Under a quantized KV format (:mod:`.kv_format`), what this step's end quantizes of the layer's held tokens
    (``positions`` ``[B, H or 1, S]``); a packed layer then gives its workspace back."""
    if getattr(layer, "packed", None) is not None:
        layer.close_step(positions, step)
    elif policy.kv_format is not None:
        policy.kv_format.settle(layer.keys, layer.values, positions, step.positions[:, -1], step.steps)


def layout_of(policy: Policy, rotary=None) -> RowLayout | HeadLayout:
    """The layout of a layer under ``policy`` (``rotary``: the model's rotary embedding, which scorers re-applied
    while decoding read)."""
    return HeadLayout(policy, rotary) if policy.per_head else RowLayout(policy)
