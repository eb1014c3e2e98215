"""H2O, heavy-hitter oracle (Zhang et al., NeurIPS 2023, arXiv 2306.14048; reference code FMInference/H2O,
``h2o_hf/utils_real_drop``: ``H2OKVCache_LayerWise``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from evalkit.core.method_settings import setting

from ..kernels import causal_attention_sums, free_lowest, reduce_groups
from ..views import DecodeView, PrefillView
from .base import Policy


@dataclasses.dataclass
class H2O(Policy):
    """Heavy hitters (most attention received, accumulated over every query so far) plus the most recent tokens.

    Every cached token carries the sum of the attention it has received (per KV head: the mean over the query heads
    of its group). At the end of prefill the prompt keeps its last ``recent`` tokens and its ``capacity - 1 -
    recent`` heaviest earlier tokens. Then, at every decode step, the new token takes the free slot, attends over
    at most ``capacity`` tokens (itself included), every attention weight is added to the running sums, and once
    the cache is full the lightest token outside the ``recent`` most recent is evicted, freeing a slot for the next
    token. This is the reference ``H2OKVCache_LayerWise`` with ``hh_size + recent_size = capacity - 1``: the
    reference also attends over ``hh + recent + 1`` tokens and evicts after the attention. ``recent`` defaults to
    half of the tokens kept (the paper's equal heavy and recent budgets).
    """

    name: ClassVar[str] = "h2o"
    supports_latent: ClassVar[bool] = True
    needs_scores: ClassVar[bool] = True
    per_head: ClassVar[bool] = True
    evicts_while_decoding: ClassVar[bool] = True
    accumulates: ClassVar[bool] = True
    sums_attention: ClassVar[bool] = True
    capacity: int = setting(0, low=3)
    recent: int | None = setting(None, low=1)
    gqa_reduce: str = setting("mean", choices=("mean", "max"))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.recent is None:
            self.recent = (self.capacity - 1) // 2
        if self.recent > self.capacity - 2:
            raise ValueError(f"H2O.recent must be an integer in [1, {self.capacity - 2}], got {self.recent!r}")

    def kept_window(self) -> int:
        return self.recent

    def prompt_capacity(self) -> int:
        return self.capacity - 1

    def cache_capacity(self) -> int:
        return self.capacity

    def score(self, view: PrefillView) -> torch.Tensor:
        return reduce_groups(causal_attention_sums(view), self.gqa_reduce)

    def decode_evict(self, view: DecodeView) -> torch.Tensor | None:
        batch, kv_heads, slots = view.valid.shape
        grouped = view.probabilities.reshape(batch, kv_heads, -1, slots)
        view.scores += reduce_groups(grouped, self.gqa_reduce)
        full = view.valid.sum(dim=-1) >= self.capacity  # [B, Hkv]
        heavy = view.valid & (view.positions <= (view.position - self.recent)[:, None, None])
        return free_lowest(view.scores, heavy, full)
