"""Entropy-gated ChunkKV (kvpress ``EntropyGatedChunkKVPress``, after ChunkKV, arXiv 2502.00299)."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import torch

from evalkit.core.method_settings import setting

from .chunkkv import ChunkKV

EPSILON = 1e-8  # kvpress'


@dataclasses.dataclass
class EntropyGatedChunkKV(ChunkKV):
    """ChunkKV whose chunks are gated by the entropy of their tokens' scores (kvpress
    ``EntropyGatedChunkKVPress.compress``): chunks in decreasing mean score fill ``capacity`` tokens; one scoring at
    or above the median chunk and of entropy (normalized, scores rebased to >= 0) below the median keeps only its best
    ``low_entropy_chunk_length`` tokens; the budget left is topped up with the best remaining tokens, so exactly
    ``capacity`` are kept, the same in every head. Ties between chunks go to the earlier one."""

    name: ClassVar[str] = "entropy_gated_chunkkv"
    chunk_length: int = setting(10, low=2)
    low_entropy_chunk_length: int = setting(4, low=1)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.low_entropy_chunk_length >= self.chunk_length:
            raise ValueError(f"EntropyGatedChunkKV.low_entropy_chunk_length must be < chunk_length "
                             f"({self.chunk_length}), got {self.low_entropy_chunk_length}")

    def chosen(self, total: torch.Tensor) -> torch.Tensor:
        m, length = len(total), self.chunk_length
        bounds = [(start, min(start + length, m)) for start in range(0, m, length)]
        means = torch.stack([total[a:b].mean() for a, b in bounds])
        entropy = torch.stack([_entropy(total[a:b]) for a, b in bounds])
        spiky = (means >= means.median()) & (entropy < entropy.median())
        keep = torch.zeros(m, dtype=torch.bool, device=total.device)
        budget = self.capacity
        for chunk in means.sort(descending=True, stable=True).indices.tolist():
            if budget <= 0:
                break
            start, end = bounds[chunk]
            count = min(end - start, budget, self.low_entropy_chunk_length if spiky[chunk] else end - start)
            keep[start + total[start:end].topk(count).indices] = True
            budget -= count
        if budget > 0:  # spiky chunks left some budget: the best remaining tokens
            left = (~keep).nonzero().squeeze(-1)
            keep[left[total[left].topk(min(budget, len(left))).indices]] = True
        return keep.nonzero().squeeze(-1)


def _entropy(scores: torch.Tensor) -> torch.Tensor:
    """Normalized entropy of a chunk's scores (rebased to be >= 0), 0 for a one-token chunk."""
    if len(scores) == 1:
        return torch.zeros((), device=scores.device)
    scores = scores - scores.min().clamp(max=0.0)
    p = scores / (scores.sum() + EPSILON)
    return (-(p * (p + EPSILON).log()).sum() / math.log(len(scores))).clamp(0.0, 1.0)
