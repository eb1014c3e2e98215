"""ShadowKV (Sun et al., arXiv 2410.21465; reference code ByteDance-Seed/ShadowKV at commit
e51904cdeab7d4d34013370f09f2cf5fcd655e15, ``models/kv_cache.py`` class ``ShadowKVCache``: ``get_svd``,
``prefill_kv_cache``, ``get_retrieval_position_ids``, ``get_value_cache``, ``get_key_cache``; as
``models/base.py`` ``LLM.layer_compute`` calls them)."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import torch
from transformers.models.llama.modeling_llama import rotate_half

from evalkit.core.method_settings import setting

from ..model_spec import layer_kinds
from ..views import PrefillView, row_of
from .base import Policy, refused_kv_format

LANDMARK_DIVISOR = math.sqrt(128)  # the reference's landmark logits divisor (its models' sqrt(head_dim)), kept as is


def unrotated(keys: torch.Tensor, positions: torch.Tensor, rotary) -> torch.Tensor:
    """Post-RoPE ``keys`` ``[H, n, D]`` at ``positions`` ``[n]`` rotated back, in fp32 (fp64 for an fp64 model)."""
    work = keys.to(torch.float64 if keys.dtype == torch.float64 else torch.float32)
    cos, sin = (t.to(work.dtype)[0] for t in rotary(work, positions[None]))  # [n, D]
    return (work * cos - rotate_half(work) * sin) / (cos * cos + sin * sin)


def low_rank_factors(pre_rope: torch.Tensor, rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's ``get_svd`` on one prompt's pre-RoPE keys ``[H, n, D]``: the heads side by side ``[n, H*D]``,
    ``U`` ``[n, rank]`` and ``SV = diag(s) V^T`` ``[H, rank, D]``, both rounded to ``dtype``."""
    heads, tokens, dim = pre_rope.shape
    u, s, vh = torch.linalg.svd(pre_rope.transpose(0, 1).reshape(tokens, heads * dim), full_matrices=False)
    sv = (torch.diag_embed(s[:rank]) @ vh[:rank]).to(dtype)
    return u[:, :rank].to(dtype), sv.view(-1, heads, dim).transpose(0, 1)


def rebuilt_keys(u: torch.Tensor, sv: torch.Tensor, positions: torch.Tensor, rotary) -> torch.Tensor:
    """The reference's ``get_key_cache``: keys ``[H, m, D]`` at prompt indices ``positions`` ``[H, m]`` rebuilt as
    ``U[position] SV`` in the factors' dtype, then rotated to their positions (its ``apply_rotary_pos_emb``)."""
    keys = torch.einsum("hrk,hkd->hrd", u[positions], sv)
    cos, sin = rotary(keys, positions)  # [H, m, D] in the keys' dtype
    return keys * cos + rotate_half(keys) * sin


