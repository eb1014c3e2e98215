"""What a compressed cache does with an agent loop's call's NEW CONTENT (a tool output, a retrieved file; the loop:
:mod:`.agent_calls`), the rule ``recompress`` (the run's ``session.recompress``):

- ``never`` (append): the new content and the question are appended like generated tokens, as every later turn of
  :func:`~evalkit.compression.shared_context.generate_shared`'s ``multi_turn`` is (the same answers, token for token);
  a method that evicts while decoding keeps its size, any other one keeps every new token.
- ``each_call`` (recompress the whole cache): before the call's question, the held cache and the new content are
  compressed again to the budget as one prompt of their own, the method's own selection over all of it with the new
  content's last queries as its observation (SnapKV's window): what ``prefill_chunk_mode=compress`` does with a
  chunk, the new content being the chunk. After the compression the cache holds the method's prompt capacity again.
- ``new_content`` (compress the new content at the context's ratio): the new content alone is compressed, as a
  prompt of its own (its keys computed over the held cache, its last queries scoring its own keys), to its share of
  the budget: the fraction of the context that the budget kept, ``ceil(new * prompt_capacity / context)``, at least
  a size the method takes with its sink + window and at most the new content; the held tokens stay as they are, bit
  for bit. The cache grows by each call's share, at the budget's ratio; a cache of one static size (SnapStream's and
  StreamingLLM's ring) writes the share through its ring instead, the oldest ring tokens going.

Per-head layouts (:mod:`.recompress_heads`: H2O's accumulated attention; :mod:`.recompress_passes`: KVzip's
reconstruction passes) and the full cache (every rule appends: nothing to compress) follow the same rules; the
definitions are docs/methods.md's "Agent loop".

The budget is the one policy's for every call. Each call's statistics are :func:`generate_shared`'s, plus
``recompress`` (the rule), ``new_content_tokens``, ``cache_tokens_compressed`` (the tokens held per layer and KV head
right after the call's compression) and ``cache_tokens_after`` (held once the call's answer is done).
``kept_prompt_tokens`` is what the last compression kept (``each_call``) or the context's (``new_content``, whose
shares count as appended tokens, as ``never``'s whole new contents do).

Re-scoring a held cache needs one budget for every layer and head, tokens held as computed: a method with another
per-head layout or its own layer budgets, one that rewrites or quantizes what it keeps, scores from hidden states or
by passes other than KVzip's, or keeps state per request is refused in one line (:func:`recompress_refusal`), and
so, under ``each_call``, is one that reads every prompt query (the held tokens' are gone).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .cache import RowState
from .held_cache import cache_tokens, held_tokens, run_content
from .methods.base import UNBOUNDED, Policy
from .recompress_heads import accumulates_attention, take_in_accumulated
from .recompress_passes import keeps_fed_ids, reconstructs, take_in_by_passes
from .session import CompressionSession

RECOMPRESS = ("never", "each_call", "new_content")
__all__ = ["RECOMPRESS", "cache_tokens", "held_tokens", "keeps_fed_ids", "recompress_refusal", "share_of", "take_in"]


def recompress_refusal(policy: Policy, rule: str) -> str | None:
    """Why ``policy``'s cache cannot take new content under ``rule`` (None: it can), in one line."""
    if rule not in RECOMPRESS:
        return f"session.recompress must be one of {', '.join(RECOMPRESS)}, got {rule!r}"
    if rule == "never":
        return None
    own_rule = accumulates_attention(policy) or reconstructs(policy)
    reasons = [
        (policy.extra_passes and not own_rule, "scores the prompt with passes of its own other than KVzip's"),
        (policy.per_head and not own_rule, "holds its tokens per KV head by a rule of its own (a per-head layout "
                                           "other than H2O's accumulated attention or KVzip's passes)"),
        (policy.reads_every_query and rule == "each_call", "reads every prompt query, and the held tokens' are gone"),
        (policy.rewrites, "rewrites the tokens it keeps"),
        (policy.reads_hidden_states, "scores from hidden states the cache does not hold"),
        (policy.selects_while_decoding or policy.keeps_slot_state, "keeps every token and reads part of them"),
        (policy.kv_format is not None, "holds its tokens quantized (kv_bits)"),
        (type(policy).layer_budget is not Policy.layer_budget, "sizes each layer's budget itself"),
        (rule == "new_content" and policy.prompt_capacity() is not None and _size_field(policy) is None,
         "is not sized by a capacity that a share of the budget could set"),
    ]
    reason = next((why for refused, why in reasons if refused), None)
    if reason is None:
        return None
    return (f"session.recompress={rule} cannot re-score the cache {policy.name} holds: it {reason}; use "
            "session.recompress=never")


