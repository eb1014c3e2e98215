"""The session's cache: a transformers ``Cache`` whose rows really shrink.

Every layer stores keys/values ``[batch, kv_heads, slots, head_dim]``, written where its layout says (:mod:`.layout`):

* **Per row** (:class:`.layout.RowLayout`, its bookkeeping a :class:`RowState` shared by all layers), for policies that
  keep the same *number* of tokens in every layer and head (which tokens differs per layer and head): the first
  ``kept`` slots of a row hold the surviving prompt tokens in text order, then new tokens are written slot by slot; a
  ring policy wraps around after ``fixed`` slots. Slots a row does not use (a shorter prompt in a batch) are invalid
  and masked out; padding is never kept.
* A latent (MLA) cache holds one shared head per layer (DeepSeek's compressed KV as keys, its shared RoPE key as
  values); a policy's per-head scores are then reduced over all the layer's heads, so the latent itself shrinks.
* **Per layer and KV head** (:class:`.layout.HeadLayout`, policies with ``per_head``): each layer keeps a validity
  mask and the text position of every slot ``[batch, kv_heads, slots]`` (:class:`.layout.HeadState`), so heads and
  layers may hold different numbers of tokens (PyramidKV, AdaKV: the slot axis is padded to the largest head) and
  free different slots while decoding (H2O, TOVA, SnapKV re-applied). A new token goes to the first free slot of each
  head; the attention mask is built per layer from that head's validity. Policies without ``per_head`` never pay for
  it.

The attention hook (:mod:`.attention`) hands each layer's prefill attention to
:meth:`CompressedCache.prefill_attention`, which scores the prompt with the layer's policy and gathers the kept rows.
"""

from __future__ import annotations

import copy
import dataclasses
import weakref

import torch
from transformers.cache_utils import Cache, DynamicLayer

from .kernels import causal_attention_sums
from .layout import DecodeStep, HeadLayout, HeadState, RowLayout, layout_of, raised_peak, ring_slot
from .merged_storage import hold_merged
from .methods.base import UNBOUNDED, Policy
from .methods.think import reduce_keys
from .model_spec import attention_sinks
from .packed_kv import PackedStorage
from .views import PrefillView


def _held_bytes(layer) -> int:
    """Bytes a layer's keys and values hold (under exact chunked prefill: the prompt buffers reserved)."""
    if not layer.is_initialized:
        return 0
    if layer.packed is not None:
        return layer.packed.nbytes()
    tensors = layer.reserved or (layer.keys, layer.values, *layer.split_keys())
    return sum(t.numel() * t.element_size() for t in tensors)


