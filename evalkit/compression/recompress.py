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
  the method's sink + window (and a size the method takes) and at most the new content; the held tokens stay as they are, bit for bit. The cache
  grows by each call's share, at the budget's ratio.

The budget is the one policy's for every call. Each call's statistics are :func:`generate_shared`'s, plus
``recompress`` (the rule), ``new_content_tokens``, ``cache_tokens_compressed`` (the tokens held per layer and KV head
right after the call's compression; None where none ran) and ``cache_tokens_after`` (held once the call's answer is
done). ``kept_prompt_tokens`` is what the last compression kept (``each_call``) or the context's (``new_content``,
whose shares count as appended tokens, as ``never``'s whole new contents do).

Re-scoring a held cache needs one budget for every layer and head, tokens held as computed, in a row layout: a method
with a per-head layout or its own layer budgets, one that rewrites or quantizes what it keeps, scores from hidden
states or by passes of its own, or keeps state per request is refused in one line (:func:`recompress_refusal`), and so,
under ``each_call``, is one that reads every prompt query (the held tokens' are gone); ``new_content`` also refuses a
method whose cache has one static size (a ring, or eviction while decoding): the shares would outgrow it.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .attention import hooked
from .cache import PrefillPlan, RowState
from .methods.base import Policy
from .model_spec import cache_kwargs
from .session import CompressionSession

RECOMPRESS = ("never", "each_call", "new_content")


def recompress_refusal(policy: Policy, rule: str) -> str | None:
    """Why ``policy``'s cache cannot take new content under ``rule`` (None: it can), in one line."""
    if rule not in RECOMPRESS:
        return f"session.recompress must be one of {', '.join(RECOMPRESS)}, got {rule!r}"
    if rule == "never":
        return None
    reasons = [
        (policy.per_head, "holds its tokens per KV head (a per-head layout), which one re-scored prompt does not keep"),
        (policy.reads_every_query and rule == "each_call", "reads every prompt query, and the held tokens' are gone"),
        (policy.rewrites, "rewrites the tokens it keeps"),
        (policy.extra_passes, "scores the prompt with passes of its own over the whole of it"),
        (policy.reads_hidden_states, "scores from hidden states the cache does not hold"),
        (policy.selects_while_decoding or policy.keeps_slot_state, "keeps every token and reads part of them"),
        (policy.kv_format is not None, "holds its tokens quantized (kv_bits)"),
        (type(policy).layer_budget is not Policy.layer_budget, "sizes each layer's budget itself"),
    ]
    reason = next((why for refused, why in reasons if refused), None)
    if reason is None and rule == "new_content" and policy.cache_capacity() is not None:
        return (f"session.recompress=new_content cannot keep new content beside what {policy.name} holds: its cache has "
                "one static size (a ring, or eviction while decoding); use session.recompress=each_call or never")
    if reason is None and rule == "new_content" and policy.prompt_capacity() is not None and \
            "capacity" not in {field.name for field in dataclasses.fields(policy)}:
        reason = "is not sized by a capacity that a share of the budget could set"
    if reason is None:
        return None
    return (f"session.recompress={rule} cannot re-score the cache {policy.name} holds: it {reason}; use "
            "session.recompress=never")


def cache_tokens(session: CompressionSession) -> float:
    """The tokens the session's cache holds now (row 0), mean over layers and KV heads, read off its validity."""
    counts = [float(layer.heads.valid[0].sum(dim=-1).float().mean()) if layer.layout.per_head
              else float(session.state.valid[0, : layer.get_seq_length()].sum()) for layer in session.cache.layers]
    return sum(counts) / len(counts)


def held_tokens(session: CompressionSession) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Every layer's held tokens in text order per KV head (row 0 of a row-layout cache): keys ``[1, Hkv, h, D]``,
    values and text positions ``[1, Hkv, h]``."""
    state, held = session.state, []
    for layer in session.cache.layers:
        slots = layer.get_seq_length()
        valid, later = state.valid[:1, :slots], state.slot_pos[:1, :slots]
        positions = later[:, None, :].expand(-1, layer.keys.shape[1], -1).clone()
        prompt = layer.prompt_positions[:1]
        written = prompt.shape[-1]
        positions[..., :written] = torch.where(later[:, None, :written] < 0, prompt, positions[..., :written])
        count = int(valid.sum())
        order = positions.masked_fill(~valid[:, None], torch.iinfo(torch.long).max).argsort(dim=-1, stable=True)
        order = order[..., :count]
        gather = order[..., None].expand(-1, -1, -1, layer.keys.shape[-1])
        held.append((layer.keys[:1].gather(2, gather), layer.values[:1].gather(2, gather),
                     positions.gather(2, order)))
    return held


class _NewContentShare(Policy, register=False):
    """The method's selection over the last ``new`` tokens of a prompt alone (a call's new content, sized to its
    share: ``sized``); the held tokens before them all kept, in order."""

    def __init__(self, sized: Policy, new: int):
        self.sized, self.new = sized, new

    def prefill_queries(self) -> int | None:
        return self.sized.prefill_queries()

    def select(self, view, kv_heads: int):
        held = view.keys.shape[2] - self.new
        alone = dataclasses.replace(view, keys=view.keys[:, :, held:], values=view.values[:, :, held:],
                                    key_valid=view.key_valid[:, held:], positions=view.positions[:, held:],
                                    prior_sums=None, hidden=None)
        indices, counts, raw = self.sized.select(alone, kv_heads)
        kept = torch.arange(held, device=indices.device).expand(indices.shape[0], kv_heads, held)
        return (torch.cat([kept, indices + held], dim=-1), counts + held,
                torch.nn.functional.pad(raw, (held, 0)))


def share_of(policy: Policy, new: int, context: int) -> int:
    """The tokens ``new_content`` keeps of ``new`` new tokens: the fraction of the ``context`` tokens the budget kept,
    at least the method's sink + window (and the smallest size the method takes), at most all of them."""
    capacity = policy.prompt_capacity()
    if capacity is None:
        return new
    share = min(new, max(math.ceil(new * min(capacity, context) / context), policy.kept_sink() + policy.kept_window()))
    while share < new and _sized(policy, share) is None:
        share += 1
    return share


