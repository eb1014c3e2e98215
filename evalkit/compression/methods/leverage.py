"""Leverage scores of the keys (Compactor, arXiv 2507.08143; kvpress ``LeverageScorePress``)."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import torch

from evalkit.core.method_settings import setting

from ..kernels import pre_rope
from ..views import PrefillView, scores_by_row
from .base import PromptScoring


def sketch(layer_idx: int, kv_heads: int, dim: int, size: int, seed: int) -> torch.Tensor:
    """The random projection ``[1, Hkv, D, size]`` of layer ``layer_idx``: the ``layer_idx + 1``-th draw of a CPU
    generator seeded ``seed``, as kvpress draws one per layer from the global generator during a forward (seeded with
    ``torch.manual_seed(seed)`` before it, the same matrices on the CPU)."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(layer_idx + 1):
        drawn = torch.randn(1, kv_heads, dim, size, generator=generator)
    return drawn * (1 / math.sqrt(size))


def leverage_scores(keys: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
    """kvpress' ``compute_leverage_scores`` of one prompt's pre-RoPE keys ``[1, H, n, D]``: the diagonal of the hat
    matrix of the centred, sketched keys (Cholesky with growing jitter), clamped at 0. In float64: a prompt's
    repeated tokens have keys equal but for rounding, so their scores tie but for rounding, and float32's differs
    with the keys' memory layout (a chunked prefill's cache against a whole one's) and the CPU's vector kernels."""
    keys = keys.double()
    centred = keys - keys.mean(dim=-2, keepdim=True)
    sketched = centred @ projection.to(keys.device, keys.dtype)  # [1, H, n, k]
    gram = sketched.transpose(-2, -1) @ sketched
    gram = 0.5 * (gram + gram.transpose(-2, -1))
    identity = torch.eye(gram.shape[-1], device=gram.device, dtype=gram.dtype)
    jitter = 1e-2
    for _ in range(5):
        lower, info = torch.linalg.cholesky_ex(gram + jitter * identity, upper=False)
        if bool((info == 0).all()):
            break
        jitter = max(1e-8, 10.0 * jitter)
    else:
        raise RuntimeError("leverage scores: the Cholesky factorization failed after 5 tries")
    solved = torch.cholesky_solve(sketched.transpose(-2, -1), lower, upper=False)  # (X^T X)^-1 X^T
    return (sketched * solved.transpose(-2, -1)).sum(dim=-1).clamp_min(0)


def z_scores(scores: torch.Tensor) -> torch.Tensor:
    """Standardized over every head and token of one prompt (kvpress' ``(s - s.mean()) / s.std().clamp_min(1e-6)``)."""
    return (scores - scores.mean()) / scores.std().clamp_min(1e-6)


@dataclasses.dataclass
class LeverageScore(PromptScoring):
    """Keep the keys that span the prompt's key space: the statistical leverage of each pre-RoPE key among the
    prompt's centred keys, through a random ``sketch_dimension``-dimensional projection, standardized over the
    prompt's heads and tokens (kvpress ``LeverageScorePress``).

    The projection is drawn per layer from a generator seeded ``seed`` (see :func:`sketch`): kvpress draws from the
    global generator, so its kept tokens equal these for a float32 model on the CPU seeded alike, but where float32
    rounding decides between near-equal scores. Computed in float64 (kvpress: the keys' dtype; see
    :func:`leverage_scores`), ties broken towards the earlier position. Each row scored alone.
    """

    name: ClassVar[str] = "leverage"
    latent_refusal: ClassVar[str] = "it reads pre-RoPE keys; MLA rotates only part of them"
    sketch_dimension: int = setting(48, low=1)
    seed: int = setting(0, low=0)

    def prefill_queries(self) -> int:
        return 0

    def score(self, view: PrefillView) -> torch.Tensor:
        def one(alone: PrefillView) -> torch.Tensor:
            keys = pre_rope(alone.keys, alone.positions, alone.rotary)
            projection = sketch(alone.layer_idx, keys.shape[1], keys.shape[-1], self.sketch_dimension, self.seed)
            return z_scores(leverage_scores(keys, projection))

        return scores_by_row(view, one)
