"""CurDKV's leverage scores (Sengupta et al., arXiv 2509.15038; kvpress ``CURPress``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from torch.nn import functional as F

from evalkit.core.method_settings import setting

from ..views import PrefillView
from .base import PromptScoring


@dataclasses.dataclass
class CUR(PromptScoring):
    """Approximate leverage scores of the keys (``||k||^2``) and values (``||v||^2``), each normalized within local
    windows of ``local_window_size`` tokens (``local_window_size`` 0: over the whole prompt), combined by
    ``leverage_type`` (``kv_product`` by default, or ``key``, ``value``, ``kv_avg``); the first ``sink`` tokens always
    kept. kvpress' ``CURPress.score`` with its defaults (4 sinks, local windows of 16).

    Windows are counted from each row's first real token (a left-padded batch gives each prompt what it gives alone).
    kvpress' ``use_random_leverage`` (a random projection drawn unseeded at every call) is left out: its kept tokens
    could not be reproduced. Kept positions identical to kvpress 0.5.5's on random GQA keys at 25% and 50% kept
    (benchmarks/parity_scores.py).
    """

    name: ClassVar[str] = "cur"
    sink: int = setting(4, low=0)  # kvpress' num_sinks
    leverage_type: str = setting("kv_product", choices=("kv_product", "kv_avg", "key", "value"))
    local_window_size: int = setting(16, low=0)

    def prefill_queries(self) -> int:
        return 0

    def score(self, view: PrefillView) -> torch.Tensor:
        k2, v2 = view.keys.float().pow(2).sum(dim=-1), view.values.float().pow(2).sum(dim=-1)  # [B, Hkv, n]
        valid = view.key_valid[:, None] if view.head_valid is None else view.head_valid  # [B, 1 or Hkv, n]
        scores = torch.zeros_like(k2)
        for row in range(k2.shape[0]):
            for group in range(valid.shape[1]):  # one pass per row, or per head where heads hold different tokens
                heads = slice(None) if valid.shape[1] == 1 else slice(group, group + 1)
                first = k2.shape[2] - int(valid[row, group].sum())
                scores[row, heads, first:] = self._leverage(k2[row, heads, first:], v2[row, heads, first:])
        return scores

    def _leverage(self, k2: torch.Tensor, v2: torch.Tensor) -> torch.Tensor:
        """kvpress' score of one unpadded sequence: squared norms ``[H, n]`` -> ``[H, n]``."""
        if self.local_window_size:
            k2, v2 = self._local(k2), self._local(v2)
        combined = {"key": k2, "value": v2, "kv_avg": (k2 + v2) / 2, "kv_product": k2 * v2}[self.leverage_type]
        return combined / combined.sum(dim=-1, keepdim=True)

    def _local(self, squares: torch.Tensor) -> torch.Tensor:
        """Each window of ``local_window_size`` tokens normalized to sum 1 (the last one padded with zeros)."""
        heads, n = squares.shape
        w = self.local_window_size
        windows = F.pad(squares, (0, (w - n % w) % w)).reshape(heads, -1, w)
        return (windows / windows.sum(dim=-1, keepdim=True)).reshape(heads, -1)[:, :n]
