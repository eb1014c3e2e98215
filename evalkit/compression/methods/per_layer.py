"""Per-layer budgets over any scorer (kvpress ``PerLayerCompressionPress``)."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import torch

from evalkit.core.method_settings import setting

from .wrapper import Wrapper


@dataclasses.dataclass
class PerLayer(Wrapper):
    """A scorer's ranking (SnapKV's by default, see :mod:`.wrapper`) with each layer's share of the budget given.

    Layer ``l`` keeps ``floor(capacity * w_l / mean(weights))`` prompt tokens per KV head (at most the prompt), so
    the layers keep ``capacity`` on average. ``weights`` gives one share per layer, or a coarser profile stretched
    over the depth (layer ``l`` of ``L`` takes ``weights[l * len(weights) // L]``, ``L`` a multiple of
    ``len(weights)``, so that the mean stays the budget). None: every layer keeps ``capacity`` (the scorer alone).

    kvpress' ``PerLayerCompressionPress(press, compression_ratios)`` keeps ``int(n * (1 - r_l))`` tokens in layer
    ``l``; with ``weights = [1 - r_l]`` and the budget ``n * (1 - mean(r))`` this keeps the same counts (up to the
    rounding of the product).
    """

    name: ClassVar[str] = "per_layer"
    per_head: ClassVar[bool] = True  # layers hold different counts
    allocates: ClassVar[bool] = True
    weights: tuple[float, ...] | None = setting(None, low=0)  # a zero weight is refused below: its layer keeps 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.weights is not None:  # a config gives a list
            self.weights = tuple(float(w) for w in self.weights)
        lightest, forced = self._layer_capacity(0, 1, lowest=True), self.scorer.kept_sink() + self.scorer.kept_window()
        if lightest <= forced:
            raise ValueError(f"PerLayer: its lightest layer keeps {lightest} tokens, not more than the {forced} "
                             f"{self.scorer.name} always keeps (raise the budget or that layer's weight)")

    def prompt_capacity(self) -> int:
        return self.capacity

    def _layer_capacity(self, layer_idx: int, num_layers: int, lowest: bool = False, highest: bool = False) -> int:
        if self.weights is None:
            return self.capacity
        mean = sum(self.weights) / len(self.weights)
        if mean == 0:
            return 0
        weight = (min(self.weights) if lowest else max(self.weights) if highest
                  else self.weights[layer_idx * len(self.weights) // num_layers])
        return math.floor(self.capacity * weight / mean)

    def check_layers(self, num_layers: int) -> None:
        if self.weights is not None and num_layers % len(self.weights):
            raise ValueError(f"PerLayer.weights gives {len(self.weights)} shares, and the model's {num_layers} layers "
                             "are not a multiple of that: give one per layer, or a profile whose length divides it")
        self.scorer.check_layers(num_layers)

    def layer_budget(self, layer_idx: int, num_layers: int, real_len: torch.Tensor) -> torch.Tensor:
        return real_len.clamp(max=self._layer_capacity(layer_idx, num_layers))

    def allocate(self, scores: torch.Tensor, budget: torch.Tensor, layer_idx: int = 0) -> torch.Tensor:
        return budget[:, None].expand(-1, scores.shape[1]).clone()  # every head of the layer keeps its budget

    def prompt_slots(self, n: int, kv_heads: int) -> int:
        return min(n, self._layer_capacity(0, 1, highest=True))
