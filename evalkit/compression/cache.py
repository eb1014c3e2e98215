"""A transformers ``Cache`` whose rows really shrink, and the attention hook that feeds it.

Layout: every layer stores keys/values ``[batch, kv_heads, slots, head_dim]``. All layers share one bookkeeping
object (:class:`RowState`) because a policy keeps the same *number* of tokens in every layer and head (which tokens
differs per layer and head). Per row: the first ``kept`` slots hold the surviving prompt tokens in text order, then
new tokens are written slot by slot; a ring policy wraps around after ``fixed`` slots. Slots a row does not use (a
shorter prompt in a batch) are invalid and masked out; padding is never kept.

The hook is an attention function registered in transformers' ``AttentionInterface``: it delegates the attention
itself to the model's own implementation (sdpa or eager) and, at the end of prefill, hands the post-RoPE queries of the
observation window and the layer's keys to the policy, then gathers the kept rows into the cache.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    AttentionMaskInterface,
)

from .base import Policy

SUPPORTED_ATTENTION = ("sdpa", "eager")
_ACTIVE: contextvars.ContextVar[CompressedCache | None] = contextvars.ContextVar("evalkit_cache", default=None)


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
        index = self.written[:, None] + torch.arange(count)
        fixed, ring = self.fixed[:, None], self.ring[:, None]
        return torch.where(index < fixed, index, fixed + (index - fixed) % ring)

    def wraps(self, count: int) -> bool:
        """Whether writing ``count`` tokens at once would overwrite a slot that one of them must still see."""
        return count > 1 and bool(((self.written + count - self.fixed) > self.ring).any())


class CompressedLayer(DynamicLayer):
    """One layer's keys and values; the prompt is compressed by :meth:`compress`, new tokens go where the state says."""

    def __init__(self, cache: CompressedCache):
        super().__init__()
        self.cache = cache

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:  # prefill: keep everything until the hook has scored this layer
            self.lazy_initialization(key_states, value_states)
            self.keys, self.values = key_states, value_states
            return self.keys, self.values
        slots = self.cache.pending_slots  # [B, q] on the device
        grow = self.cache.state.slots - self.keys.shape[-2]
        if grow > 0:
            pad = (0, 0, 0, grow)
            self.keys = torch.nn.functional.pad(self.keys, pad)
            self.values = torch.nn.functional.pad(self.values, pad)
        index = slots[:, None, :, None].expand(-1, key_states.shape[1], -1, key_states.shape[-1])
        self.keys.scatter_(2, index, key_states)
        self.values.scatter_(2, index, value_states)
        return self.keys, self.values

    def compress(self, index: torch.Tensor) -> None:
        """Keep the rows ``index`` ``[B, kv_heads, kept]`` of this layer's keys and values, in that order."""
        gather = index[..., None].expand(-1, -1, -1, self.keys.shape[-1])
        self.keys = self.keys.gather(2, gather)
        self.values = self.values.gather(2, gather)


