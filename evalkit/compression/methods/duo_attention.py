"""DuoAttention (Xiao et al., ICLR 2025, arXiv 2410.10819; mit-han-lab/duo-attention, kvpress
``DuoAttentionPress``)."""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path
from typing import ClassVar, NamedTuple

import numpy as np
import torch

from evalkit.core.errors import ConfigError
from evalkit.core.method_settings import setting

from ..learned_weights import bad_file, json_object, weights_file, whole_number
from ..views import PrefillView
from .base import Policy


class Pattern(NamedTuple):
    """A pattern as duo-attention publishes it: its sizes (``config.json``) and head scores
    (``full_attention_heads.tsv``, ``[layers, kv_heads]``, clipped to [0, 1])."""

    sink: int
    recent: int
    scores: np.ndarray
    scores_file: Path


@functools.lru_cache(maxsize=8)
def attention_pattern(source: str) -> Pattern:
    """The pattern of ``source`` (duo-attention's ``attn_patterns/<model>/<run>/`` folder: ``config.json`` and
    ``full_attention_heads.tsv``), scores clipped to [0, 1] as ``duo_attn.utils.load_attn_pattern`` does. Sizes
    that are not whole numbers >= 0 (or both 0: a streaming head would keep nothing) and scores that are not a
    table of finite numbers are refused."""
    config_path = weights_file(source, "config.json", "duo_attention")
    config = json_object(config_path, "duo_attention")
    sink, recent = (whole_number(config, key, config_path, "duo_attention") for key in ("sink_size", "recent_size"))
    if sink + recent == 0:
        raise bad_file("duo_attention", config_path, "sink_size and recent_size are both 0: a streaming head would "
                                                     "keep no token")
    scores_path = weights_file(source, "full_attention_heads.tsv", "duo_attention")
    return Pattern(sink, recent, np.clip(head_scores(scores_path), 0, 1), scores_path)


def head_scores(path: Path) -> np.ndarray:
    """``full_attention_heads.tsv``: one line per layer, one tab-separated score per KV head (``np.loadtxt``'s
    reading: blank lines and ``#`` comments skipped)."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise bad_file("duo_attention", path, "is not text (tab-separated scores)") from None
    rows, first = [], 0
    for number, line in enumerate(text.splitlines(), 1):
        cells = line.split("#", 1)[0].strip()
        if not cells:
            continue
        row = []
        for column, cell in enumerate(cells.split("\t"), 1):
            try:
                value = float(cell)
            except ValueError:
                raise bad_file("duo_attention", path, f"line {number}, column {column}: {cell.strip()!r} is not a "
                                                      "number") from None
            if not math.isfinite(value):
                raise bad_file("duo_attention", path, f"line {number}, column {column} is {cell.strip()}: scores "
                                                      "must be finite numbers")
            row.append(value)
        if rows and len(row) != len(rows[0]):
            raise bad_file("duo_attention", path, f"line {number} has {len(row)} columns, line {first} has "
                                                  f"{len(rows[0])}: one tab-separated column per KV head")
        first = first or number
        rows.append(row)
    if not rows:
        raise bad_file("duo_attention", path, "holds no scores (one line per layer, one tab-separated column per "
                                              "KV head)")
    return np.array(rows, dtype=float)


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

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.patterns:  # what the files say alone is checked as the method is built, before any model loads
            attention_pattern(self.patterns)

    def _pattern(self) -> tuple[int, int, torch.Tensor]:
        if not self.patterns:
            raise ConfigError("duo_attention needs its learned head patterns: set method.patterns to a folder holding "
                             "duo-attention's config.json and full_attention_heads.tsv for this model")
        pattern = attention_pattern(self.patterns)
        return pattern.sink, pattern.recent, streaming_heads(pattern.scores, self.head_ratio)

    def check_layers(self, num_layers: int) -> None:
        streaming = self._pattern()[2]
        if streaming.shape[0] != num_layers:
            raise bad_file("duo_attention", attention_pattern(self.patterns).scores_file,
                           f"scores {streaming.shape[0]} layers, the model has {num_layers}")

    def prefill_queries(self) -> int:
        return 0

    def select(self, view: PrefillView, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        sink, recent, streaming = self._pattern()
        if streaming.shape[1] != kv_heads:
            raise bad_file("duo_attention", attention_pattern(self.patterns).scores_file,
                           f"scores {streaming.shape[1]} KV heads, the model has {kv_heads}")
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
