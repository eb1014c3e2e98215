"""TOVA, token omission via attention (Oren et al., EMNLP 2024, arXiv 2401.06104; reference code
schwartz-lab-NLP/TOVA, ``TOVACache``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from evalkit.core.method_settings import setting

from ..kernels import causal_attention_sums, free_lowest
from ..views import DecodeView, PrefillView
from .base import Policy


@dataclasses.dataclass
class TOVA(Policy):
    """Keep the tokens the current query attends to most, averaged over all the layer's attention heads.

    At the end of prefill, the last prompt token's attention (over every prompt token, itself included), averaged
    over all query heads, ranks the prompt; the top ``capacity - 1`` are kept, in every KV head alike. At every
    decode step the new token takes the free slot, attends over at most ``capacity`` tokens, and once the cache is
    full the token with the lowest head-averaged attention from this query (possibly the new token itself) is
    dropped. This is the reference ``TOVACache.reduce`` with ``cache_size = capacity - 1``: it too attends over
    ``cache_size + 1`` tokens and reduces after the attention. (kvpress' ``TOVAPress`` is the prefill half, with
    the last token forced.)
    """

    name: ClassVar[str] = "tova"
    supports_latent: ClassVar[bool] = True
    needs_scores: ClassVar[bool] = True
    per_head: ClassVar[bool] = True
    evicts_while_decoding: ClassVar[bool] = True
    capacity: int = setting(0, low=2)

    def prompt_capacity(self) -> int:
        return self.capacity - 1

    def cache_capacity(self) -> int:
        return self.capacity

    def prefill_queries(self) -> int:
        return 1

    def score(self, view: PrefillView) -> torch.Tensor:
        last = causal_attention_sums(view, last=1)  # [B, Hkv, G, n]
        return last.mean(dim=(1, 2), keepdim=True).squeeze(2).expand(-1, view.keys.shape[1], -1)

    def decode_evict(self, view: DecodeView) -> torch.Tensor | None:
        mean = view.probabilities.mean(dim=1)  # [B, S]: every KV head holds the same tokens in the same slots
        full = view.valid[:, 0].sum(dim=-1) >= self.capacity  # [B]
        freed = free_lowest(mean, view.valid[:, 0], full)  # [B, S]
        return freed[:, None, :].expand_as(view.valid).clone()
