"""SimLayerKV (Zhang et al., arXiv 2410.13846; kvpress ``SimLayerKVPress``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from evalkit.core.method_settings import setting

from ..kernels import attention_probabilities, causal_visible
from ..model_spec import attention_sinks
from ..views import PrefillView, row_of
from .base import Policy
from .chunkkv import stacked


@dataclasses.dataclass
class SimLayerKV(Policy):
    """Find the *lazy* layers, whose last queries attend mostly to the first and most recent tokens, and keep only
    those there; keep every other layer whole (kvpress ``SimLayerKVPress``). No budget: the realized compression
    is what the layers decide, and the rows record it.

    A layer is lazy when the attention of the last ``n_last`` queries (fp32 softmax, mean over heads and those
    queries) on the first ``n_initial`` and the last ``n_recent`` of the keys before them sums above
    ``lazy_threshold``; it then keeps the first ``n_initial`` tokens and the last ``n_recent - n_last`` (kvpress'
    slice ``[-n_recent + n_last:]``). ``lazy_threshold`` 1 or a prompt of at most ``n_initial + n_recent + n_last``
    tokens keeps everything. The paper recommends 0.9 for Llama-3, 0.65 Llama-2, 0.8 Mistral, 0.85 Qwen; kvpress'
    default 1.0 compresses nothing, so this one is Llama-3's. kvpress decides once per batch (mean over its rows);
    here each row decides alone, so a batch gives each prompt what it gives alone.
    """

    name: ClassVar[str] = "simlayerkv"
    per_head: ClassVar[bool] = True  # lazy and full layers hold different counts
    takes_budget: ClassVar[bool] = False
    budget_fields: ClassVar[tuple[str, ...]] = ()
    lazy_threshold: float = setting(0.9, low=0, high=1)
    n_last: int = setting(1, low=1)
    n_recent: int = setting(1024, low=1)
    n_initial: int = setting(4, low=0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_recent <= self.n_last:
            raise ValueError(f"SimLayerKV.n_recent must be > n_last ({self.n_last}), got {self.n_recent}")

    def prefill_queries(self) -> int:
        return self.n_last

    def lazy(self, alone: PrefillView) -> bool:
        """Whether the layer is lazy for this one unpadded prompt."""
        m = alone.keys.shape[2]
        queries = alone.query[:, :, -self.n_last :]
        visible = causal_visible(alone.key_valid, m - self.n_last, m)
        attention = attention_probabilities(queries, alone.keys, visible, alone.scaling, attention_sinks(alone.module))
        attention = attention[..., : m - self.n_last].mean(dim=(0, 1, 2, 3))  # over batch, heads, queries
        return float(attention[: self.n_initial].sum() + attention[-self.n_recent :].sum()) > self.lazy_threshold

    def select(self, view: PrefillView, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        kept = []
        for row in range(view.keys.shape[0]):
            alone, first = row_of(view, row)
            m = alone.keys.shape[2]
            tokens = torch.arange(m, device=view.keys.device)
            if self.lazy_threshold < 1 and m > self.n_initial + self.n_recent + self.n_last and self.lazy(alone):
                tokens = tokens[(tokens < self.n_initial) | (tokens >= m - self.n_recent + self.n_last)]
            kept.append(tokens + first)
        counts = torch.tensor([[len(t)] * kv_heads for t in kept], device=view.keys.device)
        return stacked(kept, kv_heads, view.keys.device), counts, torch.zeros(view.keys.shape[0], kv_heads,
                                                                                 view.keys.shape[2])
