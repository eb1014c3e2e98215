"""One context, many calls: a context prefilled, and compressed where the policy says, once; then the queries asked
over it, each prefilled on top of the compressed context as the rest of a prompt is under ``compress_prefix``.

- ``multi_request``: every query continues its own copy of the context's session (:meth:`CompressionSession.fork`),
  so each sees exactly the cache it would see alone: the answers are those of :func:`generate` with
  ``compress_prefix=len(context)`` on the context followed by the query, greedy.
- ``multi_turn``: the queries are asked in order in one session, as a chat: each turn appends its query and then
  the model's own answer (``history="own"``), or, as SCBench's default, the gold answer (``history="gold"``: the
  model answers on a copy, and the gold answer is what the conversation keeps).

The rule every method follows: the context is compressed once, at its end, without the queries (query-agnostic); the
queries and answers are appended like generated tokens, so a method that evicts while decoding (SnapStream's ring,
StreamingLLM, H2O) keeps its one static size across turns, and one that only compresses the prompt keeps every
later token.

    out = ec.generate_shared(model, context_ids, [q1_ids, q2_ids], ec.SnapKV(capacity=1024), mode="multi_request")
    out.answers[0], out.stats[0]["prefill_tokens_computed"], out.stats[0]["prefill_tokens_shared"]
"""

from __future__ import annotations

import dataclasses
import time

import torch

from .engine.accounting import held_bytes
from .generate import _chooser, decode, eos_and_pad, prefill
from .methods.base import Policy
from .stopping import stop_criteria

MODES = ("multi_request", "multi_turn")
HISTORIES = ("own", "gold")


@dataclasses.dataclass
class SharedContextOutput:
    """Per query: the answer's token ids and what its call cost. ``stats[i]``: ``prefill_tokens_computed`` (the
    tokens this call ran through the model before its first answer token: the context's for the first call, then
    only the query's and, in a chat, what the last turn left to feed), ``prefill_tokens_shared`` (the positions the
    session already held, served instead of recomputed), ``ttft_seconds`` (also ``time_to_first_token_s`` and
    ``prefill_seconds``), ``decode_seconds``, ``prompt_tokens`` (every position the call's prompt spans, shared or
    not), ``generated_tokens``, ``hit_limit``, what the cache realized (``kept_prompt_tokens`` per layer and head,
    ``peak_cache_tokens``: the most the call's cache held, mean over layers and heads, ``tokens_seen``,
    ``realized_ratio``) and its bytes (:func:`~evalkit.compression.engine.accounting.held_bytes`)."""

    answers: list[torch.Tensor]
    stats: list[dict]


