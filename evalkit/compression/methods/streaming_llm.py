"""StreamingLLM (Xiao et al., ICLR 2024, arXiv 2309.17453)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from evalkit.core.method_settings import check_value, setting

from .base import Policy


@dataclasses.dataclass
class StreamingLLM(Policy):
    """Attention sinks plus a sliding window of recent tokens.

    Prefill is ordinary causal attention over the whole prompt. After prefill the cache keeps the first ``sink`` tokens
    and the last ``window`` tokens; at every decode step the new token overwrites the oldest non-sink token once the
    cache is full, so every query attends to the ``sink`` first tokens and the ``window`` most recent tokens including
    itself. Keys keep the RoPE of their true text positions (SnapKV/kvpress convention, not the original code's
    re-assignment of positions by cache slot). The reference code's defaults are sink=4, window=512.
    """

    name: ClassVar[str] = "streaming_llm"
    supports_latent: ClassVar[bool] = True
    budget_fields: ClassVar[tuple[str, ...]] = ("capacity", "window")
    sink: int = setting(4, low=0)
    window: int = setting(512, low=1)

    @classmethod
    def from_config(cls, capacity: int, **params) -> StreamingLLM:
        """The budget's capacity spent on ``sink`` + ``window`` (window = capacity - sink)."""
        sink = params.pop("sink", 4)
        check_value(cls, "sink", sink)
        if "window" in params:
            raise ValueError("streaming_llm's window comes from the budget (capacity - sink); do not set both")
        if capacity <= sink:
            raise ValueError(f"the budget gives capacity {capacity}, not more than sink={sink}")
        return cls(sink=sink, window=capacity - sink, **params)

    def kept_sink(self) -> int:
        return self.sink

    def kept_window(self) -> int:
        return self.window

    def prompt_capacity(self) -> int:
        return self.sink + self.window

    def cache_capacity(self) -> int:
        return self.sink + self.window

    def decode_layout(self, kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # The sink slots are fixed; every other slot, prompt tokens included, belongs to the window ring.
        return torch.full_like(kept, self.sink), torch.full_like(kept, self.window)
