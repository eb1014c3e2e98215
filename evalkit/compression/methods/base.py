"""Shared mechanics of the compression policies.

A policy decides two things, and nothing else:

* which prompt tokens survive prefill: at most ``prompt_capacity`` of them, the first ``sink`` and last ``window``
  tokens always, the rest ranked by ``score`` (per layer and per KV head). ``layer_budget`` and ``allocate`` let a
  policy keep a different number per layer (PyramidKV) or per head (AdaKV);
* how the cache behaves while decoding: the surviving prompt tokens are followed by a region of ``ring_size`` slots
  that new tokens fill in order and, once full, overwrite oldest first. The first ``fixed`` cached tokens are never
  overwritten. A policy that evicts by score while decoding (H2O, TOVA, SnapKV re-applied) names, after each step's
  attention, the slots it frees (``decode_evict``); the next tokens take them.

Everything else (gathering rows, ring writes, per-head validity, masks, positions) lives in
:mod:`evalkit.compression.cache`, once.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from ..kernels import snapkv_scores
from ..model_spec import attention_sinks
from ..views import DecodeView, PrefillView

UNBOUNDED = 1 << 62  # ring size of a cache that only grows

# Every method by its name: a subclass of :class:`Policy` that names itself (``name = "..."``) registers here when its
# module is imported; budgets, configs and presets read the methods from it.
REGISTRY: dict[str, type[Policy]] = {}


def require_int(owner: object, name: str, low: int, high: int | None = None) -> None:
    """Raise a ValueError naming ``name`` unless ``owner.name`` is an int in [low, high]."""
    value = getattr(owner, name)
    allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        raise ValueError(f"{type(owner).__name__}.{name} must be an integer {allowed}, got {value!r}")


def require_choice(owner: object, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(owner, name)
    if value not in choices:
        raise ValueError(f"{type(owner).__name__}.{name} must be one of {list(choices)}, got {value!r}")


@dataclasses.dataclass
class Policy:
    """Base class: no eviction. Subclasses override the class attributes and :meth:`score` only."""

    name: ClassVar[str] = "full"
    needs_scores: ClassVar[bool] = False
    # The cache keeps its validity per layer and KV head (different counts, or different slots freed while decoding)
    # instead of one count per row shared by all layers and heads.
    per_head: ClassVar[bool] = False
    # Decode-time eviction: ``decode_evict`` runs after every decode step's attention.
    evicts_while_decoding: ClassVar[bool] = False
    # Keep a running per-slot score (the accumulated attention of H2O), gathered with the prompt tokens kept.
    accumulates: ClassVar[bool] = False
    # Its prefill score is a function of the attention every prompt query gives each key, summed
    # (:func:`causal_attention_sums` over all the queries): chunked prefill accumulates the sums chunk by chunk.
    sums_attention: ClassVar[bool] = False
    # Works on a latent (MLA) cache: one shared head whose per-head keys attention expands; scores are reduced over
    # all the layer's heads, as for a single KV group. Opt-in: a method says so once it is tested on one.
    supports_latent: ClassVar[bool] = False
    latent_refusal: ClassVar[str] = "it has not been tested on a latent (MLA) cache"
    # Sized by a budget (``4x``, ``tokens_N``); the fields the budget decides, which a config may not set.
    takes_budget: ClassVar[bool] = True
    budget_fields: ClassVar[tuple[str, ...]] = ("capacity",)

    def __init_subclass__(cls, register: bool = True, **kwargs):
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("name")
        if name is None or not register:  # a shared base (SnapKVScoring), a variant, or evalkit's own machinery
            return
        known = REGISTRY.get(name)
        if known is not None and (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
            raise TypeError(f"two methods named {name!r}: {known.__module__}.{known.__qualname__} and "
                            f"{cls.__module__}.{cls.__qualname__}")
        REGISTRY[name] = cls

    @classmethod
    def from_budget(cls, capacity: int, **params) -> Policy:
        """The method with the ``capacity`` a budget gives it (``params``: its other settings)."""
        return cls(capacity=capacity, **params)

    def kept_sink(self) -> int:
        """Leading prompt tokens always kept (attention sinks)."""
        return 0

    def kept_window(self) -> int:
        """Trailing prompt tokens always kept (for SnapKV-style policies, also the queries that score the rest)."""
        return 0

    def prompt_capacity(self) -> int | None:
        """Most prompt tokens kept after prefill; ``None`` keeps them all."""
        return None

    def cache_capacity(self) -> int | None:
        """Most tokens the cache ever holds per sequence; ``None`` when it grows with the sequence."""
        return None

    def decode_layout(self, kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For per-row counts of kept prompt tokens, return (fixed slots, ring size) per row."""
        return kept.clone(), torch.full_like(kept, UNBOUNDED)

    def score(self, view: PrefillView) -> torch.Tensor:
        """Importance of every prompt key, ``[batch, kv_heads, n]`` (higher is kept first). The values at forced
        positions (sink, window) and on padding are ignored."""
        raise NotImplementedError(f"{type(self).__name__} does not score tokens")

    def prefill_queries(self) -> int | None:
        """How many of the prompt's last queries :meth:`score` reads (None: all of them). Chunked prefill keeps only
        these between chunks (a ``sums_attention`` policy keeps the sums instead)."""
        return None if self.needs_scores and not self.sums_attention else 0

    def layer_budget(self, layer_idx: int, num_layers: int, real_len: torch.Tensor) -> torch.Tensor:
        """Prompt tokens each row keeps per KV head in layer ``layer_idx`` (``real_len``: each row's prompt length)."""
        capacity = self.prompt_capacity()
        return real_len.clone() if capacity is None else real_len.clamp(max=capacity)

    def allocate(self, scores: torch.Tensor, budget: torch.Tensor) -> torch.Tensor:
        """Tokens each KV head keeps, ``[batch, kv_heads]``, given the layer's ranked scores (``+inf`` forced,
        ``-inf`` padding) and the per-row budget per head: by default every head keeps the budget."""
        return budget[:, None].expand(-1, scores.shape[1]).clone()

    def query_window(self) -> int:
        """Decode queries a decode-time policy needs to look back at (SnapKV re-applied); 0: none."""
        return 0

    def prompt_slots(self, n: int, kv_heads: int) -> int:
        """Most prompt tokens one KV head of one layer may keep of an ``n``-token prompt (to size static caches)."""
        capacity = self.prompt_capacity()
        return n if capacity is None else min(n, capacity)

    def decode_evict(self, view: DecodeView) -> torch.Tensor | None:
        """Slots to free after this decode step, ``[B, Hkv, S]`` bool, or None."""
        return None

    def unused_fields(self) -> tuple[str, ...]:
        """Fields this instance ignores (a wrapper's own scoring settings once it takes another scorer's): the tables
        leave them out rather than show a setting that did nothing."""
        return ()

    def config(self) -> dict:
        """Flat description of the policy, for result tables."""
        return {"method": self.name, "capacity": self.cache_capacity(), **recorded_fields(self)}


