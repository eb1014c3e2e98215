"""CAPKV (arXiv 2604.25975; kvpress ``CapPress``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from torch.nn import functional as F

from evalkit.core.method_settings import setting

from ..kernels import pre_rope
from ..views import PrefillView
from .base import PromptScoring
from .expected_attention import average_future_rotation


@dataclasses.dataclass
class CapKV(PromptScoring):
    """Keep the keys with the most query-weighted capacity: per query head, ``w_i = exp(tau cos(k_i, mu))`` (``mu``
    the mean pre-RoPE query after the first ``sink`` tokens, rotated into the average of the next
    ``n_future_positions`` positions, as ExpectedAttention does), ``A = I + sum_i (w_i + eps) v_i v_i^T`` and the
    score ``w_i v_i^T A^-1 v_i``, averaged over the query heads of each KV group (kvpress ``CapPress.score``: values
    stand in for the output directions; the weights shifted by their maximum). The first ``sink`` tokens are kept."""

    name: ClassVar[str] = "capkv"
    latent_refusal: ClassVar[str] = "its query anchor assumes RoPE on the whole query; MLA rotates only part of it"
    sink: int = setting(4, low=0)
    tau: float = setting(5.0, low=0)
    n_future_positions: int = setting(512, low=1)
    epsilon: float = setting(1e-6, low=0)

    def score(self, view: PrefillView) -> torch.Tensor:
        query, keys, values = view.query.float(), view.keys.float(), view.values.float()
        batch, kv_heads, n, dim = keys.shape
        groups = query.shape[1] // kv_heads
        rank = view.key_valid.long().cumsum(dim=1) - 1
        scored = view.key_valid & (rank >= self.sink)  # [B, n]
        used = scored[:, n - query.shape[2]:].float()[:, None, :, None]  # the queries averaged: those after the sink
        anchor = (pre_rope(query, view.query_positions, view.rotary) * used).sum(dim=2) / used.sum(dim=2).clamp(min=1)
        anchor = torch.einsum("bhd,bed->bhe", anchor, average_future_rotation(view, self.n_future_positions))
        anchor = F.normalize(anchor.reshape(batch, kv_heads, groups, dim), dim=-1)
        statistic = torch.einsum("bhgd,bhnd->bhgn", anchor, F.normalize(keys, dim=-1)).clamp(-1.0, 1.0)
        logits = (self.tau * statistic).masked_fill(~scored[:, None, None], float("-inf"))
        weights = (logits - logits.amax(dim=-1, keepdim=True)).exp()  # 0 outside the scored tokens
        scaled = values[:, :, None] * ((weights + self.epsilon).sqrt() * scored[:, None, None])[..., None]
        capacity = torch.eye(dim, device=keys.device) + scaled.transpose(-1, -2) @ scaled  # [B, Hkv, G, D, D]
        solved = torch.linalg.solve(capacity, values[:, :, None].transpose(-1, -2).expand(-1, -1, groups, -1, -1))
        leverage = (values[:, :, None].transpose(-1, -2) * solved).sum(dim=-2)  # v_i^T A^-1 v_i, [B, Hkv, G, n]
        return (weights * leverage).mean(dim=2)
