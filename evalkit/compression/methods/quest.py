"""Quest (Tang et al., arXiv 2406.10774; mit-han-lab/quest ``quest_attention.py``; KVCache-Factory ``quest.py``)."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import torch

from evalkit.core.method_settings import setting

from .base import Policy


@dataclasses.dataclass
class Quest(Policy):
    """Keeps the whole cache and lets each decode step read only part of it: the held tokens are cut into pages of
    ``page_size`` slots (from each row's first token), each page's keys summarized by their per-channel minimum and
    maximum; a step's query scores every page by the upper bound of ``q . k`` over that box (``sum_d q_d max_d`` where
    ``q_d > 0``, else ``q_d min_d``), per query head, and attends only to its ``min(max(3, capacity // page_size),
    pages)`` best pages. The first ``dense_layers`` layers and the prompt (prefill, and any multi-token step) attend to
    everything, as the reference's. Nothing is evicted: the rows price the whole cache (``kv_bytes_peak`` equals a full
    cache's); the point is the accuracy of reading ``capacity`` tokens a step.
    """

    name: ClassVar[str] = "quest"
    selects_while_decoding: ClassVar[bool] = True
    capacity: int = setting(low=1)
    page_size: int = setting(16, low=1)
    dense_layers: int = setting(2, low=0)

    def decode_visible(self, query: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, layer_idx: int,
                       states: list | None = None) -> torch.Tensor | None:
        if layer_idx < self.dense_layers or query.shape[2] != 1:
            return None
        batch, q_heads, _, dim = query.shape
        kv_heads, slots = keys.shape[1], keys.shape[2]
        pages = math.ceil(slots / self.page_size)
        pad = pages * self.page_size - slots
        held = torch.nn.functional.pad(visible.expand(batch, kv_heads, slots), (0, pad))[..., None]
        padded = torch.nn.functional.pad(keys.float(), (0, 0, 0, pad)).view(batch, kv_heads, pages, self.page_size, dim)
        held = held.view(batch, kv_heads, pages, self.page_size, 1)
        high = padded.masked_fill(~held, float("-inf")).amax(dim=3)[:, :, None]  # [B, Hkv, 1, pages, D]
        low = padded.masked_fill(~held, float("inf")).amin(dim=3)[:, :, None]
        q = query[:, :, 0].float().view(batch, kv_heads, q_heads // kv_heads, 1, dim)
        bound = torch.where(q > 0, q * high, q * low).sum(dim=-1)  # [B, Hkv, G, pages]
        bound = bound.masked_fill(~held.any(dim=3)[:, :, None, :, 0], float("-inf"))
        chosen = bound.topk(min(max(3, self.capacity // self.page_size), pages), dim=-1).indices
        picked = torch.zeros_like(bound, dtype=torch.bool).scatter_(-1, chosen, True)
        picked = picked.repeat_interleave(self.page_size, dim=-1)[..., :slots]
        return picked.reshape(batch, q_heads, slots)
