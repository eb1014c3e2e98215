"""SnapKV re-applied while decoding (kvpress ``DecodingPress`` over ``SnapKVPress``; the R-KV setting for long
reasoning, arXiv 2505.24133), or any other prefill scorer re-applied the same way (``DecodingPress`` over any
``ScorerPress``)."""

from __future__ import annotations

import dataclasses
import sys
from typing import ClassVar

import torch

from evalkit.core.method_settings import check, setting

from ..kernels import attention_probabilities, pool_scores, reduce_groups, slots_visible
from ..views import DecodeView, dropped_by_reselection
from .snapkv import SnapKV
from .wrapper import Wrapper


@dataclasses.dataclass
class DecodingSnapKV(Wrapper):
    """A cache of ``capacity`` tokens compressed back to ``capacity - interval`` every ``interval`` decode steps.

    Prefill: the prompt is compressed by the wrapped method to ``capacity - interval`` tokens (kvpress'
    ``PrefillDecodingPress`` with SnapKV on both sides). Decoding: generated tokens fill the free slots; after every
    ``interval``-th decode step's attention, SnapKV scores every cached token with the last ``window`` queries (the
    most recent tokens, each seeing the cached tokens up to its own position), pooled along text order, and each
    layer and KV head keeps the ``window`` most recent tokens plus its best ``capacity - interval - window`` others.
    Defaults follow kvpress (``compression_interval`` 512, ``SnapKVPress`` window 64, kernel 5, average pooling).

    Differences from kvpress, both in SnapKV's favour of its own definition: the window queries keep their own RoPE
    positions (kvpress re-applies the current position's), and the cache stays in text order for the pooling
    (kvpress pools over the previous compression's score order).

    ``scorer`` (see :mod:`.wrapper`: ``"knorm"``, ``{"name": "adakv", "scorer": "knorm"}``, a method): that method
    selects instead of SnapKV, at prefill and at every re-application; the kvpress ``DecodingPress(base_press=...)``
    composition. At a re-application it sees the cache as a prompt: each head's tokens in text order (the empty slots
    before them as left padding, each head its own where an allocating method left heads unequal), their keys and
    values, and the last ``window`` queries (kvpress' buffer of recent hidden states, ``hidden_states_buffer_size``).
    ``window`` is then only that buffer. Methods that sum the attention of every query of the sequence (H2O,
    ObservedAttention) are refused: decoding keeps the recent queries only.
    """

    name: ClassVar[str] = "decoding_snapkv"
    per_head: ClassVar[bool] = True
    evicts_while_decoding: ClassVar[bool] = True
    shared_with_inline: ClassVar[tuple[str, ...]] = ("window",)
    window: int = setting(64, low=1)
    interval: int = setting(512, low=1)

    def __post_init__(self) -> None:
        check(self)  # its own settings first: the scorer is sized by them
        if self.interval <= self.window:
            raise ValueError(f"DecodingSnapKV.interval must be > window ({self.window}), got {self.interval}")
        if self.capacity - self.interval <= self.window:
            raise ValueError(f"DecodingSnapKV.capacity must be > interval + window ({self.interval + self.window}), "
                             f"got {self.capacity} (lower interval or raise the budget)")
        super().__post_init__()
        self._check_scorer()

    def scorer_capacity(self) -> int:
        return self.capacity - self.interval

    def _check_scorer(self) -> None:
        scorer, owner = self.scorer, type(self).__name__
        if scorer.sums_attention:
            raise ValueError(f"{owner}.scorer cannot be {scorer.name}: its score sums the attention of every query "
                             "of the sequence, and decoding keeps only the recent ones (snapkv scores with those)")
        if scorer.reads_hidden_states:
            raise ValueError(f"{owner}.scorer cannot be {scorer.name}: it scores from hidden states, which decoding "
                             "does not keep")
        if scorer.reads_every_query:
            raise ValueError(f"{owner}.scorer cannot be {scorer.name}: it reads every query of the sequence, and "
                             "decoding keeps only the recent ones")
        needed = scorer.prefill_queries()
        if needed is not None and needed > self.window:
            raise ValueError(f"{owner}.window ({self.window}: the recent queries kept for the scorer) must be >= "
                             f"the {needed} queries {scorer.name} reads")
        forced = scorer.kept_sink() + scorer.kept_window()
        if forced >= self.capacity - self.interval:
            raise ValueError(f"{owner}: {scorer.name} forces {forced} tokens, not fewer than the "
                             f"{self.capacity - self.interval} kept at each re-application (capacity - interval)")

    def prompt_capacity(self) -> int:
        return self.capacity - self.interval

    def cache_capacity(self) -> int:
        return self.capacity

    def slot_capacity(self, kv_heads: int) -> int:
        """Under an allocating scorer (AdaKV, PyramidKV) heads hold unequal shares of ``capacity``: the largest share
        it gives, plus the ``interval`` tokens generated before the next re-application."""
        if not self.scorer.allocates:
            return self.capacity
        return self.scorer.prompt_slots(sys.maxsize, kv_heads) + self.interval

    def query_window(self) -> int:
        return self.window

    def decode_evict(self, view: DecodeView) -> torch.Tensor | None:
        due = view.steps % self.interval == 0  # [B]: rows whose interval ends at this step
        # Eager, skip the scoring on the other steps; compiled, always score (masked by ``due``): one static graph.
        if not torch.compiler.is_compiling() and not bool(due.any()):
            return None
        if not self._snapkv_own_pass():
            return self._reapply(view) & due[:, None, None]
        valid, positions, window = view.valid, view.positions, self.window
        target = self.capacity - self.interval
        query_positions = view.position[:, None] - window + 1 + torch.arange(window, device=valid.device)  # [B, w]
        visible = slots_visible(valid, positions, query_positions)
        attention = attention_probabilities(view.query_buffer, view.keys, visible, view.scaling, view.sinks).sum(dim=-2)
        # Group the query heads by the cache's heads (all of them for a latent cache): [B, Hkv, G, S].
        attention = attention.reshape(valid.shape[0], valid.shape[1], -1, attention.shape[-1])
        in_window = positions >= query_positions[:, :1, None]  # [B, Hkv, S]
        # Score in text order (each head's slots sorted by position, empty slots last): pooling sees text
        # neighbours, and ties go to the earlier token as at prefill.
        order = positions.masked_fill(~valid, torch.iinfo(positions.dtype).max).argsort(dim=-1)

        def in_order(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.gather(-1, order)

        prefix = in_order(valid & ~in_window)
        grouped_order = order[:, :, None].expand_as(attention)
        ordered = attention.gather(-1, grouped_order).masked_fill(~prefix[:, :, None], 0.0)
        snapkv = self.scorer
        scores = reduce_groups(pool_scores(ordered, snapkv.kernel_size, snapkv.pooling), snapkv.gqa_reduce)
        scores = scores.masked_fill(in_order(valid & in_window), float("inf")).masked_fill(~in_order(valid), float("-inf"))
        return dropped_beyond(scores, order, valid, target) & due[:, None, None]

    def reselect(self, prompt, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What a re-application keeps of the cache seen as a prompt: the wrapped method's selection."""
        return self.select(prompt, kv_heads)

    def _snapkv_own_pass(self) -> bool:
        """SnapKV scoring with this method's window: re-applied by one pass over the slots (compile-friendly, no
        reordering of keys) that ranks as :meth:`_reapply` would."""
        return type(self.scorer) is SnapKV and self.scorer.window == self.window

    def _reapply(self, view: DecodeView) -> torch.Tensor:
        """The slots the wrapped method drops when it selects from the cache as from a prompt (see the class): each
        head's tokens in text order, its empty slots before them as a prompt's left padding."""
        return dropped_by_reselection(view, self.reselect)


def dropped_beyond(scores: torch.Tensor, order: torch.Tensor, valid: torch.Tensor, target: int) -> torch.Tensor:
    """The valid slots beyond the ``target`` best ``scores`` (given in the slot ``order`` of text order; ties to the
    earlier token), as a mask over the slots."""
    ranked = scores.sort(dim=-1, descending=True, stable=True).indices
    dropped = torch.zeros_like(valid).scatter_(-1, ranked[..., target:], True)  # in text order
    return valid & torch.zeros_like(valid).scatter_(-1, order, dropped)
