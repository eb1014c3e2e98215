"""Random eviction: the floor every comparison table needs (kvpress ``RandomPress``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from evalkit.core.method_settings import setting

from ..views import PrefillView
from .base import PromptScoring


@dataclasses.dataclass
class Random(PromptScoring):
    """Keep ``capacity`` prompt tokens per layer and KV head chosen uniformly at random, reproducibly from ``selection_seed``.

    As kvpress' ``RandomPress``, every layer draws ``torch.rand`` from a generator seeded with ``selection_seed`` (so layers
    draw alike); unlike it, the draw is made per prompt (``[kv_heads, prompt length]``), so a prompt keeps the same
    tokens alone or in any batch. The draws are made in float32 on the CPU; kvpress draws in the keys' dtype on
    their device, so the kept tokens are kvpress' own only for a float32 model on the CPU (elsewhere they are other,
    equally uniform draws).
    """

    name: ClassVar[str] = "random"
    supports_latent: ClassVar[bool] = True
    selection_seed: int = setting(0, low=0)  # kvpress' ``seed``; named apart from the run's sampling seed

    def prefill_queries(self) -> int:
        return 0

    def score(self, view: PrefillView) -> torch.Tensor:
        batch, kv_heads, n, _ = view.keys.shape
        scores = torch.zeros(batch, kv_heads, n)
        for row, valid in enumerate(view.key_valid.cpu()):
            real = int(valid.sum())
            generator = torch.Generator().manual_seed(self.selection_seed)
            scores[row, :, n - real :] = torch.rand(kv_heads, real, generator=generator)
        return scores.to(view.keys.device)
