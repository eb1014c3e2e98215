"""A transformers ``Cache`` whose rows really shrink, and the attention hook that feeds it.

Layout: every layer stores keys/values ``[batch, kv_heads, slots, head_dim]``. Two kinds of bookkeeping:

* **Per row** (:class:`RowState`, shared by all layers), for policies that keep the same *number* of tokens in every
  layer and head (which tokens differs per layer and head): the first ``kept`` slots of a row hold the surviving
  prompt tokens in text order, then new tokens are written slot by slot; a ring policy wraps around after ``fixed``
  slots. Slots a row does not use (a shorter prompt in a batch) are invalid and masked out; padding is never kept.
* A latent (MLA) cache holds one shared head per layer (DeepSeek's compressed KV as keys, its shared RoPE key as
  values); a policy's per-head scores are then reduced over all the layer's heads, so the latent itself shrinks.
* **Per layer and KV head** (:class:`HeadState`, policies with ``per_head``): each layer keeps a validity mask and
  the text position of every slot ``[batch, kv_heads, slots]``, so heads and layers may hold different numbers of
  tokens (PyramidKV, AdaKV: the slot axis is padded to the largest head) and free different slots while decoding
  (H2O, TOVA, SnapKV re-applied). A new token goes to the first free slot of each head; the attention mask is built
  per layer from that head's validity. Policies without ``per_head`` never pay for it.

The hook is an attention function registered in transformers' ``AttentionInterface``: it delegates the attention
itself to the model's own implementation (sdpa or eager) and, at the end of prefill, hands the post-RoPE queries of the
observation window and the layer's keys to the policy, then gathers the kept rows into the cache.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import weakref

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    AttentionMaskInterface,
)

from .kernels import attention_probabilities, attention_with_sums, causal_attention_sums, slots_visible
from .layout import first_free, occupy, raised_peak, ring_slot
from .methods.base import Policy
from .model_spec import (  # noqa: F401  (check_hookable, layer_devices: their former home, kept for callers)
    SUPPORTED_ATTENTION,
    attention_sinks,
    check_hookable,
    family_eager,
    layer_devices,
)
from .views import DecodeView, PrefillView

_ACTIVE: contextvars.ContextVar[CompressedCache | None] = contextvars.ContextVar("evalkit_cache", default=None)


def on_device(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``tensor`` on ``like``'s device: a model spread over devices (``device_map``) keeps each layer's cache on that
    layer's device, and the step's row bookkeeping (made on the input's device) goes to it, never the cache."""
    return tensor if tensor.device == like.device else tensor.to(like.device, non_blocking=True)


@dataclasses.dataclass
class RowState:
    """Per-row bookkeeping shared by all layers. Small tensors; ``valid`` and ``slot_pos`` live on the model's device."""

    valid: torch.Tensor  # [B, slots] bool: slot holds a real token
    slot_pos: torch.Tensor  # [B, slots] long: text position of a token written after prefill; -1 for prompt slots
    seq_len: torch.Tensor  # [B] real tokens seen so far (= position of the next token)
    written: torch.Tensor  # [B] slots written so far, counting wrapped writes
    fixed: torch.Tensor  # [B] slots never overwritten
    ring: torch.Tensor  # [B] size of the ring after the fixed slots
    kept_prompt: torch.Tensor  # [B] prompt tokens kept after prefill
    peak: torch.Tensor  # [B] most valid slots held at once

    @property
    def slots(self) -> int:
        return self.valid.shape[1]

    def next_slots(self, count: int) -> torch.Tensor:
        """Slots that the next ``count`` tokens of each row go to: ``[B, count]``."""
        return ring_slot(self.written[:, None] + torch.arange(count), self.fixed[:, None], self.ring[:, None])

    def wraps(self, count: int) -> bool:
        """Whether writing ``count`` tokens at once would overwrite a slot that one of them must still see."""
        return count > 1 and bool(((self.written + count - self.fixed) > self.ring).any())