class _NewContentShare(Policy, register=False):
    """The method's selection over the last ``new`` tokens of a prompt alone (a call's new content, sized to its
    share: ``sized``; None: all of it); the held tokens before them all kept, in order. ``ring``: a static cache's
    ``(fixed, ring)`` slots, through whose ring the share is written (the oldest ring tokens go)."""

    def __init__(self, sized: Policy | None, new: int, ring: tuple[int, int] | None = None):
        self.sized, self.new, self.ring = sized, new, ring

    def prefill_queries(self) -> int | None:
        return 0 if self.sized is None else self.sized.prefill_queries()

    def select(self, view, kv_heads: int):
        held = view.keys.shape[2] - self.new
        device = view.keys.device
        if self.sized is None:
            indices = torch.arange(self.new, device=device).expand(1, kv_heads, self.new)
            raw = torch.zeros(1, kv_heads, self.new, device=device)
        else:
            alone = dataclasses.replace(view, keys=view.keys[:, :, held:], values=view.values[:, :, held:],
                                        key_valid=view.key_valid[:, held:], positions=view.positions[:, held:],
                                        prior_sums=None, hidden=None)
            indices, counts, raw = self.sized.select(alone, kv_heads)
            if bool((counts != counts.flatten()[0]).any()):
                raise RuntimeError(f"{self.sized.name} kept different counts per head of a row-layout cache")
        kept = torch.arange(held, device=device)
        if self.ring is not None:  # the share through the ring: its last `ring` tokens, then the newest held ones
            fixed, ring = self.ring
            share = indices.shape[-1]
            written = min(share, ring)
            stays = min(held - fixed, ring - written)
            kept = torch.cat([kept[:fixed], kept[held - stays:]])
            indices = indices[..., share - written:]
        kept = kept.expand(indices.shape[0], kv_heads, -1)
        count = torch.full((indices.shape[0], kv_heads), kept.shape[-1] + indices.shape[-1], device=device)
        return torch.cat([kept, indices + held], dim=-1), count, torch.nn.functional.pad(raw, (held, 0))


def share_of(policy: Policy, new: int, context: int) -> int:
    """The tokens ``new_content`` keeps of ``new`` new tokens: the fraction of the ``context`` tokens the budget kept,
    at least the smallest size the method takes with its sink + window, at most all of them."""
    capacity = policy.prompt_capacity()
    if capacity is None:
        return new
    share = min(new, math.ceil(new * min(capacity, context) / context))
    while share < new and not _takes(policy, share):
        share += 1
    return share


def _takes(policy: Policy, share: int) -> bool:
    sized = sized_to(policy, share)
    return sized is not None and share >= sized.kept_sink() + sized.kept_window()


def _size_field(policy: Policy) -> str | None:
    """The setting that sizes ``policy``'s prompt: its capacity, or StreamingLLM's window (None: neither)."""
    fields = {field.name for field in dataclasses.fields(policy)}
    return next((name for name in ("capacity", "window") if name in fields and name in policy.budget_fields), None)


def sized_to(policy: Policy, share: int) -> Policy | None:
    """``policy`` keeping ``share`` prompt tokens (its capacity, or window, moved by as much as its prompt capacity),
    or None where the method takes no such size."""
    field = _size_field(policy)
    try:
        sized = dataclasses.replace(policy, **{field: getattr(policy, field) - policy.prompt_capacity() + share})
    except (ValueError, TypeError):
        return None
    for name, value in vars(policy).items():  # what was bound at run time, as Policy.for_prompt keeps it
        if name not in vars(sized):
            setattr(sized, name, value)
    return sized