def _sized(policy: Policy, share: int) -> Policy | None:
    """``policy`` keeping ``share`` prompt tokens (its capacity moved by as much as its prompt capacity), or None
    where the method takes no such size."""
    try:
        sized = dataclasses.replace(policy, capacity=policy.capacity - policy.prompt_capacity() + share)
    except ValueError:
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
    cache, model, count = session.cache, session.model, ids.shape[1]
    for layer, (keys, values, positions) in zip(cache.layers, held_tokens(session)):
        layer.keys, layer.values, layer.prompt_positions = keys, values, positions
    held = cache.layers[0].keys.shape[-2]
    device = cache.layers[0].keys.device
    positions = session.state.seq_len[:, None].to(device) + torch.arange(count, device=device)
    keep = session.policy.prompt_capacity()
    compress = keep is not None and held + count > keep if rule == "each_call" else share < count
    plan = PrefillPlan(torch.ones(1, held + count, dtype=torch.bool, device=device),
                       torch.cat([torch.full((1, held), -1, device=device), positions], dim=1), compress,
                       chunk_mode="compress")
    policies = cache.layer_policies
    if rule == "new_content" and compress:
        sized = _sized(session.policy, share)
        if sized is None:
            raise ValueError(f"session.recompress=new_content: {session.policy.name} takes no share of {share} tokens "
                             "(ec.share_of gives one it takes)")
        cache.layer_policies = [_NewContentShare(sized, count)] * len(policies)
    cache.plan, cache.compressed_layers, cache.chunk_memory = plan, set(), {}
    try:
        with hooked(model):
            output = model(input_ids=ids, attention_mask=None, position_ids=positions, use_cache=True,
                           logits_to_keep=1, evalkit_cache=cache, **cache_kwargs(model, cache))
        session._check_every_layer_compressed()
    finally:
        cache.plan, cache.layer_policies, cache.chunk_memory = None, policies, {}
    _settle(session, held + count, count, rule)
    return output.logits[:, -1].float()


def _settle(session: CompressionSession, before: int, count: int, rule: str) -> None:
    """The row's bookkeeping once new content is taken in: its kept tokens as a prompt's (text order, the next slot
    after them), ``count`` more positions seen, the peak raised to the ``before`` tokens held before selection."""
    cache, state = session.cache, session.state
    kept = {layer.keys.shape[-2] for layer in cache.layers}
    if len(kept) != 1:
        raise RuntimeError(f"layers kept different counts after taking in new content: {sorted(kept)}")
    kept = torch.tensor([kept.pop()])
    fixed, ring = session.policy.decode_layout(kept)
    device = state.valid.device
    cache.state = RowState(valid=torch.ones(1, int(kept), dtype=torch.bool, device=device),
                           slot_pos=torch.full((1, int(kept)), -1, dtype=torch.long, device=device),
                           seq_len=state.seq_len + count, written=kept.clone(), fixed=fixed, ring=ring,
                           kept_prompt=kept.clone() if rule == "each_call" else state.kept_prompt.clone(),
                           peak=torch.maximum(state.peak, torch.tensor([before])))
    cache.prefill_slots = [layer.keys.shape[-2] for layer in cache.layers]
