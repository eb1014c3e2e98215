"""Merge-on-evict (kvpress ``MergingPress``; after Token Merging, arXiv 2210.09461, and D2O, arXiv 2406.13035)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from evalkit.core.method_settings import setting

from ..views import PrefillView
from .rewriting import Rewriting

EPS = 1e-6  # kvpress' _EPS


@dataclasses.dataclass
class Merging(Rewriting):
    """Keep the scorer's ``capacity`` tokens and fold each evicted token's value into its most key-cosine-similar
    kept token of the same head (kvpress ``MergingPress.merge``): a merge needs similarity >= ``similarity_threshold``
    and, with ``merge_fraction`` < 1, to be among that share of the most similar; its weight is ``max(sim, 0) *
    |v_e| / (|v_e| + |v_t| + eps)``, and a kept value becomes ``(v_t + sum w v_e) / (1 + sum w)``. Keys unchanged.
    Each row and head merged alone (its own evicted tokens), in fp32."""

    name: ClassVar[str] = "merging"
    similarity_threshold: float = setting(0.0, low=0, high=1)
    merge_fraction: float = setting(1.0, low=0, high=1)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.merge_fraction == 0:
            raise ValueError("Merging.merge_fraction must be in (0, 1], got 0")

    def rewrite(self, view: PrefillView, indices: torch.Tensor, counts: torch.Tensor, keys: torch.Tensor,
                values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values = values.clone()
        batch, heads = indices.shape[:2]
        for row in range(batch):
            for head in range(heads):
                kept = indices[row, head, : int(counts[row, head])]
                evicted = view.key_valid[row].clone()
                evicted[kept] = False
                if bool(evicted.any()) and len(kept):
                    merged = self._merge(view.keys[row, head], view.values[row, head], kept, evicted)
                    values[row, head, : len(kept)] = merged.to(values.dtype)
        return keys, values

    def _merge(self, keys: torch.Tensor, values: torch.Tensor, kept: torch.Tensor, evicted: torch.Tensor):
        kept_keys, evict_keys = keys[kept].float(), keys[evicted].float()
        kept_values, evict_values = values[kept], values[evicted]
        kept_keys = kept_keys / kept_keys.norm(dim=-1, keepdim=True).clamp(min=EPS)
        evict_keys = evict_keys / evict_keys.norm(dim=-1, keepdim=True).clamp(min=EPS)
        similarity, target = (evict_keys @ kept_keys.T).max(dim=-1)
        merge = similarity >= self.similarity_threshold
        if self.merge_fraction < 1 and bool(merge.any()):
            floor = similarity.masked_fill(~merge, float("-inf")).quantile(1 - self.merge_fraction)
            merge &= similarity >= floor
        evict_norm = evict_values.float().norm(dim=-1)
        weights = similarity.clamp(min=0) * merge.float()
        weights = weights * evict_norm / (evict_norm + kept_values.float().norm(dim=-1)[target] + EPS)
        added = torch.zeros(len(kept), values.shape[-1], device=values.device).index_add_(0, target, weights[:, None] * evict_values.float())
        total = torch.zeros(len(kept), device=values.device).index_add_(0, target, weights)
        merged = (kept_values.float() + added) / (1 + total)[:, None]
        return torch.where((total > 0)[:, None], merged.to(values.dtype), kept_values)
