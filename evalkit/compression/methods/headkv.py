"""HeadKV (Fu et al., "Not All Heads Matter: A Head-Level KV Cache Compression Method with Integrated Retrieval and
Reasoning", arXiv 2410.19258; reference code Zefan-Cai/KVCache-Factory at c97f9d706d63d1b56e980f8b81b2a924c21162b3:
``HeadKVCluster`` in ``pyramidkv/pyramidkv_utils.py``, its head budgets in ``run_longbench.py``)."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from pathlib import Path
from typing import ClassVar, NamedTuple

import numpy as np
import torch

from evalkit.core.method_settings import setting

from ..kernels import causal_visible, pool_scores, reduce_groups
from ..learned_weights import LearnedFileError, bad_file, json_object, weights_file
from ..model_spec import attention_sinks
from ..views import PrefillView
from .wrapper import Wrapper

HEAD = re.compile(r"(\d+)-(\d+)")  # a score's key: "<layer>-<query head>"


class HeadScores(NamedTuple):
    """A score file: each query head's share of the total score, ``[layers, heads]`` float64, and where it was read."""

    shares: np.ndarray
    path: Path


@dataclasses.dataclass
class HeadKV(Wrapper):
    """A scorer's ranking (by default KVCache-Factory's HeadKV score, SnapKV's window attention: window 8, kernel 7,
    max pooling, as its ``run_longbench.py`` sets it) within a fixed budget per KV head, learned offline: the
    retrieval-reasoning head scores KVCache-Factory publishes per model (``scores``, e.g.
    ``data/heads_score/Meta-Llama-3-8B-Instruct_retrieval_reasoning_heads.json``: one JSON object, ``"layer-head"``
    for every query head to its scores on the probe samples).

    The budgets are the reference's (``run_longbench.py``, float64): each head's mean score ``s`` over the total,
    ``C = capacity - window`` (the scorer's forced tokens), ``pool = C // beta``, and query head h of layer l keeps
    ``round(s * pool * layers * heads + C - pool)`` tokens by score plus the window. A prompt of fewer than C tokens
    is kept whole. The cache holds one head per KV head, as the reference's ``kv_head`` granularity
    (``HeadKVCluster.update_kv``): each KV head's budget is the mean of its query heads' (rounded half to even), and
    the SnapKV score averages the window queries' attention, then each group's query heads, then pools.

    Where this differs from the reference:

    * ``capacity`` is what each head keeps on average, window included (every evalkit budget is tokens held); the
      reference's ``--max_capacity_prompts`` is C, its heads keeping C plus the window on average;
    * the score is computed in float64 (the reference casts its float32 softmax back to the model's dtype), and ties
      between equal scores go to the earlier token (the reference's unstable sort leaves them unspecified);
    * the reference's default granularity gives every query head a cache of its own (keys repeated per query
      head), ``groups`` times the memory; its ``kv_head`` mode is the one followed here;
    * the scores are named by ``"layer-head"`` and placed by their names (the reference reshapes them in file
      order, the same for its files, which list them layer by layer), and the whole file is read as JSON (the
      reference reads its first line, which is the whole of its files).

    The reference keeps the window after the chosen tokens; here every head holds its tokens in text order (the same
    attention). ``scores``: a local path, or ``<Hub repository id>/<path in it>``.
    """

    name: ClassVar[str] = "headkv"
    per_head: ClassVar[bool] = True
    allocates: ClassVar[bool] = True
    latent_refusal: ClassVar[str] = "its budgets are learned per attention head"
    # KVCache-Factory's run_longbench.py for HeadKV: window 8, kernel 7, max pooling (not our SnapKV's 32/7/max).
    inline: ClassVar[tuple[str, dict]] = ("snapkv", {"window": 8, "kernel_size": 7, "pooling": "max"})
    scores: str | None = None
    beta: float = setting(1.01, low=1)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.supports_latent = False
        self.latent_refusal = type(self).latent_refusal
        if self.scores:  # what the file says alone is checked as the method is built, before any model loads
            head_scores(str(self.scores))

    def prompt_capacity(self) -> int:
        return self.capacity

    def _forced(self) -> int:
        return self.kept_sink() + self.kept_window()

    def _table(self) -> HeadScores:
        if not self.scores:
            raise ValueError("headkv needs its head scores: set method.scores to KVCache-Factory's score file for the "
                             "model (data/heads_score/<model>_retrieval_reasoning_heads.json), a local path or "
                             "<Hub repository id>/<path in it>")
        return head_scores(str(self.scores))

    def _query_budgets(self, num_layers: int | None = None) -> np.ndarray:
        """``[layers, heads]``: the tokens each query head keeps by score (the window aside), as the reference's."""
        table = self._table()
        if num_layers is not None and table.shares.shape[0] != num_layers:
            raise bad_file("headkv", table.path, f"scores {table.shares.shape[0]} layers, the model has {num_layers}")
        return query_budgets(table.shares, self.capacity - self._forced(), self.beta)

    def _head_budgets(self, layer_idx: int, kv_heads: int) -> torch.Tensor:
        """``[kv_heads]``: the tokens each KV head of layer ``layer_idx`` keeps by score (the window aside)."""
        budgets = self._query_budgets()
        if budgets.shape[1] % kv_heads:
            raise bad_file("headkv", self._table().path, f"scores {budgets.shape[1]} attention heads per layer, not a "
                                                         f"multiple of the model's {kv_heads} KV heads")
        return kv_budgets(budgets[layer_idx], kv_heads)

    def check_layers(self, num_layers: int) -> None:
        self._query_budgets(num_layers)
        super().check_layers(num_layers)

    def prompt_slots(self, n: int, kv_heads: int) -> int:
        if not self.scores:
            return n
        largest = max(int(self._head_budgets(layer, kv_heads).max()) for layer in range(len(self._query_budgets())))
        return min(n, max(largest + self._forced(), self.capacity - self._forced()))

    def layer_budget(self, layer_idx: int, num_layers: int, real_len: torch.Tensor) -> torch.Tensor:
        """Per row: the whole prompt below the reference's C, else the mean of what the layer's heads keep (floored:
        the whole prompt only if every head keeps it); :meth:`allocate` gives each head its own count."""
        if not self.scores:  # priced before its file is named: the budget's capacity
            return super().layer_budget(layer_idx, num_layers, real_len)
        budgets = self._query_budgets(num_layers)[layer_idx].tolist()
        least, forced = self.capacity - self._forced(), self._forced()
        means = [n if n < least else sum(min(b + forced, n) for b in budgets) // len(budgets) for n in real_len.tolist()]
        return torch.tensor(means, dtype=real_len.dtype)

    def allocate(self, scores: torch.Tensor, budget: torch.Tensor, layer_idx: int = 0) -> torch.Tensor:
        real = (scores > float("-inf")).sum(dim=-1)  # [B, Hkv] each head's tokens
        budgets = self._head_budgets(layer_idx, scores.shape[1]).to(real.device)
        keep = torch.minimum(budgets[None] + self._forced(), real)
        whole = real.amax(dim=1, keepdim=True) < self.capacity - self._forced()  # the reference compresses nothing
        return torch.where(whole, real, keep)

    def select(self, view: PrefillView, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        table = self._table()
        if table.shares.shape[1] != view.query.shape[1]:
            raise bad_file("headkv", table.path, f"scores {table.shares.shape[1]} attention heads per layer, the model "
                                                 f"has {view.query.shape[1]}")
        return super().select(view, kv_heads)

    def score(self, view: PrefillView) -> torch.Tensor:
        scorer = self.scorer
        if scorer.name != "snapkv":
            return scorer.score(view)
        return window_scores(view, scorer.window, scorer.kernel_size, scorer.pooling, scorer.gqa_reduce)


def query_budgets(shares: np.ndarray, capacity: int, beta: float) -> np.ndarray:
    """``[layers, heads]`` int: each query head's tokens by score for the reference's ``--max_capacity_prompts``
    ``capacity`` and ``--head_beta`` ``beta`` (its float64 arithmetic, rounded half to even as ``torch.round``)."""
    layers, heads = shares.shape
    pool = capacity // beta
    return np.round(shares * (pool * layers * heads) + (capacity - pool)).astype(np.int64)


def kv_budgets(row: np.ndarray, kv_heads: int) -> torch.Tensor:
    """``[kv_heads]``: a layer's query-head budgets ``row`` as the mean over each KV head's group, rounded half to
    even (the reference's float32 mean of whole numbers, exactly)."""
    groups = row.reshape(kv_heads, -1)
    return torch.from_numpy(np.round(groups.sum(axis=1) / groups.shape[1]).astype(np.int64))


def window_scores(view: PrefillView, window: int, kernel_size: int, pooling: str, gqa_reduce: str) -> torch.Tensor:
    """``HeadKVCluster.calcul_attn_sore`` at KV-head granularity, in float64: the softmax attention of the last
    ``window`` queries over the prompt (causal inside the window), averaged over those queries and then over each
    KV group's query heads, cut to the keys before the window and pooled (stride 1, padding ``kernel_size // 2``).
    ``[B, Hkv, n]``, the window's own keys 0 (they are always kept)."""
    keys = view.keys.double()
    batch, kv_heads, n, _ = keys.shape
    queries = view.query[:, :, view.query.shape[2] - window :].double()
    q_heads, dim = queries.shape[1], queries.shape[-1]
    grouped = queries.reshape(batch, kv_heads, q_heads // kv_heads, window, dim)
    logits = grouped @ keys.unsqueeze(2).transpose(-1, -2) * view.scaling  # [B, Hkv, G, w, n]
    valid = view.key_valid if view.head_valid is None else view.head_valid
    logits = logits.masked_fill(~causal_visible(valid, n - window, n)[:, :, None], float("-inf"))
    sinks = attention_sinks(view.module)
    if sinks is None:
        attention = logits.softmax(dim=-1)
    else:  # gpt-oss: each head's sink logit takes its share of the mass
        sink = sinks.double().reshape(1, kv_heads, -1, 1, 1).expand(batch, -1, -1, window, 1)
        attention = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]
    mean = reduce_groups(attention.mean(dim=-2)[..., : n - window], gqa_reduce)
    return torch.nn.functional.pad(pool_scores(mean, kernel_size, pooling), (0, window))


def score_file(source: str) -> Path:
    """The score file ``source`` names: a local path, or ``<Hub repository id>/<path in it>`` (downloaded to the Hub
    cache; offline, read from it)."""
    path = Path(source).expanduser()
    if path.is_file():
        return path
    parts = source.split("/")
    if source.startswith((".", "/", "~")) or len(parts) < 3 or path.is_dir() or path.parent.is_dir():
        raise LearnedFileError(f"headkv: no score file {source} (KVCache-Factory's <model>_retrieval_reasoning_heads"
                               ".json, as a local path or <Hub repository id>/<path in it>)")
    return weights_file("/".join(parts[:2]), "/".join(parts[2:]), "headkv")


@functools.lru_cache(maxsize=8)
def head_scores(source: str) -> HeadScores:
    """The score file of ``source``, checked: a JSON object naming every query head of a grid of layers and heads
    (``"layer-head"``) with its scores (a list of numbers >= 0, or one), not all 0. Each head's mean score over the
    total, as the reference: ``np.mean`` per head, the builtin ``sum`` in file order."""
    path = score_file(source)
    config = json_object(path, "headkv")
    places, means = [], []
    for key, value in config.items():
        match = HEAD.fullmatch(key)
        if match is None:
            raise bad_file("headkv", path, f"names {key!r}; each key is a head's 'layer-head', e.g. '0-31'")
        samples = value if isinstance(value, list) else [value]
        if not samples or not all(_score(sample) for sample in samples):
            raise bad_file("headkv", path, f"head {key} holds {json.dumps(value)[:60]}; its scores are numbers >= 0")
        places.append((int(match[1]), int(match[2])))
        means.append(np.mean(samples))
    if not places:
        raise bad_file("headkv", path, "holds no head scores")
    layers, heads = max(layer for layer, _ in places) + 1, max(head for _, head in places) + 1
    if len(set(places)) != len(places) or len(places) != layers * heads:
        absent = next((f"{l}-{h}" for l in range(layers) for h in range(heads) if (l, h) not in places), None)
        what = f"no head {absent}" if absent else "a head named twice"
        raise bad_file("headkv", path, f"names {len(places)} heads, not each of {layers} layers x {heads} heads once "
                                       f"({what})")
    total = sum(means)
    if total <= 0:
        raise bad_file("headkv", path, "scores every head 0: no share to allocate by")
    shares = np.zeros((layers, heads))
    for (layer, head), mean in zip(places, means):
        shares[layer, head] = mean / total
    return HeadScores(shares, path)


def _score(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
