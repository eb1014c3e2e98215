"""Chunk-wise compression (kvpress ``ChunkPress``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from evalkit.core.method_settings import setting

from ..views import PrefillView, row_of, span
from .wrapper import Wrapper


@dataclasses.dataclass
class ChunkWise(Wrapper):
    """A scorer (kvpress' SnapKV by default, see :mod:`.wrapper`) applied to each chunk of ``chunk_length`` prompt
    tokens as a prompt of its own: each chunk keeps ``max(1, len * capacity // n)`` of its tokens by the scorer's
    selection (its forced tokens, such as SnapKV's window, counted per chunk; a chunk whose share is not more than
    them keeps its last tokens), so the prompt keeps about
    ``capacity`` spread evenly over its length (kvpress ``ChunkPress``: ``max(1, int(len * (1 - ratio)))``, the same
    count wherever ``n * (1 - ratio)`` is whole). A query-based scorer reads each chunk's own last queries at their
    true positions (kvpress rotates them with the prompt's last positions). Each row ranked alone.
    """

    name: ClassVar[str] = "chunkwise"
    per_head: ClassVar[bool] = True  # the chunks' floors leave layers at slightly different counts
    chunk_length: int = setting(1024, low=1)

    def refusal(self, scorer) -> str | None:
        cls = scorer if isinstance(scorer, type) else type(scorer)
        if cls.allocates or issubclass(cls, Wrapper):
            return "it sizes each chunk's selection itself"
        if cls.sums_attention:
            return "its score sums the attention of every query of the sequence, not of a chunk"
        return super().refusal(scorer)

    def prompt_capacity(self) -> int:
        return self.capacity

    def prefill_queries(self) -> int | None:
        return 0 if self.scorer.prefill_queries() == 0 else None  # each chunk's own queries: all of them

    def select(self, view: PrefillView, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, n = view.keys.shape[0], view.keys.shape[2]
        picks, counts = [], torch.zeros(batch, kv_heads, dtype=torch.long, device=view.keys.device)
        for row in range(batch):
            alone, first = row_of(view, row)
            heads = [tokens + first for tokens in self._row(alone, kv_heads)]
            counts[row] = torch.tensor([len(tokens) for tokens in heads])
            picks.append(heads)
        keep = int(counts.max())
        indices = torch.zeros(batch, kv_heads, keep, dtype=torch.long, device=view.keys.device)
        for row, heads in enumerate(picks):
            for head, tokens in enumerate(heads):
                indices[row, head, : len(tokens)] = tokens
        return indices, counts, torch.zeros(batch, kv_heads, n, device=view.keys.device)

    def _row(self, alone: PrefillView, kv_heads: int) -> list[torch.Tensor]:
        """Each head's kept tokens of one unpadded prompt, in text order."""
        m = alone.keys.shape[2]
        if m <= self.capacity:
            return [torch.arange(m, device=alone.keys.device)] * kv_heads
        if self.scorer.prefill_queries() != 0 and alone.query.shape[2] != m:
            raise ValueError(f"chunkwise over {self.scorer.name} reads each chunk's queries; this prefill kept only "
                             f"the last {alone.query.shape[2]} of {m}")
        heads = [[] for _ in range(kv_heads)]
        forced = self.scorer.kept_sink() + self.scorer.kept_window()
        for start in range(0, m, self.chunk_length):
            end = min(start + self.chunk_length, m)
            keep = max(1, (end - start) * self.capacity // m)
            chunk = span(alone, start, end)
            if keep >= end - start:
                chosen, counts = torch.arange(end - start)[None, None].expand(1, kv_heads, -1), None
            elif keep <= forced:  # too short a chunk for the scorer's forced tokens: its most recent ones
                chosen, counts = torch.arange(end - start - keep, end - start)[None, None].expand(1, kv_heads, -1), None
            else:
                chosen, counts, _ = dataclasses.replace(self.scorer, capacity=keep).select(chunk, kv_heads)
            for head in range(kv_heads):
                count = chosen.shape[-1] if counts is None else int(counts[0, head])
                heads[head].append(chosen[0, head, :count].to(alone.keys.device) + start)
        return [torch.cat(tokens) for tokens in heads]
