"""ChunkKV (Liu et al., arXiv 2502.00299; kvpress ``ChunkKVPress``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from evalkit.core.method_settings import setting

from ..kernels import reduce_groups
from ..views import PrefillView, row_of
from .wrapper import Wrapper


@dataclasses.dataclass
class ChunkKV(Wrapper):
    """A scorer's ranking (kvpress' SnapKV by default, see :mod:`.wrapper`) applied to chunks of ``chunk_length``
    tokens: each chunk scores the mean over its tokens of the score summed over the KV heads, the best
    ``capacity // chunk_length`` chunks are kept whole, the same tokens in every head (kvpress ``ChunkKVPress``).

    The tokens the scorer forces (SnapKV's window) score the row's best other score + 1, as kvpress' SnapKV pads
    them, so the chunks they fill rank first. The prompt's last ``n % chunk_length`` tokens form a short chunk. A
    prompt of fewer than ``chunk_length`` tokens falls back to the scorer's own selection. kvpress keeps
    ``max(1, int(chunks * (1 - ratio)))`` chunks; ``capacity // chunk_length`` is the same count wherever
    ``n * (1 - ratio)`` is whole and never keeps more than ``capacity`` tokens. Each row ranked alone.
    """

    name: ClassVar[str] = "chunkkv"
    per_head: ClassVar[bool] = True  # a layer that keeps the short chunk keeps fewer tokens
    chunk_length: int = setting(20, low=1)

    def prompt_capacity(self) -> int:
        return self.capacity

    def prompt_slots(self, n: int, kv_heads: int) -> int:
        return min(n, self.capacity)

    def select(self, view: PrefillView, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch = view.keys.shape[0]
        kept, raws = [], []
        for row in range(batch):
            alone, first = row_of(view, row)
            tokens, raw = self._row(alone, kv_heads)
            kept.append(tokens + first)
            raws.append(torch.nn.functional.pad(raw, (first, 0)))
        return stacked(kept, kv_heads, view.keys.device), torch.tensor([[len(t)] * kv_heads for t in kept],
                                                                        device=view.keys.device), torch.cat(raws)

    def _row(self, alone: PrefillView, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The kept token indices of one unpadded prompt (text order) and its raw scores ``[1, kv_heads, m]``."""
        m = alone.keys.shape[2]
        raw = self.scorer.score(alone).float()
        if raw.shape[1] != kv_heads:
            raw = reduce_groups(raw[:, None], getattr(self.scorer, "gqa_reduce", "mean"))
        if m <= self.capacity:
            return torch.arange(m, device=raw.device), raw
        if m < self.chunk_length:  # no whole chunk: the scorer's own per-head selection cannot share tokens
            indices, counts, _ = Wrapper.select(self, alone, kv_heads)
            return indices[0, 0, : int(counts[0, 0])], raw
        position = torch.arange(m, device=raw.device)
        window, sink = min(self.kept_window(), m), self.kept_sink()
        forced = (position >= m - window) | (position < sink)
        ranked = raw.masked_fill(forced, float("-inf")).amax() + 1 if bool((~forced).any()) else raw.amax()
        total = raw.masked_fill(forced, float(ranked)).sum(dim=1)[0]  # [m]: summed over the heads
        return self.chosen(total), raw

    def chosen(self, total: torch.Tensor) -> torch.Tensor:
        """The kept token indices (text order) of a prompt whose tokens score ``total`` ``[m]``: whole chunks."""
        position = torch.arange(len(total), device=total.device)
        chunk_of = position // self.chunk_length
        chunks = int(chunk_of[-1]) + 1
        chunk_scores = torch.zeros(chunks, device=total.device).index_add_(0, chunk_of, total)
        chunk_scores /= torch.bincount(chunk_of, minlength=chunks).float()
        best = chunk_scores.sort(descending=True, stable=True).indices[: max(1, self.capacity // self.chunk_length)]
        return position[torch.isin(chunk_of, best)]


def stacked(kept: list[torch.Tensor], kv_heads: int, device) -> torch.Tensor:
    """Per-row kept indices (the same for every head) as ``[B, kv_heads, most kept]``, a shorter row padded with
    its first index (past its count: unused)."""
    keep = max(len(tokens) for tokens in kept)
    rows = [torch.cat([tokens, tokens[:1].expand(keep - len(tokens))]) for tokens in kept]
    return torch.stack(rows).to(device)[:, None].expand(-1, kv_heads, -1).contiguous()