def _check(context_ids: torch.Tensor, queries: list, mode: str, history: str, gold_answers) -> None:
    if context_ids.dim() != 2 or context_ids.shape[0] != 1:
        raise ValueError(f"context_ids must be one context, [1, tokens]; got shape {tuple(context_ids.shape)}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
    if history not in HISTORIES:
        raise ValueError(f"history must be one of {list(HISTORIES)}, got {history!r}")
    if not queries or any(query.dim() != 1 or len(query) == 0 for query in queries):
        raise ValueError("queries must be a non-empty list of non-empty 1-d token id tensors")
    if history == "gold" and (mode != "multi_turn" or gold_answers is None or len(gold_answers) != len(queries)):
        raise ValueError("history='gold' is a multi_turn option and needs one gold answer per query")


@torch.no_grad()
def generate_shared(model, context_ids: torch.Tensor, queries: list[torch.Tensor], policy: Policy,
                    mode: str = "multi_request", history: str = "own", gold_answers: list[torch.Tensor] | None = None,
                    max_new_tokens: int | list[int] = 64, eos_token_id: int | list[int] | None = None, tokenizer=None,
                    pad_token_id: int | None = None, stop_strings: list[str] | None = None,
                    compress_first_query: bool = False,
                    context_positions: torch.Tensor | None = None) -> SharedContextOutput:
    """Greedy answers to ``queries`` (token ids, each ``[tokens]``) over one ``context_ids`` ``[1, tokens]``: the
    context prefilled and compressed once (see the module's docstring for the modes and the rule).
    ``max_new_tokens``: one for all, or one per query. ``stop_strings`` end an answer as in :func:`generate` (a
    tokenizer is needed). ``compress_first_query`` (``multi_turn`` only): compress the context together with the
    first query, as a chat's first prompt is (the rule SCBench's multi-turn runs follow); later turns are appended.
    ``context_positions`` ``[tokens]``: the context's positions when they are not 0..n-1 (the tokens a speculative
    prefill's draft kept, at their original positions); what follows continues from the largest + 1."""
    _check(context_ids, queries, mode, history, gold_answers)
    if compress_first_query and mode != "multi_turn":
        raise ValueError("compress_first_query is a multi_turn option: multi_request compresses the context alone")
    if tokenizer is not None:
        policy.bind_tokenizer(tokenizer)
    eos, pad_token_id = eos_and_pad(model, tokenizer, eos_token_id, pad_token_id)
    limits = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(queries)
    choose = _chooser(False, None, None, None, context_ids.device)
    device, stops = context_ids.device, set(eos.tolist()) if eos is not None else set()
    first, session, logits, context_seconds = prefill_first(model, policy, context_ids,
                                                            queries[0] if compress_first_query else None,
                                                            context_positions)
    answers, stats, pending = [], [], torch.empty(0, dtype=torch.long, device=device)
    for turn, query in enumerate(queries):
        query = query.to(device)
        if len(pending) and int(pending[-1]) in stops and int(query[0]) == int(pending[-1]):
            query = query[1:]  # the template writes the end of turn the model's answer ended with: fed once
        fed = torch.cat([pending, query])[None]
        shared = 0 if turn == 0 else int(session.state.seq_len.max())  # the tokens the session holds for this call
        call = session.fork() if mode == "multi_request" else session
        started = time.perf_counter()
        if not (turn == 0 and compress_first_query):
            logits = call.step(fed)[:, -1]
        ttft = time.perf_counter() - started + (context_seconds if turn == 0 else 0.0)
        computed = fed.shape[1] if turn else first.shape[1] + (0 if compress_first_query else fed.shape[1])
        if history == "gold":  # the model answers on a copy; the conversation keeps the gold answer instead
            call = session.fork()
        stop = stop_criteria(tokenizer, stop_strings, fed.shape[1]) if stop_strings else None
        started = time.perf_counter()
        sequences, generated, _ = decode(call, logits, fed, limits[turn], choose, eos, stop, pad_token_id)
        answers.append(sequences[0, fed.shape[1]: fed.shape[1] + int(generated[0])])
        stats.append(_call_stats(call, turn, shared + computed, computed, shared, ttft, time.perf_counter() - started,
                                 int(generated[0]), limits[turn]))
        # Fed with the next query: the answer's last token (decoding fed the others), or the whole gold answer.
        if mode == "multi_turn":
            pending = gold_answers[turn].to(device) if history == "gold" else answers[-1][-1:]
    return SharedContextOutput(answers=answers, stats=stats)


def prefill_first(model, policy: Policy, context_ids: torch.Tensor, first_query: torch.Tensor | None,
                  context_positions: torch.Tensor | None) -> tuple:
    """A session's first prefill: the context, followed by ``first_query`` where it is compressed with it, at the
    context's positions where a draft chose them (what follows from the largest + 1). The ids prefilled, the
    session, the last logits and the seconds it took."""
    first = context_ids if first_query is None else torch.cat([context_ids, first_query.to(context_ids.device)[None]], 1)
    positions = None
    if context_positions is not None:
        after = context_positions.max() + 1 + torch.arange(first.shape[1] - context_ids.shape[1])
        positions = torch.cat([context_positions.cpu(), after])[None].to(context_ids.device)
    return first, *prefill(model, policy, first, position_ids=positions)


@torch.no_grad()
def prefill_context(model, policy: Policy, context_ids: torch.Tensor, position_ids: torch.Tensor | None = None):
    """``context_ids`` ``[1, tokens]`` (at ``position_ids`` ``[1, tokens]``, where not 0..n-1) prefilled and compressed
    once: the session the engine's requests over it continue (``Request(prefix=session)``, each on its own copy), and
    the seconds it took."""
    session, _, seconds = prefill(model, policy, context_ids, position_ids=position_ids)
    return session, seconds


def _call_stats(call, turn: int, prompt: int, computed: int, shared: int, ttft: float, decode_seconds: float,
                generated: int, limit: int) -> dict:
    """One call's statistics (:class:`SharedContextOutput`), read off its session's cache."""
    realized = call.realized(0)
    seen = prompt + max(generated - 1, 0)
    peak = realized["peak_cache_tokens"]
    held = held_bytes(call.cache.layers, 0, int(call.state.peak[0]), seen, max(generated - 1, 0),
                      call.cache.layers[0].values.shape[-2])
    return {"turn": turn, "prefill_tokens_computed": computed, "prefill_tokens_shared": shared, "ttft_seconds": ttft,
            "time_to_first_token_s": ttft, "prefill_seconds": ttft, "decode_seconds": decode_seconds,
            "prompt_tokens": prompt, "generated_tokens": generated, "hit_limit": generated >= limit,
            **realized, "tokens_seen": seen, "realized_ratio": seen / peak if peak else None, **held}
