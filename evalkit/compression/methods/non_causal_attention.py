"""Non-causal chunked attention (Compactor, arXiv 2507.08143; kvpress ``NonCausalAttnPress``)."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import torch
from torch.nn import functional as F

from evalkit.core.method_settings import setting

from ..views import PrefillView, scores_by_row
from .base import PromptScoring
from .leverage import z_scores


def chunk_attention_received(queries: torch.Tensor, keys: torch.Tensor, chunk: int) -> torch.Tensor:
    """kvpress' ``non_causal_chunked_attn``: within chunks of ``chunk`` tokens, every query's softmax over every key
    of its chunk (no causal mask, no ``1/sqrt(d)`` scaling, as the reference), summed per key. ``queries`` and
    ``keys`` ``[1, H, n, D]`` (one prompt). The last chunk is padded with zero vectors as the reference pads it:
    padded keys get the logit ``-1e-9`` (not ``-inf``: they take a share of the real queries' attention) and padded
    queries attend uniformly (they add ``1/chunk`` to each of the chunk's keys)."""
    batch, heads, n, dim = keys.shape
    queries, keys = queries.float(), keys.float()  # fp32 products, whatever the model's dtype
    padded_length = math.ceil(n / chunk) * chunk
    pad = padded_length - n
    if pad:
        queries, keys = F.pad(queries, (0, 0, 0, pad)), F.pad(keys, (0, 0, 0, pad))
    chunks = padded_length // chunk
    dots = queries.reshape(batch, heads, chunks, chunk, dim) @ keys.reshape(batch, heads, chunks, chunk, dim).transpose(-2, -1)
    padding = torch.arange(padded_length - chunk, padded_length, device=keys.device) >= n
    last = dots[:, :, -1]
    last.masked_fill_(padding[:, None], 0)
    last.masked_fill_(padding[None, :], -1e-9)
    return dots.softmax(dim=-1).sum(dim=-2).reshape(batch, heads, padded_length)[..., :n]


def non_causal_scores(alone: PrefillView, chunk: int) -> torch.Tensor:
    """kvpress' ``NonCausalAttnPress.score`` of one prompt: the attention each key receives in its chunk (mean over
    its group's query heads) times ``||v||``, averaged over 3 neighbours, standardized (:func:`z_scores`)."""
    if alone.query.shape[2] != alone.keys.shape[2]:
        raise ValueError("non_causal_attention reads every prompt query; this prefill kept only the last "
                         f"{alone.query.shape[2]} of {alone.keys.shape[2]}")
    kv_heads = alone.keys.shape[1]
    keys = alone.keys.repeat_interleave(alone.query.shape[1] // kv_heads, dim=1)
    received = chunk_attention_received(alone.query, keys.to(alone.query.dtype), chunk)  # [1, Hq, n]
    received = received.reshape(1, kv_heads, -1, received.shape[-1]).mean(dim=2)
    scores = received * alone.values.float().norm(dim=-1)
    scores = F.avg_pool1d(scores, kernel_size=3, padding=1, stride=1)
    return z_scores(scores)


@dataclasses.dataclass
class NonCausalAttention(PromptScoring):
    """Keep the keys the prompt's queries attend to within chunks of ``chunk_size`` tokens, both ways (kvpress
    ``NonCausalAttnPress``): see :func:`non_causal_scores`. Reads every prompt query, so exact chunked prefill
    keeps them all. Each row scored alone."""

    name: ClassVar[str] = "non_causal_attention"
    reads_every_query: ClassVar[bool] = True
    latent_refusal: ClassVar[str] = "it reads the queries against the cache's keys; a latent cache holds no keys"
    chunk_size: int = setting(256, low=1)

    def score(self, view: PrefillView) -> torch.Tensor:
        return scores_by_row(view, lambda alone: non_causal_scores(alone, self.chunk_size))
