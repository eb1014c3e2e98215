"""RaaS, reasoning-aware attention sparsity (Hu et al., arXiv 2502.11147: "milestone" tokens kept while they are used;
no public code: written from the paper's algorithm, token by token)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from evalkit.core.method_settings import setting

from ..kernels import reduce_groups
from ..views import DecodeView, PrefillView
from .base import Policy


@dataclasses.dataclass
class RaaS(Policy):
    """A cache of ``capacity`` tokens per layer and KV head: the prompt kept whole (the paper's "phoenix" tokens live
    there), each generated token stamped with the last decode step that gave it more than ``alpha`` of its attention
    (the mean over the query heads of its group), and once the cache is full, after each step's attention, the
    generated token with the oldest stamp evicted (ties: the earliest). A new token is stamped with its own step.

    The paper's deployed variant works on pages of 16 tokens with Quest's bounds as their scores; this is its
    token-level algorithm. A prompt longer than ``capacity - 1`` keeps its last ``capacity - 1`` tokens (RaaS assumes
    the prompt fits: the paper pairs it with a prefill method otherwise). ``alpha`` 1e-4 is the paper's setting.
    """

    name: ClassVar[str] = "raas"
    needs_scores: ClassVar[bool] = True
    per_head: ClassVar[bool] = True
    evicts_while_decoding: ClassVar[bool] = True
    accumulates: ClassVar[bool] = True  # the slots' running score is each token's stamp
    wrappable: ClassVar[bool] = False
    capacity: int = setting(0, low=2)
    alpha: float = setting(1e-4, low=0, high=1)
    gqa_reduce: str = setting("mean", choices=("mean", "max"))

    def kept_window(self) -> int:
        return self.capacity - 1

    def prompt_capacity(self) -> int:
        return self.capacity - 1

    def cache_capacity(self) -> int:
        return self.capacity

    def score(self, view: PrefillView) -> torch.Tensor:
        return torch.zeros(view.keys.shape[:3], device=view.keys.device)  # the prompt's stamps (never evicted)

    def decode_evict(self, view: DecodeView) -> torch.Tensor | None:
        batch, kv_heads, slots = view.valid.shape
        step = view.steps.to(view.scores.dtype)[:, None, None]
        attention = reduce_groups(view.probabilities.reshape(batch, kv_heads, -1, slots), self.gqa_reduce)
        used = view.valid & ((attention > self.alpha) | (view.positions == view.position[:, None, None]))
        view.scores.copy_(torch.where(used, step, view.scores))
        first = (view.position - view.steps + 1)[:, None, None]  # the first generated token's position
        generated = view.valid & (view.positions >= first)
        full = view.valid.sum(dim=-1) >= self.capacity  # [B, Hkv]
        oldest = view.scores.masked_fill(~generated, float("inf")).amin(dim=-1, keepdim=True)
        candidates = generated & (view.scores == oldest)
        earliest = view.positions.masked_fill(~candidates, torch.iinfo(view.positions.dtype).max).argmin(dim=-1)
        return torch.nn.functional.one_hot(earliest, slots).bool() & full[..., None] & candidates.any(-1, keepdim=True)
