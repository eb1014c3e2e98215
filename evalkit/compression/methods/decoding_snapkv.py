"""SnapKV re-applied while decoding (kvpress ``DecodingPress`` over ``SnapKVPress``; the R-KV setting for long
reasoning, arXiv 2505.24133), or any other prefill scorer re-applied the same way (``DecodingPress`` over any
``ScorerPress``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from ..kernels import attention_probabilities, pool_scores, reduce_groups, slots_visible
from ..views import DecodeView, PrefillView
from .base import SnapKVScoring, require_int
from .scorer import WithScorer


@dataclasses.dataclass
class DecodingSnapKV(WithScorer, SnapKVScoring):
    """A cache of ``capacity`` tokens compressed back to ``capacity - interval`` every ``interval`` decode steps.

    Prefill: the prompt is compressed by SnapKV to ``capacity - interval`` tokens (kvpress' ``PrefillDecodingPress``
    with SnapKV on both sides). Decoding: generated tokens fill the free slots; after every ``interval``-th decode
    step's attention, SnapKV scores every cached token with the last ``window`` queries (the most recent tokens, each
    seeing the cached tokens up to its own position), pooled along text order, and each layer and KV head keeps the
    ``window`` most recent tokens plus its best ``capacity - interval - window`` others. Defaults follow kvpress
    (``compression_interval`` 512, ``SnapKVPress`` window 64, kernel 5, average pooling).

    Differences from kvpress, both in SnapKV's favour of its own definition: the window queries keep their own RoPE
    positions (kvpress re-applies the current position's), and the cache stays in text order for the pooling
    (kvpress pools over the previous compression's score order).

    ``scorer`` (as AdaKV's: ``"knorm"``, ``{"name": "snapkv", "window": 16}``, a policy): that method's score ranks
    instead of SnapKV's, at prefill and at every re-application, and its forced tokens (sink, window) are kept; the
    kvpress ``DecodingPress(base_press=...)`` composition. At a re-application the scorer sees the cache as a prompt:
    each head's tokens in text order (every head holds as many), their keys and values, and the last ``window``
    queries (kvpress' buffer of recent hidden states, ``hidden_states_buffer_size``). ``window`` is then only that
    buffer; SnapKV's other fields are unused. Scorers that sum the attention of every query of the sequence (H2O,
    ObservedAttention) are refused: decoding keeps the recent queries only.
    """

    name: ClassVar[str] = "decoding_snapkv"
    per_head: ClassVar[bool] = True
    evicts_while_decoding: ClassVar[bool] = True
    window: int = 64
    kernel_size: int = 5
    pooling: str = "avg"
    interval: int = 512
    scorer_free_fields: ClassVar[tuple[str, ...]] = ("capacity", "window")

    def __post_init__(self) -> None:
        if self.scorer is None:
            super().__post_init__()
        else:
            self._take_scorer()
            require_int(self, "window", 1)
            self._check_scorer()
        require_int(self, "interval", 1)
        if self.interval <= self.window:
            raise ValueError(f"DecodingSnapKV.interval must be > window ({self.window}), got {self.interval}")
        if self.capacity - self.interval <= self.window:
            raise ValueError(f"DecodingSnapKV.capacity must be > interval + window ({self.interval + self.window}), "
                             f"got {self.capacity} (lower interval or raise the budget)")

    def _check_scorer(self) -> None:
        scoring, owner = self.scoring, type(self).__name__
        if scoring.sums_attention:
            raise ValueError(f"{owner}.scorer cannot be {scoring.name}: its score sums the attention of every query "
                             "of the sequence, and decoding keeps only the recent ones (snapkv scores with those)")
        needed = scoring.prefill_queries()
        if needed is not None and needed > self.window:
            raise ValueError(f"{owner}.window ({self.window}: the recent queries kept for the scorer) must be >= "
                             f"the {needed} queries {scoring.name} reads")
        forced = scoring.kept_sink() + scoring.kept_window()
        if forced >= self.capacity - self.interval:
            raise ValueError(f"{owner}: {scoring.name} forces {forced} tokens, not fewer than the "
                             f"{self.capacity - self.interval} kept at each re-application (capacity - interval)")

    def prompt_capacity(self) -> int:
        return self.capacity - self.interval

    def cache_capacity(self) -> int:
        return self.capacity

    def query_window(self) -> int:
        return self.window

    def decode_evict(self, view: DecodeView) -> torch.Tensor | None:
        due = view.steps % self.interval == 0  # [B]: rows whose interval ends at this step
        # Eager, skip the scoring on the other steps; compiled, always score (masked by ``due``): one static graph.
        if not torch.compiler.is_compiling() and not bool(due.any()):
            return None
        if self.scorer is not None:
            return self._rescore(view) & due[:, None, None]
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
        scores = reduce_groups(pool_scores(ordered, self.kernel_size, self.pooling), self.gqa_reduce)
        scores = scores.masked_fill(in_order(valid & in_window), float("inf")).masked_fill(~in_order(valid), float("-inf"))
        return _dropped(scores, order, valid, target) & due[:, None, None]

    def _rescore(self, view: DecodeView) -> torch.Tensor:
        """The slots the scorer drops when it ranks the cache as a prompt (see the class): each head's tokens in
        text order, the empty slots before them as a prompt's left padding (every head holds as many tokens), the
        scorer's forced sink and window kept, the best others up to ``capacity - interval``; ties to the earlier."""
        valid, positions = view.valid, view.positions
        scoring, target = self.scoring, self.capacity - self.interval
        order = positions.masked_fill(~valid, -1).argsort(dim=-1, stable=True)  # empty slots first, then text order

        def in_order(tensor: torch.Tensor) -> torch.Tensor:
            index = order if tensor.dim() == 3 else order[..., None].expand(-1, -1, -1, tensor.shape[-1])
            return tensor.gather(2, index)

        held = in_order(valid)  # [B, Hkv, S]
        key_valid = held[:, 0]  # [B, S]: the same for every head
        prompt = PrefillView(
            query=view.query_buffer, keys=in_order(view.keys), values=in_order(view.values), key_valid=key_valid,
            scaling=view.scaling, layer_idx=getattr(view.module, "layer_idx", 0), num_layers=0, module=view.module,
            positions=in_order(positions)[:, 0].clamp(min=0), rotary=view.rotary)
        raw = scoring.score(prompt).float()
        if raw.shape[1] != valid.shape[1]:  # per-head scores over a shared latent: one group of all the heads
            raw = reduce_groups(raw[:, None], getattr(scoring, "gqa_reduce", "mean"))
        slots = valid.shape[-1]
        index = torch.arange(slots, device=valid.device)
        first = (slots - key_valid.sum(dim=1))[:, None]  # [B, 1]: the first held token's place
        forced = (index >= slots - min(scoring.kept_window(), slots)) | (
            (index >= first) & (index < first + scoring.kept_sink()))
        scores = raw.masked_fill(forced[:, None], float("inf")).masked_fill(~held, float("-inf"))
        return _dropped(scores, order, valid, target)


def _dropped(scores: torch.Tensor, order: torch.Tensor, valid: torch.Tensor, target: int) -> torch.Tensor:
    """The valid slots beyond the ``target`` best ``scores`` (given in the slot ``order`` of text order; ties to the
    earlier token), as a mask over the slots."""
    ranked = scores.sort(dim=-1, descending=True, stable=True).indices
    dropped = torch.zeros_like(valid).scatter_(-1, ranked[..., target:], True)  # in text order
    return valid & torch.zeros_like(valid).scatter_(-1, order, dropped)