@dataclasses.dataclass
class HeadState:
    """Per-layer, per-KV-head bookkeeping of a ``per_head`` policy (tensors on the model's device)."""

    valid: torch.Tensor  # [B, Hkv, slots] bool
    positions: torch.Tensor  # [B, Hkv, slots] long: text position of the slot's token; -1 when empty
    kept_prompt: torch.Tensor  # [B, Hkv] prompt tokens kept after prefill
    peak: torch.Tensor  # [B, Hkv] most tokens held at once
    scores: torch.Tensor | None = None  # [B, Hkv, slots] running score of an accumulating policy (H2O)
    queries: torch.Tensor | None = None  # [B, Hq, w, D] the last w queries (a policy's ``query_window``)

    def pad_to(self, slots: int) -> None:
        extra = slots - self.valid.shape[-1]
        if extra > 0:
            self.valid = torch.nn.functional.pad(self.valid, (0, extra), value=False)
            self.positions = torch.nn.functional.pad(self.positions, (0, extra), value=-1)
            if self.scores is not None:
                self.scores = torch.nn.functional.pad(self.scores, (0, extra))


def evict_after_step(heads, policy: Policy, query: torch.Tensor, keys: torch.Tensor, position: torch.Tensor,
                     steps: torch.Tensor, scaling: float, sinks: torch.Tensor | None = None, *,
                     values: torch.Tensor | None = None, module=None, rotary=None) -> None:
    """After one decode step's attention (one token per row), hand it to a decode-time eviction policy and free, in
    place, the slots it names. ``heads`` holds ``valid``, ``positions``, ``scores`` and ``queries`` per KV head (a
    :class:`HeadState`, or the engine's slot layer): every valid slot is visible to this step's token."""
    probabilities = attention_probabilities(query, keys, heads.valid[:, :, None, :], scaling, sinks)  # [B, Hkv, G, 1, S]
    batch, kv_heads, groups, _, slots = probabilities.shape
    view = DecodeView(
        probabilities=probabilities.reshape(batch, kv_heads * groups, slots), valid=heads.valid,
        positions=heads.positions, position=position, scores=heads.scores, query_buffer=heads.queries, keys=keys,
        scaling=scaling, steps=steps, capacity=policy.cache_capacity(), sinks=sinks, values=values, module=module,
        rotary=rotary,
    )
    freed = policy.decode_evict(view)
    if freed is not None:
        freed = freed & heads.valid
        heads.valid.logical_and_(~freed)
        heads.positions.masked_fill_(freed, -1)
        if heads.scores is not None:
            heads.scores.masked_fill_(freed, 0.0)