def on_device(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``tensor`` on ``like``'s device: a model spread over devices (``device_map``) keeps each layer's cache on that
    layer's device, and the prefill's row bookkeeping (made on the input's device) goes to it, never the cache."""
    return tensor if tensor.device == like.device else tensor.to(like.device, non_blocking=True)


@dataclasses.dataclass
class PrefillPlan:
    """What one pass of a prefill (the prompt, or one chunk of it) asks of every layer's attention."""

    key_valid: torch.Tensor  # [B, n] bool: the keys that are real tokens (False on left padding)
    positions: torch.Tensor  # [B, n] long: the keys' text positions
    compress: bool  # some row is over its budget or padded: row layouts compress (per-head layouts always do)
    chunk_mode: str | None = None  # a chunked prefill's mode ("exact", "compress"); None: the prompt in one pass
    reserve: int | None = None  # exact chunked prefill: the whole prompt's length, reserved in every layer at once
    final: bool = True  # this pass ends the prompt
    defer: bool = False  # the policy scores with passes of its own after the prompt (KVzip): layers wait for them


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

    def plan(self, count: int, active: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Reserve slots for ``count`` new tokens per row (``active``: rows whose tokens count in the peak): their
        slots ``[B, count]``, the attention mask ``[B, 1, count, slots]`` (bool), and whether one token sees every
        slot (a full ring, no padding: no mask needed)."""
        slots = self.next_slots(count)
        needed = int(slots.max()) + 1
        device = self.valid.device
        if needed > self.slots:
            grow = needed - self.slots
            self.valid = torch.nn.functional.pad(self.valid, (0, grow), value=False)
            self.slot_pos = torch.nn.functional.pad(self.slot_pos, (0, grow), value=-1)
        positions = (self.seq_len[:, None] + torch.arange(count)).to(device)
        slots = slots.to(device)
        self.valid.scatter_(1, slots, True)
        self.slot_pos.scatter_(1, slots, positions)
        self.written += count
        self.seq_len += count
        self.peak = raised_peak(self.peak, self.valid.sum(dim=1).cpu(), active)
        mask = self.valid[:, None, None, :] & (self.slot_pos[:, None, None, :] <= positions[:, None, :, None])
        return slots, mask, count == 1 and bool(mask.all())


class CompressedLayer(PackedStorage, DynamicLayer):
    """One layer's keys and values; the prompt is compressed by :meth:`compress`, new tokens go where its layout
    says (:mod:`.layout`); under a quantized KV format they are held packed after prefill (:mod:`.packed_kv`)."""

    def __init__(self, cache: CompressedCache, index: int, layout: RowLayout | HeadLayout):
        super().__init__()
        # A weak reference back: the cache holds its layers, and a cycle would keep a finished request's KV tensors
        # alive until Python's cycle collector runs (which never sees GPU memory as pressure).
        self._cache, self.index, self.layout = weakref.ref(cache), index, layout
        self.heads: HeadState | None = None  # a head layout's state, set when the prompt is compressed
        self.reserved: tuple[torch.Tensor, torch.Tensor] | None = None  # exact chunked prefill: the whole prompt's
        # A row layout's text position of the prompt token in each slot, per head ``[B, kv_heads, slots]`` (a head
        # layout keeps them in ``heads``); slots written after prefill have theirs in the row state's ``slot_pos``.
        self.prompt_positions: torch.Tensor | None = None
        # ThinK's removed key channels: ``keys`` is then the prompt block at reduced width, ``key_channels`` ``[B,
        # kv_heads, C]`` the channels it keeps per head, ``later_keys`` the full-width keys of the slots after it.
        self.key_channels: torch.Tensor | None = None
        self.later_keys: torch.Tensor | None = None
        # The policy's state per row (``Policy.keeps_slot_state``; None: it keeps none), made as the prompt is kept.
        self.slot_states: list | None = None

    @property
    def cache(self) -> CompressedCache:
        return self._cache()

    def __deepcopy__(self, memo):
        """A copy within a copied cache (:meth:`CompressionSession.fork`): its reference back follows the cache's copy."""
        copied = self.__class__.__new__(self.__class__)
        memo[id(self)] = copied
        copied.__dict__.update({key: copy.deepcopy(value, memo) for key, value in self.__dict__.items() if key != "_cache"})
        copied._cache = weakref.ref(memo.get(id(self.cache), self.cache))
        return copied

    def update(self, key_states, value_states, *args, **kwargs):
        plan = self.cache.plan
        if not self.is_initialized:  # prefill: keep everything until the hook has scored this layer
            self.lazy_initialization(key_states, value_states)
            self.keys, self.values = key_states, value_states
            if plan is not None and plan.reserve:  # exact chunked prefill: the whole prompt, written chunk by chunk
                batch, heads = key_states.shape[:2]
                self.reserved = (key_states.new_empty(batch, heads, plan.reserve, key_states.shape[-1]),
                                 value_states.new_empty(batch, heads, plan.reserve, value_states.shape[-1]))
                return self._append_reserved(key_states, value_states, 0)
            return self.keys, self.values
        if plan is not None:  # a later chunk of a chunked prefill: after what the layer holds
            if self.reserved is not None:
                return self._append_reserved(key_states, value_states, self.keys.shape[-2])
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
            return self.keys, self.values
        if self.key_channels is not None:
            return self._write_later(key_states, value_states)
        self.pad_slots(self.layout.slots_needed(self, key_states.shape[2], self.cache.state.slots))
        if self.packed is not None:
            self.open_step()
        self.layout.write(self, self.cache.step.on(self.keys.device), key_states, value_states)
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

    def get_seq_length(self) -> int:
        if self.packed is not None:
            return self.packed.slots
        return self.values.shape[-2] if self.key_channels is not None else super().get_seq_length()

    def split_keys(self) -> tuple[torch.Tensor, ...]:
        """The tensors a layer with reduced prompt keys holds besides ``keys`` and ``values`` (none otherwise)."""
        return () if self.key_channels is None else (self.later_keys, self.key_channels)

    def remove_channels(self, channels: torch.Tensor) -> None:
        """Keep the prompt keys at the width of ``channels`` ``[B, kv_heads, C]``; later tokens' keys go to a
        full-width block after them (:func:`.methods.think.attend_reduced` reads both)."""
        batch, heads, _, dim = self.keys.shape
        self.later_keys = self.keys.new_empty(batch, heads, 0, dim)
        self.keys, self.key_channels = reduce_keys(self.keys, channels), channels

    def widen(self) -> None:
        """Back to full-width keys over every slot, the removed channels zero (what the engine's slots hold)."""
        batch, heads, prompt, _ = self.keys.shape
        index = self.key_channels[:, :, None].expand(-1, -1, prompt, -1)
        zeroed = self.later_keys.new_zeros(batch, heads, prompt, self.later_keys.shape[-1]).scatter(-1, index, self.keys)
        self.keys, self.later_keys, self.key_channels = torch.cat([zeroed, self.later_keys], dim=-2), None, None

    def _write_later(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """A decode step's tokens under reduced prompt keys: values at their slots, keys at full width in
        ``later_keys`` (slot minus the prompt block's)."""
        step, prompt, slots = self.cache.step.on(self.values.device), self.keys.shape[-2], self.cache.state.slots
        self.values = torch.nn.functional.pad(self.values, (0, 0, 0, max(0, slots - self.values.shape[-2])))
        later = max(0, slots - prompt - self.later_keys.shape[-2])
        self.later_keys = torch.nn.functional.pad(self.later_keys, (0, 0, 0, later))
        batch, heads = key_states.shape[:2]
        rows = torch.arange(batch, device=self.values.device)[:, None, None]
        index = (rows, torch.arange(heads, device=rows.device)[None, :, None], step.slots[:, None, :])
        self.values.index_put_(index, value_states)
        self.later_keys.index_put_((*index[:2], index[2] - prompt), key_states)
        return self.keys, self.values

    def pad_slots(self, slots: int) -> None:
        extra = slots - self.slot_count
        if extra > 0 and self.packed is not None:
            self.packed.pad(slots)
        elif extra > 0:
            self.keys = torch.nn.functional.pad(self.keys, (0, 0, 0, extra))
            self.values = torch.nn.functional.pad(self.values, (0, 0, 0, extra))
        if self.heads is not None:
            self.heads.pad_to(slots)

    def hold_prompt(self, positions: torch.Tensor, index: torch.Tensor | None = None) -> None:
        """Record the text positions of the prompt tokens this row-layout layer holds: of the keys it was handed
        (``positions`` ``[B, n]``; a compress-mode chunk's held tokens are -1 there, their recorded positions stand),
        the picks ``index`` ``[B, kv_heads, kept]`` (None: all of them)."""
        source = positions[:, None, :].expand(-1, self.keys.shape[1], -1)
        if self.prompt_positions is not None:
            held = self.prompt_positions.shape[-1]
            source = torch.cat([self.prompt_positions, source[..., held:]], dim=-1)
        self.prompt_positions = source if index is None else source.gather(2, index)

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
    """The cache a policy controls. Built by :class:`CompressionSession`; not meant to be passed to ``model.generate``.
    The session sets ``plan`` for a prefill's passes and ``step`` for each decode step; the attention hook reads
    them off the cache it is handed."""

    def __init__(self, policy: Policy, num_layers: int, rotary=None, layer_policies: list[Policy] | None = None):
        super().__init__(layers=[])
        self.policy = policy
        # Each layer's policy: ``policy``, or the sliding window of a hybrid model's sliding-window layers.
        self.layer_policies = layer_policies or [policy] * num_layers
        self.rotary = rotary  # the model's rotary embedding (scores that need pre-RoPE queries)
        self.layers = [CompressedLayer(self, index, layout_of(layer_policy, rotary))
                       for index, layer_policy in enumerate(self.layer_policies)]
        self.state: RowState | None = None
        self.plan: PrefillPlan | None = None  # set while a prefill pass runs
        self.step: DecodeStep | None = None  # the decode step running now
        self.decode_steps = 0
        self.compressed_layers: set[int] = set()
        self.chunk_memory: dict[int, dict] = {}  # chunked prefill: what each layer keeps of earlier chunks' queries
        # Each layer's attention inputs of this prefill, chunk by chunk (``reads_hidden_states`` policies only).
        self.layer_inputs: dict[int, list[torch.Tensor]] = {}
        self.recording: list | None = None  # a prefill being recorded for reuse: each layer's call (.prefill_store)
        self.prefill_slots: list[int] = []  # each layer's slots right after prefill (row layout)
        self.prefill_peak_bytes = 0  # the most bytes every layer's keys and values held at once during prefill
        self.deferred: dict[int, tuple] = {}  # layers waiting for the policy's passes: (module, scaling)
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
        plan, policy = self.plan, self.layer_policies[layer_idx]
        mode = plan.chunk_mode
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
            if plan.final:
                return self.compress_layer(layer_idx, module, query, keys, values, scaling, memory.pop("sums", None))
            view = self._view(layer_idx, module, query, keys, values, scaling, memory.get("sums"))
            memory["sums"] = causal_attention_sums(view)
            self.compressed_layers.add(layer_idx)
            return
        needed = policy.prefill_queries()
        queries = _recent_queries(memory, query, None if needed is None else max(needed, policy.query_window()))
        if plan.final:
            memory.clear()
            return self.compress_layer(layer_idx, module, queries, keys, values, scaling)
        self.compressed_layers.add(layer_idx)

    def _view(self, layer_idx: int, module, query, keys, values, scaling: float, prior_sums=None) -> PrefillView:
        plan, n = self.plan, keys.shape[2]
        inputs = self.layer_inputs.get(layer_idx)
        hidden = None if not inputs else inputs[0] if len(inputs) == 1 else torch.cat(inputs, dim=1)
        return PrefillView(query, keys, values, on_device(plan.key_valid[:, :n], keys), scaling, layer_idx,
                           len(self.layers), module, on_device(plan.positions[:, :n], keys), self.rotary,
                           prior_sums, hidden=hidden)

    def compress_layer(self, layer_idx: int, module, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       scaling: float, prior_sums: torch.Tensor | None = None) -> None:
        if layer_idx in self.compressed_layers:
            raise RuntimeError(f"layer {layer_idx} was compressed twice in one prefill; its attention is shared")
        self.compressed_layers.add(layer_idx)
        self.count_held_bytes()
        if self.plan.defer:
            self.deferred[layer_idx] = (module, scaling)
            return
        layout = self.layers[layer_idx].layout
        if not (self.plan.compress or layout.per_head):  # per-head layouts always need their validity and positions
            self.layers[layer_idx].hold_prompt(on_device(self.plan.positions[:, : keys.shape[2]], keys))
            return
        view = self._view(layer_idx, module, query, keys, values, scaling, prior_sums)
        indices, counts, raw = self.select(view)
        self.keep(layer_idx, view, query, indices, counts, raw)

    def keep(self, layer_idx: int, view: PrefillView, query: torch.Tensor, indices: torch.Tensor,
             counts: torch.Tensor, raw: torch.Tensor) -> None:
        """Keep the prompt tokens ``indices`` ``[B, kv_heads, kept]`` of layer ``layer_idx`` (each head's first
        ``counts`` real; ``raw``: the policy's scores), as the policy rewrites them."""
        self.layer_inputs.pop(layer_idx, None)
        layer, policy = self.layers[layer_idx], self.layer_policies[layer_idx]
        if not layer.layout.per_head:
            layer.hold_prompt(view.positions, indices)
        layer.compress(indices)
        channels = policy.kept_channels(view, counts, layer.keys) if self._removes_channels(layer, view, counts) else None
        if channels is not None:
            layer.remove_channels(channels)
        elif policy.rewrites:
            layer.keys, layer.values = policy.rewrite(view, indices, counts, layer.keys, layer.values)
            hold_merged(self, layer_idx)
        if policy.keeps_slot_state:
            layer.slot_states = policy.prefill_state(view)
        layer.layout.after_compress(self, layer_idx, view, query, indices, counts, raw)

    def _removes_channels(self, layer: CompressedLayer, view: PrefillView, counts: torch.Tensor) -> bool:
        """Whether ``layer`` keeps its prompt keys at ThinK's reduced width: not under the engine (its slots are
        full width), in a row layout whose every row fills its prompt block and whose new tokens follow it (no ring),
        no quantized format, the plain softmax attention (no learned sinks, no soft-capping)."""
        policy, module = self.layer_policies[layer.index], view.module
        if not getattr(policy, "remove_channels", False) or self.targets is not None or layer.layout.per_head:
            return False
        ring = policy.decode_layout(torch.ones(1, dtype=torch.long))[1]
        return (policy.kv_format is None and not policy.evicts_while_decoding and int(ring[0]) >= UNBOUNDED
                and bool((counts == layer.keys.shape[-2]).all()) and attention_sinks(module) is None
                and getattr(getattr(module, "config", None), "attn_logit_softcapping", None) is None)

    def count_held_bytes(self, extra: int = 0) -> None:
        """Raise the prefill's peak to what every layer holds now, plus ``extra`` bytes held beside them."""
        self.prefill_peak_bytes = max(self.prefill_peak_bytes, extra + sum(_held_bytes(layer) for layer in self.layers))

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
        return [layer for layer in self.layers if layer.layout.per_head]

    def finish_head_prefill(self) -> int:
        """Give every layer with a per-head layout the same slot axis (its largest head's, or its policy's fixed
        capacity, whichever is larger, over those layers); return its size (0: no such layer)."""
        layers = self.head_layers()
        if not layers:
            return 0
        slots = max(layer.keys.shape[-2] for layer in layers)
        capacities = [layer.layout.policy.slot_capacity(layer.keys.shape[1]) for layer in layers]
        slots = max([slots, *(c for c in capacities if c is not None)])
        for layer in layers:
            layer.pad_slots(slots)
        return slots

    def realized(self, row: int) -> dict:
        """What row ``row`` held: prompt tokens kept per layer (mean over its KV heads), per layer and head, the most
        tokens held at once (mean over layers and heads: the memory a per-head layout without padding needs), and
        the layers the run's policy compressed (a hybrid model's sliding-window layers keep their window)."""
        kept, peaks = [], []
        for index, layer in enumerate(self.layers):
            heads, peak = layer.layout.realized(layer, row, self.state, self.prefill_slots[index])
            kept.append(heads)
            peaks.append(peak)
        per_layer = [sum(heads) / len(heads) for heads in kept]
        peak = sum(peaks) / len(peaks)
        return {
            "kept_prompt_tokens": [int(k) if float(k).is_integer() else round(k, 3) for k in per_layer],
            "kept_prompt_tokens_per_head": kept,
            "peak_cache_tokens": int(peak) if peak.is_integer() and not self.head_layers() else round(peak, 3),
            "compressed_layers": [i for i, policy in enumerate(self.layer_policies) if policy is self.policy],
            # a batch's peak, shared equally by its rows
            "kv_bytes_prefill_peak": self.prefill_peak_bytes // max(1, self.layers[0].keys.shape[0]),
        }
