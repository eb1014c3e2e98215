"""KVCompose (Akulov et al., arXiv 2509.05165; kvpress ``KVComposePress``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from evalkit.core.method_settings import setting

from .base import Policy

QUERY_BLOCK = 1024  # pass queries scored at once (bounds the attention held)
LIFT = 1e9  # kvpress' bonus for the first keep_token_lower_bound ranks


@dataclasses.dataclass
class KVCompose(Policy):
    """Each prompt token is scored by the attention the prompt gives it when it runs a second time over its own cache
    (one pass after the prefill, from the prompt's last position on): per query head, the ``agg_task`` of its pass
    queries' attention; per KV head, the ``agg_group`` of its query heads' (times the value's norm where
    ``add_v_norm``); then each head's score plus the mean over the layer's heads (``add_mean_across_heads``).

    The budget is the whole model's, allotted by composite scores: each head's scores sorted, the first
    ``keep_token_lower_bound`` ranks lifted by 1e9. ``structured``: a layer's composite is the ``agg_head`` of its heads'
    sorted scores (layer 0's the most of every layer's), the ``num_layers * capacity`` best composites of the model
    say how many tokens each layer keeps (at least ``max(1, keep_token_lower_bound)``), and every head of the layer
    keeps that many of its best tokens. Unstructured: the ``num_layers * kv_heads * capacity`` best sorted scores of
    every head say how many each head keeps.

    Reference: kvpress 0.5.5 ``KVComposePress`` (``kvpress/presses/kvcompose_press.py``), whose pass repeats the
    context when no question is registered (its pipeline registers none). Differences: ties between equal composites
    go to the earlier layer and head, equal scores to the earlier token (kvpress: ``topk``'s order); the pass queries
    are scored in blocks of 1024 (kvpress holds the pass' whole attention); a ``removed_R`` budget keeps
    ``num_layers * int(n * (1 - R))`` (kvpress ``int(num_layers * n * (1 - R))``); ``add_v_norm`` takes the prompt's
    values (kvpress 0.5.5 multiplies by the norms of the prompt and the pass together and fails on the shapes); the
    unstructured variant evicts where kvpress masks, for any batch (kvpress: one prompt).
    """

    name: ClassVar[str] = "kvcompose"
    needs_scores: ClassVar[bool] = True
    per_head: ClassVar[bool] = True
    extra_passes: ClassVar[bool] = True
    latent_refusal: ClassVar[str] = "its pass scores per-head keys"
    capacity: int = setting(low=1)
    structured: bool = True
    agg_task: str = setting("max", choices=("max", "mean"))
    agg_group: str = setting("mean", choices=("max", "mean"))
    agg_head: str = setting("mean", choices=("max", "mean"))
    add_v_norm: bool = False
    add_mean_across_heads: bool = True
    keep_token_lower_bound: int = setting(0, low=0)

    def prompt_capacity(self) -> int:
        return self.capacity

    def prompt_slots(self, n: int, kv_heads: int) -> int:
        return n  # a layer, or a head, may take any share of the model's budget

    def passes(self, ids: torch.Tensor) -> list[tuple[int, int, torch.Tensor]]:
        """One pass: the prompt ``ids`` ``[n]`` again, scoring all of it."""
        return [(0, ids.shape[0], ids)]

    def pass_scores(self, module, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    hidden: torch.Tensor | None, scaling: float, start: int, end: int) -> torch.Tensor:
        """``[1, Hkv, end - start]``: each prompt token's score from the pass' attention (see the class). ``query``
        ``[1, Hq, q, D]`` (post-RoPE), ``keys``/``values`` ``[1, Hkv, n + q, D]`` (the prompt's, then the pass')."""
        dtype = torch.promote_types(query.dtype, torch.float32)
        count, kv_heads, total = query.shape[2], keys.shape[1], keys.shape[2]
        groups = query.shape[1] // kv_heads
        q = query.to(dtype).view(1, kv_heads, groups, count, -1)
        k = keys.to(dtype)
        task = None
        for first in range(0, count, QUERY_BLOCK):
            block = q[:, :, :, first : first + QUERY_BLOCK]
            logits = torch.einsum("bhgqd,bhkd->bhgqk", block, k) * scaling
            seen = total - count + first + torch.arange(block.shape[3], device=keys.device)  # each query's own key
            logits = logits.masked_fill(torch.arange(total, device=keys.device) > seen[:, None], float("-inf"))
            weights = logits.softmax(dim=-1)[..., start:end]
            part = weights.amax(dim=3) if self.agg_task == "max" else weights.sum(dim=3)
            task = part if task is None else torch.maximum(task, part) if self.agg_task == "max" else task + part
        if self.agg_task == "mean":
            task = task / count
        scores = task.amax(dim=2) if self.agg_group == "max" else task.mean(dim=2)  # [1, Hkv, end - start]
        if self.add_v_norm:
            scores = scores * values[:, :, start:end].to(dtype).norm(dim=-1)
        return scores

    def allocate_layers(self, scores: torch.Tensor, real_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """From every layer's scores ``[L, B, Hkv, n]`` (``-inf`` on padding) and each row's prompt length ``[B]``:
        the scores ranked and the tokens each layer and KV head keeps ``[L, B, Hkv]`` (each row on its own)."""
        layers, batch, kv_heads, n = scores.shape
        if self.add_mean_across_heads:
            real = scores.masked_fill(scores == float("-inf"), 0.0)
            scores = (real + real.mean(dim=2, keepdim=True)).masked_fill(scores == float("-inf"), float("-inf"))
        counts = torch.stack([self._counts(scores[:, row, :, n - int(m):], int(m)) for row, m in enumerate(real_len)])
        return scores, counts.permute(1, 0, 2)

    def _counts(self, scores: torch.Tensor, m: int) -> torch.Tensor:
        """``[L, Hkv]``: the tokens each layer and head of one unpadded prompt (``scores`` ``[L, Hkv, m]``) keeps."""
        layers, kv_heads = scores.shape[:2]
        budget = min(m, self.capacity)
        ranked = scores.double().sort(dim=-1, descending=True).values
        lift = torch.where(torch.arange(m, device=scores.device) < self.keep_token_lower_bound, LIFT, 0.0)
        if not self.structured:
            chosen = best(ranked + lift, layers * kv_heads * budget)
            return chosen.view(layers, kv_heads, m).sum(dim=-1)
        composite = ranked.amax(dim=1) if self.agg_head == "max" else ranked.mean(dim=1)  # [L, m]
        composite = composite + lift
        composite[0] = composite.amax(dim=0)
        per_layer = best(composite, max(1, layers * budget)).view(layers, m).sum(dim=-1)
        per_layer = per_layer.clamp(min=max(1, self.keep_token_lower_bound), max=m)
        return per_layer[:, None].expand(-1, kv_heads)


def best(values: torch.Tensor, count: int) -> torch.Tensor:
    """A mask of the ``count`` largest of ``values`` (flattened; ties to the earlier entry)."""
    flat = values.reshape(-1)
    order = flat.argsort(descending=True, stable=True)
    return torch.zeros_like(flat, dtype=torch.bool).scatter_(0, order[:count], True)
