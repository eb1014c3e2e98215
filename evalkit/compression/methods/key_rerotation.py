"""Key re-rotation after eviction (kvpress ``KeyRerotationPress``; SinkCache's and Finch's re-rotation)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from transformers.models.llama.modeling_llama import rotate_half

from ..kernels import pre_rope
from ..views import PrefillView
from .rewriting import Rewriting


@dataclasses.dataclass
class KeyRerotation(Rewriting):
    """Keep the scorer's ``capacity`` tokens, then re-rotate each kept key to the position it now holds: the i-th
    kept token of a head (text order) at position i, as if the prompt had been those tokens alone. Decoding goes on
    at the prompt's own next position, as kvpress' (the gap between the kept keys and the new tokens widens)."""

    name: ClassVar[str] = "key_rerotation"

    def rewrite(self, view: PrefillView, indices: torch.Tensor, counts: torch.Tensor, keys: torch.Tensor,
                values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, heads, kept, dim = keys.shape
        old = view.positions[:, None, :].expand(-1, heads, -1).gather(2, indices).reshape(batch * heads, kept)
        new = torch.arange(kept, device=keys.device).expand(batch * heads, -1)
        unrotated = pre_rope(keys.reshape(batch * heads, 1, kept, dim), old, view.rotary)
        cos, sin = (t.float()[:, None] for t in view.rotary(unrotated, new))
        rotated = unrotated * cos + rotate_half(unrotated) * sin
        return rotated.reshape(batch, heads, kept, dim).to(keys.dtype), values
