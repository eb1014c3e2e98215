"""H2O's cache taking in an agent loop's new content (:mod:`.recompress`): a per-head layout whose every token carries
the attention it has received, summed over every query so far, at one static capacity.

The new content runs over the held tokens as a compress-mode chunk (the heads hold as many tokens each: H2O's do),
and its queries' attention is added to the running sums, H2O's own accumulation (the held tokens' sums as a prior
over which the content's queries' attention sums, :attr:`PrefillView.prior_sums`). Then per KV head:

- ``each_call``: H2O's prefill rule over the held tokens and the content as one prompt: the last ``recent`` tokens
  and the heaviest others, ``capacity - 1`` in all;
- ``new_content``: the content alone cut to its share (its last ``recent`` tokens and its heaviest others), then
  written into the cache under H2O's decode rule: while a head holds more than ``capacity - 1`` tokens, the
  lightest outside the ``recent`` most recent goes (all at once: no query comes in between). The tokens that stay
  are as they were, bit for bit.

The running sums are kept with the tokens, for the decode steps that follow.
"""

from __future__ import annotations

import dataclasses

import torch

from .cache import RowState
from .held_cache import in_text_order, run_content
from .methods.base import UNBOUNDED, Policy, best_in_order
from .session import CompressionSession


def accumulates_attention(policy: Policy) -> bool:
    """Whether ``policy`` ranks by attention summed over every query so far and evicts at a fixed capacity (H2O)."""
    return (policy.per_head and policy.accumulates and policy.sums_attention and policy.evicts_while_decoding
            and not policy.allocates and policy.cache_capacity() is not None)


class _Accumulated(Policy, register=False):
    """``policy``'s selection over held tokens (their running sums ``held[layer]``) and a chunk of new content."""

    per_head = True

    def __init__(self, policy: Policy, rule: str, share: int | None, held: dict[int, torch.Tensor]):
        self.policy, self.rule, self.share, self.held = policy, rule, share, held
        self.picked: dict[int, torch.Tensor] = {}

    def prefill_queries(self) -> int:
        return 0  # the chunk's queries: their attention sums

    def select(self, view, kv_heads: int):
        sums = self.held[view.layer_idx]
        prior = sums[:, :, None].expand(-1, -1, view.groups, -1)
        view = dataclasses.replace(view, prior_sums=prior)
        if self.rule == "each_call":
            indices, counts, raw = self.policy.select(view, kv_heads)
        else:
            raw = self.policy.score(view).float()
            indices, counts = self._share_then_evict(raw, sums.shape[-1])
        self.picked[view.layer_idx] = indices
        return indices, counts, raw

    def _share_then_evict(self, raw: torch.Tensor, held: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The content's share (its last ``recent`` and its heaviest others), then the lightest outside the last
        ``recent`` tokens evicted down to ``capacity - 1``."""
        batch, heads, n = raw.shape
        recent, position = self.policy.kept_window(), torch.arange(n, device=raw.device)
        content = raw[..., held:].masked_fill(position[held:] >= n - recent, float("inf"))
        share = min(self.share, n - held)
        picks = best_in_order(content, torch.full((batch, heads), share, device=raw.device)) + held
        candidate = torch.zeros_like(raw, dtype=torch.bool)
        candidate[..., :held] = True
        candidate.scatter_(-1, picks, True)
        keep = min(self.policy.prompt_capacity(), held + share)
        ranked = raw.masked_fill(position >= n - recent, float("inf")).masked_fill(~candidate, float("-inf"))
        counts = torch.full((batch, heads), keep, device=raw.device)
        return best_in_order(ranked, counts), counts


@torch.no_grad()
def take_in_accumulated(session: CompressionSession, ids: torch.Tensor, rule: str, share: int | None) -> torch.Tensor:
    """The new content ``ids`` ``[1, m]`` taken into an H2O session under ``rule`` (the module's docstring); the
    logits after its last token ``[1, vocab]``."""
    cache, count = session.cache, ids.shape[1]
    held_sums, held_positions, before = {}, {}, []
    for index, layer in enumerate(cache.layers):
        heads = layer.heads
        keys, values, positions, sums = in_text_order(
            [layer.keys[:1], layer.values[:1], heads.positions[:1], heads.scores[:1]], heads.valid[:1],
            heads.positions[:1])
        layer.keys, layer.values = keys, values
        held_sums[index], held_positions[index] = sums, positions
        before.append((heads.peak, heads.kept_prompt))
    held = cache.layers[0].keys.shape[-2]
    selection = _Accumulated(session.policy, rule, share, held_sums)
    output = run_content(session, ids, True, [selection] * len(cache.layers))
    new = session.state.seq_len[:, None, None].to(ids.device) + torch.arange(count, device=ids.device)
    for index, layer in enumerate(cache.layers):
        heads, (peak, kept_prompt) = layer.heads, before[index]
        every = torch.cat([held_positions[index], new.expand(1, heads.valid.shape[1], -1)], dim=-1)
        heads.positions = every.gather(2, selection.picked[index]).masked_fill(~heads.valid, -1)
        heads.peak = torch.maximum(peak, torch.tensor(held + count, device=peak.device))
        if rule == "new_content":
            heads.kept_prompt = kept_prompt
    _settle_heads(session, held + count, count, rule)
    return output.logits[:, -1].float()


def _settle_heads(session: CompressionSession, before: int, count: int, rule: str) -> None:
    """The row's bookkeeping once a per-head cache took in new content: every head layer's slots padded to the
    capacity (a free slot for the next token), ``count`` more positions seen, the peak raised to ``before``."""
    cache, state = session.cache, session.state
    slots = cache.finish_head_prefill()
    kept = torch.tensor([max(int(layer.heads.valid[0].sum(dim=-1).max()) for layer in cache.layers)])
    device = state.valid.device
    cache.state = RowState(valid=torch.arange(slots, device=device)[None, :] < kept.to(device)[:, None],
                           slot_pos=torch.full((1, slots), -1, dtype=torch.long, device=device),
                           seq_len=state.seq_len + count, written=kept.clone(), fixed=kept.clone(),
                           ring=torch.full_like(kept, UNBOUNDED),
                           kept_prompt=kept.clone() if rule == "each_call" else state.kept_prompt.clone(),
                           peak=torch.maximum(state.peak, torch.tensor([before])))
    cache.prefill_slots = [layer.keys.shape[-2] for layer in cache.layers]
