"""FINCH (Corallo & Papotti, TACL 2024, "FINCH: Prompt-guided Key-Value Cache Compression"; kvpress 0.5.5
``FinchPress``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from evalkit.core.method_settings import setting

from ..kernels import attention_probabilities, causal_visible
from ..model_spec import attention_sinks
from ..views import PrefillView, scores_by_row
from .base import Policy, best_in_order
from .key_rerotation import KeyRerotation


@dataclasses.dataclass
class Finch(Policy):
    """Score the context's keys by the attention of the question's queries; keep the question whole.

    The question is the prompt's last ``window`` tokens: kvpress finds it as the tokens after a delimiter token
    (``<|finch_sep|>``, dropped from the embeddings) and compresses ``context + question`` as one prompt, which is
    the prompt evalkit compresses under ``compression_scope=prompt`` (the question after its document, as the tasks
    mark it), with ``window`` the question's token count. Per unpadded row, the window's queries' fp32 softmax over
    all keys (causal inside the window) is cut to the context, each query's row multiplied by its position
    (``normalize_scores``: kvpress' count of the keys it sees, ``n - window + i``), averaged over the window's
    queries, then over the query heads of each KV group. Each head keeps its ``capacity`` best (the window forced);
    with ``chunk_length``, the same scores ranked chunk by chunk from the row's start, each chunk keeping
    ``max(1, len * capacity // n)`` (kvpress' ``int(len * (1 - ratio))`` where ``n * (1 - ratio)`` is whole). With
    ``rerotate_keys``, each kept key is re-rotated to the position it now holds (0, 1, ... per head).

    Differences from kvpress: the question's length is a setting, not found per prompt from a delimiter (evalkit's
    prompts carry no mark; under ``compression_scope=context`` the question is prefilled after compression, so the
    window is the document's last tokens instead); after re-rotation decoding goes on at the prompt's own next
    position (kvpress' pipeline: at the compressed length); a prompt of at most ``capacity`` tokens is kept whole;
    equal scores go to the earlier token; where chunks' floors would pass ``capacity``, the last chunk keeps what is
    left.
    """

    name: ClassVar[str] = "finch"
    needs_scores: ClassVar[bool] = True
    rewrites: ClassVar[bool] = True  # re-rotation (off per instance where rerotate_keys is false)
    wrappable: ClassVar[bool] = False  # its chunked selection and re-rotation are its own
    capacity: int = setting(low=1)
    window: int = setting(16, low=1)
    chunk_length: int | None = setting(None, low=1)
    normalize_scores: bool = setting(True)
    rerotate_keys: bool = setting(True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.capacity <= self.window:
            raise ValueError(f"Finch.capacity must be > window ({self.window}), got {self.capacity}")
        self.rewrites = self.rerotate_keys

    def kept_window(self) -> int:
        return self.window

    def prompt_capacity(self) -> int:
        return self.capacity

    def prefill_queries(self) -> int:
        return self.window

    def score(self, view: PrefillView) -> torch.Tensor:
        return scores_by_row(view, self._row_scores)

    def _row_scores(self, alone: PrefillView) -> torch.Tensor:
        """``[1, Hkv, m]`` scores of one unpadded prompt (0 on its window, which is forced)."""
        m = alone.keys.shape[2]
        window = min(self.window, m - 1)
        query = alone.query[:, :, alone.query.shape[2] - window :]
        visible = causal_visible(alone.key_valid, m - window, m)
        attention = attention_probabilities(query, alone.keys, visible, alone.scaling,
                                            attention_sinks(alone.module))[..., : m - window]  # [1, Hkv, G, w, c]
        if self.normalize_scores:
            seen = torch.arange(m - window, m, device=attention.device, dtype=attention.dtype)
            attention = attention * seen[:, None]
        scores = attention.mean(dim=-2).mean(dim=2)
        return torch.nn.functional.pad(scores, (0, window))

    def select(self, view: PrefillView, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.chunk_length is None:
            return super().select(view, kv_heads)
        batch, device = view.keys.shape[0], view.keys.device
        raw = self.score(view).float()
        rows = [self._row_chunks(raw[row], view, row) for row in range(batch)]
        keep = max(tokens.shape[-1] for tokens in rows)
        indices = torch.zeros(batch, kv_heads, keep, dtype=torch.long, device=device)
        counts = torch.zeros(batch, kv_heads, dtype=torch.long, device=device)
        for row, tokens in enumerate(rows):
            indices[row, :, : tokens.shape[-1]] = tokens
            counts[row] = tokens.shape[-1]
        return indices, counts, raw

    def _row_chunks(self, raw: torch.Tensor, view: PrefillView, row: int) -> torch.Tensor:
        """``[Hkv, kept]``: one row's kept tokens (indices in its padded row, text order), chunk by chunk."""
        n = raw.shape[-1]
        first = n - int(view.key_valid[row].sum())
        m = n - first
        if m <= self.capacity:
            return torch.arange(first, n, device=raw.device).expand(raw.shape[0], -1)
        if self.chunk_length * self.capacity <= self.window * m:  # kvpress: chunk_length > window / (1 - ratio)
            raise ValueError(f"Finch.chunk_length {self.chunk_length} must exceed window / kept share "
                             f"({self.window} * {m} / {self.capacity})")
        scores = raw[:, first:].clone()
        scores[:, m - min(self.window, m - 1) :] = float("inf")
        picks, left = [], self.capacity
        for start in range(0, m, self.chunk_length):
            end = min(start + self.chunk_length, m)
            keep = max(1, (end - start) * self.capacity // m)
            keep = min(keep, left) if end == m else keep  # the floors never pass capacity
            chunk = scores[None, :, start:end]
            picks.append(best_in_order(chunk, torch.full(chunk.shape[:2], keep, device=raw.device))[0] + start)
            left -= keep
        return torch.cat(picks, dim=-1) + first

    def rewrite(self, view: PrefillView, indices: torch.Tensor, counts: torch.Tensor, keys: torch.Tensor,
                values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.rerotate_keys:
            return keys, values
        return KeyRerotation.rewrite(self, view, indices, counts, keys, values)  # kvpress' re-rotation, shared
