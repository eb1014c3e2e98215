"""Scissorhands, persistence of importance (Liu et al., NeurIPS 2023, arXiv 2305.17118; reference code
Zefan-Cai/KVCache-Factory, ``pyramidkv/scissorhands.py`` at commit c97f9d706d63d1b56e980f8b81b2a924c21162b3:
``reduce_scissorhands_scores``, ``update_scissorhands_importance``, ``select_scissorhands_tokens``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from evalkit.core.method_settings import setting

from ..kernels import causal_attention_sums, reduce_groups
from ..views import DecodeView, PrefillView
from .base import Policy


@dataclasses.dataclass
class Scissorhands(Policy):
    """Pivotal tokens by persistent importance (attention received, carried from step to step) under a fixed budget.

    Every cached token carries an importance per KV head (the mean, or max, over the query heads of its group). At
    the end of prefill it is the attention the prompt's last ``history_window`` queries gave the token, summed (all
    the queries when None): ``reduce_scissorhands_scores``. The prompt then keeps ``capacity - 1`` tokens per layer
    and KV head: its first ``sink`` and last ``recent`` tokens, and the others of highest importance
    (``select_scissorhands_tokens`` with ``token_budget = capacity - 1``, top-k). At every decode step the new token
    takes the free slot, attends over at most ``capacity`` tokens (itself included), every held token's importance
    becomes ``decay * importance + this step's attention`` (``update_scissorhands_importance``; a new token starts
    from its own), and once the cache is full the held token of lowest importance outside the first ``sink`` and
    last ``recent`` held ones is evicted (ties: the later token), which is the reference's selection of the budget.

    Differences from the paper, where evalkit follows the reference: the paper ranks tokens by how often their
    attention in the history window falls below a threshold and drops ``m`` tokens at once when the cache exceeds
    its budget; the reference sums the attention (with an optional ``decay``), protects attention sinks as well as
    recent tokens, and keeps the budget whenever the cache exceeds it, which here is one eviction per decode step.
    Differences from the reference: its probabilistic selection (``selection="prob"``, sampling by softmaxed
    importance) is left out: only its default top-k; settings whose protected tokens fill the budget
    (``sink + recent >= capacity - 1``, where the reference keeps the latest protected tokens) are refused; and
    the reference has no decode loop of its own (KVCache-Factory calls none of these functions), so the decode
    schedule above is the one its functions give when called after every step's attention, as H2O's and TOVA's are.
    Defaults are the reference's (``history_window=None``, ``sink=0``, ``decay=1``, the group's mean, KVCache-Factory's
    ``gqa_score_agg``) but ``recent=8``: with the reference's 0 a new token, one step's attention against the prompt's
    sums, would be evicted as soon as the cache is full.
    """

    name: ClassVar[str] = "scissorhands"
    needs_scores: ClassVar[bool] = True
    per_head: ClassVar[bool] = True
    evicts_while_decoding: ClassVar[bool] = True
    accumulates: ClassVar[bool] = True
    # Its importance persists while decoding (the method's point): a wrapper would take only its prefill half.
    wrappable: ClassVar[bool] = False
    capacity: int = setting(low=2)
    history_window: int | None = setting(None, low=1)
    sink: int = setting(0, low=0)
    recent: int = setting(8, low=0)
    decay: float = setting(1.0, low=0)
    gqa_reduce: str = setting("mean", choices=("mean", "max"))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sink + self.recent > self.capacity - 2:
            raise ValueError(f"Scissorhands.sink + recent must be <= capacity - 2 ({self.capacity - 2}), got "
                             f"{self.sink} + {self.recent} (lower them or raise the budget)")

    def kept_sink(self) -> int:
        return self.sink

    def kept_window(self) -> int:
        return self.recent

    def prompt_capacity(self) -> int:
        return self.capacity - 1

    def cache_capacity(self) -> int:
        return self.capacity

    def prefill_queries(self) -> int | None:
        return self.history_window

    def score(self, view: PrefillView) -> torch.Tensor:
        count = view.query.shape[2]
        last = None if self.history_window is None else min(self.history_window, count)
        return reduce_groups(causal_attention_sums(view, last=last), self.gqa_reduce)

    def decode_evict(self, view: DecodeView) -> torch.Tensor | None:
        batch, kv_heads, slots = view.valid.shape
        current = reduce_groups(view.probabilities.reshape(batch, kv_heads, -1, slots), self.gqa_reduce)
        if self.decay != 1.0:
            view.scores.mul_(self.decay)
        view.scores.add_(current)
        held = view.valid.sum(dim=-1)  # [B, Hkv]
        eligible = view.valid & ~self._protected(view.valid, view.positions, held)
        lowest = view.scores.masked_fill(~eligible, float("inf")).amin(dim=-1, keepdim=True)
        tied = eligible & (view.scores == lowest)
        victim = view.positions.masked_fill(~tied, -1).argmax(dim=-1)  # the latest of the lowest
        full = held >= self.capacity
        return torch.nn.functional.one_hot(victim, slots).bool() & full[..., None]

    def _protected(self, valid: torch.Tensor, positions: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
        """``[B, Hkv, S]``: the first ``sink`` and last ``recent`` held tokens of each head, in text order."""
        empty = torch.iinfo(positions.dtype).max
        order = positions.masked_fill(~valid, empty).argsort(dim=-1)  # held slots first, in text order
        ranks = torch.arange(valid.shape[-1], device=valid.device).expand_as(order)
        rank = torch.empty_like(order).scatter_(-1, order, ranks)
        return (rank < self.sink) | (rank >= (held - self.recent)[..., None])
