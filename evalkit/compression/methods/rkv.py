"""R-KV, redundancy-aware KV compression for reasoning models (Cai et al., arXiv 2505.24133; reference code
Zefan-Cai/R-KV, ``rkv/compression/r1_kv.py`` ``R1KV.update_kv`` and ``rkv/utils.py`` ``cal_similarity``, driven by
``rkv/modeling.py`` with ``divide_method="step_length"``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from evalkit.core.method_settings import setting

from ..views import DecodeView, PrefillView
from .base import Policy
from .decoding_snapkv import dropped_beyond


@dataclasses.dataclass
class RKV(Policy):
    """Importance minus redundancy, re-applied every ``interval`` generated tokens.

    A cache of ``capacity`` tokens: the prompt keeps ``capacity - interval`` of them (R-KV's ``budget``) and so does
    the cache after every compression, which runs after the attention of each decode step whose token's position is
    a multiple of ``interval`` (the reference's ``length % divide_length == 0``). Each layer and KV head keeps its
    ``window`` most recent tokens (the observation window, R-KV's α) and the ``capacity - interval - window`` others
    of highest ``mix_lambda * importance - (1 - mix_lambda) * redundancy``:

    * importance: the window queries' attention logits, the max over the query heads of the KV group, softmaxed over
      the other tokens, averaged over the queries and max-pooled (``kernel_size``) along text order;
    * redundancy: each key's mean cosine similarity to every held key (itself excluded, and for each key its most
      recent neighbour more similar than ``similarity_threshold`` excluded too, so that the latest of a run of
      near-duplicates is spared), softmaxed over the held keys.

    Differences from the reference, each shown by ``benchmarks/parity_rkv.py``: the reference keeps the survivors in
    top-k order, so its next compression pools neighbours and picks "most recent" similar keys in that order; evalkit
    keeps text order (sorting the reference's top-k makes every step identical). The reference also carries its
    step counter and compression flag from one sequence to the next (``model.length``, ``config.compression``);
    evalkit counts each sequence's own positions. Memory: the redundancy is a ``held x held`` matrix per KV head,
    computed only for the rows due.
    """

    name: ClassVar[str] = "rkv"
    needs_scores: ClassVar[bool] = True
    per_head: ClassVar[bool] = True
    evicts_while_decoding: ClassVar[bool] = True
    wrappable: ClassVar[bool] = False
    capacity: int = setting(low=3)
    window: int = setting(8, low=1)
    interval: int = setting(128, low=1)
    kernel_size: int = setting(7, low=1, odd=True)
    mix_lambda: float = setting(0.07, low=0, high=1)
    similarity_threshold: float = setting(0.5, low=-1, high=1)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.capacity - self.interval <= self.window:
            raise ValueError(f"RKV.capacity must be > interval + window ({self.interval + self.window}), got "
                             f"{self.capacity} (lower interval or raise the budget)")

    def kept_window(self) -> int:
        return self.window

    def prefill_queries(self) -> int:
        return self.window

    def query_window(self) -> int:
        return self.window

    def prompt_capacity(self) -> int:
        return self.capacity - self.interval

    def cache_capacity(self) -> int:
        return self.capacity

    def score(self, view: PrefillView) -> torch.Tensor:
        n, window = view.keys.shape[2], self.window
        valid = view.key_valid[:, None].expand(-1, view.keys.shape[1], -1)
        prefix = valid & (torch.arange(n, device=valid.device) < n - window)
        queries = view.query[:, :, view.query.shape[2] - window:]
        return self.rank(queries, view.keys, valid, prefix, view.scaling)

    def decode_evict(self, view: DecodeView) -> torch.Tensor | None:
        due = (view.position % self.interval == 0) & (view.valid.sum(dim=-1).amax(dim=-1) >= self.capacity - self.interval)
        if not torch.compiler.is_compiling():  # eager: only the rows due are scored
            rows = due.nonzero().flatten()
            if rows.numel() == 0:
                return None
            freed = torch.zeros_like(view.valid)
            freed[rows] = self._dropped(view.query_buffer[rows], view.keys[rows], view.valid[rows],
                                        view.positions[rows], view.position[rows], view.scaling)
            return freed
        freed = self._dropped(view.query_buffer, view.keys, view.valid, view.positions, view.position, view.scaling)
        return freed & due[:, None, None]

    def _dropped(self, queries, keys, valid, positions, position, scaling: float) -> torch.Tensor:
        """The held slots a compression frees: every head's tokens ranked in text order, as at prefill."""
        order = positions.masked_fill(~valid, torch.iinfo(positions.dtype).max).argsort(dim=-1)
        held = valid.gather(-1, order)
        ordered_keys = keys.gather(2, order[..., None].expand(-1, -1, -1, keys.shape[-1]))
        prefix = held & (positions.gather(-1, order) <= (position - self.window)[:, None, None])
        scores = self.rank(queries, ordered_keys, held, prefix, scaling)
        scores = scores.masked_fill(held & ~prefix, float("inf")).masked_fill(~held, float("-inf"))
        return dropped_beyond(scores, order, valid, self.capacity - self.interval)

    def rank(self, queries: torch.Tensor, keys: torch.Tensor, held: torch.Tensor, prefix: torch.Tensor,
             scaling: float) -> torch.Tensor:
        """R-KV's score of every held key (``keys`` ``[B, Hkv, S, D]`` in text order, ``held`` ``[B, Hkv, S]``) that
        may be evicted (``prefix``: held and not in the window), from the window's ``queries`` ``[B, Hq, w, D]``;
        arbitrary elsewhere. In the keys' dtype where the reference computes in it."""
        batch, kv_heads, slots, dim = keys.shape
        dtype = keys.dtype
        grouped = queries.reshape(batch, kv_heads, -1, queries.shape[2], dim)
        logits = torch.matmul(grouped, keys[:, :, None].transpose(-1, -2)).amax(dim=2) * scaling  # [B, Hkv, w, S]
        logits = logits.masked_fill(~prefix[:, :, None], float("-inf"))
        importance = logits.softmax(dim=-1, dtype=torch.float32).nan_to_num(0.0).mean(dim=-2).to(dtype)
        importance = importance.masked_fill(~prefix, float("-inf"))
        importance = torch.nn.functional.max_pool1d(importance.reshape(-1, 1, slots), self.kernel_size, stride=1,
                                                    padding=self.kernel_size // 2).reshape(batch, kv_heads, slots)
        return importance * self.mix_lambda - self.redundancy(keys, held) * (1 - self.mix_lambda)

    def redundancy(self, keys: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
        """``cal_similarity`` over the held keys ``[B, Hkv, S]`` (text order): ``[B, Hkv, S]``."""
        normed = keys / (keys.norm(dim=-1, keepdim=True) + 1e-8)
        cosine = torch.matmul(normed, normed.transpose(-1, -2))  # [B, Hkv, S, S]: row i, column j
        slots = keys.shape[2]
        index = torch.arange(slots, device=keys.device)
        pair = held[..., :, None] & held[..., None, :]
        cosine = cosine.masked_fill(~pair | (index[:, None] == index[None, :]), 0.0)
        # each key's most recent held neighbour above the threshold (none: the first held key) is not counted
        similar = (cosine > self.similarity_threshold) & pair
        latest = torch.where(similar, index, -1).amax(dim=-1)
        first = held.int().argmax(dim=-1, keepdim=True).expand_as(latest)
        latest = torch.where(latest < 0, first, latest)
        cosine = cosine.scatter(-1, latest[..., None], 0.0)
        count = held.sum(dim=-1, keepdim=True).clamp(min=1).to(cosine.dtype)
        mean = cosine.sum(dim=-2) / count  # over the rows i: each key j's mean similarity to the held keys
        return mean.masked_fill(~held, float("-inf")).softmax(dim=-1).nan_to_num(0.0)
