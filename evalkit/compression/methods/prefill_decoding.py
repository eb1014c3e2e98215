"""One method at prefill, another re-applied while decoding (kvpress ``PrefillDecodingPress``)."""

from __future__ import annotations

import dataclasses
import sys
from typing import ClassVar

import torch

from ..views import PrefillView
from .base import Policy, named_settings
from .decoding_snapkv import DecodingSnapKV
from .wrapper import build_scorer


@dataclasses.dataclass
class PrefillDecoding(DecodingSnapKV):
    """``prefill`` compresses the prompt to ``capacity - interval`` tokens; while decoding, ``scorer`` (SnapKV by
    default) is re-applied every ``interval`` steps as in :class:`DecodingSnapKV` (kvpress
    ``PrefillDecodingPress(prefilling_press, DecodingPress(scorer))``). ``prefill``: any prompt method, allocating
    ones (AdaKV, PyramidKV) and wrappers included, as a name or its settings; None: the decoding scorer, which is
    ``decoding_snapkv``. Methods that act while decoding, rewrite the cache or sum every query's attention (whose
    fused prefill pass keeps no queries for the decoding window) are refused."""

    name: ClassVar[str] = "prefill_decoding"
    prefill: Policy | str | dict | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        spec = self.prefill if self.prefill is not None else named_settings(self.scorer)
        self.prefill = build_scorer(spec, self.prompt_capacity(), "PrefillDecoding", field="prefill")
        method = self.prefill
        reason = ("it acts while decoding" if method.evicts_while_decoding or method.cache_capacity() is not None
                  else "it rewrites the cache it keeps" if method.rewrites
                  else "its fused attention-sum pass keeps no queries for the decoding window"
                  if method.sums_attention else "it keeps every token" if not method.needs_scores else None)
        if reason:
            raise ValueError(f"PrefillDecoding.prefill cannot be {method.name}: {reason}")
        self.supports_latent = self.supports_latent and method.supports_latent
        self.reads_hidden_states = method.reads_hidden_states

    def settings(self) -> dict:
        return {**super().settings(), "prefill": named_settings(self.prefill)}

    def check_layers(self, num_layers: int) -> None:
        super().check_layers(num_layers)
        self.prefill.check_layers(num_layers)

    def check_model(self, config) -> None:
        super().check_model(config)
        self.prefill.check_model(config)

    def kept_sink(self) -> int:
        return self.prefill.kept_sink()

    def kept_window(self) -> int:
        return self.prefill.kept_window()

    def prefill_queries(self) -> int | None:
        needed = self.prefill.prefill_queries()
        return None if needed is None else max(needed, self.window)

    def prompt_slots(self, n: int, kv_heads: int) -> int:
        return self.prefill.prompt_slots(n, kv_heads)

    def slot_capacity(self, kv_heads: int) -> int:
        return max(super().slot_capacity(kv_heads), self.prefill.prompt_slots(sys.maxsize, kv_heads) + self.interval)

    def select(self, view: PrefillView, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.prefill.select(view, kv_heads)

    def reselect(self, prompt: PrefillView, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return super().select(prompt, kv_heads)
