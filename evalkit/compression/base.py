"""Shared mechanics of the compression policies.

A policy decides two things, and nothing else:

* which prompt tokens survive prefill: at most ``prompt_capacity`` of them, the first ``sink`` and last ``window``
  tokens always, the rest ranked by ``score`` (per layer and per KV head);
* how the cache behaves while decoding: the surviving prompt tokens are followed by a region of ``ring_size`` slots
  that new tokens fill in order and, once full, overwrite oldest first. The first ``fixed`` cached tokens are never
  overwritten.

Everything else (gathering rows, ring writes, masks, positions) lives in :mod:`evalkit.compression.cache`, once.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

UNBOUNDED = 1 << 62  # ring size of a cache that only grows


def require_int(owner: object, name: str, low: int, high: int | None = None) -> None:
    """Raise a ValueError naming ``name`` unless ``owner.name`` is an int in [low, high]."""
    value = getattr(owner, name)
    allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        raise ValueError(f"{type(owner).__name__}.{name} must be an integer {allowed}, got {value!r}")


def require_choice(owner: object, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(owner, name)
    if value not in choices:
        raise ValueError(f"{type(owner).__name__}.{name} must be one of {list(choices)}, got {value!r}")


@dataclasses.dataclass
class Policy:
    """Base class: no eviction. Subclasses override the class attributes and :meth:`score` only."""

    name: ClassVar[str] = "full"
    needs_scores: ClassVar[bool] = False

    def kept_sink(self) -> int:
        """Leading prompt tokens always kept (attention sinks)."""
        return 0

    def kept_window(self) -> int:
        """Trailing prompt tokens always kept (for SnapKV-style policies, also the queries that score the rest)."""
        return 0

    def prompt_capacity(self) -> int | None:
        """Most prompt tokens kept after prefill; ``None`` keeps them all."""
        return None

    def cache_capacity(self) -> int | None:
        """Most tokens the cache ever holds per sequence; ``None`` when it grows with the sequence."""
        return None

    def decode_layout(self, kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For per-row counts of kept prompt tokens, return (fixed slots, ring size) per row."""
        return kept.clone(), torch.full_like(kept, UNBOUNDED)

    def score(self, window_queries: torch.Tensor, keys: torch.Tensor, key_valid: torch.Tensor, scaling: float) -> torch.Tensor:
        """Importance of every prompt key before the observation window: ``[batch, kv_heads, n - window]``."""
        raise NotImplementedError(f"{type(self).__name__} does not score tokens")

    def config(self) -> dict:
        """Flat description of the policy, for result tables."""
        return {"method": self.name, "capacity": self.cache_capacity(), **dataclasses.asdict(self)}


def snapkv_scores(
    window_queries: torch.Tensor,
    keys: torch.Tensor,
    key_valid: torch.Tensor,
    scaling: float,
    kernel_size: int,
    pooling: str,
    gqa_reduce: str,
) -> torch.Tensor:
    """SnapKV importance of the keys before the observation window (Li et al., NeurIPS 2024, arXiv 2404.14469).

    window_queries ``[B, Hq, w, D]`` (post-RoPE), keys ``[B, Hkv, n, D]``, key_valid ``[B, n]`` (False on padding).
    Softmax in fp32 of the window queries over all keys (causal inside the window), summed over the window queries,
    cut to the keys before the window, pooled along keys (stride 1, padding kernel_size // 2), then reduced over the
    query heads of each KV group. Returns ``[B, Hkv, n - w]``.
    """
    batch, q_heads, window, dim = window_queries.shape
    kv_heads, n = keys.shape[1], keys.shape[2]
    group = q_heads // kv_heads
    queries = window_queries.float().reshape(batch, kv_heads, group, window, dim)
    logits = torch.matmul(queries, keys.float().unsqueeze(2).transpose(-1, -2)) * scaling  # [B, Hkv, G, w, n]
    query_pos = torch.arange(n - window, n, device=keys.device)
    visible = torch.arange(n, device=keys.device)[None, :] <= query_pos[:, None]  # [w, n] causal
    visible = visible[None, :, :] & key_valid[:, None, :]  # [B, w, n]
    logits = logits.masked_fill(~visible[:, None, None], float("-inf"))
    attention = logits.softmax(dim=-1).sum(dim=-2)[..., : n - window]  # [B, Hkv, G, n - w]
    flat = attention.reshape(-1, 1, n - window)
    pool = torch.nn.functional.max_pool1d if pooling == "max" else torch.nn.functional.avg_pool1d
    pooled = pool(flat, kernel_size=kernel_size, stride=1, padding=kernel_size // 2).reshape(attention.shape)
    return pooled.amax(dim=2) if gqa_reduce == "max" else pooled.mean(dim=2)


@dataclasses.dataclass
class SnapKVScoring(Policy):
    """Fields and validation shared by the policies that rank prompt tokens with the SnapKV score."""

    needs_scores: ClassVar[bool] = True
    capacity: int
    window: int = 32
    kernel_size: int = 7
    pooling: str = "max"
    gqa_reduce: str = "mean"

    def __post_init__(self) -> None:
        require_int(self, "capacity", 1)
        require_int(self, "window", 1)
        require_int(self, "kernel_size", 1)
        if self.kernel_size % 2 == 0:
            # Even kernels with padding k//2 change the length of the pooled scores; the reference code uses odd ones.
            raise ValueError(f"{type(self).__name__}.kernel_size must be odd, got {self.kernel_size}")
        require_choice(self, "pooling", ("max", "avg"))
        require_choice(self, "gqa_reduce", ("mean", "max"))

    def kept_window(self) -> int:
        return self.window

    def score(self, window_queries, keys, key_valid, scaling):
        return snapkv_scores(
            window_queries, keys, key_valid, scaling, self.kernel_size, self.pooling, self.gqa_reduce
        )
