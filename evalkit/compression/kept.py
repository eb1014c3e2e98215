"""What a method kept: the text positions each layer and KV head of a compressed cache holds, read off the cache.

A per-head layout keeps every slot's position beside its validity (:class:`.layout.HeadState`); a row layout keeps
its prompt slots' positions per head (``CompressedLayer.prompt_positions``) and those of the tokens written after
prefill per row (``RowState.slot_pos``), a ring's overwritten prompt slots included.
"""

from __future__ import annotations

import torch

from .cache import CompressedCache
from .generate import GenerationOutput
from .session import CompressionSession


def _cache_of(source) -> CompressedCache:
    """The compressed cache of a :class:`CompressedCache`, a :class:`CompressionSession` or a generate output."""
    if isinstance(source, GenerationOutput):
        if source.session is None:
            raise ValueError("this generate output kept no session: call generate(..., keep_session=True)")
        source = source.session
    if isinstance(source, CompressionSession):
        return source.cache
    if isinstance(source, CompressedCache):
        return source
    raise TypeError(f"kept_positions reads a CompressedCache, CompressionSession or generate output, got "
                    f"{type(source).__name__}")


def _row_layer(layer, state, row: int) -> list[torch.Tensor]:
    """A row-layout layer's held positions per head: a slot written after prefill holds ``slot_pos``, a prompt slot
    the position recorded when the prompt was compressed."""
    slots = min(layer.values.shape[-2], state.slots)
    written = state.slot_pos[row, :slots].cpu()
    prompt = layer.prompt_positions[row, :, :slots].cpu()  # [H, P]
    recorded = torch.arange(slots) < prompt.shape[-1]
    held = written[None].repeat(prompt.shape[0], 1)
    held[:, : prompt.shape[-1]] = torch.where(written[: prompt.shape[-1]] >= 0, written[: prompt.shape[-1]], prompt)
    valid = state.valid[row, :slots].cpu() & ((written >= 0) | recorded)
    return [head[valid] for head in held]


def _head_layer(layer, row: int) -> list[torch.Tensor]:
    """A per-head layout's held positions per head: its valid slots' positions."""
    positions, valid = layer.heads.positions[row].cpu(), layer.heads.valid[row].cpu()
    return [head[mask] for head, mask in zip(positions, valid)]


def kept_positions(source, row: int = 0, prompt_only: bool = False) -> list[list[torch.Tensor]]:
    """The text positions row ``row`` holds now, per layer and KV head: ``[layer][head]`` a sorted 1-D LongTensor
    (on the CPU). ``source``: a ``CompressionSession`` or its ``cache`` after ``prefill`` (and any ``step``), or
    ``generate(..., keep_session=True)``'s output (what the cache held when generation ended).

    Prompt and later tokens alike; ``prompt_only=True`` keeps only the positions the prefill ran over (below the
    position decoding began at). A latent (MLA) cache has one head per layer; a hybrid model's sliding-window layers
    hold their window.
    """
    cache = _cache_of(source)
    state = cache.state
    if state is None:
        raise ValueError("kept_positions reads a prefilled cache: call prefill first")
    if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < state.valid.shape[0]:
        raise ValueError(f"row must be an integer in [0, {state.valid.shape[0]}), got {row!r}")
    kept = []
    for layer in cache.layers:
        heads = _head_layer(layer, row) if layer.heads is not None else _row_layer(layer, state, row)
        if prompt_only:
            end = int(state.seq_len[row] - state.written[row] + state.kept_prompt[row])  # where decoding began
            heads = [positions[positions < end] for positions in heads]
        kept.append([positions.sort().values for positions in heads])
    return kept
