"""What a session's cache holds, read in text order, and an agent loop's new content run over it as one chunk: the
pieces every ``session.recompress`` rule (:mod:`.recompress`) is made of."""

from __future__ import annotations

import torch

from .attention import hooked
from .cache import PrefillPlan
from .model_spec import cache_kwargs
from .session import CompressionSession

LAST = torch.iinfo(torch.long).max


def cache_tokens(session: CompressionSession) -> float:
    """The tokens the session's cache holds now (row 0), mean over layers and KV heads, read off its validity."""
    counts = [float(layer.heads.valid[0].sum(dim=-1).float().mean()) if layer.layout.per_head
              else float(session.state.valid[0, : layer.get_seq_length()].sum()) for layer in session.cache.layers]
    return sum(counts) / len(counts)


def in_text_order(tensors: list[torch.Tensor], valid: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
    """Each of ``tensors`` (``[1, H, S]`` or ``[1, H, S, D]``) cut to the slots ``valid`` ``[1, H, S]`` holds, in the
    text order of their ``positions``; every head must hold as many."""
    counts = valid.sum(dim=-1)
    if bool((counts != counts.flatten()[0]).any()):
        raise ValueError("the cache's KV heads hold different numbers of tokens; a rule here takes them in row by row")
    order = positions.masked_fill(~valid, LAST).argsort(dim=-1, stable=True)[..., : int(counts.flatten()[0])]
    return [tensor.gather(2, order if tensor.dim() == 3 else order[..., None].expand(-1, -1, -1, tensor.shape[-1]))
            for tensor in tensors]


def held_tokens(session: CompressionSession) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Every layer's held tokens in text order per KV head (row 0): keys ``[1, Hkv, h, D]``, values and text positions
    ``[1, Hkv, h]`` (a per-head layout's heads must hold as many: H2O's do)."""
    state, held = session.state, []
    for layer in session.cache.layers:
        if layer.layout.per_head:
            valid, positions = layer.heads.valid[:1], layer.heads.positions[:1]
            slots = valid.shape[-1]
        else:
            slots = layer.get_seq_length()
            valid, later = state.valid[:1, :slots], state.slot_pos[:1, :slots]
            positions = later[:, None, :].expand(-1, layer.keys.shape[1], -1).clone()
            prompt = layer.prompt_positions[:1]
            written = prompt.shape[-1]
            positions[..., :written] = torch.where(later[:, None, :written] < 0, prompt, positions[..., :written])
            valid = valid[:, None].expand_as(positions)
        keys, values = layer.keys[:1, :, :slots], layer.values[:1, :, :slots]
        held.append(tuple(in_text_order([keys, values, positions], valid, positions)))
    return held


@torch.no_grad()
def run_content(session: CompressionSession, ids: torch.Tensor, compress: bool, policies: list | None = None):
    """Run new content ``ids`` ``[1, m]`` after the ``held`` tokens each layer's keys now hold (in text order) as a
    compress-mode prefill chunk: every layer compressed by its policy (``policies``: in place of the cache's, for
    this chunk) over the held tokens and the content, the content's queries observing. Returns the model's output."""
    cache, model, count = session.cache, session.model, ids.shape[1]
    held = cache.layers[0].keys.shape[-2]
    device = cache.layers[0].keys.device
    positions = session.state.seq_len[:, None].to(device) + torch.arange(count, device=device)
    plan = PrefillPlan(torch.ones(1, held + count, dtype=torch.bool, device=device),
                       torch.cat([torch.full((1, held), -1, device=device), positions], dim=1), compress,
                       chunk_mode="compress")
    kept_policies = cache.layer_policies
    if policies is not None:
        cache.layer_policies = policies
    cache.plan, cache.compressed_layers, cache.chunk_memory = plan, set(), {}
    try:
        with hooked(model):
            output = model(input_ids=ids, attention_mask=None, position_ids=positions, use_cache=True,
                           logits_to_keep=1, evalkit_cache=cache, **cache_kwargs(model, cache))
        session._check_every_layer_compressed()
    finally:
        cache.plan, cache.layer_policies, cache.chunk_memory = None, kept_policies, {}
    return output
