"""ExpectedAttention (Devoto et al., arXiv 2510.00636; kvpress ``ExpectedAttentionPress``)."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import torch

from evalkit.core.method_settings import setting

from ..kernels import pre_rope as unrotated
from ..views import PrefillView
from .base import PromptScoring


@dataclasses.dataclass
class ExpectedAttention(PromptScoring):
    """Keep the prompt keys that *future* queries are expected to attend to, from statistics of the prompt's queries.

    As kvpress' ``ExpectedAttentionPress.score``, per layer: the mean ``mu`` and covariance ``S`` (biased) of the
    pre-RoPE queries of the prompt after its first ``sink`` tokens; the RoPE rotation averaged over the next
    ``n_future_positions`` positions, ``R``, applied to them (``R mu``, ``R S R^T``); for every key ``k`` after the
    sink, ``softmax_k(k . R mu / sqrt(d) + k^T R S R^T k / (2 d))`` per query head (the covariance term when
    ``use_covariance``), averaged over the query heads of each KV group, then ``(score + epsilon) * ||v||`` when
    ``use_vnorm``. The first ``sink`` tokens are always kept (kvpress' ``n_sink``, default 4).

    The pre-RoPE queries are the post-RoPE queries rotated back (exact: RoPE is a rotation), which also covers
    models that normalise queries before RoPE (Qwen3). Future positions start at each prompt's own length.
    """

    name: ClassVar[str] = "expected_attention"
    supports_latent: ClassVar[bool] = False
    latent_refusal: ClassVar[str] = "its query statistics assume RoPE on the whole query; MLA rotates only part of it"
    sink: int = setting(4, low=0)
    n_future_positions: int = setting(512, low=1)
    use_covariance: bool = setting(True)
    use_vnorm: bool = setting(True)
    epsilon: float = setting(0.0, low=0)

    def score(self, view: PrefillView) -> torch.Tensor:
        query, keys = view.query.float(), view.keys.float()
        batch, q_heads, _, dim = query.shape
        n = keys.shape[2]
        pre_rope = unrotated(query, view.query_positions, view.rotary)
        rank = view.key_valid.long().cumsum(dim=1) - 1
        # The queries' statistics: those held (all of the prompt's, or under chunked prefill compressed as it goes
        # the chunk's), after the first ``sink`` tokens.
        used = (view.key_valid & (rank >= self.sink))[:, n - query.shape[2]:].float()[:, None, :, None]  # [B, 1, q, 1]
        count = used.sum(dim=2, keepdim=True).clamp(min=1)
        mean = (pre_rope * used).sum(dim=2, keepdim=True) / count  # [B, Hq, 1, D]
        centered = (pre_rope - mean) * used
        covariance = centered.transpose(-1, -2) @ centered / count  # [B, Hq, D, D]
        rotation = average_future_rotation(view, self.n_future_positions)  # [B, D, D]
        mean = torch.einsum("bhd,bed->bhe", mean.squeeze(2), rotation)  # mu R^T, [B, Hq, D]
        covariance = torch.einsum("bij,bhjk,blk->bhil", rotation, covariance, rotation)  # R S R^T
        return self.expected_scores(view, keys, mean, covariance)

    def expected_scores(self, view: PrefillView, keys: torch.Tensor, mean: torch.Tensor,
                        covariance: torch.Tensor | None) -> torch.Tensor:
        """The keys' ``[B, Hkv, n, D]`` attention expected from queries of ``mean`` ``[B, Hq, D]`` and ``covariance``
        ``[B, Hq, D, D]`` (both in the future's average rotation), softmaxed after ``sink``, averaged over each KV
        group's heads, times the values' norms."""
        batch, kv_heads, _, dim = keys.shape
        groups = mean.shape[1] // kv_heads
        logits = torch.einsum("bhnd,bhgd->bhgn", keys, mean.reshape(batch, kv_heads, groups, dim)) / math.sqrt(dim)
        if self.use_covariance:
            covariance = covariance.reshape(batch, kv_heads, groups, dim, dim)
            logits = logits + torch.einsum("bhnd,bhgde,bhne->bhgn", keys, covariance, keys) / dim / 2
        rank = view.key_valid.long().cumsum(dim=1) - 1
        scored = view.key_valid & (rank >= self.sink)
        logits = logits.masked_fill(~scored[:, None, None], float("-inf"))
        scores = torch.nan_to_num(logits.softmax(dim=-1), nan=0.0).mean(dim=2)  # [B, Hkv, n]
        if self.use_vnorm:
            scores = (scores + self.epsilon) * view.values.float().norm(dim=-1)
        return scores


def average_future_rotation(view: PrefillView, future: int) -> torch.Tensor:
    """RoPE as a matrix ``cos I + sin P`` averaged over each row's next ``future`` positions, ``[B, D, D]``
    (kvpress' averaged RoPE matrix; ``x @ R.T`` rotates a pre-RoPE state into that average future)."""
    dim = view.query.shape[-1]
    start = view.positions.max(dim=1).values + 1  # [B]
    positions = start[:, None] + torch.arange(future, device=start.device)
    cos, sin = (t.float() for t in view.rotary(view.query, positions))  # [B, F, D]
    half = dim // 2
    identity = torch.eye(dim, device=cos.device)
    swap = torch.zeros(dim, dim, device=cos.device)
    swap[half:, :half], swap[:half, half:] = torch.eye(half), -torch.eye(half)
    return (cos[:, :, None, :] * identity + sin[:, :, None, :] * swap).mean(dim=1)
