"""Two prompt methods applied in order (kvpress ``ComposedPress``)."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import torch

from evalkit.core.method_settings import setting

from ..views import PrefillView, held_as_prompt
from .base import Policy, named_settings
from .wrapper import build_scorer


@dataclasses.dataclass
class Composed(Policy):
    """``first`` keeps ``ceil(capacity * first_keeps)`` prompt tokens per KV head, then ``then`` keeps ``capacity`` of
    those: it ranks them as a prompt of its own (each head's kept tokens in text order, the queries the prompt's).
    Both are prompt methods (they act once, at the end of prefill; generated tokens are appended). Each is given as
    a config gives a wrapper's scorer: a name, its settings with a name, or a method; ``first`` None is KNorm
    keeping the queries ``then`` reads (its ``window``).

    ``then`` reads the prompt's last queries against the kept keys, so ``first`` must keep those queries' own tokens
    (its ``window`` covers them); methods that sum the attention of every query (ObservedAttention) are refused, as
    their sums would count keys ``first`` dropped. kvpress composes the same way, except that its second press sees
    the kept tokens in the first one's score order (ours: text order, which SnapKV's pooling assumes) and that it
    accepts a second press whose window queries the first dropped.
    """

    name: ClassVar[str] = "composed"
    needs_scores: ClassVar[bool] = True
    per_head: ClassVar[bool] = True  # an allocating stage (AdaKV) leaves heads unequal
    capacity: int = setting(low=1)
    first: Policy | str | dict | None = None
    then: Policy | str | dict = "snapkv"
    first_keeps: float = setting(2.0, low=1)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.then = build_scorer(self.then, self.capacity, "Composed", field="then")
        first = self.first if self.first is not None else {"name": "knorm", "window": self.then.prefill_queries() or 0}
        self.first = build_scorer(first, math.ceil(self.capacity * self.first_keeps), "Composed", field="first")
        for stage, method in (("first", self.first), ("then", self.then)):
            reason = _refusal(method)
            if reason:
                raise ValueError(f"Composed.{stage} cannot be {method.name}: {reason}")
        needed = self.then.prefill_queries()
        if needed is None or needed > self.first.kept_window():
            raise ValueError(f"Composed: {self.then.name} reads the prompt's last {needed or 'all'} queries, and "
                             f"{self.first.name} keeps only its last {self.first.kept_window()} tokens for sure "
                             f"(give first a window >= {needed}, e.g. {{name: {self.first.name}, window: {needed}}})")
        if self.then.reads_hidden_states:
            raise ValueError(f"Composed.then cannot be {self.then.name}: it scores from hidden states, and the tokens "
                             f"{self.first.name} kept are ranked without them")
        self.supports_latent = self.first.supports_latent and self.then.supports_latent
        self.reads_hidden_states = self.first.reads_hidden_states

    @classmethod
    def config_settings(cls) -> tuple[str, ...]:
        return ("first", "then", "first_keeps")

    def settings(self) -> dict:
        return {"capacity": self.capacity, "first": named_settings(self.first), "then": named_settings(self.then),
                "first_keeps": self.first_keeps}

    def check_layers(self, num_layers: int) -> None:
        self.first.check_layers(num_layers)
        self.then.check_layers(num_layers)

    def check_model(self, config) -> None:
        super().check_model(config)
        self.first.check_model(config)
        self.then.check_model(config)

    def prompt_capacity(self) -> int:
        return self.capacity

    def kept_sink(self) -> int:
        return self.first.kept_sink()

    def kept_window(self) -> int:
        return min(self.first.kept_window(), self.then.kept_window())

    def prefill_queries(self) -> int | None:
        return max(self.first.prefill_queries() or 0, self.then.prefill_queries() or 0)

    def prompt_slots(self, n: int, kv_heads: int) -> int:
        return min(self.then.prompt_slots(n, kv_heads), self.first.prompt_slots(n, kv_heads))

    def select(self, view: PrefillView, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        indices, counts, _ = self.first.select(view, kv_heads)
        n = view.keys.shape[2]
        kept = _mask(indices, counts, n)
        positions = view.positions[:, None].expand(-1, kv_heads, -1)
        prompt, order = held_as_prompt(kept, view.keys, view.values, positions, query=view.query, scaling=view.scaling,
                                       layer_idx=view.layer_idx, num_layers=view.num_layers, module=view.module,
                                       rotary=view.rotary)
        then_indices, then_counts, then_raw = self.then.select(prompt, kv_heads)
        chosen = torch.zeros_like(kept).scatter_(-1, order, _mask(then_indices, then_counts, n))
        counts = chosen.sum(dim=-1)
        keep = int(counts.max())
        position = torch.arange(n, device=chosen.device)
        indices = (position + n * ~chosen).sort(dim=-1).values[..., :keep] % n  # kept in text order, then the rest
        raw = torch.zeros_like(then_raw).scatter_(-1, order, then_raw)
        return indices, counts, raw


def _mask(indices: torch.Tensor, counts: torch.Tensor, n: int) -> torch.Tensor:
    """``[B, H, n]`` bool: the first ``counts`` of ``indices`` per head."""
    picked = torch.arange(indices.shape[-1], device=indices.device) < counts[..., None]
    return torch.zeros(*indices.shape[:-1], n, dtype=torch.bool, device=indices.device).scatter_(-1, indices, picked)


def _refusal(method: Policy) -> str | None:
    if method.rewrites:
        return "it rewrites the cache it keeps, which only the outermost method may do"
    if method.evicts_while_decoding or method.accumulates or method.cache_capacity() is not None:
        return "it acts while decoding, and Composed applies prompt methods at the end of prefill"
    if method.sums_attention:
        return "its score sums the attention of every query, which would count tokens the other stage dropped"
    if not method.needs_scores or method.takes_budget is False:
        return "it keeps every token"
    return None
