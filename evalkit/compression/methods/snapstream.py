"""SnapStream (Li et al., SambaNova, arXiv 2511.03092)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from evalkit.core.method_settings import setting

from .base import SnapKVScoring


@dataclasses.dataclass
class SnapStream(SnapKVScoring):
    """SnapKV at prefill plus a StreamingLLM-style ring while decoding, in one static cache of ``capacity`` tokens.

    Layout per sequence: ``[prompt region | ring]``. After prefill the prompt region holds at most
    ``capacity - recent`` prompt tokens: a longer prompt keeps its first ``sink`` tokens, its last ``window`` tokens
    and the best of the rest by the SnapKV score. The prompt region never changes afterwards. Generated tokens fill
    the remaining ``capacity - kept`` slots (at least ``recent``) as a ring: once it is full, each new token
    overwrites the oldest generated token. The cache never exceeds ``capacity`` tokens.
    ``recent`` defaults to a quarter of ``capacity``.
    """

    name: ClassVar[str] = "snapstream"
    sink: int = setting(4, low=0)
    recent: int | None = setting(None, low=1)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.recent is None:
            self.recent = max(1, self.capacity // 4)
        needed = self.sink + self.window + self.recent
        if self.capacity < needed:
            raise ValueError(
                f"SnapStream.capacity must be >= sink + window + recent ({needed}), got {self.capacity}"
            )

    def kept_sink(self) -> int:
        return self.sink

    def prompt_capacity(self) -> int:
        return self.capacity - self.recent

    def cache_capacity(self) -> int:
        return self.capacity

    def decode_layout(self, kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return kept.clone(), self.capacity - kept
