"""CriticalKV and CriticalAdaKV (Feng et al., arXiv 2502.03805; kvpress ``CriticalKVPress``, ``CriticalAdaKVPress``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from evalkit.core.method_settings import setting

from ..views import PrefillView
from .adakv import AdaKV
from .base import SnapKVScoring
from .wrapper import Wrapper

TOP = torch.finfo(torch.float32).max  # kvpress marks a chosen token with the largest float


def projected_value_norm(values: torch.Tensor, module, query_heads: int) -> torch.Tensor:
    """``||W_o^h v||_1`` of every value ``[B, Hkv, n, D]`` through each query head's slice of the output projection,
    averaged over the query heads of its KV group: ``[B, Hkv, n]`` fp32 (kvpress ``CriticalKVPress.vwl1norm``)."""
    batch, kv_heads, n, dim = values.shape
    output = module.o_proj.weight.float().t().reshape(query_heads, dim, -1)  # [Hq, D, hidden]
    groups = query_heads // kv_heads
    norms = torch.stack([(values[:, head // groups].float() @ output[head]).abs().sum(dim=-1)
                         for head in range(query_heads)], dim=1)  # [B, Hq, n]
    return norms.reshape(batch, kv_heads, groups, n).mean(dim=2)


def kvpress_scale(scorer, raw: torch.Tensor) -> torch.Tensor:
    """The scorer's scores on the scale kvpress' presses give them, where the second stage's ``epsilon`` sees it:
    SnapKV's attention averaged over the window queries (kvpress' ``SnapKVPress``), not summed (SnapKV's official
    code, evalkit's ``snapkv_scores``)."""
    return raw / scorer.window if isinstance(scorer, SnapKVScoring) else raw


def forced_and_padding(policy, view: PrefillView, raw: torch.Tensor) -> torch.Tensor:
    """``raw`` with the tokens ``policy`` always keeps at +inf and padding at -inf (before a two-stage selection
    that must count them, as kvpress' scorers rank their forced tokens first)."""
    n = raw.shape[-1]
    valid = view.key_valid[:, None] if view.head_valid is None else view.head_valid
    position = torch.arange(n, device=raw.device)
    first = (n - valid.sum(dim=-1))[..., None]
    window, sink = min(policy.kept_window(), n), policy.kept_sink()
    forced = (position >= n - window) | ((position >= first) & (position < first + sink))
    return raw.masked_fill(forced, float("inf")).masked_fill(~valid, float("-inf"))


def mark_top(scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``scores`` ``[B, H, n]`` with each head's top ``counts`` (``[B, H]`` or a number) set to the largest float."""
    rank = scores.sort(dim=-1, descending=True, stable=True).indices.argsort(dim=-1)
    counts = torch.as_tensor(counts, device=scores.device)
    counts = counts[..., None] if counts.dim() else counts
    return scores.masked_fill(rank < counts, TOP)


@dataclasses.dataclass
class CriticalKV(Wrapper):
    """A scorer's ranking (kvpress' SnapKV by default, see :mod:`.wrapper`) corrected by what each value
    contributes to the output: per head, the scorer's best ``int(capacity * first_stage_ratio)`` tokens are kept
    first (its forced ones among them), the rest ranked by ``(score + epsilon) * ||W_o v||_1`` (kvpress
    ``CriticalKVPress``). kvpress sizes the first stage from ``(1 - ratio) * n``: the same count wherever that is
    whole.
    """

    name: ClassVar[str] = "criticalkv"
    latent_refusal: ClassVar[str] = "it projects values through the output projection per KV head"
    epsilon: float = setting(1e-4, low=0)
    first_stage_ratio: float = setting(0.5, low=0, high=1)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.supports_latent = False

    def prompt_capacity(self) -> int:
        return self.capacity

    def first_stage(self) -> int:
        chosen = int(self.capacity * self.first_stage_ratio)
        return max(1, chosen) if self.first_stage_ratio > 0 else 0

    def score(self, view: PrefillView) -> torch.Tensor:
        raw = forced_and_padding(self, view, kvpress_scale(self.scorer, self.scorer.score(view).float()))
        first = mark_top(raw, self.first_stage())
        norms = projected_value_norm(view.values, view.module, view.query.shape[1])
        return torch.where(first == TOP, TOP, (raw + self.epsilon) * norms)


@dataclasses.dataclass
class CriticalAdaKV(AdaKV):
    """AdaKV's head budgets with CriticalKV's two stages (kvpress ``CriticalAdaKVPress``): each head's top
    ``int(capacity * alpha_safeguard)`` tokens are safe, the layer's ``kv_heads * capacity`` best tokens over all
    heads give each head its budget ``b_h``; per head the best ``int(b_h * first_stage_ratio)`` by the scorer are
    kept first, the rest of ``b_h`` by ``(score + epsilon) * ||W_o v||_1``. kvpress masks the others; here they
    leave the cache (each head its own count, as AdaKV)."""

    name: ClassVar[str] = "criticaladakv"
    latent_refusal: ClassVar[str] = "it projects values through the output projection per KV head"
    epsilon: float = setting(1e-4, low=0)
    first_stage_ratio: float = setting(0.5, low=0, high=1)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.supports_latent = False

    def select(self, view: PrefillView, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raw = kvpress_scale(self.scorer, self.scorer.score(view).float())
        scores = forced_and_padding(self, view, raw)
        valid = scores > float("-inf")
        n = scores.shape[-1]
        budget = valid.sum(dim=-1).amax(dim=1).clamp(max=self.capacity)  # [B]
        safe = (budget.double() * self.alpha_safeguard).long()
        safe = torch.where(budget > 0, safe.clamp(min=1), safe) if self.alpha_safeguard > 0 else safe
        scores = mark_top(scores, safe[:, None].expand(-1, kv_heads))
        flat = scores.reshape(scores.shape[0], -1)
        chosen = flat.sort(dim=-1, descending=True, stable=True).indices.argsort(dim=-1) < (budget * kv_heads)[:, None]
        head_budget = (chosen & (flat > float("-inf"))).reshape(scores.shape).sum(dim=-1)  # [B, Hkv]
        scores = mark_top(scores, (head_budget * self.first_stage_ratio).long())
        norms = projected_value_norm(view.values, view.module, view.query.shape[1])
        final = torch.where(scores == TOP, TOP, (scores + self.epsilon) * norms).masked_fill(~valid, float("-inf"))
        keep = int(head_budget.max())
        indices = final.sort(dim=-1, descending=True, stable=True).indices[..., :keep]
        unused = torch.arange(keep, device=final.device) >= head_budget[..., None]
        return (indices + n * unused).sort(dim=-1).values % n, head_budget, raw
