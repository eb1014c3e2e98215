"""What the engine counts: decode steps and busy slot-steps (its utilization), and each finished request's stats,
read off the request's own tokens and the tensors the engine allocated."""

from __future__ import annotations

import math
import time

from ..merged_storage import merged_saving
from ..methods.sliding_window import SlidingWindow
from ..packed_kv import PackedKV
from .request import Completion, Resident
from .slot_pool import SlotPool


class Accounting:
    def __init__(self, pool: SlotPool):
        self.pool = pool
        self.counters = {"decode_steps": 0, "busy_slot_steps": 0}

    def count(self, steps: int, busy_slots: int) -> None:
        self.counters["decode_steps"] += steps
        self.counters["busy_slot_steps"] += steps * busy_slots

    def utilization(self) -> float:
        """Busy slot-steps over all slot-steps so far."""
        total = self.counters["decode_steps"] * self.pool.slots
        return self.counters["busy_slot_steps"] / total if total else 0.0

    def complete(self, slot: int, resident: Resident) -> Completion:
        generated = len(resident.tokens)
        # Every token fed back takes a new slot until the ring is full; the count never drops, so the end is the peak.
        # (Read off the request's own tokens: the device may have run a few steps past a stop string.)
        peak = row_peak = min(resident.held_at_start + max(generated - 1, 0), resident.limit)
        if self.pool.head_layouts:  # per-head layouts are tracked on the device: the mean over layers and heads
            peaks = [layer.layout.held(layer, slot, row_peak)[0] for layer in self.pool.cache.layers]
            peak = round(sum(peaks) / len(peaks), 3)
        prompt = resident.stats["prompt_tokens"]
        seen = prompt + max(generated - 1, 0)
        # From its first token to the sync at which its end was seen (up to sync_every steps later).
        decode_seconds = time.perf_counter() - resident.admitted_at
        stats = {**resident.stats, "decode_seconds": decode_seconds, "generated_tokens": generated,
                 "hit_limit": generated >= resident.request.max_new_tokens,
                 "peak_cache_tokens": peak, "tokens_seen": seen,
                 "realized_ratio": seen / peak, "reserved_cache_tokens": self.pool.slot_tokens,
                 **held_bytes(self.pool.cache.layers, slot, row_peak, seen, max(generated - 1, 0), self.pool.slot_tokens)}
        stats["kv_byte_seconds"] = _byte_seconds(stats, resident, row_peak)
        return Completion(resident.index, list(resident.tokens), stats)

def held_bytes(layers, row: int, row_peak: int, seen: int, fed_back: int, reserved_tokens: int) -> dict:
    """What a request's cache really took, in bytes, read off the tensors of its cache ``layers`` (row ``row``):
    ``kv_bytes_peak`` the most it held (per layer: its peak tokens, or per head its own peak, times the bytes of a
    token's keys and values in that layer's dtype and widths: latent widths for MLA; a prompt's keys held at a reduced
    width, ThinK's, priced so; MiniCache's merged tokens as it holds them), ``kv_bytes_reserved`` what its
    ``reserved_tokens`` slots reserve, ``kv_bytes_full`` what a full cache holds for the same ``seen`` tokens (a
    sliding-window layer at most its window), and ``memory_ratio`` = full / peak. Under a quantized KV format also
    ``kv_quantized_tokens``: of the held tokens at the peak (per KV head, the mean over layers, as
    ``peak_cache_tokens``), those ``kv_bytes_peak`` prices at ``kv_bits``: the kept prompt and the generated tokens
    beyond the full-precision residual (the ``fed_back`` generated tokens the cache took). A method that offloads
    part of its cache to the host (ShadowKV: ``offloaded_bytes``) also gives ``kv_bytes_device``, what stays on the
    device, and ``kv_bytes_fetched_step``, what a decode step fetches from the host (``kv_bytes_peak`` stays the whole
    cache, held somewhere)."""
    peak = reserved = full = 0
    quantized, formats = 0.0, 0
    offload = _offloaded(layers, row, row_peak)
    for index, layer in enumerate(layers):
        heads, key_dim, value_dim, element = _geometry(layer)
        token_bytes = (key_dim + value_dim) * element
        policy = layer.layout.policy
        shape = (heads, key_dim, value_dim, element)
        held = layer.layout.held(layer, row, row_peak)[1]
        saved = _removed_bytes(layer, row) + merged_saving(layers, index, row, row_peak - fed_back)
        peak += _price(policy.kv_format, held, *shape, fed_back) - saved
        reserved += _price(policy.kv_format, reserved_tokens * heads, *shape) - saved
        window = policy.cache_capacity() if isinstance(policy, SlidingWindow) else None
        full += (min(seen, window) if window else seen) * heads * token_bytes
        if policy.kv_format is not None:
            quantized += policy.kv_format.quantized_tokens(held, heads, fed_back) / heads
            formats += 1
    peak, reserved = math.ceil(peak), math.ceil(reserved)
    return {"kv_bytes_peak": peak, "kv_bytes_reserved": reserved, "kv_bytes_full": full,
            "memory_ratio": full / peak if peak else None,
            **({"kv_quantized_tokens": round(quantized / len(layers), 3)} if formats else {}), **offload}


