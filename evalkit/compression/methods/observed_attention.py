"""ObservedAttention (kvpress ``ObservedAttentionPress``; the prefill score of H2O, Zhang et al., arXiv 2306.14048)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from ..kernels import causal_attention_sums
from ..views import PrefillView
from .base import PromptScoring


@dataclasses.dataclass
class ObservedAttention(PromptScoring):
    """Keep the prompt keys that received the most attention during prefill, on average over the queries that saw them.

    Score of key j = (sum over prompt queries i >= j of softmax attention(i, j)) / (number of such queries), per query
    head, then the mean over the query heads of each KV group: kvpress' ``ObservedAttentionPress.score`` exactly
    (it reads the eager attention matrix; here the same softmax is recomputed in fp32, a chunk of queries at a time,
    so any attention implementation works).
    """

    name: ClassVar[str] = "observed_attention"
    supports_latent: ClassVar[bool] = True
    sums_attention: ClassVar[bool] = True

    def score(self, view: PrefillView) -> torch.Tensor:
        sums = causal_attention_sums(view)  # [B, Hkv, G, n]
        n = sums.shape[-1]
        # Queries at or after each key; under chunked prefill compressed as it goes, only the chunk's queries count.
        queries = n if view.prior_sums is not None else view.query.shape[2]
        seen_by = torch.arange(n, 0, -1, device=sums.device, dtype=sums.dtype).clamp(max=queries)
        return (sums / seen_by).mean(dim=2)
