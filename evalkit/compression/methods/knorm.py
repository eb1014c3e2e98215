"""KNorm (Devoto et al., EMNLP 2024, arXiv 2406.11430; kvpress ``KnormPress``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from ..views import PrefillView
from .base import PromptScoring


@dataclasses.dataclass
class KNorm(PromptScoring):
    """Keep the prompt keys with the *smallest* L2 norm (a low key norm goes with high attention, per the paper).

    Score = ``-||k||`` per layer and KV head, as kvpress' ``KnormPress.score``; the top ``capacity`` prompt tokens by
    score are kept, nothing forced unless ``sink``/``window`` say so. Needs no attention at all.
    """

    name: ClassVar[str] = "knorm"
    supports_latent: ClassVar[bool] = True

    def prefill_queries(self) -> int:
        return 0

    def score(self, view: PrefillView) -> torch.Tensor:
        return -view.keys.float().norm(dim=-1)
