"""Block-wise scoring (KeyDiff's iteration, arXiv 2504.15364; kvpress ``BlockPress``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from evalkit.core.method_settings import setting

from ..views import PrefillView, row_of, span
from .wrapper import Wrapper


@dataclasses.dataclass
class BlockWise(Wrapper):
    """A query-free scorer (KeyDiff by default) applied block by block: per KV head, the first ``capacity`` tokens
    are held; each next block of ``block_size`` tokens joins them, the scorer ranks the ``capacity + block_size``
    tokens as a prompt of their own, and the best ``capacity`` stay (kvpress ``BlockPress``: the held tokens in the
    scorer's order, best first, then the block; ties to the earlier). The prompt's forced tokens (the scorer's
    ``sink`` first and ``window`` last) are kept whatever the scorer says. Each row and head ranked alone.
    """

    name: ClassVar[str] = "blockwise"
    inline: ClassVar[tuple[str, dict]] = ("keydiff", {})
    block_size: int = setting(128, low=1)

    def refusal(self, scorer) -> str | None:
        cls = scorer if isinstance(scorer, type) else type(scorer)
        if cls.allocates or issubclass(cls, Wrapper):
            return "it ranks blocks with a scorer of its own"
        if cls.reads_hidden_states:
            return "it ranks one head at a time, and a hidden state scores them all"
        reason = super().refusal(scorer)
        if reason is None and not isinstance(scorer, type) and scorer.prefill_queries() != 0:
            reason = "it reads the prompt's queries, which a block of held tokens has not"
        return reason

    def prompt_capacity(self) -> int:
        return self.capacity

    def select(self, view: PrefillView, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, n = view.keys.shape[0], view.keys.shape[2]
        indices = torch.zeros(batch, kv_heads, min(n, self.capacity), dtype=torch.long, device=view.keys.device)
        counts = torch.zeros(batch, kv_heads, dtype=torch.long, device=view.keys.device)
        for row in range(batch):
            alone, first = row_of(view, row)
            for head in range(kv_heads):
                kept = self._head(alone, head)
                indices[row, head, : len(kept)] = kept + first
                counts[row, head] = len(kept)
        return indices, counts, torch.zeros(batch, kv_heads, n, device=view.keys.device)

    def _head(self, alone: PrefillView, head: int) -> torch.Tensor:
        """The kept tokens of one head of one unpadded prompt, in text order."""
        m = alone.keys.shape[2]
        if m <= self.capacity:
            return torch.arange(m, device=alone.keys.device)
        position = torch.arange(m, device=alone.keys.device)
        forced = (position < self.kept_sink()) | (position >= m - min(self.kept_window(), m))
        block = min(self.block_size, m)
        one = span(alone, 0, m, slice(head, head + 1))
        held = position[: self.capacity]
        for start in range(self.capacity, m, block):
            candidates = torch.cat([held, position[start : min(start + block, m)]])
            tokens = dataclasses.replace(one, keys=one.keys[:, :, candidates], values=one.values[:, :, candidates],
                                         positions=one.positions[:, candidates], key_valid=one.key_valid[:, candidates])
            scores = self.scorer.score(tokens).float()[0, 0].masked_fill(forced[candidates], float("inf"))
            held = candidates[scores.sort(descending=True, stable=True).indices[: self.capacity]]
        return held.sort().values
