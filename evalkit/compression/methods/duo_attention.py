"""DuoAttention (Xiao et al., ICLR 2025, arXiv 2410.10819; mit-han-lab/duo-attention, kvpress
``DuoAttentionPress``)."""

from __future__ import annotations

import dataclasses
import functools
import math
import weakref
from pathlib import Path
from typing import ClassVar, NamedTuple

import numpy as np
import torch
from transformers.models.llama.modeling_llama import rotate_half

from evalkit.core.errors import ConfigError
from evalkit.core.method_settings import setting

from ..learned_weights import bad_file, json_object, weights_file, whole_number
from ..model_spec import rotary_embedding
from ..views import PrefillView
from .base import Policy

# ``patterns: on_the_fly``: the pattern estimated from the model (kvpress ``DuoAttentionPress(on_the_fly_scoring=True)``,
# its ``duo_attention_on_the_fly``), with kvpress' fixed sizes and sampling.
ON_THE_FLY = "on_the_fly"
ESTIMATED_SINK, ESTIMATED_RECENT = 128, 256
ESTIMATION_QUERIES = 500  # the positions the mean query and key are repeated over (kvpress' ``q_len``)
ESTIMATION_SEED = 42  # pandas' ``DataFrame.sample(random_state=42)``
_ESTIMATED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(texts' source, samples): scores}


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


def calibration_texts(source: str, samples: int) -> list[str]:
    """The ``chapter`` of ``samples`` rows of ``source``'s train split (a Hub dataset id, or a local ``.json``,
    ``.jsonl``, ``.csv`` or ``.parquet`` file), drawn as kvpress draws them: pandas' ``DataFrame.sample(samples,
    random_state=42)``, which is numpy's ``RandomState(42).choice(rows, samples, replace=False)``, in that order."""
    from datasets import load_dataset

    path = Path(source).expanduser()
    formats = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
    try:
        if path.is_file():
            if path.suffix not in formats:
                raise ConfigError(f"duo_attention: {path}: calibration texts must be a .json, .jsonl, .csv or "
                                  ".parquet file with a chapter column")
            data = load_dataset(formats[path.suffix], data_files=str(path), split="train")
        else:
            data = load_dataset(source, split="train")
    except (OSError, ValueError) as error:  # datasets' missing file, offline hub, bad data
        if isinstance(error, ConfigError):
            raise
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(f"duo_attention: cannot read the calibration texts {source} ({first}); download the "
                          "dataset once online or give a local file") from None
    if "chapter" not in data.column_names:
        raise ConfigError(f"duo_attention: {source} has no chapter column (it has {', '.join(data.column_names)})")
    if len(data) < samples:
        raise ConfigError(f"duo_attention: {source} has {len(data)} rows, fewer than samples={samples}")
    rows = np.random.RandomState(ESTIMATION_SEED).choice(len(data), size=samples, replace=False)
    return [str(data[int(row)]["chapter"]) for row in rows]


def estimated_head_scores(layer, rotary, hidden: torch.Tensor, queries: int = ESTIMATION_QUERIES) -> torch.Tensor:
    """One text's score of each KV head of decoder ``layer`` (``[kv_heads]``, float64) from its attention's input
    ``hidden`` ``[1, n, d_model]``: the mean query and mean key over the text (after ``q_norm``/``k_norm`` where the
    family has them) at every position ``0..queries-1`` with RoPE; the attention of the last position's query over
    the ``queries`` keys (scaled by ``head_dim ** -0.5``); the area under its cumulated curve (the mean of its
    cumulative sum), averaged over each KV head's query heads. A head whose attention lies on the earliest keys
    scores near 1, one on the latest near 0."""
    attention = layer.self_attn
    dim = attention.head_dim
    states = layer.input_layernorm(hidden)

    def mean_state(projection, norm) -> torch.Tensor:  # [heads, dim], float64
        out = projection(states).view(1, states.shape[1], -1, dim)
        out = norm(out) if norm is not None else out
        return out[0].double().mean(dim=0)

    query = mean_state(attention.q_proj, getattr(attention, "q_norm", None))
    key = mean_state(attention.k_proj, getattr(attention, "k_norm", None))
    positions = torch.arange(queries, device=hidden.device)[None]
    cos, sin = (t[0].double() for t in rotary(hidden, positions))  # [queries, dim]

    def rotated(state: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return state[:, None] * cos + rotate_half(state)[:, None] * sin  # [heads, positions, dim]

    last = rotated(query, cos[-1:], sin[-1:])  # [Hq, 1, dim]
    keys = rotated(key, cos, sin).repeat_interleave(query.shape[0] // key.shape[0], dim=0)  # [Hq, queries, dim]
    weights = (last @ keys.transpose(1, 2))[:, 0].div(dim**0.5).softmax(dim=-1)  # [Hq, queries]
    return weights.cumsum(dim=-1).mean(dim=-1).view(key.shape[0], -1).mean(dim=-1)


@torch.no_grad()
def estimate_pattern(model, tokenizer, texts: list[str], queries: int = ESTIMATION_QUERIES) -> np.ndarray:
    """``[layers, kv_heads]`` float64: each KV head's :func:`estimated_head_scores`, averaged over ``texts`` (each
    tokenized whole, with the tokenizer's special tokens, and run through ``model`` alone; the attention's input of
    every layer is the model's hidden state before it). Lowest scores stream."""
    layers = model.get_decoder().layers
    rotary = rotary_embedding(model)
    if rotary is None:
        raise ConfigError("duo_attention: patterns=on_the_fly needs a model with a rotary embedding")
    device = next(model.parameters()).device
    scores = torch.zeros(len(layers), model.config.num_key_value_heads, dtype=torch.float64)
    for text in texts:
        inputs = tokenizer(text, return_tensors="pt")
        hidden = model(input_ids=inputs["input_ids"].to(device), attention_mask=inputs["attention_mask"].to(device),
                       output_hidden_states=True, use_cache=False).hidden_states[:-1]
        for index, states in enumerate(hidden):
            scores[index] += estimated_head_scores(layers[index], rotary, states, queries).cpu() / len(texts)
    return scores.numpy()


def estimated_pattern(model, tokenizer, source: str, samples: int) -> np.ndarray:
    """:func:`estimate_pattern` over :func:`calibration_texts`, once per model, source and sample count."""
    known = _ESTIMATED.setdefault(model, {})
    if (source, samples) not in known:
        known[source, samples] = estimate_pattern(model, tokenizer, calibration_texts(source, samples))
    return known[source, samples]


@dataclasses.dataclass
class DuoAttention(Policy):
    """Retrieval heads keep the whole prompt; streaming heads keep only its first ``sink_size`` and last
    ``recent_size`` tokens (kvpress ``DuoAttentionPress``). Which heads stream is learned: the ``head_ratio`` of the
    KV heads with the lowest score in a pattern published by duo-attention (``patterns``: a folder holding its
    ``config.json``, which gives ``sink_size`` and ``recent_size``, and ``full_attention_heads.tsv``, one row per
    layer, one column per KV head; e.g. a copy of ``attn_patterns/Meta-Llama-3.1-8B-Instruct/lr=0.02-reg=0.05-
    ctx=1000_128000-multi_passkey10``). No budget: kvpress' leaderboard sweeps ``head_ratio``.

    ``patterns: on_the_fly`` estimates the scores from the model instead, as kvpress does for a model without a
    published pattern (:func:`estimate_pattern` over ``samples`` texts of ``calibration``; sink 128, recent 256), once
    per model when the method is bound to it (:meth:`bind_model`, before the first prompt).

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
    calibration: str = setting("kmfoda/booksum", recorded_when_set=True)
    samples: int = setting(50, low=1, recorded_when_set=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._estimated, self._tokenizer = None, None
        if self.patterns and self.patterns != ON_THE_FLY:  # what the files say alone is checked as it is built
            attention_pattern(self.patterns)

    def bind_tokenizer(self, tokenizer) -> None:
        self._tokenizer = tokenizer

    def bind_model(self, model) -> None:
        """With ``patterns: on_the_fly``, estimate the pattern from ``model`` (once per model, source and sample
        count), its texts tokenized by the bound tokenizer, else the one saved with the model (kvpress'
        ``AutoTokenizer.from_pretrained(model.config.name_or_path)``)."""
        if self.patterns != ON_THE_FLY:
            return
        tokenizer = self._tokenizer
        if tokenizer is None:
            from transformers import AutoTokenizer

            try:
                tokenizer = AutoTokenizer.from_pretrained(model.config.name_or_path)
            except (OSError, ValueError):
                raise ConfigError("duo_attention: patterns=on_the_fly needs the model's tokenizer: none is saved with "
                                  f"{model.config.name_or_path or 'the model'}; bind one (bind_tokenizer)") from None
        self._estimated = estimated_pattern(model, tokenizer, self.calibration, self.samples)

    def _source(self) -> str:
        return f"the pattern estimated on {self.calibration}" if self.patterns == ON_THE_FLY else str(
            attention_pattern(self.patterns).scores_file)

    def _pattern(self) -> tuple[int, int, torch.Tensor]:
        if not self.patterns:
            raise ConfigError("duo_attention needs its learned head patterns: set method.patterns to a folder holding "
                             "duo-attention's config.json and full_attention_heads.tsv for this model, or to "
                             f"{ON_THE_FLY} to estimate them from the model")
        if self.patterns == ON_THE_FLY:
            if self._estimated is None:
                raise ConfigError("duo_attention: patterns=on_the_fly estimates the pattern from the model: bind it "
                                  "first (bind_model(model))")
            return ESTIMATED_SINK, ESTIMATED_RECENT, streaming_heads(self._estimated, self.head_ratio)
        pattern = attention_pattern(self.patterns)
        return pattern.sink, pattern.recent, streaming_heads(pattern.scores, self.head_ratio)

    def check_layers(self, num_layers: int) -> None:
        if self.patterns == ON_THE_FLY and self._estimated is None:
            return  # estimated from the model itself when it is bound
        streaming = self._pattern()[2]
        if streaming.shape[0] != num_layers:
            raise bad_file("duo_attention", self._source(), f"scores {streaming.shape[0]} layers, the model has "
                                                            f"{num_layers}")

    def prefill_queries(self) -> int:
        return 0

    def select(self, view: PrefillView, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        sink, recent, streaming = self._pattern()
        if streaming.shape[1] != kv_heads:
            raise bad_file("duo_attention", self._source(), f"scores {streaming.shape[1]} KV heads, the model has "
                                                            f"{kv_heads}")
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
