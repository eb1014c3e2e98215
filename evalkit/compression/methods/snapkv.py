"""SnapKV (Li et al., NeurIPS 2024, arXiv 2404.14469)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from .base import SnapKVScoring


@dataclasses.dataclass
class SnapKV(SnapKVScoring):
    """Compress the prompt once, at the end of prefill; never evict while decoding.

    Per layer and per KV head, keep the last ``window`` prompt tokens (the observation window) plus the
    ``capacity - window`` earlier tokens with the highest SnapKV score (see :func:`~evalkit.compression.kernels.snapkv_scores`).
    A prompt of at most ``capacity`` tokens is kept whole. Generated tokens are appended, so the cache grows by one
    token per step after prefill.
    """

    name: ClassVar[str] = "snapkv"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.capacity <= self.window:
            raise ValueError(f"{type(self).__name__}.capacity must be > window ({self.window}), got {self.capacity}")

    def prompt_capacity(self) -> int:
        return self.capacity
