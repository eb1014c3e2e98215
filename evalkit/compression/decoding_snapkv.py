"""SnapKV re-applied while decoding (kvpress ``DecodingPress`` over ``SnapKVPress``; the R-KV setting for long
reasoning, arXiv 2505.24133)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from .base import (
    DecodeView,
    SnapKVScoring,
    attention_probabilities,
    pool_scores,
    reduce_groups,
    require_int,
    slots_visible,
)


@dataclasses.dataclass
class DecodingSnapKV(SnapKVScoring):
    """A cache of ``capacity`` tokens compressed back to ``capacity - interval`` every ``interval`` decode steps.

    Prefill: the prompt is compressed by SnapKV to ``capacity - interval`` tokens (kvpress' ``PrefillDecodingPress``
    with SnapKV on both sides). Decoding: generated tokens fill the free slots; after every ``interval``-th decode
    step's attention, SnapKV scores every cached token with the last ``window`` queries (the most recent tokens, each
    seeing the cached tokens up to its own position), pooled along text order, and each layer and KV head keeps the
    ``window`` most recent tokens plus its best ``capacity - interval - window`` others. Defaults follow kvpress
    (``compression_interval`` 512, ``SnapKVPress`` window 64, kernel 5, average pooling).

    Differences from kvpress, both in SnapKV's favour of its own definition: the window queries keep their own RoPE
    positions (kvpress re-applies the current position's), and the cache stays in text order for the pooling
    (kvpress pools over the previous compression's score order).
    """

    name: ClassVar[str] = "decoding_snapkv"
    per_head: ClassVar[bool] = True
    evicts_while_decoding: ClassVar[bool] = True
    window: int = 64
    kernel_size: int = 5
    pooling: str = "avg"
    interval: int = 512

    def __post_init__(self) -> None:
        super().__post_init__()
        require_int(self, "interval", 1)
        if self.interval <= self.window:
            raise ValueError(f"DecodingSnapKV.interval must be > window ({self.window}), got {self.interval}")
        if self.capacity - self.interval <= self.window:
            raise ValueError(f"DecodingSnapKV.capacity must be > interval + window ({self.interval + self.window}), "
                             f"got {self.capacity} (lower interval or raise the budget)")

    def prompt_capacity(self) -> int:
        return self.capacity - self.interval

    def cache_capacity(self) -> int:
        return self.capacity

    def query_window(self) -> int:
        return self.window

    def decode_evict(self, view: DecodeView) -> torch.Tensor | None:
        due = view.steps % self.interval == 0  # [B]: rows whose interval ends at this step
        # Eager, skip the scoring on the other steps; compiled, always score (masked by ``due``): one static graph.
        if not torch.compiler.is_compiling() and not bool(due.any()):
            return None
        valid, positions, window = view.valid, view.positions, self.window
        target = self.capacity - self.interval
        query_positions = view.position[:, None] - window + 1 + torch.arange(window, device=valid.device)  # [B, w]
        visible = slots_visible(valid, positions, query_positions)
        attention = attention_probabilities(view.query_buffer, view.keys, visible, view.scaling, view.sinks).sum(dim=-2)
        # Group the query heads by the cache's heads (all of them for a latent cache): [B, Hkv, G, S].
        attention = attention.reshape(valid.shape[0], valid.shape[1], -1, attention.shape[-1])
        in_window = positions >= query_positions[:, :1, None]  # [B, Hkv, S]
        # Score in text order (each head's slots sorted by position, empty slots last): pooling sees text
        # neighbours, and ties go to the earlier token as at prefill.
        order = positions.masked_fill(~valid, torch.iinfo(positions.dtype).max).argsort(dim=-1)

        def in_order(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.gather(-1, order)

        prefix = in_order(valid & ~in_window)
        grouped_order = order[:, :, None].expand_as(attention)
        ordered = attention.gather(-1, grouped_order).masked_fill(~prefix[:, :, None], 0.0)
        scores = reduce_groups(pool_scores(ordered, self.kernel_size, self.pooling), self.gqa_reduce)
        scores = scores.masked_fill(in_order(valid & in_window), float("inf")).masked_fill(~in_order(valid), float("-inf"))
        ranked = scores.sort(dim=-1, descending=True, stable=True).indices
        dropped = torch.zeros_like(valid).scatter_(-1, ranked[..., target:], True)  # in text order
        return valid & torch.zeros_like(valid).scatter_(-1, order, dropped) & due[:, None, None]
