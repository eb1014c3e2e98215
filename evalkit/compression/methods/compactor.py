"""Compactor (Chari et al., arXiv 2507.08143; kvpress ``CompactorPress``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from evalkit.core.method_settings import setting

from ..kernels import pre_rope
from ..views import PrefillView, scores_by_row, span
from .base import PromptScoring
from .leverage import leverage_scores, sketch, z_scores
from .non_causal_attention import non_causal_scores


@dataclasses.dataclass
class Compactor(PromptScoring):
    """Keep the keys that span the prompt (leverage scores, :class:`~.leverage.LeverageScore`) and that the prompt
    attends to (non-causal chunked attention, :class:`~.non_causal_attention.NonCausalAttention`), blended:
    ``blending * leverage + attention``, both standardized, scored on the prompt without its first ``sink`` and last
    ``window`` tokens, which are always kept (kvpress ``CompactorPress``: ``sink_size_start=8``, ``sink_size_end=4``).

    ``blending`` null is kvpress' default, the compression ratio: here the fraction of the prompt dropped,
    ``1 - capacity / n`` (kvpress' ``compression_ratio``, equal where ``n * (1 - ratio)`` is a whole number).
    ``method=adakv method.scorer=compactor`` is kvpress' leaderboard ``adakv_compactor``.
    """

    name: ClassVar[str] = "compactor"
    reads_every_query: ClassVar[bool] = True
    latent_refusal: ClassVar[str] = "it reads pre-RoPE keys; MLA rotates only part of them"
    sink: int = setting(8, low=0)
    window: int = setting(4, low=0)
    chunk_size: int = setting(256, low=1)
    sketch_dimension: int = setting(48, low=1)
    blending: float | None = setting(None, low=0)
    seed: int = setting(0, low=0)

    def score(self, view: PrefillView) -> torch.Tensor:
        return scores_by_row(view, self._one)

    def _one(self, alone: PrefillView) -> torch.Tensor:
        n = alone.keys.shape[2]
        left = min(self.sink, n)
        right = min(self.window, max(0, n - left))
        middle = span(alone, left, n - right)
        if middle.keys.shape[2] == 0:
            return torch.zeros(1, alone.keys.shape[1], n)
        keys = pre_rope(middle.keys, middle.positions, middle.rotary)
        projection = sketch(alone.layer_idx, keys.shape[1], keys.shape[-1], self.sketch_dimension, self.seed)
        leverage = z_scores(leverage_scores(keys, projection))
        attention = non_causal_scores(middle, self.chunk_size)
        blending = self.blending if self.blending is not None else 1 - min(self.capacity, n) / n
        scores = blending * leverage + attention
        return torch.nn.functional.pad(scores, (left, right))  # the forced tokens: kept whatever their score
