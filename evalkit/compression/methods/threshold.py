"""Eviction by a score threshold (DMS's mechanism, arXiv 2506.05345; kvpress ``DMSPress``, in prefill and, with
``decoding``, while decoding)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from evalkit.core.method_settings import setting

from ..views import DecodeView, PrefillView
from .base import UNBOUNDED
from .wrapper import Wrapper


@dataclasses.dataclass
class Threshold(Wrapper):
    """Evict every prompt token its scorer (KVzap by default) scores below ``threshold``, except the last
    ``sliding_window_size`` (kvpress ``DMSPress``: per KV head, ``score < threshold`` evicted among the tokens before
    the window) and the scorer's own forced tokens. No budget: each head keeps what clears the threshold, and the
    rows record the compression realized. kvpress' leaderboard ranks KVzap this way.

    ``decoding`` (kvpress' ``decoding=True``): the rule goes on while decoding. Each new token is scored once, alone,
    as it enters (from its attention input for KVzap, else its key and value), after its step's attention; once a
    token is ``sliding_window_size`` tokens old it is evicted if its score is below the threshold (kvpress masks its
    key from the next step on; evalkit frees its slot).
    """

    name: ClassVar[str] = "threshold"
    per_head: ClassVar[bool] = True  # heads keep what clears the threshold: different counts
    takes_budget: ClassVar[bool] = False
    inline: ClassVar[tuple[str, dict]] = ("kvzap", {})
    capacity: int | None = None  # no budget
    threshold: float | None = setting(None)
    sliding_window_size: int = setting(128, low=0)
    decoding: bool = setting(False, recorded_when_set=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        # While decoding, each held token's score is kept per slot (the prompt's from prefill, a new token's as it
        # enters), and the slots of those below the threshold that leave the window are freed.
        self.evicts_while_decoding = self.accumulates = self.decoding
        if self.decoding and self.scorer.prefill_queries() != 0:
            raise ValueError(f"Threshold.scorer cannot be {self.scorer.name} with decoding: each new token is scored "
                             "alone, and it reads queries")

    def scorer_capacity(self) -> int:
        return UNBOUNDED  # the scorer only ranks

    def refusal(self, scorer) -> str | None:
        cls = scorer if isinstance(scorer, type) else type(scorer)
        if cls.allocates or issubclass(cls, Wrapper):
            return "it decides each head's count itself"
        return super().refusal(scorer)

    def check_layers(self, num_layers: int) -> None:
        if self.threshold is None:
            raise ValueError("threshold needs method.threshold: the score below which a token is evicted (on the "
                             "scorer's own scale)")
        super().check_layers(num_layers)

    def kept_window(self) -> int:
        return max(self.sliding_window_size, self.scorer.kept_window())

    def layer_budget(self, layer_idx: int, num_layers: int, real_len: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(real_len)  # no row is kept whole for its length: ``allocate`` counts

    def allocate(self, scores: torch.Tensor, budget: torch.Tensor, layer_idx: int = 0) -> torch.Tensor:
        return (scores >= self.threshold).sum(dim=-1)  # forced tokens score +inf, padding -inf

    def select(self, view: PrefillView, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        indices, counts, raw = super().select(view, kv_heads)
        if self.decoding and view.keys.shape[2] <= self.kept_window():  # the window holds it all: scored all the same
            raw = self.score(view).float()
        return indices, counts, raw

    def decode_evict(self, view: DecodeView) -> torch.Tensor:
        entering = view.valid & (view.positions == view.position[:, None, None])  # [B, Hkv, S]: this step's token
        view.scores.copy_(torch.where(entering, self._entering_scores(view, entering), view.scores))
        old = view.positions <= (view.position - self.kept_window())[:, None, None]
        forced = view.positions < self.kept_sink()  # the scorer's first tokens, kept at prefill whatever their score
        return view.valid & old & ~forced & (view.scores < self.threshold)

    def _entering_scores(self, view: DecodeView, entering: torch.Tensor) -> torch.Tensor:
        """``[B, Hkv, 1]`` fp32: the scorer's score of this step's token, from its key, value and attention input as a
        prompt of one token (what kvpress hands its scorer: the new token's alone)."""
        if self.reads_hidden_states and view.hidden is None:
            raise RuntimeError(f"threshold scores each new token from its attention input with {self.scorer.name}, "
                               "and this decode step handed none")
        slot = entering.to(torch.uint8).argmax(dim=-1)[..., None, None]  # [B, Hkv, 1, 1]

        def entered(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.gather(2, slot.expand(-1, -1, 1, tensor.shape[-1]))

        keys, module = entered(view.keys), view.module
        config = getattr(module, "config", None)
        token = PrefillView(query=keys.new_zeros(keys.shape[0], view.probabilities.shape[1], 0, keys.shape[-1]),
                            keys=keys, values=entered(view.values),
                            key_valid=torch.ones(keys.shape[0], 1, dtype=torch.bool, device=keys.device),
                            scaling=view.scaling, layer_idx=getattr(module, "layer_idx", 0),
                            num_layers=getattr(config, "num_hidden_layers", 1), module=module,
                            positions=view.position[:, None], rotary=view.rotary, hidden=view.hidden)
        return self.scorer.score(token).float()
