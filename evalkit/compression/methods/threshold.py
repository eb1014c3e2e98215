"""Eviction by a score threshold (DMS's mechanism, arXiv 2506.05345; kvpress ``DMSPress``, in prefill)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from evalkit.core.method_settings import setting

from .base import UNBOUNDED
from .wrapper import Wrapper


@dataclasses.dataclass
class Threshold(Wrapper):
    """Evict every prompt token its scorer (KVzap by default) scores below ``threshold``, except the last
    ``sliding_window_size`` (kvpress ``DMSPress``, decoding off: per KV head, ``score < threshold`` evicted among the
    tokens before the window) and the scorer's own forced tokens. No budget: each head keeps what clears the
    threshold, and the rows record the compression realized. kvpress' leaderboard ranks KVzap this way.
    """

    name: ClassVar[str] = "threshold"
    per_head: ClassVar[bool] = True  # heads keep what clears the threshold: different counts
    takes_budget: ClassVar[bool] = False
    inline: ClassVar[tuple[str, dict]] = ("kvzap", {})
    capacity: int | None = None  # no budget
    threshold: float | None = setting(None)
    sliding_window_size: int = setting(128, low=0)

    def scorer_capacity(self) -> int:
        return UNBOUNDED  # the scorer only ranks

    def refusal(self, scorer) -> str | None:
        cls = scorer if isinstance(scorer, type) else type(scorer)
        if cls.allocates or issubclass(cls, Wrapper):
            return "it decides each head's count itself"
        return super().refusal(scorer)

    def check_layers(self, num_layers: int) -> None:
        if self.threshold is None:
            raise ValueError("threshold needs method.threshold: the score below which a token is evicted (on the "
                             "scorer's own scale)")
        super().check_layers(num_layers)

    def kept_window(self) -> int:
        return max(self.sliding_window_size, self.scorer.kept_window())

    def layer_budget(self, layer_idx: int, num_layers: int, real_len: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(real_len)  # no row is kept whole for its length: ``allocate`` counts

    def allocate(self, scores: torch.Tensor, budget: torch.Tensor, layer_idx: int = 0) -> torch.Tensor:
        return (scores >= self.threshold).sum(dim=-1)  # forced tokens score +inf, padding -inf