class CompressedCache(Cache):
    """The cache a policy controls. Built by :class:`CompressionSession`; not meant to be passed to ``model.generate``."""

    def __init__(self, policy: Policy, num_layers: int):
        super().__init__(layers=[])
        self.policy = policy
        self.layers = [CompressedLayer(self) for _ in range(num_layers)]
        self.state: RowState | None = None
        self.pending_slots: torch.Tensor | None = None
        self.prefill_plan: dict | None = None
        self.compressed_layers: set[int] = set()
        self.all_visible = False  # this decode step's token sees every slot: no mask needed

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].get_seq_length()

    # -- prefill ---------------------------------------------------------------------------------------------------
    def select(self, query: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
        """Indices of the prompt tokens to keep, per row and KV head: ``[B, kv_heads, kept]`` in text order."""
        plan = self.prefill_plan
        key_valid, real_len, keep = plan["key_valid"], plan["real_len"], plan["keep"]
        policy = self.policy
        batch, kv_heads, n, _ = keys.shape
        window, sink = min(policy.kept_window(), n), policy.kept_sink()
        scores = torch.zeros(batch, kv_heads, n, device=keys.device)
        if policy.needs_scores and n > window:
            scores[..., : n - window] = policy.score(query[:, :, n - window :], keys, key_valid, scaling)
        position = torch.arange(n, device=keys.device)
        first = (n - real_len)[:, None]
        forced = (position >= n - window)[None, :] | ((position >= first) & (position < first + sink))
        forced |= (real_len <= keep)[:, None]
        scores = scores.masked_fill(forced[:, None], float("inf")).masked_fill(~key_valid[:, None], float("-inf"))
        # Max pooling copies one score to its neighbours, so ties are common: a stable sort breaks them towards the
        # earlier token, deterministically.
        ranked = scores.sort(dim=-1, descending=True, stable=True)
        values, indices = ranked.values[..., :keep], ranked.indices[..., :keep]
        # Real tokens first in text order, then the padding picks that fill a short row's unused slots.
        order = indices + n * (values == float("-inf"))
        return order.sort(dim=-1).values % n

    def compress_layer(self, layer_idx: int, query: torch.Tensor, keys: torch.Tensor, scaling: float) -> None:
        if layer_idx in self.compressed_layers:
            raise RuntimeError(f"layer {layer_idx} was compressed twice in one prefill; its attention is shared")
        self.compressed_layers.add(layer_idx)
        if self.prefill_plan["compress"]:
            self.layers[layer_idx].compress(self.select(query, keys, scaling))

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
        state.peak = torch.where(active, torch.maximum(state.peak, held), state.peak)
        self.pending_slots = slots_dev
        mask = state.valid[:, None, None, :] & (state.slot_pos[:, None, None, :] <= positions[:, None, :, None])
        self.all_visible = count == 1 and bool(mask.all())
        return mask


def _hooked_attention(delegate):
    def attention(module, query, key, value, attention_mask, **kwargs):
        cache = _ACTIVE.get()
        if cache is not None and cache.prefill_plan is None and cache.all_visible:
            # One new token that sees every slot (a full ring, no padding): without a mask, sdpa can use its GQA
            # path instead of copying K/V for every query head.
            attention_mask = None
        output = delegate(module, query, key, value, attention_mask, **kwargs)
        if cache is not None and cache.prefill_plan is not None:
            cache.compress_layer(module.layer_idx, query, key, kwargs.get("scaling", module.scaling))
        return output

    return attention


def _register_hooks() -> None:
    # Llama's eager attention is the one the Llama, Qwen2/3 and Mistral families share.
    from transformers.models.llama.modeling_llama import eager_attention_forward

    delegates = {"sdpa": sdpa_attention_forward, "eager": eager_attention_forward}
    for name, delegate in delegates.items():
        AttentionInterface.register(f"evalkit_{name}", _hooked_attention(delegate))
        AttentionMaskInterface.register(f"evalkit_{name}", ALL_MASK_ATTENTION_FUNCTIONS[name])


_register_hooks()


def check_hookable(model) -> None:
    """Fail before any compute if this model's attention cannot go through the hook."""
    config = model.config
    implementation = config._attn_implementation
    if implementation not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"attention implementation {implementation!r} cannot be compressed; load the model with "
            f"attn_implementation in {list(SUPPORTED_ATTENTION)}"
        )
    if getattr(config, "kv_lora_rank", None):
        raise ValueError(f"{type(model).__name__} uses latent (MLA) attention, which the reference policies do not support")
    attention_modules = [m for m in model.modules() if type(m).__name__.endswith("Attention")]
    if not attention_modules or any(getattr(m, "layer_idx", None) is None for m in attention_modules):
        raise ValueError(f"{type(model).__name__} has no attention modules with a layer_idx; it cannot be hooked")
    layer_types = getattr(config, "layer_types", None) or []
    if any(kind != "full_attention" for kind in layer_types):
        raise ValueError(
            f"{type(model).__name__} has non-full attention layers ({sorted(set(layer_types))}); only full-attention "
            "models are supported"
        )


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
