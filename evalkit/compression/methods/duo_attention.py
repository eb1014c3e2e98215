"""DuoAttention (Xiao et al., ICLR 2025, arXiv 2410.10819; mit-han-lab/duo-attention, kvpress
``DuoAttentionPress``)."""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import ClassVar

import numpy as np
import torch

from evalkit.method_settings import setting

from ..learned_weights import weights_file
from ..views import PrefillView
from .base import Policy


@functools.lru_cache(maxsize=8)
def attention_pattern(source: str) -> tuple[int, int, np.ndarray]:
    """``(sink_size, recent_size, head scores [layers, kv_heads])`` of a pattern as duo-attention publishes it (its
    ``attn_patterns/<model>/<run>/`` folder: ``config.json`` and ``full_attention_heads.tsv``), scores clipped to
    [0, 1] as ``duo_attn.utils.load_attn_pattern`` does."""
    config = json.loads(weights_file(source, "config.json", "duo_attention").read_text())
    scores = np.loadtxt(weights_file(source, "full_attention_heads.tsv", "duo_attention"), dtype=float, delimiter="\t")
    scores = np.atleast_2d(scores)
    missing = [key for key in ("sink_size", "recent_size") if key not in config]
    if missing:
        raise ValueError(f"duo_attention: {source}/config.json has no {missing[0]}")
    return int(config["sink_size"]), int(config["recent_size"]), np.clip(scores, 0, 1)


def streaming_heads(scores: np.ndarray, head_ratio: float) -> torch.Tensor:
    """``[layers, kv_heads]`` bool: the ``round(heads * head_ratio)`` heads of lowest score stream (kvpress' choice,
    numpy's default argsort over the flattened scores)."""
    mask = np.zeros(scores.shape, dtype=bool)
    pruned = round(scores.size * head_ratio)
    if pruned > 0:
        mask[np.unravel_index(np.argsort(scores, axis=None)[:pruned], scores.shape)] = True
    return torch.from_numpy(mask)


@dataclasses.dataclass
class DuoAttention(Policy):
    """Retrieval heads keep the whole prompt; streaming heads keep only its first ``sink_size`` and last
    ``recent_size`` tokens (kvpress ``DuoAttentionPress``). Which heads stream is learned: the ``head_ratio`` of the
    KV heads with the lowest score in a pattern published by duo-attention (``patterns``: a folder holding its
    ``config.json``, which gives ``sink_size`` and ``recent_size``, and ``full_attention_heads.tsv``, one row per
    layer, one column per KV head; e.g. a copy of ``attn_patterns/Meta-Llama-3.1-8B-Instruct/lr=0.02-reg=0.05-
    ctx=1000_128000-multi_passkey10``). No budget: kvpress' leaderboard sweeps ``head_ratio``.

    kvpress masks the streaming heads' middle tokens in attention; here they leave the cache (each head its own
    count), so the rows' bytes are what the heads really hold.
    """

    name: ClassVar[str] = "duo_attention"
    per_head: ClassVar[bool] = True
    takes_budget: ClassVar[bool] = False
    budget_fields: ClassVar[tuple[str, ...]] = ()
    latent_refusal: ClassVar[str] = "its patterns are learned per KV head"
    patterns: str | None = None
    head_ratio: float = setting(0.5, low=0, high=1)

    def _pattern(self) -> tuple[int, int, torch.Tensor]:
        if not self.patterns:
            raise ValueError("duo_attention needs its learned head patterns: set method.patterns to a folder holding "
                             "duo-attention's config.json and full_attention_heads.tsv for this model")
        sink, recent, scores = attention_pattern(self.patterns)
        return sink, recent, streaming_heads(scores, self.head_ratio)

    def check_layers(self, num_layers: int) -> None:
        streaming = self._pattern()[2]
        if streaming.shape[0] != num_layers:
            raise ValueError(f"DuoAttention.patterns {self.patterns} scores {streaming.shape[0]} layers, the model "
                             f"has {num_layers}")

    def prefill_queries(self) -> int:
        return 0

    def select(self, view: PrefillView, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        sink, recent, streaming = self._pattern()
        if streaming.shape[1] != kv_heads:
            raise ValueError(f"DuoAttention.patterns {self.patterns} scores {streaming.shape[1]} KV heads, the model "
                             f"has {kv_heads}")
        batch, n = view.key_valid.shape
        device = view.keys.device
        first = (n - view.key_valid.sum(dim=-1))[:, None, None]  # [B, 1, 1]
        position = torch.arange(n, device=device)
        rank = position - first
        real = view.key_valid[:, None, :]
        middle = (rank >= sink) & (position < n - recent)
        dropped = middle & streaming[view.layer_idx].to(device)[None, :, None] & real
        keep = real & ~dropped  # [B, Hkv, n]
        counts = keep.sum(dim=-1)
        width = int(counts.max())
        # Kept tokens first in text order, then the others (unused).
        order = (~keep).long().mul(n).add(position).argsort(dim=-1)[..., :width]
        return order, counts, torch.zeros(batch, kv_heads, n, device=device)
