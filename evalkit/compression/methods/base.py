"""The method contract: what a compression method decides, and nothing else.

* which prompt tokens survive prefill (:meth:`Policy.select`): at most ``prompt_capacity`` of them, the first
  ``kept_sink`` and last ``kept_window`` tokens always, the rest ranked by :meth:`Policy.score` (per layer and per KV
  head). ``layer_budget`` and ``allocate`` let a method keep a different number per layer (PyramidKV) or per head
  (AdaKV); a method may replace :meth:`Policy.select` altogether;
* how the cache behaves while decoding: the surviving prompt tokens are followed by a region of ``ring_size`` slots
  that new tokens fill in order and, once full, overwrite oldest first. The first ``fixed`` cached tokens are never
  overwritten. A method that evicts by score while decoding (H2O, TOVA, SnapKV re-applied) names, after each step's
  attention, the slots it frees (``decode_evict``); the next tokens take them;
* what it keeps of each row's own prompt for its decode-time hooks (``keeps_slot_state``): one object per layer and
  row, made by :meth:`Policy.prefill_state` as the row's prompt is kept and handed back to :meth:`Policy.decode_visible`
  as ``states``. The runtime carries it with the row: the session's layer per row, into its engine slot at admission,
  copied with a forked session, dropped when the slot's request ends (a free slot holds None). A policy instance holds
  no per-request state of its own: rows of one batch, slots of one engine and forks share it.

A method is a dataclass of settings (:func:`~.settings.setting`: type, bounds and default in one place). Its
capabilities are plain values: class attributes, which a wrapper (:mod:`.wrapper`) sets on its instance from what it
wraps. Everything else (gathering rows, ring writes, per-head validity, masks, positions) is the runtime's.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from evalkit.core.errors import ConfigError
from evalkit.core.method_settings import check, setting

from ..kernels import reduce_groups, snapkv_scores
from ..model_spec import attention_sinks, layer_kinds
from ..views import DecodeView, PrefillView

UNBOUNDED = 1 << 62  # ring size of a cache that only grows

# Every method by its name: a subclass of :class:`Policy` that names itself (``name = "..."``) registers here when its
# module is imported; budgets, configs and presets read the methods from it.
REGISTRY: dict[str, type[Policy]] = {}


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
    # Decides how many tokens each layer or head keeps from another method's ranking (AdaKV, PyramidKV).
    allocates: ClassVar[bool] = False
    # Its score reads every prompt query itself (not statistics of those at hand): never re-applied while decoding.
    reads_every_query: ClassVar[bool] = False
    # Rewrites the kept keys or values after selection (key re-rotation, merging, key-channel pruning): :meth:`rewrite`.
    rewrites: ClassVar[bool] = False
    # Scores from the attention's input (``PrefillView.hidden``: KVzap's surrogate), recorded while the prompt runs.
    reads_hidden_states: ClassVar[bool] = False
    # Scores the prompt by running the model again over inputs of its own after the prefill (KVzip's context
    # reconstruction, :mod:`..reconstruction`): every layer is sized and compressed once all the passes have run.
    extra_passes: ClassVar[bool] = False
    # Its passes' scores do not depend on the budget: the jobs of a sweep over the same prompt run them once
    # (:mod:`..prefill_store`) and each budget keeps its share of them.
    budget_free_passes: ClassVar[bool] = False
    # Keeps every token but lets each decode step attend to part of them (Quest): :meth:`decode_visible`.
    selects_while_decoding: ClassVar[bool] = False
    # Keeps state per row (per engine slot) from the row's prefill: :meth:`prefill_state`, read back by
    # :meth:`decode_visible` (ShadowKV's landmarks).
    keeps_slot_state: ClassVar[bool] = False
    # Its ranking can serve a wrapper (AdaKV, DecodingSnapKV, ...); False where it is tied to the method's own sizing
    # and schedule (R-KV keeps ``capacity - interval``).
    wrappable: ClassVar[bool] = True
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

    # kvpress' ``compression_ratio`` (a ``removed_R`` budget): the fraction of each prompt removed. The method is then
    # sized for every prompt by its own length (:meth:`for_prompt`); ``capacity`` is the longest prompt's.
    removed: ClassVar[float | None] = None
    # The quantized storage the cache holds (:class:`..kv_format.KVFormat`; None: the model's dtype), set by a run's
    # ``kv_bits`` on the method's instance.
    kv_format: ClassVar[object | None] = None

    def __post_init__(self) -> None:
        check(self)

    def for_prompt(self, n: int) -> Policy:
        """The method as it compresses an ``n``-token prompt: itself, or under a ``removed`` fraction the same
        method keeping ``int(n * (1 - removed))`` of the prompt."""
        if self.removed is None:
            return self
        keep = max(1, int(n * (1 - self.removed)))
        try:
            sized = dataclasses.replace(self, capacity=keep)
        except ValueError as error:
            raise ValueError(f"removing {self.removed} of a {n}-token prompt keeps {keep} of them, too few for "
                             f"{self.name}: {error}") from None
        for name, value in vars(self).items():  # what was bound at run time (KVzip's prompt), not the fraction
            if name != "removed" and name not in vars(sized):
                setattr(sized, name, value)
        return sized

    @classmethod
    def from_config(cls, capacity: int, **params) -> Policy:
        """The method as a config gives it: its settings ``params``, sized by a budget's ``capacity`` (None: a method
        that ``takes_budget`` False)."""
        return cls(**params) if capacity is None else cls(capacity=capacity, **params)

    @classmethod
    def config_settings(cls) -> tuple[str, ...]:
        """The settings a config may give (everything but what the budget decides)."""
        return tuple(field.name for field in dataclasses.fields(cls) if field.name not in cls.budget_fields)

    def check_layers(self, num_layers: int) -> None:
        """Raise a ValueError if the method cannot run on a model of ``num_layers`` layers (settings given per
        layer)."""

    def check_model(self, config) -> None:
        """Raise a one-line ValueError if the method cannot run on a model of this (text) ``config``: read from the
        model's files before its weights load (:mod:`evalkit.models.limits`), so a method states its own constraint
        here (the head size it divides, the files it needs) and a run that cannot go is refused before it starts. By
        default: the cache kind, from the capabilities (a latent cache without ``supports_latent``; sliding-window
        layers under ``extra_passes``). The prefill checks the same again on the loaded model."""
        if getattr(config, "kv_lora_rank", None) and not self.supports_latent:
            allowed = ", ".join(sorted(name for name, cls in REGISTRY.items() if cls.supports_latent))
            raise ValueError(f"method={self.name} does not run on a latent (MLA) cache, this model's: "
                             f"{self.latent_refusal}; methods that do: {allowed}")
        sliding = layer_kinds(config).count("sliding_attention")
        if self.extra_passes and sliding:
            raise ValueError(f"method={self.name} does not run on a model with sliding-window layers ({sliding} of "
                             f"its {config.num_hidden_layers} keep only their last {config.sliding_window} tokens): its "
                             "passes run over every layer's whole prompt; choose a method that scores the prompt in its "
                             "prefill (snapkv, for one)")

    def bind_tokenizer(self, tokenizer) -> None:
        """Read what the method needs of the model's tokenizer (KVzip: its reconstruction prompt). Most need
        nothing."""

    def bind_model(self, model) -> None:
        """Read what the method needs of the model itself before its first prompt (DuoAttention's pattern estimated
        on the fly). Most need nothing."""

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

    def slot_capacity(self, kv_heads: int) -> int | None:
        """Most tokens one KV head of a layer ever holds (the slot axis of a static cache; ``None``: it grows): the
        cache capacity, unless heads share it unequally."""
        return self.cache_capacity()

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

    def allocate(self, scores: torch.Tensor, budget: torch.Tensor, layer_idx: int = 0) -> torch.Tensor:
        """Tokens each KV head keeps, ``[batch, kv_heads]``, given the layer's ranked scores (``+inf`` forced,
        ``-inf`` padding) and the per-row budget per head (layer ``layer_idx``): by default every head keeps the
        budget."""
        return budget[:, None].expand(-1, scores.shape[1]).clone()

    def query_window(self) -> int:
        """Decode queries a decode-time policy needs to look back at (SnapKV re-applied); 0: none."""
        return 0

    def prompt_slots(self, n: int, kv_heads: int) -> int:
        """Most prompt tokens one KV head of one layer may keep of an ``n``-token prompt (to size static caches)."""
        capacity = self.prompt_capacity()
        return n if capacity is None else min(n, capacity)

    def rewrite(self, view: PrefillView, indices: torch.Tensor, counts: torch.Tensor, keys: torch.Tensor,
                values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The kept ``keys`` and ``values`` ``[B, Hkv, kept, D]`` (the prompt tokens ``indices`` names, the first
        ``counts`` of each head real) as the cache will hold them. Runs after :meth:`select` where ``rewrites``."""
        return keys, values

    def prefill_state(self, view: PrefillView) -> list:
        """What the method keeps of each row's prompt in layer ``view.layer_idx``, one object per row (None: nothing),
        from the prompt as ``view`` holds it. Runs where ``keeps_slot_state``, once the layer's prompt is kept (after
        :meth:`select` and :meth:`rewrite`); the runtime carries each row's object (module docstring)."""
        return [None] * view.keys.shape[0]

    def decode_visible(self, query: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, layer_idx: int,
                       states: list | None = None) -> torch.Tensor | None:
        """The held slots a decode step's attention reads, ``[B, Hq, S]`` bool (None: every visible one). ``query``
        ``[B, Hq, q, D]`` (post-RoPE), ``keys`` ``[B, Hkv, S, D]`` (this step's written), ``visible`` ``[B, 1 or Hkv,
        S]`` the slots the step may see, ``states`` the layer's :meth:`prefill_state` objects per row (an engine's per
        slot, None where a slot holds none; None for a method that keeps none). Runs before the attention where
        ``selects_while_decoding``."""
        return None

    def decode_evict(self, view: DecodeView) -> torch.Tensor | None:
        """Slots to free after this decode step, ``[B, Hkv, S]`` bool, or None."""
        return None

    def select(self, view: PrefillView, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The prompt tokens to keep, per row and KV head: indices ``[B, kv_heads, kept]`` (in text order; a head
        that keeps fewer than ``kept`` has its extra picks last), the count each head keeps ``[B, kv_heads]``, and the
        raw scores ``[B, kv_heads, n]``. ``kv_heads``: the cache's heads (1 for a latent cache). Where
        ``view.head_valid`` is given (a cache ranked as a prompt), each head's own tokens count."""
        keys, valid = view.keys, view.key_valid if view.head_valid is None else view.head_valid
        valid = valid[:, None] if valid.dim() == 2 else valid  # [B, 1 or Hkv, n]
        real_len = valid.sum(dim=-1).amax(dim=1)
        batch, n = keys.shape[0], keys.shape[2]
        window, sink = min(self.kept_window(), n), self.kept_sink()
        budget = self.layer_budget(view.layer_idx, view.num_layers, real_len).to(keys.device)
        raw = torch.zeros(batch, kv_heads, n, device=keys.device)
        if self.needs_scores and n > window:
            raw = self.score(view).float()
            if raw.shape[1] != kv_heads:  # per-head scores over a shared latent: one group of all the heads
                raw = reduce_groups(raw[:, None], getattr(self, "gqa_reduce", "mean"))
        position = torch.arange(n, device=keys.device)
        first = (n - valid.sum(dim=-1))[..., None]  # [B, 1 or Hkv, 1]
        forced = (position >= n - window) | ((position >= first) & (position < first + sink))
        forced |= (real_len <= budget)[:, None, None]
        scores = raw.masked_fill(forced, float("inf")).masked_fill(~valid, float("-inf"))
        counts = torch.minimum(self.allocate(scores, budget, view.layer_idx), valid.sum(dim=-1))
        return best_in_order(scores, counts), counts, raw

    def settings(self) -> dict:
        """The method's settings as the result tables record them (what builds it again from a config). A setting
        added after runs were recorded (``recorded_when_set``) is left out while at its default, so that those runs
        keep their config digest."""
        out = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not (field.metadata.get("recorded_when_set") and value == field.default):
                out[field.name] = value
        return out

    def config(self) -> dict:
        """Flat description of the method, for result tables."""
        return {"method": self.name, "capacity": self.cache_capacity(), **self.settings()}


def refused_kv_format(reason: str) -> property:
    """A method's ``kv_format`` that stays None: a quantized KV format is refused in one line naming ``reason``."""

    def refuse(policy: Policy, fmt) -> None:
        if fmt is not None:
            raise ConfigError(f"kv_bits < 16 does not combine with method={policy.name}: {reason}; use kv_bits=16")

    return property(lambda policy: None, refuse)


def best_in_order(scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Each head's ``counts`` best ``scores`` ``[B, H, n]``, as indices ``[B, H, max count]`` in text order, the picks
    beyond a head's own count (padding, or a head that keeps less) last."""
    n, keep = scores.shape[-1], int(counts.max())
    # Max pooling copies one score to its neighbours, so ties are common: a stable sort breaks them towards the
    # earlier token, deterministically.
    indices = scores.sort(dim=-1, descending=True, stable=True).indices[..., :keep]
    unused = torch.arange(keep, device=scores.device) >= counts[..., None]
    return (indices + n * unused).sort(dim=-1).values % n


def named_settings(policy: Policy) -> dict:
    """``{"name": ..., setting: value}``: what builds ``policy`` again under a wrapper (its budget is the wrapper's)."""
    fields = policy.settings()
    for name in policy.budget_fields:
        fields.pop(name, None)
    return {"name": policy.name, **fields}


@dataclasses.dataclass
class SnapKVScoring(Policy):
    """Fields and validation shared by the policies that rank prompt tokens with the SnapKV score."""

    needs_scores: ClassVar[bool] = True
    supports_latent: ClassVar[bool] = True
    capacity: int = setting(low=1)
    window: int = setting(32, low=1)
    kernel_size: int = setting(7, low=1, odd=True)
    pooling: str = setting("max", choices=("max", "avg"))
    gqa_reduce: str = setting("mean", choices=("mean", "max"))

    def kept_window(self) -> int:
        return self.window

    def prefill_queries(self) -> int:
        return self.window

    def score(self, view: PrefillView) -> torch.Tensor:
        window = self.window
        valid = view.key_valid if view.head_valid is None else view.head_valid
        prefix = snapkv_scores(view.query[:, :, view.query.shape[2] - window :], view.keys, valid, view.scaling,
                               self.kernel_size, self.pooling, self.gqa_reduce, attention_sinks(view.module))
        return torch.nn.functional.pad(prefix, (0, window))


@dataclasses.dataclass
class PromptScoring(Policy):
    """Fields shared by the policies that rank prompt tokens once, at the end of prefill, by a score of their own
    (KNorm, Random, ObservedAttention, ExpectedAttention): keep ``capacity`` prompt tokens per layer and KV head,
    the first ``sink`` and last ``window`` always; generated tokens are appended (the cache grows, as SnapKV's).
    kvpress' scorer presses force nothing, hence ``sink = window = 0`` by default."""

    needs_scores: ClassVar[bool] = True
    capacity: int = setting(low=1)
    sink: int = setting(0, low=0)
    window: int = setting(0, low=0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.capacity <= self.sink + self.window:
            raise ValueError(f"{type(self).__name__}.capacity must be > sink + window ({self.sink + self.window}), "
                             f"got {self.capacity}")

    def kept_sink(self) -> int:
        return self.sink

    def kept_window(self) -> int:
        return self.window

    def prompt_capacity(self) -> int:
        return self.capacity


