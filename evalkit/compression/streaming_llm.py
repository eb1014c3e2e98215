"""StreamingLLM (Xiao et al., ICLR 2024, arXiv 2309.17453)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from .base import Policy, require_int


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
    sink: int = 4
    window: int = 512

    def __post_init__(self) -> None:
        require_int(self, "sink", 0)
        require_int(self, "window", 1)

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
