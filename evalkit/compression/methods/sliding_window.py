"""The sliding-window layers of hybrid models (Gemma-2/3, gpt-oss, ...), kept as the model defines them."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from evalkit.core.method_settings import setting

from ..kernels import free_lowest
from ..model_spec import layer_kinds
from ..views import DecodeView
from .base import Policy


@dataclasses.dataclass
class SlidingWindow(Policy, register=False):
    """A layer whose attention only ever sees the last ``window`` tokens (the model's ``sliding_window``).

    Not a compression method: hybrid models' sliding-window layers get it instead of the run's policy, so they hold
    exactly what the model's own cache holds (transformers' ``DynamicSlidingWindowLayer``): the last ``window - 1``
    prompt tokens after prefill; at each decode step the new token takes the free slot, attends over at most
    ``window`` tokens, and the oldest is dropped after the attention.
    """

    name: ClassVar[str] = "sliding_window"
    per_head: ClassVar[bool] = True
    evicts_while_decoding: ClassVar[bool] = True
    window: int = setting(0, low=2)

    def kept_window(self) -> int:
        return self.window - 1

    def prompt_capacity(self) -> int:
        return self.window - 1

    def cache_capacity(self) -> int:
        return self.window

    def decode_evict(self, view: DecodeView) -> torch.Tensor | None:
        full = view.valid.sum(dim=-1) >= self.window  # [B, Hkv]
        return free_lowest(view.positions, view.valid, full)  # the oldest token


def layer_policies(model, policy: Policy) -> list[Policy]:
    """The policy of each layer: ``policy`` on full-attention layers (compressed), :class:`SlidingWindow` on a hybrid
    model's sliding-window layers (left as the model defines them)."""
    return [SlidingWindow(window=model.config.sliding_window) if kind == "sliding_attention" else policy
            for kind in layer_kinds(model.config)]
