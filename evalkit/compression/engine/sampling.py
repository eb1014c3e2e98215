"""Per-request random streams and token choice for the engine's decode step: a sampled request draws the same
tokens whatever its neighbours and its slot (a counter-based hash of its seed, its token index and the vocabulary
entry, turned into Gumbel noise)."""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (xorshift-multiply) on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x4C8E9CF5) & _MASK32
    return x ^ (x >> 16)


def gumbel_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel(0, 1) noise ``[rows, vocab]`` that depends only on each row's (seed, step) and the vocabulary index:
    the same request draws the same noise in any slot, next to any neighbours."""
    lo, hi = seeds & _MASK32, (seeds >> 32) & _MASK32
    base = _hash32(_hash32(lo ^ _hash32(hi + 0x3C6EF372)) ^ _hash32(steps & _MASK32))
    index = torch.arange(vocab, device=seeds.device)
    bits = _hash32(_hash32((base[:, None] + index[None, :] * 0x9E3779B1) & _MASK32) ^ base[:, None])
    uniform = ((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))  # in (0, 1), never 0 or 1
    return -torch.log(-torch.log(uniform))


def choose_tokens(logits, greedy_only: bool, seeds, steps, do_sample, temperature, top_p, use_top_p: bool):
    """Next token per row: argmax for greedy rows; for sampling rows, temperature, then top-p (transformers'
    ``TopPLogitsWarper`` rule, per row), then a draw by the Gumbel-max trick with the row's own noise."""
    greedy = logits.argmax(dim=-1)
    if greedy_only:
        return greedy
    scores = logits / temperature[:, None]
    if use_top_p:
        ordered, order = scores.sort(dim=-1)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - top_p[:, None])
        remove[:, -1] = False
        scores = scores.masked_fill(remove.scatter(1, order, remove), float("-inf"))
    sampled = (scores + gumbel_noise(seeds, steps, scores.shape[-1])).argmax(dim=-1)
    return torch.where(do_sample, sampled, greedy)


