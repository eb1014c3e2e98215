"""AdaKV (Feng et al., arXiv 2407.11550; kvpress ``AdaKVPress`` over ``SnapKVPress``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from evalkit.core.method_settings import setting

from .wrapper import Wrapper


@dataclasses.dataclass
class AdaKV(Wrapper):
    """A scorer's ranking (SnapKV's by default, see :mod:`.wrapper`) with each layer's budget shared among its KV
    heads by score.

    Per row and layer, ``capacity`` tokens per KV head on average: every head first keeps its own top
    ``int(capacity * alpha_safeguard)`` tokens (the observation window ranks first), then the layer keeps its
    ``kv_heads * capacity`` best-scoring tokens across all heads, so heads whose attention is spread keep more than
    heads whose attention is concentrated. This is kvpress' ``AdaKVPress`` selection (reference safeguard 0.2),
    except that the pruned tokens leave the cache instead of being masked: each head holds its own count, on a slot
    axis padded to the largest head, and the statistics report the count per layer and head.
    """

    name: ClassVar[str] = "adakv"
    per_head: ClassVar[bool] = True
    allocates: ClassVar[bool] = True
    # kvpress' SnapKVPress under AdaKVPress: window 64, kernel 5, average pooling (not our SnapKV's 32/7/max).
    inline: ClassVar[tuple[str, dict]] = ("snapkv", {"window": 64, "kernel_size": 5, "pooling": "avg"})
    alpha_safeguard: float = setting(0.2, low=0, high=1)

    def prompt_capacity(self) -> int:
        return self.capacity

    def prompt_slots(self, n: int, kv_heads: int) -> int:
        # One head may take the layer's whole budget but what the others' safeguards keep.
        return min(n, kv_heads * self.capacity - (kv_heads - 1) * int(self.capacity * self.alpha_safeguard))

    def allocate(self, scores: torch.Tensor, budget: torch.Tensor, layer_idx: int = 0) -> torch.Tensor:
        batch, kv_heads, n = scores.shape
        budget = budget.to(scores.device)
        safe = (budget.double() * self.alpha_safeguard).long()  # int() of a non-negative number
        own_rank = scores.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
        protected = scores.masked_fill(own_rank < safe[:, None, None], float("inf"))
        protected = protected.masked_fill(scores == float("-inf"), float("-inf"))  # padding stays out
        return pooled_counts(protected, budget)


def pooled_counts(scores: torch.Tensor, budget: torch.Tensor) -> torch.Tensor:
    """Tokens each KV head keeps when a layer keeps its ``kv_heads * budget`` best ``scores`` ``[B, Hkv, n]`` across
    all its heads (``-inf``: padding, never kept; ties to the earlier head and token)."""
    batch, kv_heads, n = scores.shape
    flat = scores.reshape(batch, kv_heads * n)
    rank = flat.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
    chosen = (rank < (budget.to(scores.device) * kv_heads)[:, None]) & (flat > float("-inf"))
    return chosen.reshape(batch, kv_heads, n).sum(dim=-1)
