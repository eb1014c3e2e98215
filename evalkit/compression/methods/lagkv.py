"""LagKV (Liang et al., arXiv 2504.04704; kvpress ``LagKVPress``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from evalkit.core.method_settings import setting

from ..views import PrefillView
from .base import PromptScoring


@dataclasses.dataclass
class LagKV(PromptScoring):
    """Score each token by how far its key and value stand out from the *next* partition's range (lag-relative).

    After the first ``sink`` tokens (always kept), the prompt is cut into partitions of ``lag_size`` tokens; each
    token of a partition is min-max normalized by the following partition's per-channel range, its score is the
    softmax over the partition of the channel standard deviation (keys and values averaged), ranked within the
    partition (``cross_scoring`` false: rank / lag_size; true: the softmax itself). The last partition and the
    remainder (they have no successor) score 1: kept first after the sink. A prompt shorter than
    ``sink + 2 * lag_size`` keeps its latest tokens. All of it as kvpress' ``LagKVPress.score``.

    Counted from each row's first real token (a left-padded batch gives each prompt what it gives alone); the sink is
    forced (kvpress scores it 1). Without ``cross_scoring`` every partition holds the same ranks, so a cut falls
    among equal scores: kvpress' ``topk`` breaks those ties its own way, evalkit towards the earlier token. On random
    GQA keys (benchmarks/parity_scores.py) the kept positions are kvpress 0.5.5's where the cut falls between
    distinct scores (``cross_scoring``, and 50% kept at ``lag_size`` 128); elsewhere they differ only among tokens of
    equal kvpress score (the kept sets carry the same multiset of kvpress' scores).
    """

    name: ClassVar[str] = "lagkv"
    sink: int = setting(4, low=0)  # kvpress' n_sink
    lag_size: int = setting(128, low=1)
    cross_scoring: bool = setting(False)

    def prefill_queries(self) -> int:
        return 0

    def score(self, view: PrefillView) -> torch.Tensor:
        keys, values = view.keys.float(), view.values.float()
        valid = view.key_valid[:, None] if view.head_valid is None else view.head_valid  # [B, 1 or Hkv, n]
        scores = torch.zeros(keys.shape[:3], device=keys.device)
        for row in range(keys.shape[0]):
            for group in range(valid.shape[1]):  # one pass per row, or per head where heads hold different tokens
                heads = slice(None) if valid.shape[1] == 1 else slice(group, group + 1)
                real = int(valid[row, group].sum())
                first = keys.shape[2] - real
                scores[row, heads, first:] = self._lag_scores(keys[row, heads, first:], values[row, heads, first:])
        return scores

    def _lag_scores(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """kvpress' score of one unpadded sequence: keys and values ``[H, n, D]`` -> ``[H, n]``."""
        heads, n, dim = keys.shape
        sink, lag = self.sink, self.lag_size
        score = torch.ones(heads, n, device=keys.device)
        if n < sink + 2 * lag:  # too short to partition: the latest tokens rank first
            if n > sink:
                score[:, sink:] = torch.arange(n - sink, device=keys.device) / (n - sink)
            return score
        end = sink + ((n - sink) // lag) * lag
        both = (self._states_score(keys[:, sink:end].reshape(heads, -1, lag, dim))
                + self._states_score(values[:, sink:end].reshape(heads, -1, lag, dim))) / 2
        if not self.cross_scoring:
            both = both.argsort(dim=-1).argsort(dim=-1) / lag
        score[:, sink : end - lag] = both.reshape(heads, -1)
        return score

    def _states_score(self, partitions: torch.Tensor) -> torch.Tensor:
        """``[H, P, lag, D]`` -> ``[H, P - 1, lag]``: each partition normalized by the next one's range."""
        reference, states = partitions[:, 1:], partitions[:, :-1]
        low, high = reference.amin(dim=-2, keepdim=True), reference.amax(dim=-2, keepdim=True)
        return ((states - low) / (high - low)).std(dim=-1).softmax(dim=-1)