def _offloaded(layers, row: int, row_peak: int) -> dict:
    """Row ``row``'s ``kv_bytes_device`` and ``kv_bytes_fetched_step`` where a layer's policy offloads, priced by
    the policy from the row's state in that layer (``slot_states``: ShadowKV's landmarks and chunks) and the
    ``row_peak`` tokens it held (a layer that does not offload, or holds its prompt whole, counts whole on the
    device); empty where none can."""
    if not any(hasattr(layer.layout.policy, "offloaded_bytes") for layer in layers):
        return {}
    device = fetched = 0
    for layer in layers:
        policy, element = layer.layout.policy, layer.keys.element_size()
        heads, key_dim, value_dim = layer.keys.shape[1], _key_width(layer), layer.values.shape[-1]
        state = layer.slot_states[row] if getattr(layer, "slot_states", None) else None  # the policy's, of this row
        split = getattr(policy, "offloaded_bytes", lambda *args: None)(state, row_peak, heads, key_dim, element)
        if split is None:
            device += layer.layout.held(layer, row, row_peak)[1] * (key_dim + value_dim) * element
        else:
            device, fetched = device + split[0], fetched + split[1]
    return {"kv_bytes_device": math.ceil(device), "kv_bytes_fetched_step": fetched}


def _geometry(layer) -> tuple[int, int, int, int]:
    """``layer``'s KV heads, a token's key and value widths (full key width also where the prompt's keys are held
    reduced, ThinK's) and element bytes: a packed layer's read off its storage, not dequantized."""
    if isinstance(getattr(layer, "packed", None), PackedKV):
        _, heads, _, dim = layer.packed.dense_shape
        return heads, dim, dim, layer.packed.like.element_size()
    return layer.keys.shape[1], _key_width(layer), layer.values.shape[-1], layer.keys.element_size()


def _key_width(layer) -> int:
    """A token's key width in ``layer``: full width also where the prompt's keys are held reduced (ThinK)."""
    later = getattr(layer, "later_keys", None)
    return layer.keys.shape[-1] if later is None else later.shape[-1]


def _removed_bytes(layer, row: int) -> int:
    """Bytes row ``row`` of ``layer`` does not hold for its prompt's removed key channels (ThinK), less the index
    of the channels kept: 0 for full-width keys."""
    channels = getattr(layer, "key_channels", None)
    if channels is None:
        return 0
    heads, prompt, width = layer.keys.shape[1:]
    prompt = layer.prompt_kept[row] if hasattr(layer, "prompt_kept") else prompt  # an engine slot's own prompt
    removed = heads * prompt * (_key_width(layer) - width) * layer.keys.element_size()
    return removed - channels[row].numel() * channels.element_size()


def _price(fmt, tokens: float, heads: int, key_dim: int, value_dim: int, element: int,
           generated: float | None = None) -> float:
    """Bytes ``tokens`` held tokens of a layer take: as its quantized format stores them (:mod:`..kv_format`; the
    residual at most the ``generated`` tokens held, where known), or in the layer's dtype."""
    if fmt is not None:
        return fmt.held_bytes(tokens, heads, key_dim, value_dim, element, generated)
    return tokens * (key_dim + value_dim) * element


def _byte_seconds(stats: dict, resident: Resident, row_peak: int) -> float | None:
    """The request's memory-time product: its prefill's KV peak for the prefill's seconds, then over its decode
    seconds the bytes it held on average, step by step (each step's count of held tokens, from the prompt's kept ones
    up to the cache's limit, priced at the measured bytes per held token)."""
    if not stats.get("kv_bytes_peak") or not row_peak:
        return None
    steps = max(len(resident.tokens) - 1, 0)
    held = [min(resident.held_at_start + step, resident.limit) for step in range(1, steps + 1)] or [resident.held_at_start]
    mean_bytes = stats["kv_bytes_peak"] * (sum(held) / len(held)) / row_peak
    prefill = (stats.get("kv_bytes_prefill_peak") or 0) * (stats.get("prefill_seconds") or 0.0)
    return float(prefill + mean_bytes * stats["decode_seconds"])
