"""PyramidKV (Cai et al., arXiv 2406.02069; reference code Zefan-Cai/KVCache-Factory, ``PyramidKVCluster``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from evalkit.core.method_settings import setting

from .wrapper import Wrapper


@dataclasses.dataclass
class PyramidKV(Wrapper):
    """A scorer's ranking (SnapKV's by default, see :mod:`.wrapper`) with budgets that decrease linearly with depth and
    keep the same total.

    ``capacity`` is SnapKV's prompt capacity C on average over layers. For a prompt of n tokens, as
    KVCache-Factory's ``PyramidKVCluster`` (integer arithmetic included), with window w and L layers:
    n < C keeps everything; n < 2 (C - w) keeps C in every layer (SnapKV); otherwise
    ``min = (C - w) // beta``, ``max = 2 (C - w) - min`` (if ``max >= n - w``: ``max = n - w``,
    ``min = 2 (C - w) - max``), ``steps = (max - min) // (L - 1)``, and layer l keeps ``max - l * steps`` prompt
    tokens by score plus the w window tokens. ``beta`` (reference default 20) sets the slope. Because ``steps`` is
    floored, the deepest layers keep slightly more than the exact pyramid: the realized mean is in the statistics.

    kvpress' ``PyramidKVPress`` allocates differently (another budget formula, and uniform budgets when
    n(1 - R)/beta < window); evalkit follows KVCache-Factory, whose per-layer budgets give the same kept sets as
    kvpress when kvpress is handed these budgets.
    """

    name: ClassVar[str] = "pyramidkv"
    per_head: ClassVar[bool] = True
    allocates: ClassVar[bool] = True
    # KVCache-Factory's PyramidKVCluster: window 64, kernel 5, average pooling (not our SnapKV's 32/7/max).
    inline: ClassVar[tuple[str, dict]] = ("snapkv", {"window": 64, "kernel_size": 5, "pooling": "avg"})
    beta: int = setting(20, low=1)

    def prompt_capacity(self) -> int:
        return self.capacity

    def layer_budget(self, layer_idx: int, num_layers: int, real_len: torch.Tensor) -> torch.Tensor:
        return torch.tensor([self._budget(layer_idx, num_layers, int(n)) for n in real_len.tolist()])

    def prompt_slots(self, n: int, kv_heads: int) -> int:
        return min(n, 2 * self.capacity - self.kept_window())  # the first layer's largest budget

    def _budget(self, layer_idx: int, num_layers: int, n: int) -> int:
        capacity, window = self.capacity, self.kept_window()  # SnapKV's window, or the tokens the scorer forces
        if n < capacity:
            return n
        if n < (capacity - window) * 2 or num_layers == 1:
            return capacity
        low = (capacity - window) // self.beta
        high = (capacity - window) * 2 - low
        if high >= n - window:
            high = n - window
            low = (capacity - window) * 2 - high
        steps = (high - low) // (num_layers - 1)
        return high - layer_idx * steps + window
