"""ThinK, key-channel pruning (Xu et al., arXiv 2407.21018; kvpress ``ThinKPress``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from evalkit.core.method_settings import setting

from ..views import PrefillView
from .rewriting import Rewriting


@dataclasses.dataclass
class ThinK(Rewriting):
    """Keep the scorer's ``capacity`` tokens (kvpress composes ThinK after a sequence press:
    ``ComposedPress([SnapKVPress, ThinKPress])``), then prune, per KV head, the ``int(head_dim *
    key_channel_compression_ratio)`` key channels of least ``mean_q(q_c^2) * mean_k(k_c^2)`` over the kept keys and
    the last ``window_size`` queries (mean over each group's query heads; kvpress ``ThinKPress.compress``).

    The session (:func:`~evalkit.compression.generate`, :class:`~evalkit.compression.CompressionSession`,
    :func:`~evalkit.compression.generate_shared`) removes the channels: a layer keeps its prompt keys at the reduced
    width ``[B, Hkv, kept, D - pruned]`` with the channels kept per head ``[B, Hkv, D - pruned]``, later tokens'
    keys at full width (ThinK prunes the prompt's keys), and :func:`attend_reduced` reads both; its bytes say so.
    The engine's slots hold them so too, each slot its own channels (:mod:`..engine.reduced_keys`). Where removal
    does not fit (a per-head layout, a ring, a quantized KV format, learned attention sinks, a hybrid model's engine
    slots) and with ``remove_channels = False`` on an instance, the keys are held at full width with the pruned
    channels zeroed, as kvpress does: the same logits, no bytes freed."""

    name: ClassVar[str] = "think"
    key_channel_compression_ratio: float = setting(0.5, low=0, high=1)
    window_size: int = setting(32, low=1)
    remove_channels: ClassVar[bool] = True  # False: zero them instead (the same logits, no bytes freed)

    def prefill_queries(self) -> int | None:
        needed = self.scorer.prefill_queries()
        return None if needed is None else max(needed, self.window_size)

    def kept_channel_count(self, dim: int) -> int:
        """Key channels a KV head of width ``dim`` keeps: ``dim - int(dim * key_channel_compression_ratio)``."""
        return dim - int(dim * self.key_channel_compression_ratio)

    def kept_channels(self, view: PrefillView, counts: torch.Tensor, keys: torch.Tensor) -> torch.Tensor | None:
        """The key channels each KV head keeps, ``[B, Hkv, D - pruned]`` in channel order (None: none pruned)."""
        batch, heads, kept, dim = keys.shape
        pruned = dim - self.kept_channel_count(dim)
        if pruned == 0:
            return None
        query = view.query[:, :, -self.window_size :].float()
        query_norm = query.pow(2).mean(dim=2).reshape(batch, heads, -1, dim).mean(dim=2)  # [B, Hkv, D]
        real = (torch.arange(kept, device=keys.device) < counts[..., None]).float()[..., None]  # [B, Hkv, kept, 1]
        key_norm = (keys.float().pow(2) * real).sum(dim=2) / real.sum(dim=2).clamp(min=1)
        channels = (query_norm * key_norm).topk(pruned, dim=-1, largest=False).indices  # [B, Hkv, pruned]
        keep = torch.ones(batch, heads, dim, dtype=torch.bool, device=keys.device).scatter(-1, channels, False)
        return keep.to(torch.uint8).argsort(dim=-1, descending=True, stable=True)[..., : dim - pruned]

    def rewrite(self, view: PrefillView, indices: torch.Tensor, counts: torch.Tensor, keys: torch.Tensor,
                values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The zeroed form: the kept keys at full width, the pruned channels 0."""
        channels = self.kept_channels(view, counts, keys)
        if channels is None:
            return keys, values
        index = channels[:, :, None].expand(-1, -1, keys.shape[2], -1)
        return torch.zeros_like(keys).scatter(-1, index, keys.gather(-1, index)), values


def reduce_keys(keys: torch.Tensor, channels: torch.Tensor) -> torch.Tensor:
    """``keys`` ``[B, Hkv, n, D]`` narrowed to each head's ``channels`` ``[B, Hkv, C]``: ``[B, Hkv, n, C]``."""
    return keys.gather(-1, channels[:, :, None].expand(-1, -1, keys.shape[2], -1))


def attend_reduced(query: torch.Tensor, prompt_keys: torch.Tensor, channels: torch.Tensor, later_keys: torch.Tensor,
                   values: torch.Tensor, mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """Attention over a layer whose first ``P`` slots hold reduced keys ``prompt_keys`` ``[B, Hkv, P, C]`` (the
    ``channels`` ``[B, Hkv, C]`` of each head) and the rest full-width ``later_keys`` ``[B, Hkv, S - P, D]``: the
    query ``[B, Hq, q, D]`` is narrowed to its KV head's channels for the first block (the query heads of a group
    share them), the logits of both blocks take one softmax. ``mask``: None, bool (True: attend) or additive,
    broadcast to ``[B, Hq, q, S]``. Returns ``[B, q, Hq, Dv]``, as transformers' attention functions do."""
    batch, query_heads, count, dim = query.shape
    kv_heads = prompt_keys.shape[1]
    grouped = query.reshape(batch, kv_heads, -1, dim)  # [B, Hkv, G * q, D]: query head h is KV head h // G
    narrowed = reduce_keys(grouped, channels)
    logits = torch.cat([narrowed @ prompt_keys.transpose(-1, -2), grouped @ later_keys.transpose(-1, -2)], dim=-1)
    logits = logits.reshape(batch, query_heads, count, -1).float() * scaling
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask
    weights = logits.softmax(dim=-1).to(values.dtype).reshape(batch, kv_heads, -1, logits.shape[-1])
    output = (weights @ values).reshape(batch, query_heads, count, values.shape[-1])
    return output.transpose(1, 2).contiguous()
