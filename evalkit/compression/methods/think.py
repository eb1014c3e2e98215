"""ThinK, key-channel pruning (Xu et al., arXiv 2407.21018; kvpress ``ThinKPress``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from evalkit.core.method_settings import setting

from ..views import PrefillView
from .rewriting import Rewriting


@dataclasses.dataclass
class ThinK(Rewriting):
    """Keep the scorer's ``capacity`` tokens (kvpress composes ThinK after a sequence press:
    ``ComposedPress([SnapKVPress, ThinKPress])``), then zero, per KV head, the ``int(head_dim *
    key_channel_compression_ratio)`` key channels of least ``mean_q(q_c^2) * mean_k(k_c^2)`` over the kept keys and
    the last ``window_size`` queries (mean over each group's query heads; kvpress ``ThinKPress.compress``). As in
    kvpress the channels are zeroed, not removed: the keys keep their width and no memory is freed (the rows' bytes
    say so); what it measures is the accuracy cost of the pruned channels."""

    name: ClassVar[str] = "think"
    key_channel_compression_ratio: float = setting(0.5, low=0, high=1)
    window_size: int = setting(32, low=1)

    def prefill_queries(self) -> int | None:
        needed = self.scorer.prefill_queries()
        return None if needed is None else max(needed, self.window_size)

    def rewrite(self, view: PrefillView, indices: torch.Tensor, counts: torch.Tensor, keys: torch.Tensor,
                values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, heads, kept, dim = keys.shape
        pruned = int(dim * self.key_channel_compression_ratio)
        if pruned == 0:
            return keys, values
        query = view.query[:, :, -self.window_size :].float()
        query_norm = query.pow(2).mean(dim=2).reshape(batch, heads, -1, dim).mean(dim=2)  # [B, Hkv, D]
        real = (torch.arange(kept, device=keys.device) < counts[..., None]).float()[..., None]  # [B, Hkv, kept, 1]
        key_norm = (keys.float().pow(2) * real).sum(dim=2) / real.sum(dim=2).clamp(min=1)
        channels = (query_norm * key_norm).topk(pruned, dim=-1, largest=False).indices  # [B, Hkv, pruned]
        return keys.scatter(-1, channels[:, :, None].expand(-1, -1, kept, -1), 0), values