def recorded_fields(policy: Policy) -> dict:
    """A policy's settings as the result tables record them: its fields, a scorer as its own settings (name first).
    A field added to a method after runs were recorded (``metadata={"recorded_when_set": True}``) is left out while
    it holds its default, so that those runs keep their config digest."""
    out = {}
    for field in dataclasses.fields(policy):
        value = getattr(policy, field.name)
        if field.metadata.get("recorded_when_set") and value == field.default or field.name in policy.unused_fields():
            continue
        out[field.name] = scorer_settings(value) if isinstance(value, Policy) else value
    return out


def scorer_settings(scorer: Policy) -> dict:
    """``{"name": ..., setting: value}``: what builds ``scorer`` again under a wrapper (its capacity is the wrapper's)."""
    fields = recorded_fields(scorer)
    for name in scorer.budget_fields:
        fields.pop(name, None)
    return {"name": scorer.name, **fields}


@dataclasses.dataclass
class SnapKVScoring(Policy):
    """Fields and validation shared by the policies that rank prompt tokens with the SnapKV score."""

    needs_scores: ClassVar[bool] = True
    supports_latent: ClassVar[bool] = True
    capacity: int
    window: int = 32
    kernel_size: int = 7
    pooling: str = "max"
    gqa_reduce: str = "mean"

    def __post_init__(self) -> None:
        require_int(self, "capacity", 1)
        require_int(self, "window", 1)
        require_int(self, "kernel_size", 1)
        if self.kernel_size % 2 == 0:
            # Even kernels with padding k//2 change the length of the pooled scores; the reference code uses odd ones.
            raise ValueError(f"{type(self).__name__}.kernel_size must be odd, got {self.kernel_size}")
        require_choice(self, "pooling", ("max", "avg"))
        require_choice(self, "gqa_reduce", ("mean", "max"))

    def kept_window(self) -> int:
        return self.window

    def prefill_queries(self) -> int:
        return self.window

    def score(self, view: PrefillView) -> torch.Tensor:
        window = self.window
        prefix = snapkv_scores(view.query[:, :, view.query.shape[2] - window :], view.keys, view.key_valid, view.scaling,
                               self.kernel_size, self.pooling, self.gqa_reduce, attention_sinks(view.module))
        return torch.nn.functional.pad(prefix, (0, window))


@dataclasses.dataclass
class PromptScoring(Policy):
    """Fields shared by the policies that rank prompt tokens once, at the end of prefill, by a score of their own
    (KNorm, Random, ObservedAttention, ExpectedAttention): keep ``capacity`` prompt tokens per layer and KV head,
    the first ``sink`` and last ``window`` always; generated tokens are appended (the cache grows, as SnapKV's).
    kvpress' scorer presses force nothing, hence ``sink = window = 0`` by default."""

    needs_scores: ClassVar[bool] = True
    capacity: int
    sink: int = 0
    window: int = 0

    def __post_init__(self) -> None:
        require_int(self, "capacity", 1)
        require_int(self, "sink", 0)
        require_int(self, "window", 0)
        if self.capacity <= self.sink + self.window:
            raise ValueError(f"{type(self).__name__}.capacity must be > sink + window ({self.sink + self.window}), "
                             f"got {self.capacity}")

    def kept_sink(self) -> int:
        return self.sink

    def kept_window(self) -> int:
        return self.window

    def prompt_capacity(self) -> int:
        return self.capacity


