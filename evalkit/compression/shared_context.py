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

from .generate import _chooser, decode, eos_and_pad, prefill
from .methods.base import Policy

MODES = ("multi_request", "multi_turn")
HISTORIES = ("own", "gold")


@dataclasses.dataclass
class SharedContextOutput:
    """Per query: the answer's token ids and what its call cost. ``stats[i]``: ``prefill_tokens_computed`` (the
    tokens this call ran through the model before its first answer token: the context's for the first call, then
    only the query's and, in a chat, what the last turn left to feed), ``prefill_tokens_shared`` (the positions the
    session already held, served instead of recomputed), ``ttft_seconds``, ``generated_tokens`` and
    ``peak_cache_tokens`` (the most the call's cache held, mean over layers and heads)."""

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
                    max_new_tokens: int = 64, eos_token_id: int | list[int] | None = None, tokenizer=None,
                    pad_token_id: int | None = None) -> SharedContextOutput:
    """Greedy answers to ``queries`` (token ids, each ``[tokens]``) over one ``context_ids`` ``[1, tokens]``: the
    context prefilled and compressed once (see the module's docstring for the modes and the rule)."""
    _check(context_ids, queries, mode, history, gold_answers)
    if tokenizer is not None:
        policy.bind_tokenizer(tokenizer)
    eos, pad_token_id = eos_and_pad(model, tokenizer, eos_token_id, pad_token_id)
    choose = _chooser(False, None, None, None, context_ids.device)
    session, _, context_seconds = prefill(model, policy, context_ids)
    answers, stats, pending = [], [], torch.empty(0, dtype=torch.long, device=context_ids.device)
    for turn, query in enumerate(queries):
        fed = torch.cat([pending, query.to(context_ids.device)])[None]
        shared = 0 if turn == 0 else int(session.state.seq_len.max())  # the tokens the session holds for this call
        call = session.fork() if mode == "multi_request" else session
        started = time.perf_counter()
        logits = call.step(fed)[:, -1]
        ttft = time.perf_counter() - started + (context_seconds if turn == 0 else 0.0)
        if history == "gold":  # the model answers on a copy; the conversation keeps the gold answer instead
            call = session.fork()
        sequences, generated, _ = decode(call, logits, fed, max_new_tokens, choose, eos, None, pad_token_id)
        answers.append(sequences[0, fed.shape[1]: fed.shape[1] + int(generated[0])])
        stats.append({"turn": turn, "prefill_tokens_computed": fed.shape[1] + (context_ids.shape[1] if turn == 0 else 0),
                      "prefill_tokens_shared": shared, "ttft_seconds": ttft, "generated_tokens": int(generated[0]),
                      "peak_cache_tokens": call.realized(0)["peak_cache_tokens"]})
        # Fed with the next query: the answer's last token (decoding fed the others), or the whole gold answer.
        if mode == "multi_turn":
            pending = gold_answers[turn].to(context_ids.device) if history == "gold" else answers[-1][-1:]
    return SharedContextOutput(answers=answers, stats=stats)
