"""KVzip's cache taking in an agent loop's new content (:mod:`.recompress`): every token scored by how much the model
attends to it when asked to repeat the text it belongs to (:mod:`.reconstruction`, ``methods/kvzip.py``), the budget
the whole model's (``capacity`` tokens per layer and KV head on average, spread over them by score).

The new content is appended as ``never`` appends it (each head's tokens masked by its own validity). Then KVzip's
reconstruction passes run over the cache as it holds the text (each layer and head its own tokens, as decode steps
see them), and a pass's queries score the text's span, KVzip's own attention (softmax over the text's first ``sink``
tokens, the span and the pass itself, the most any query of the KV group gives each token):

- ``each_call``: the text is what the cache holds (every position any layer or head holds, in text order, their ids
  as the session was fed them: :func:`keeps_fed_ids`) followed by the new content, its first ``sink`` tokens
  forced; every layer and head together keep the budget;
- ``new_content``: the text is the new content alone (its own first ``sink`` tokens forced); its tokens keep their
  share of the budget (``capacity`` = the share), the held tokens stay as they were, bit for bit.
"""

from __future__ import annotations

import torch

from .kernels import attention_probabilities
from .layout import HeadLayout
from .methods.base import Policy
from .model_spec import attention_modules
from .session import CompressionSession


def reconstructs(policy: Policy) -> bool:
    """Whether ``policy`` scores by KVzip's reconstruction passes alone (not KVzip+'s norms, KVgrad's gradients or
    RestoreKV's tokens of its own)."""
    return (policy.extra_passes and policy.per_head and callable(getattr(policy, "pass_weights", None))
            and isinstance(getattr(policy, "sink", None), int) and not getattr(policy, "normalized", False)
            and not getattr(policy, "appends", False) and not hasattr(policy, "run_pass"))


def keeps_fed_ids(session: CompressionSession, first_ids: torch.Tensor,
                  context_positions: torch.Tensor | None = None) -> CompressionSession:
    """``session`` (prefilled with ``first_ids`` ``[1, n]``, its context at ``context_positions`` where a draft chose
    them) keeping from now on every id it is fed with its text position: what ``each_call`` reconstructs of the held
    tokens under KVzip. Its forks keep their own."""
    count = first_ids.shape[1]
    positions = torch.arange(count)
    if context_positions is not None:
        context = context_positions.cpu()
        positions = torch.cat([context, context.max() + 1 + torch.arange(count - len(context))])
    session.fed_ids = [(first_ids[0].cpu(), positions)]  # step adds each later feed; a fork copies its own
    return session


def _ids_at(session: CompressionSession, positions: torch.Tensor) -> torch.Tensor:
    fed = session.fed_ids
    if fed is None:
        raise ValueError(f"session.recompress=each_call reconstructs the tokens {session.policy.name} holds, and this "
                         "session kept no ids of what it was fed (ec.keeps_fed_ids after its prefill)")
    table = torch.full((int(session.state.seq_len[0]),), -1, dtype=torch.long)
    for ids, at in fed:
        table[at] = ids
    ids = table[positions]
    if bool((ids < 0).any()):
        raise ValueError("the session's cache holds tokens it kept no ids of")
    return ids


class _PassQueries(Policy, register=False):
    """A per-head layout that keeps the last ``count`` queries of a step (a reconstruction pass's)."""

    per_head = True

    def __init__(self, count: int):
        self.count = count

    def query_window(self) -> int:
        return self.count


@torch.no_grad()
def take_in_by_passes(session: CompressionSession, ids: torch.Tensor, rule: str, sized: Policy | None) -> torch.Tensor:
    """The new content ``ids`` ``[1, m]`` taken into a KVzip session under ``rule`` (``sized``: the method at the
    content's share under ``new_content``, None where the share is all of it); the logits after its last token."""
    cache, count = session.cache, ids.shape[1]
    start = int(session.state.seq_len[0])
    held = torch.unique(torch.cat([layer.heads.positions[0][layer.heads.valid[0]].cpu() for layer in cache.layers]))
    logits = session.step(ids)[:, -1]
    if rule == "new_content" and sized is None:
        return logits  # the share is the whole content: nothing to cut
    new = torch.arange(start, start + count)
    if rule == "each_call":
        text, text_ids, policy = torch.cat([held, new]), torch.cat([_ids_at(session, held), ids[0].cpu()]), session.policy
    else:
        text, text_ids, policy = new, ids[0].cpu(), sized
    scores = _pass_scores(session, policy, text, text_ids)
    for layer, score, keep in zip(cache.layers, scores, _allocate(policy, scores, len(text))):
        layer.heads.free((score > float("-inf")) & ~keep)
        if rule == "each_call":
            layer.heads.kept_prompt = layer.heads.valid.sum(dim=-1)
    return logits