def outlier_chunks(chunked: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's ``prefill_kv_cache`` on the context's post-RoPE keys ``[H, chunks, size, D]``: the landmark
    of every chunk (its keys' mean) ``[H, chunks, D]`` and, per head, the ``count`` chunks whose least cosine
    similarity of a key to the chunk's landmark is lowest (the outliers, kept exact) ``[H, count]``."""
    landmarks = chunked.mean(dim=-2)
    similarity = torch.nn.functional.cosine_similarity(landmarks.unsqueeze(2).expand_as(chunked), chunked, dim=-1)
    return landmarks, similarity.min(dim=-1).values.topk(count, largest=False).indices


def chunk_scores(query: torch.Tensor, landmarks: torch.Tensor) -> torch.Tensor:
    """The reference's ``get_retrieval_position_ids`` before its top-k: one step's queries ``[Hq, q, D]`` against a
    head's landmarks ``[H, C, D]``: softmax over the chunks in fp32 (logits scaled by 1/sqrt(128)), back to the
    model's dtype, summed over the queries, the most over a KV group's query heads: ``[H, C]``."""
    heads, count, dim = query.shape[0], query.shape[1], query.shape[2]
    grouped = query.reshape(landmarks.shape[0], heads // landmarks.shape[0], count, dim)
    logits = torch.einsum("hgqd,hdc->hgqc", grouped, landmarks.transpose(1, 2)) / LANDMARK_DIVISOR
    weights = torch.softmax(logits, dim=-1, dtype=torch.float32).to(query.dtype).sum(dim=-2)
    return weights.max(dim=-2).values


@dataclasses.dataclass
class PromptShadow:
    """ShadowKV's state of one row in one layer (:meth:`ShadowKV.prefill_state`, carried with the row by the runtime):
    its prompt's ``tokens`` (from the row's first slot), per KV head the landmarks ``[H, C, D]`` of the chunks it may
    read and their chunk indices ``[H, C]``. A prompt too short to select from has none (None): it is read whole."""

    tokens: int
    landmarks: torch.Tensor
    chunks: torch.Tensor


@dataclasses.dataclass
class ShadowKV(Policy):
    """Keeps every token and lets each decode step read part of them, as ShadowKV's accuracy class
    ``ShadowKVCache``. At the end of prefill, per layer and row: the prompt's pre-RoPE keys (all heads side by side)
    are factored by SVD, ``U`` ``[n, rank]`` and ``SV`` ``[H, rank, D]`` rounded to the model's dtype; the last
    ``local_chunks`` chunks of ``chunk_size`` tokens and the ``n % chunk_size`` after them (the local window) are
    kept exact; of the context chunks before it, per KV head, the ``outlier_chunks`` whose least cosine similarity
    of a post-RoPE key to the chunk's mean is lowest are kept exact, every other chunk is summarized by its landmark
    (that mean) and its keys are held as ShadowKV rebuilds them: ``U[i] SV`` rotated to position ``i``. Each decode
    step's query scores the landmarks (softmax of ``q . landmark / sqrt(128)`` per query head, the most over a KV
    group's heads) and reads the ``capacity // chunk_size`` best chunks per KV head, beside every exact token (local
    window, outliers, generated tokens). Values are always exact (the reference fetches the selected ones from the
    host). The prefill, and any multi-token step, reads everything. A row's landmarks and their chunk indices are its
    state (:class:`PromptShadow`, ``keeps_slot_state``), which the runtime keeps with the row.

    Differences from the reference: the rebuilt keys are computed once at prefill (the same numbers the reference
    computes for a chunk each step it is read); the pre-RoPE keys are the post-RoPE ones rotated back in fp32 (the
    reference takes them before RoPE); a prompt with fewer candidate chunks than ``capacity // chunk_size`` (where
    the reference fails) is held exact and read whole; ``rank`` is at most ``min(n, H*D)``. The rows price the whole
    cache (``kv_bytes_peak``) and, apart, what ShadowKV keeps on the device (``kv_bytes_device``: ``U``, ``SV``,
    landmarks and their indices, exact tokens, the step's buffer of read keys and values) and fetches from the host
    each step (``kv_bytes_fetched_step``: the read chunks' values); :meth:`offloaded_bytes`."""

    name: ClassVar[str] = "shadowkv"
    selects_while_decoding: ClassVar[bool] = True
    keeps_slot_state: ClassVar[bool] = True
    rewrites: ClassVar[bool] = True
    wrappable: ClassVar[bool] = False
    latent_refusal: ClassVar[str] = "it factors per-head pre-RoPE keys; a latent cache holds none"
    capacity: int = setting(low=1)
    rank: int = setting(160, low=1)
    chunk_size: int = setting(8, low=1)
    local_chunks: int = setting(4, low=0)
    outlier_chunks: int = setting(48, low=0)

    kv_format = refused_kv_format("ShadowKV holds rebuilt keys and exact values of its own")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.capacity < self.chunk_size:
            raise ValueError(f"ShadowKV.capacity must be >= chunk_size ({self.chunk_size}): it reads capacity // "
                             f"chunk_size chunks a step, got {self.capacity}")

    def check_model(self, config) -> None:
        super().check_model(config)
        if "sliding_attention" in layer_kinds(config):
            raise ValueError("method=shadowkv does not run on a hybrid model (sliding-window layers): it rebuilds keys "
                             "with a single rotate-half RoPE, and these models rotate theirs per layer kind; choose a "
                             "method that keeps the keys it is given (snapkv, for one)")

    def bind_model(self, model) -> None:
        self.check_model(model.config)  # again on the loaded model, for a caller that did not check it before

    def selected_chunks(self) -> int:
        return self.capacity // self.chunk_size

    def geometry(self, tokens: int) -> tuple[int, int] | None:
        """A ``tokens``-token prompt's context chunks and candidate chunks per head (None: read whole)."""
        chunks = tokens // self.chunk_size - self.local_chunks
        candidates = chunks - self.outlier_chunks
        return (chunks, candidates) if chunks > 0 and candidates >= self.selected_chunks() else None

    def rewrite(self, view: PrefillView, indices: torch.Tensor, counts: torch.Tensor, keys: torch.Tensor,
                values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys = keys.clone()
        for row in range(keys.shape[0]):  # every token kept: a row's prompt in its first slots, in text order
            alone, _ = row_of(view, row)
            shadow_keys = self.shadow(alone.keys[0], alone.positions[0], view.rotary)
            keys[row, :, : shadow_keys.shape[1]] = shadow_keys
        return keys, values

    def prefill_state(self, view: PrefillView) -> list[PromptShadow | None]:
        """Each row's :class:`PromptShadow` (None: its prompt is read whole), from its prompt's exact keys."""
        states = []
        for row in range(view.keys.shape[0]):
            keys = row_of(view, row)[0].keys[0]
            candidates = self.candidates(keys)
            states.append(None if candidates is None else PromptShadow(keys.shape[1], *candidates))
        return states

    def candidates(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One prompt's post-RoPE keys ``[H, n, D]``: the landmarks ``[H, C, D]`` of its candidate chunks (every
        context chunk but the outliers) and their chunk indices ``[H, C]`` (None: read whole)."""
        heads, tokens, dim = keys.shape
        shape = self.geometry(tokens)
        if shape is None:
            return None
        chunks, _ = shape
        chunked = keys[:, : chunks * self.chunk_size].reshape(heads, chunks, self.chunk_size, dim)
        landmarks, outliers = outlier_chunks(chunked, self.outlier_chunks)
        rest = torch.ones(heads, chunks, dtype=torch.bool, device=keys.device).scatter(-1, outliers, False)
        candidates = torch.arange(chunks, device=keys.device).expand(heads, -1)[rest].view(heads, -1)
        return landmarks.gather(1, candidates[..., None].expand(-1, -1, dim)), candidates

    def shadow(self, keys: torch.Tensor, positions: torch.Tensor, rotary) -> torch.Tensor:
        """One prompt's post-RoPE keys ``[H, n, D]`` at ``positions`` ``[n]`` as ShadowKV holds them: its candidate
        chunks' keys rebuilt from the low-rank factors, the rest exact."""
        heads, tokens, dim = keys.shape
        chosen = self.candidates(keys)
        if chosen is None:
            return keys
        candidates = chosen[1]
        rank = min(self.rank, tokens, heads * dim)
        u, sv = low_rank_factors(unrotated(keys, positions, rotary), rank, keys.dtype)
        index = (candidates[..., None] * self.chunk_size + torch.arange(self.chunk_size, device=keys.device)).flatten(1)
        held = keys.clone()
        held.scatter_(1, index[..., None].expand(-1, -1, dim), rebuilt_keys(u, sv, positions[index], rotary))
        return held

    def decode_visible(self, query: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, layer_idx: int,
                       states: list[PromptShadow | None] | None = None) -> torch.Tensor | None:
        if states is None or query.shape[2] != 1:
            return None
        batch, query_heads = query.shape[:2]
        kv_heads, slots = keys.shape[1], keys.shape[2]
        chosen = visible.expand(batch, kv_heads, slots).clone()
        for row, shadow in enumerate(states):
            if shadow is None:  # a prompt read whole, or an engine slot no request holds
                continue
            first = int(visible[row].any(dim=0).int().argmax())  # the row's prompt from its first held slot
            chosen[row] &= self.readable(shadow, query[row], first, slots)
        return chosen.repeat_interleave(query_heads // kv_heads, dim=1)

    def readable(self, shadow: PromptShadow, query: torch.Tensor, first: int, slots: int) -> torch.Tensor:
        """``[H, S]``: every slot but those of the candidate chunks this step's ``query`` ``[Hq, 1, D]`` does not
        select (the reference's top ``capacity // chunk_size`` landmarks per KV head)."""
        picked = chunk_scores(query, shadow.landmarks).topk(self.selected_chunks(), dim=-1).indices
        offsets = torch.arange(self.chunk_size, device=query.device)

        def slots_of(chunks: torch.Tensor) -> torch.Tensor:
            return (first + chunks[..., None] * self.chunk_size + offsets).flatten(1)

        readable = torch.ones(shadow.chunks.shape[0], slots, dtype=torch.bool, device=query.device)
        readable.scatter_(1, slots_of(shadow.chunks), False)
        return readable.scatter_(1, slots_of(shadow.chunks.gather(1, picked)), True)

    def offloaded_bytes(self, shadow: PromptShadow | None, held: int, kv_heads: int, head_dim: int,
                        element: int) -> tuple[int, int] | None:
        """For one layer's row holding ``held`` tokens (its prompt and those after it) with the state ``shadow``: the
        bytes ShadowKV keeps on the device (``U``, ``SV``, the landmarks with their int64 chunk indices, the exact
        local window, outlier chunks and later tokens, the step's buffer of read keys and values) and those it fetches
        from the host each step (the read chunks' values). None: a prompt read whole (all on the device)."""
        if shadow is None:
            return None
        token = kv_heads * head_dim * element  # one token's keys, or values, over the heads
        rank = min(self.rank, shadow.tokens, kv_heads * head_dim)
        exact = held - shadow.chunks.shape[1] * self.chunk_size  # all but the candidate chunks
        read = self.selected_chunks() * self.chunk_size
        factors = (shadow.tokens * rank + kv_heads * rank * head_dim) * element
        landmarks = sum(t.numel() * t.element_size() for t in (shadow.landmarks, shadow.chunks))
        return factors + landmarks + 2 * (exact + read) * token, read * token