class CompressedLayer(DynamicLayer):
    """One layer's keys and values; the prompt is compressed by :meth:`compress`, new tokens go where the state says."""

    def __init__(self, cache: CompressedCache, index: int):
        super().__init__()
        # A weak reference back: the cache holds its layers, and a cycle would keep a finished request's KV tensors
        # alive until Python's cycle collector runs (which never sees GPU memory as pressure).
        self._cache, self.index = weakref.ref(cache), index
        self.heads: HeadState | None = None
        self.reserved: tuple[torch.Tensor, torch.Tensor] | None = None  # exact chunked prefill: the whole prompt's

    @property
    def cache(self) -> CompressedCache:
        return self._cache()

    def update(self, key_states, value_states, *args, **kwargs):
        plan = self.cache.prefill_plan
        if not self.is_initialized:  # prefill: keep everything until the hook has scored this layer
            self.lazy_initialization(key_states, value_states)
            self.keys, self.values = key_states, value_states
            total = plan.get("reserve") if plan is not None else None
            if total:  # exact chunked prefill: the whole prompt's keys and values, written chunk by chunk in place
                batch, heads = key_states.shape[:2]
                self.reserved = (key_states.new_empty(batch, heads, total, key_states.shape[-1]),
                                 value_states.new_empty(batch, heads, total, value_states.shape[-1]))
                return self._append_reserved(key_states, value_states, 0)
            return self.keys, self.values
        if plan is not None:  # a later chunk of a chunked prefill: after what the layer holds
            if self.reserved is not None:
                return self._append_reserved(key_states, value_states, self.keys.shape[-2])
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
            return self.keys, self.values
        if self.heads is not None:
            return self._update_heads(key_states, value_states)
        slots = on_device(self.cache.pending_slots, self.keys)  # [B, q]
        grow = self.cache.state.slots - self.keys.shape[-2]
        if grow > 0:
            pad = (0, 0, 0, grow)
            self.keys = torch.nn.functional.pad(self.keys, pad)
            self.values = torch.nn.functional.pad(self.values, pad)
        self._write(slots[:, None, :].expand(-1, key_states.shape[1], -1), key_states, value_states)
        return self.keys, self.values

    def _append_reserved(self, key_states: torch.Tensor, value_states: torch.Tensor, held: int):
        """Write a chunk after the ``held`` tokens of the reserved prompt tensors; the layer's keys and values are
        views of what is written (no copy of what came before, no freed buffers left behind)."""
        end = held + key_states.shape[-2]
        keys, values = self.reserved
        keys[:, :, held:end].copy_(key_states)
        values[:, :, held:end].copy_(value_states)
        self.keys, self.values = keys[:, :, :end], values[:, :, :end]
        return self.keys, self.values

    def _write(self, slots: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """keys/values[b, h, slots[b, h, i]] = the i-th new token's (key and value widths may differ: MLA latents)."""
        self.keys.scatter_(2, slots[..., None].expand(-1, -1, -1, key_states.shape[-1]), key_states)
        self.values.scatter_(2, slots[..., None].expand(-1, -1, -1, value_states.shape[-1]), value_states)

    def _update_heads(self, key_states, value_states):
        """Write each head's new tokens into its first free slots (growing the slot axis if a head has none)."""
        heads, count = self.heads, key_states.shape[2]
        shortfall = count - int((~heads.valid).sum(dim=-1).min())
        if shortfall > 0:
            policy = self.cache.layer_policies[self.index]
            if policy.cache_capacity() is not None:
                raise RuntimeError(f"{policy.name} left no free slot in a full cache; its eviction is broken")
            self.pad_slots(self.keys.shape[-2] + max(shortfall, 64))
        slots = first_free(heads.valid, count)  # [B, Hkv, count], in slot order
        self._write(slots, key_states, value_states)
        batch, kv_heads, _ = slots.shape
        rows = torch.arange(batch, device=slots.device)[:, None, None]
        occupy(heads, (rows, torch.arange(kv_heads, device=slots.device)[None, :, None], slots),
               on_device(self.cache.pending_positions, slots)[:, None, :])
        held = heads.valid.sum(dim=-1)
        heads.peak = raised_peak(heads.peak, held, on_device(self.cache.active, held))
        return self.keys, self.values

    def pad_slots(self, slots: int) -> None:
        extra = slots - self.keys.shape[-2]
        if extra > 0:
            self.keys = torch.nn.functional.pad(self.keys, (0, 0, 0, extra))
            self.values = torch.nn.functional.pad(self.values, (0, 0, 0, extra))
        if self.heads is not None:
            self.heads.pad_to(slots)

    def compress(self, index: torch.Tensor) -> None:
        """Keep the rows ``index`` ``[B, kv_heads, kept]`` of this layer's keys and values, in that order."""
        self.keys = self.keys.gather(2, index[..., None].expand(-1, -1, -1, self.keys.shape[-1]))
        self.values = self.values.gather(2, index[..., None].expand(-1, -1, -1, self.values.shape[-1]))


def _recent_queries(memory: dict, query: torch.Tensor, count: int | None) -> torch.Tensor:
    """The last ``count`` queries (None: all) of the earlier chunks' kept in ``memory`` followed by this chunk's;
    ``memory`` keeps them for the next chunk."""
    held = memory.get("queries")
    if held is not None and (count is None or query.shape[2] < count):
        query = torch.cat([held, query], dim=2)
    if count is not None:
        query = query[:, :, max(0, query.shape[2] - count):]
    memory["queries"] = query if query.shape[2] else None
    return query


class CompressedCache(Cache):
    """The cache a policy controls. Built by :class:`CompressionSession`; not meant to be passed to ``model.generate``."""

    def __init__(self, policy: Policy, num_layers: int, rotary=None, layer_policies: list[Policy] | None = None):
        super().__init__(layers=[])
        self.policy = policy
        # Each layer's policy: ``policy``, or the sliding window of a hybrid model's sliding-window layers.
        self.layer_policies = layer_policies or [policy] * num_layers
        self.rotary = rotary  # the model's rotary embedding (scores that need pre-RoPE queries)
        self.layers = [CompressedLayer(self, index) for index in range(num_layers)]
        self.state: RowState | None = None
        self.pending_slots: torch.Tensor | None = None
        self.pending_positions: torch.Tensor | None = None  # [B, q] text positions of this step's tokens
        self.active: torch.Tensor | None = None  # [B] bool on the device: rows whose tokens count in statistics
        self.decode_steps = 0
        self.prefill_plan: dict | None = None
        self.compressed_layers: set[int] = set()
        self.chunk_memory: dict[int, dict] = {}  # chunked prefill: what each layer keeps of earlier chunks' queries
        self.prefill_slots: list[int] = []  # each layer's slots right after prefill (row layout)
        self.all_visible = False  # this decode step's token sees every slot: no mask needed
        # Engine admission: each layer's slot of the engine's cache, ``(keys, values)`` ``[1, kv_heads, slot_tokens,
        # D]``; a row-layout layer's compressed prompt is written straight into it (see :meth:`write_through`).
        self.targets: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].get_seq_length()

    # -- prefill ---------------------------------------------------------------------------------------------------
    def select(self, view: PrefillView) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The prompt tokens to keep, per row and KV head: indices ``[B, kv_heads, kept]`` (in text order; a head
        that keeps fewer than ``kept`` has its extra picks last), the count each head keeps ``[B, kv_heads]``, and the
        policy's raw scores ``[B, kv_heads, n]``."""
        kv_heads = self.layers[view.layer_idx].keys.shape[1]  # the cache's heads: 1 for a latent (MLA) cache
        return self.layer_policies[view.layer_idx].select(view, kv_heads)

    def prefill_attention(self, layer_idx: int, module, query: torch.Tensor, keys: torch.Tensor,
                          values: torch.Tensor, scaling: float) -> None:
        """After a prefill attention: compress the layer (the whole prompt, or under chunked prefill its last chunk),
        or keep what the policy's score will need of this chunk's queries."""
        plan, policy = self.prefill_plan, self.layer_policies[layer_idx]
        mode = plan.get("chunk_mode")
        if mode is None:
            return self.compress_layer(layer_idx, module, query, keys, values, scaling)
        if layer_idx in self.compressed_layers:
            raise RuntimeError(f"layer {layer_idx} ran twice in one prefill chunk; its attention is shared")
        memory = self.chunk_memory.setdefault(layer_idx, {})
        if mode == "compress":  # every chunk compressed as a prompt of what the cache holds: its kept tokens + the chunk
            needed = policy.prefill_queries() or 0  # the chunk's queries, after the last ones of a short chunk
            recent = _recent_queries(memory, query, needed)
            return self.compress_layer(layer_idx, module, query if query.shape[2] >= needed else recent, keys, values,
                                       scaling)
        if policy.sums_attention:  # the attention sums, exactly decomposable over the queries: summed chunk by chunk
            if plan["final"]:
                return self.compress_layer(layer_idx, module, query, keys, values, scaling, memory.pop("sums", None))
            view = self._view(layer_idx, module, query, keys, values, scaling, memory.get("sums"))
            memory["sums"] = causal_attention_sums(view)
            self.compressed_layers.add(layer_idx)
            return
        needed = policy.prefill_queries()
        queries = _recent_queries(memory, query, None if needed is None else max(needed, policy.query_window()))
        if plan["final"]:
            memory.clear()
            return self.compress_layer(layer_idx, module, queries, keys, values, scaling)
        self.compressed_layers.add(layer_idx)

    def _view(self, layer_idx: int, module, query, keys, values, scaling: float, prior_sums=None) -> PrefillView:
        plan, n = self.prefill_plan, keys.shape[2]
        return PrefillView(query, keys, values, on_device(plan["key_valid"][:, :n], keys), scaling, layer_idx,
                           len(self.layers), module, on_device(plan["positions"][:, :n], keys), self.rotary,
                           prior_sums)

    def compress_layer(self, layer_idx: int, module, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       scaling: float, prior_sums: torch.Tensor | None = None) -> None:
        if layer_idx in self.compressed_layers:
            raise RuntimeError(f"layer {layer_idx} was compressed twice in one prefill; its attention is shared")
        self.compressed_layers.add(layer_idx)
        plan, policy = self.prefill_plan, self.layer_policies[layer_idx]
        if not (plan["compress"] or policy.per_head):  # per-head layouts always need their validity and positions
            return
        view = self._view(layer_idx, module, query, keys, values, scaling, prior_sums)
        indices, counts, raw = self.select(view)
        layer = self.layers[layer_idx]
        layer.compress(indices)
        if not policy.per_head:
            return self.write_through(layer_idx)
        kept = torch.arange(indices.shape[-1], device=indices.device) < counts[..., None]
        positions = view.positions[:, None, :].expand(-1, indices.shape[1], -1).gather(2, indices)
        layer.heads = HeadState(valid=kept, positions=positions.masked_fill(~kept, -1), kept_prompt=counts,
                                peak=counts.clone())
        if policy.accumulates:
            layer.heads.scores = raw.gather(2, indices).masked_fill(~kept, 0.0)
        window = policy.query_window()
        if window:
            layer.heads.queries = query[:, :, -window:]

    def write_through(self, layer_idx: int) -> None:
        """Under engine admission (``targets`` set), write this layer's compressed prompt into its slot and keep views
        of it: the session never holds a second copy of every layer's kept tokens (the admission's peak drops by
        one request's compressed cache). Whatever changes the layer afterwards (a question prefilled on top, a later
        chunk) makes new tensors, which the engine then copies as before."""
        target = self.targets[layer_idx] if self.targets is not None else None
        layer = self.layers[layer_idx]
        if target is None or layer.keys.shape[0] != 1 or layer.keys.shape[-2] > target[0].shape[-2]:
            return
        kept = layer.keys.shape[-2]
        keys, values = target[0][:, :, :kept], target[1][:, :, :kept]
        keys.copy_(layer.keys)
        values.copy_(layer.values)
        layer.keys, layer.values = keys, values

    def head_layers(self) -> list[CompressedLayer]:
        return [layer for layer, policy in zip(self.layers, self.layer_policies) if policy.per_head]

    def finish_head_prefill(self) -> int:
        """Give every layer with a per-head layout the same slot axis (its largest head's, or its policy's fixed
        capacity, whichever is larger, over those layers); return its size."""
        layers = self.head_layers()
        slots = max(layer.keys.shape[-2] for layer in layers)
        capacities = [policy.cache_capacity() for policy in self.layer_policies if policy.per_head]
        slots = max([slots, *(c for c in capacities if c is not None)])
        for layer in layers:
            layer.pad_slots(slots)
        return slots

    # -- per-head decoding -------------------------------------------------------------------------------------------
    def head_mask(self, layer_idx: int, q_heads: int, dtype: torch.dtype | None) -> torch.Tensor:
        """This layer's attention mask for the step, ``[B, Hq, q, slots]`` (bool, or additive in ``dtype``)."""
        layer = self.layers[layer_idx]
        heads = layer.heads
        visible = slots_visible(heads.valid, heads.positions, on_device(self.pending_positions, layer.keys))
        mask = visible.repeat_interleave(q_heads // visible.shape[1], dim=1)
        return mask if dtype is None else additive_mask(mask, dtype)

    def after_decode_attention(self, layer_idx: int, query: torch.Tensor, keys: torch.Tensor, scaling: float,
                               sinks: torch.Tensor | None = None, values: torch.Tensor | None = None,
                               module=None) -> None:
        """Hand this step's attention to a decode-time eviction policy and free the slots it names."""
        layer, policy = self.layers[layer_idx], self.layer_policies[layer_idx]
        heads = layer.heads
        window = policy.query_window()
        if window:
            heads.queries = torch.cat([heads.queries, query], dim=2)[:, :, -window:]
        if policy.evicts_while_decoding:
            position = on_device(self.pending_positions[:, -1], keys)
            evict_after_step(heads, policy, query, keys, position, torch.full_like(position, self.decode_steps), scaling,
                             sinks, values=values, module=module, rotary=self.rotary)

    def realized(self, row: int) -> dict:
        """What row ``row`` held: prompt tokens kept per layer (mean over its KV heads), per layer and head, the most
        tokens held at once (mean over layers and heads: the memory a per-head layout without padding needs), and
        the layers the run's policy compressed (a hybrid model's sliding-window layers keep their window)."""
        kept, peaks = [], []
        for index, layer in enumerate(self.layers):
            if layer.heads is not None:
                kept.append(layer.heads.kept_prompt[row].tolist())
                peaks.append(float(layer.heads.peak[row].float().mean()))
            else:
                count = min(int(self.state.kept_prompt[row]), self.prefill_slots[index])
                kept.append([count] * layer.keys.shape[1])
                peaks.append(float(self.state.peak[row]))
        per_layer = [sum(heads) / len(heads) for heads in kept]
        peak = sum(peaks) / len(peaks)
        return {
            "kept_prompt_tokens": [int(k) if float(k).is_integer() else round(k, 3) for k in per_layer],
            "kept_prompt_tokens_per_head": kept,
            "peak_cache_tokens": int(peak) if peak.is_integer() and not self.head_layers() else round(peak, 3),
            "compressed_layers": [i for i, policy in enumerate(self.layer_policies) if policy is self.policy],
        }

    # -- decoding --------------------------------------------------------------------------------------------------
    def plan_step(self, count: int, active: torch.Tensor) -> torch.Tensor:
        """Reserve slots for ``count`` new tokens per row; return the attention mask ``[B, 1, count, slots]`` (bool)."""
        state = self.state
        slots = state.next_slots(count)
        needed = int(slots.max()) + 1
        device = state.valid.device
        if needed > state.slots:
            grow = needed - state.slots
            state.valid = torch.nn.functional.pad(state.valid, (0, grow), value=False)
            state.slot_pos = torch.nn.functional.pad(state.slot_pos, (0, grow), value=-1)
        positions = (state.seq_len[:, None] + torch.arange(count)).to(device)
        slots_dev = slots.to(device)
        state.valid.scatter_(1, slots_dev, True)
        state.slot_pos.scatter_(1, slots_dev, positions)
        state.written += count
        state.seq_len += count
        held = state.valid.sum(dim=1).cpu()
        state.peak = raised_peak(state.peak, held, active)
        self.pending_slots = slots_dev
        mask = state.valid[:, None, None, :] & (state.slot_pos[:, None, None, :] <= positions[:, None, :, None])
        self.all_visible = count == 1 and bool(mask.all())
        return mask


MASK_CELLS = 1 << 22  # a later prefill chunk's attention: query rows per call so that its mask stays this small


def _later_chunk(cache, module, query, key, value, eager: bool) -> bool:
    """Whether this attention is a later chunk of a chunked prefill that :func:`chunk_attention` may compute: sdpa,
    a full-attention layer of a model with per-head keys (not a latent), no learned sinks."""
    return (cache is not None and cache.prefill_plan is not None and cache.prefill_plan.get("chunk_mode") is not None
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
    if cache is None or cache.prefill_plan is None or cache.prefill_plan.get("chunk_mode") is not None or eager:
        return False
    plan, policy = cache.prefill_plan, cache.layer_policies[module.layer_idx]
    return (policy.sums_attention and plan["compress"] and query.shape[2] == key.shape[2] > 1
            and bool(plan["key_valid"].all()) and attention_sinks(module) is None
            and not getattr(module, "sliding_window", None) and query.shape[-1] == key.shape[-1] == value.shape[-1]
            and query.shape[1] % key.shape[1] == 0 and module.layer_idx not in cache.compressed_layers)


def _hooked_attention(delegate, eager: bool):
    def attention(module, query, key, value, attention_mask, **kwargs):
        cache = _ACTIVE.get()
        scaling = kwargs.get("scaling", module.scaling)
        if _later_chunk(cache, module, query, key, value, eager):
            output = chunk_attention(query, key, value, scaling)
            cache.prefill_attention(module.layer_idx, module, query, key, value, scaling)
            return output, None
        if _fused_prefill(cache, module, query, key, value, eager):
            output, sums = attention_with_sums(query, key, value, scaling)
            # The view then holds no queries: its sums are all of them (``prior_sums``), and nothing is recomputed.
            cache.compress_layer(module.layer_idx, module, query[:, :, :0], key, value, scaling, sums)
            return output, None
        decoding = cache is not None and cache.prefill_plan is None
        per_head = decoding and cache.layers[module.layer_idx].heads is not None
        if per_head:
            attention_mask = cache.head_mask(module.layer_idx, query.shape[1], query.dtype if eager else None)
        elif decoding and cache.all_visible:
            # One new token that sees every slot (a full ring, no padding): without a mask, sdpa can use its GQA
            # path instead of copying K/V for every query head.
            attention_mask = None
        forward = family_eager(module, delegate) if eager else delegate
        output = forward(module, query, key, value, attention_mask, **kwargs)
        if cache is not None and cache.prefill_plan is not None:
            cache.prefill_attention(module.layer_idx, module, query, key, value, scaling)
        elif per_head:
            cache.after_decode_attention(module.layer_idx, query, key, scaling, attention_sinks(module), value, module)
        return output

    return attention


def _register_hooks() -> None:
    # Llama's eager attention is the one the Llama, Qwen2/3 and Mistral families share.
    from transformers.models.llama.modeling_llama import eager_attention_forward

    delegates = {"sdpa": sdpa_attention_forward, "eager": eager_attention_forward}
    for name, delegate in delegates.items():
        AttentionInterface.register(f"evalkit_{name}", _hooked_attention(delegate, eager=name == "eager"))
        AttentionMaskInterface.register(f"evalkit_{name}", ALL_MASK_ATTENTION_FUNCTIONS[name])


_register_hooks()


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask (True: attend) as the additive float mask eager attention takes."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


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


@contextlib.contextmanager
def hooked(model, cache: CompressedCache):
    """Route the model's attention through the hook, with ``cache`` as the active cache, for the duration."""
    with attention_implementation(model, f"evalkit_{model.config._attn_implementation}"):
        token = _ACTIVE.set(cache)
        try:
            yield
        finally:
            _ACTIVE.reset(token)
