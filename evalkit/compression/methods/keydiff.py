"""KeyDiff (Park et al., arXiv 2504.15364; kvpress ``KeyDiffPress``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from torch.nn import functional as F

from ..views import PrefillView
from .base import PromptScoring


@dataclasses.dataclass
class KeyDiff(PromptScoring):
    """Keep the prompt keys least like the average key: score = ``-cos(k, anchor)``, the anchor the mean of the
    prompt's L2-normalized keys, per layer and KV head (kvpress ``KeyDiffPress.score``). Needs no attention.

    The anchor is the mean over each row's own tokens (kvpress scores one unpadded prompt; a left-padded batch gives
    each prompt what it gives alone). kvpress keeps the paper's block-wise iteration for ``BlockPress``; this is its
    one-shot score. Kept positions identical to kvpress 0.5.5's on random GQA keys at 25% and 50% kept
    (benchmarks/parity_scores.py).
    """

    name: ClassVar[str] = "keydiff"
    supports_latent: ClassVar[bool] = True

    def prefill_queries(self) -> int:
        return 0

    def score(self, view: PrefillView) -> torch.Tensor:
        keys = view.keys.float()
        valid = view.key_valid[:, None] if view.head_valid is None else view.head_valid  # [B, 1 or Hkv, n]
        normalized = F.normalize(keys, p=2, dim=-1) * valid[..., None]
        anchor = normalized.sum(dim=2, keepdim=True) / valid.sum(dim=-1).clamp(min=1)[..., None, None]
        return -F.cosine_similarity(keys, anchor, dim=-1)
