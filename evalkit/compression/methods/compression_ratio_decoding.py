"""A decoding cache that keeps a fraction of every token seen so far (kvpress ``CompressionRatioDecodingPress``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from evalkit.core.method_settings import check, setting

from ..views import DecodeView, dropped_by_reselection
from .wrapper import Wrapper


@dataclasses.dataclass
class CompressionRatioDecoding(Wrapper):
    """Every ``interval`` decode steps, each layer and KV head keeps ``max(1, int(seen * (1 - ratio)))`` tokens, the
    best its ``scorer`` ranks (KNorm by default: kvpress' press takes a scorer and names none), ``seen`` being every token of the sequence so far (the step's
    position + 1): the cache grows between compressions and holds ``1 - ratio`` of the sequence after each.

    Reference: kvpress 0.5.5 ``CompressionRatioDecodingPress`` (``kvpress/presses/compression_ratio_decoding_press.py``,
    over ``DecodingPress`` in ``decoding_press.py``). kvpress compresses nothing at prefill; here the prompt is kept to
    the budget's ``capacity`` by the same scorer (kvpress ``PrefillDecodingPress(scorer, CompressionRatioDecodingPress)``):
    a budget of at least the prompt keeps it whole, the press alone. At a compression the scorer sees the cache as a
    prompt, each head's tokens in text order, with the last ``buffer`` queries (kvpress' ``hidden_states_buffer_size``),
    as :class:`~.decoding_snapkv.DecodingSnapKV` re-applies it; a SnapKV scorer differs from kvpress as it says there
    (the window queries keep their own RoPE positions; the pooling runs in text order). kvpress also compresses on a step
    whose ``target`` is 1 (``q_len >= target_size``), which no ratio below ``1 - 2 / seen`` reaches; here only every
    ``interval`` steps.
    """

    name: ClassVar[str] = "compression_ratio_decoding"
    per_head: ClassVar[bool] = True
    evicts_while_decoding: ClassVar[bool] = True
    inline: ClassVar[tuple[str, dict]] = ("knorm", {})
    buffer: int = setting(256, low=1)
    interval: int = setting(512, low=1)
    ratio: float = setting(0.5, low=0, high=1)

    def __post_init__(self) -> None:
        check(self)
        if self.ratio >= 1:
            raise ValueError(f"CompressionRatioDecoding.ratio (the fraction removed) must be below 1, got {self.ratio}")
        super().__post_init__()
        scorer, needed = self.scorer, self.scorer.prefill_queries()
        reason = ("its score sums the attention of every query" if scorer.sums_attention
                  else "it scores from hidden states, which decoding does not keep" if scorer.reads_hidden_states
                  else "it reads every query of the sequence" if scorer.reads_every_query or needed is None
                  else "it sizes layers and heads itself" if scorer.allocates
                  else f"it reads {needed} queries, more than the {min(self.buffer, self.interval)} kept (buffer, "
                       "interval)" if needed > min(self.buffer, self.interval)
                  else None)
        if reason:
            raise ValueError(f"CompressionRatioDecoding.scorer cannot be {scorer.name}: {reason}")
        self._targets: torch.Tensor | None = None

    def prompt_capacity(self) -> int:
        return self.capacity

    def query_window(self) -> int:
        return self.buffer

    def layer_budget(self, layer_idx: int, num_layers: int, real_len: torch.Tensor) -> torch.Tensor:
        if self._targets is None:  # prefill
            return super().layer_budget(layer_idx, num_layers, real_len)
        return torch.minimum(real_len, self._targets.to(real_len.device))

    def decode_evict(self, view: DecodeView) -> torch.Tensor | None:
        due = view.steps % self.interval == 0  # [B]: rows whose interval ends at this step
        if not torch.compiler.is_compiling() and not bool(due.any()):
            return None
        seen = (view.position + 1).double()
        self._targets = (seen * (1 - self.ratio)).floor().long().clamp(min=1)
        try:
            return self._reapply(view) & due[:, None, None]
        finally:
            self._targets = None

    def _reapply(self, view: DecodeView) -> torch.Tensor:
        """The slots the scorer drops when it selects from the cache as from a prompt (each head's tokens in text
        order, its empty slots before them as left padding), keeping each row's target."""
        return dropped_by_reselection(view, self.select)