def _check_session(session: CompressionSession, ids: torch.Tensor, rule: str) -> None:
    refusal = recompress_refusal(session.policy, rule) if rule != "never" else "session.recompress=never appends"
    if refusal:
        raise ValueError(refusal)
    if session.state is None or len(session.state.seq_len) != 1:
        raise ValueError("take_in continues a prefilled session of one row")
    if any(policy is not session.policy for policy in session.cache.layer_policies):
        raise ValueError(f"session.recompress={rule} cannot keep a hybrid model's sliding-window layers apart")
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        raise ValueError(f"take_in takes new content ids of shape [1, tokens], got {list(ids.shape)}")


@torch.no_grad()
def take_in(session: CompressionSession, ids: torch.Tensor, rule: str, share: int | None = None) -> torch.Tensor:
    """Run a call's new content ``ids`` ``[1, m]`` after what ``session`` holds and compress under ``rule``
    (``each_call``: the held tokens and the new content to the budget; ``new_content``: the new content alone to
    ``share`` tokens). Returns the logits after its last token ``[1, vocab]``."""
    _check_session(session, ids, rule)
    policy = session.policy
    sized = None  # new_content: the method at the content's share, where that is less than all of it
    if rule == "new_content" and share < ids.shape[1]:
        sized = sized_to(policy, share)
        if sized is None:
            raise ValueError(f"session.recompress=new_content: {policy.name} takes no share of {share} tokens "
                             "(ec.share_of gives one it takes)")
    if reconstructs(policy):
        return take_in_by_passes(session, ids, rule, sized)
    if policy.per_head:
        return take_in_accumulated(session, ids, rule, share)
    return _take_in_rows(session, ids, rule, sized)


def _take_in_rows(session: CompressionSession, ids: torch.Tensor, rule: str, sized: Policy | None) -> torch.Tensor:
    cache, count, state = session.cache, ids.shape[1], session.state
    for layer, (keys, values, positions) in zip(cache.layers, held_tokens(session)):
        layer.keys, layer.values, layer.prompt_positions = keys, values, positions
    held = cache.layers[0].keys.shape[-2]
    keep = session.policy.prompt_capacity()
    ring = (int(state.fixed[0]), int(state.ring[0])) if int(state.ring[0]) < UNBOUNDED else None
    policies = None
    if rule == "each_call":
        compress = keep is not None and held + count > keep
    else:
        compress = sized is not None or (ring is not None and held - ring[0] + count > ring[1])
        if compress:
            policies = [_NewContentShare(sized, count, ring)] * len(cache.layers)
    output = run_content(session, ids, compress, policies)
    _settle(session, held + count, count, rule)
    return output.logits[:, -1].float()


def _settle(session: CompressionSession, before: int, count: int, rule: str) -> None:
    """The row's bookkeeping once new content is taken in: its kept tokens as a prompt's (text order, the next slot
    after them; under ``new_content`` the held layout's fixed slots and ring stay), ``count`` more positions seen,
    the peak raised to the ``before`` tokens held before selection."""
    cache, state = session.cache, session.state
    kept = {layer.keys.shape[-2] for layer in cache.layers}
    if len(kept) != 1:
        raise RuntimeError(f"layers kept different counts after taking in new content: {sorted(kept)}")
    kept = torch.tensor([kept.pop()])
    fixed, ring = session.policy.decode_layout(kept) if rule == "each_call" else (state.fixed, state.ring)
    device = state.valid.device
    cache.state = RowState(valid=torch.ones(1, int(kept), dtype=torch.bool, device=device),
                           slot_pos=torch.full((1, int(kept)), -1, dtype=torch.long, device=device),
                           seq_len=state.seq_len + count, written=kept.clone(), fixed=fixed.clone(), ring=ring.clone(),
                           kept_prompt=kept.clone() if rule == "each_call" else state.kept_prompt.clone(),
                           peak=torch.maximum(state.peak, torch.tensor([before])))
    cache.prefill_slots = [layer.keys.shape[-2] for layer in cache.layers]