def _pass_scores(session: CompressionSession, policy, text: torch.Tensor, text_ids: torch.Tensor) -> list:
    """Every layer's scores of the slots holding ``text`` (positions ``[t]``, ids ``[t]``) ``[1, Hkv, S]`` fp32,
    ``+inf`` on the text's first ``sink`` tokens, ``-inf`` on slots outside it, from the policy's passes."""
    layers = session.cache.layers
    device = layers[0].keys.device
    text = text.to(device)
    scores = []
    for layer in layers:
        in_text = layer.heads.valid[:1] & torch.isin(layer.heads.positions[:1], text)
        scores.append(torch.full(in_text.shape, float("-inf"), device=device).masked_fill(in_text, 0.0))
    modules, query_heads = attention_modules(session.model), session.model.config.num_attention_heads
    for begin, end, pass_ids in policy.passes(text_ids):
        fork = session.fork()
        first_pass = int(fork.state.seq_len[0])
        for layer in fork.cache.layers:
            layer.layout = HeadLayout(_PassQueries(len(pass_ids)), fork.cache.rotary)
            layer.heads.queries = layer.keys.new_empty(1, query_heads, 0, layer.keys.shape[-1])
        fork.step(pass_ids.to(device)[None])
        span, sink = text[begin:end], text[: min(policy.sink, begin)]
        for index, (layer, score) in enumerate(zip(fork.cache.layers, scores)):
            weights = _span_weights(layer, modules[index].scaling, span, sink, first_pass)
            slots = score.shape[-1]
            spanned = torch.isin(layer.heads.positions[:1, :, :slots], span) & layer.heads.valid[:1, :, :slots]
            score.copy_(torch.where(spanned, weights[..., :slots], score))
    for layer, score in zip(layers, scores):  # the text's first sink tokens: kept
        score.masked_fill_(torch.isin(layer.heads.positions[:1], text[: policy.sink]) & (score > float("-inf")),
                           float("inf"))
    return scores


def _span_weights(layer, scaling: float, span: torch.Tensor, sink: torch.Tensor, first_pass: int) -> torch.Tensor:
    """``[1, Hkv, S]``: the most attention a pass query (of any query head of the group) gives each slot, its softmax
    over the slots holding the ``sink`` and ``span`` positions and the pass's own tokens up to it (KVzip's
    :meth:`pass_weights`, each head over its own slots)."""
    heads, queries = layer.heads, layer.heads.queries
    valid, positions = heads.valid[:1], heads.positions[:1]
    count = queries.shape[2]
    query_positions = first_pass + torch.arange(count, device=positions.device)
    text = valid & (torch.isin(positions, span) | torch.isin(positions, sink))
    own = valid & (positions >= first_pass)
    visible = text[:, :, None, :] | (own[:, :, None, :] & (positions[:, :, None, :] <= query_positions[:, None]))
    probabilities = attention_probabilities(queries, layer.keys[:1], visible, scaling)
    return probabilities.amax(dim=(2, 3))


def _allocate(policy, scores: list, length: int) -> list:
    """Which scored slots each layer and head keeps ``[1, Hkv, S]`` bool: KVzip's budget (``capacity`` per layer and
    head on average, over the whole model, or per layer where ``layerwise``) to the best scores."""
    heads = scores[0].shape[1]
    budget = min(length, policy.capacity) * heads
    groups = [[index] for index in range(len(scores))] if policy.layerwise else [list(range(len(scores)))]
    chosen = [None] * len(scores)
    for group in groups:
        flat = torch.cat([scores[index].flatten() for index in group])
        rank = flat.argsort(descending=True, stable=True).argsort()
        keep = (rank < budget * len(group)) & (flat > float("-inf"))
        for index, part in zip(group, keep.split([scores[index].numel() for index in group])):
            chosen[index] = part.view(scores[index].shape)
    return chosen
