"""SnapKV-D, SnapKV applied at every decoding step ("Hold Onto That Thought", Liu et al., arXiv 2512.12008; its
code, minghui-liu/kvpress: ``SnapKVPress`` through ``BasePress.compress_decoding``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from ..kernels import pool_scores, reduce_groups
from ..views import DecodeView
from .base import SnapKVScoring


@dataclasses.dataclass
class SnapKVD(SnapKVScoring):
    """A cache of ``capacity`` tokens per layer and KV head, one evicted at every decode step once it is full.

    Prefill: SnapKV keeps ``capacity - 1`` prompt tokens (its last ``window`` and the best others by the last
    ``window`` queries' attention, pooled). Decoding: each step's token takes the free slot and, after its attention,
    the held token that attention ranks lowest is evicted: the step's attention over the held tokens older than the
    ``window`` most recent (which are always kept), pooled along text order (``kernel_size``, average with zeros
    padded), averaged over the query heads of the group. Defaults are the code's (window 64, kernel 5, average).

    How it differs from ``decoding_snapkv`` (kvpress' DecodingPress): that one re-applies SnapKV every ``interval``
    steps with the last ``window`` queries, freeing ``interval`` slots at once; SnapKV-D scores with the current query
    alone and evicts one token per step, so its cache is always full (H2O's rhythm with a memoryless score).

    Differences from the code: it gathers the kept tokens in top-k order, so from the second step on its "last
    ``window`` slots" and pooling neighbours are those of score order, not the most recent tokens; evalkit keeps text
    order (the paper's description: the recent window is kept). ``capacity`` here counts the decoding token's slot
    (the code's budget is ``capacity - 1``, held between steps).
    """

    name: ClassVar[str] = "snapkv_d"
    supports_latent: ClassVar[bool] = False
    per_head: ClassVar[bool] = True
    evicts_while_decoding: ClassVar[bool] = True
    wrappable: ClassVar[bool] = False  # its prefill ranking is snapkv's: wrap that
    window: int = 64
    kernel_size: int = 5
    pooling: str = "avg"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.capacity <= self.window + 1:
            raise ValueError(f"SnapKVD.capacity must be > window + 1 ({self.window + 1}), got {self.capacity}")

    def prompt_capacity(self) -> int:
        return self.capacity - 1

    def cache_capacity(self) -> int:
        return self.capacity

    def decode_evict(self, view: DecodeView) -> torch.Tensor | None:
        valid, positions = view.valid, view.positions
        batch, kv_heads, slots = valid.shape
        full = valid.sum(dim=-1) >= self.capacity  # [B, Hkv]
        order = positions.masked_fill(~valid, torch.iinfo(positions.dtype).max).argsort(dim=-1)  # text order
        older = valid & (positions <= (view.position - self.window)[:, None, None])
        prefix = older.gather(-1, order)
        attention = view.probabilities.reshape(batch, kv_heads, -1, slots)
        ordered = attention.gather(-1, order[:, :, None].expand_as(attention)).masked_fill(~prefix[:, :, None], 0.0)
        scores = reduce_groups(pool_scores(ordered, self.kernel_size, self.pooling), self.gqa_reduce)
        victim = scores.masked_fill(~prefix, float("inf")).argmin(dim=-1, keepdim=True)  # ties: the earlier token
        freed = torch.zeros_like(valid).scatter_(-1, order.gather(-1, victim), True)
        return freed & full[..., None]
