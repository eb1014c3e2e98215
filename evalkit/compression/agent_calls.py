"""The agent loop: one session's calls, each bringing NEW CONTENT (a tool output, a retrieved file) and then its
question, over one cache compressed under a policy, the new content taken in under the rule ``recompress``
(:mod:`.recompress`).

    calls = [(torch.tensor([], dtype=torch.long), q1), (tool_output_2, q2), (tool_output_3, q3)]
    out = ec.generate_calls(model, context_ids, calls, ec.SnapKV(capacity=1024), recompress="each_call")
    out.answers[2], out.stats[2]["cache_tokens_after"]

Under speculative prefill (``draft=``, :class:`~.spec_calls.SpecCalls`) a draft model reads each call as it comes and
picks the tokens of its new content (the first call's: the context) that the target prefills, each at its original
position (the positions of the dropped ones are skipped); the question and what the last answer left to feed are
prefilled whole, and the call's time to first token includes the draft's.
"""

from __future__ import annotations

import time

import torch

from .generate import _chooser, decode, eos_and_pad
from .methods.base import Policy
from .recompress import RECOMPRESS, cache_tokens, recompress_refusal, share_of, take_in
from .recompress_passes import keeps_fed_ids, reconstructs
from .session import CompressionSession
from .shared_context import HISTORIES, SharedContextOutput, _call_stats, prefill_first
from .stopping import stop_criteria


def _check_calls(context_ids: torch.Tensor, calls: list, rule: str, history: str, gold_answers) -> None:
    if context_ids.dim() != 2 or context_ids.shape[0] != 1:
        raise ValueError(f"context_ids must be one context, [1, tokens]; got shape {tuple(context_ids.shape)}")
    if rule not in RECOMPRESS:
        raise ValueError(recompress_refusal(Policy(), rule))
    if history not in HISTORIES:
        raise ValueError(f"history must be one of {list(HISTORIES)}, got {history!r}")
    if not calls or any(len(call) != 2 or any(ids.dim() != 1 for ids in call) for call in calls):
        raise ValueError("calls must be a non-empty list of (new_content_ids, question_ids), 1-d token id tensors")
    for number, (new, question) in enumerate(calls, start=1):
        if len(question) == 0:
            raise ValueError(f"call {number} has no question")
        if number > 1 and len(new) == 0 and rule != "never":
            raise ValueError(f"call {number} brings no new content for session.recompress={rule} to take in (only the "
                             "first call's may be the context's end)")
    if history == "gold" and (gold_answers is None or len(gold_answers) != len(calls)):
        raise ValueError("history='gold' needs one gold answer per call")


def _check_draft(calls: list, rule: str, context_positions) -> None:
    if rule != "never":
        raise ValueError(f"speculative prefill in the loop takes a call's new content under session.recompress=never "
                         f"only: the draft's kept tokens keep their original positions, which {rule} does not "
                         "recompress yet; use session.recompress=never")
    if context_positions is not None:
        raise ValueError("a draft chooses the context's tokens and positions itself: give context_positions or draft")
    if len(calls[0][0]):
        raise ValueError("with a draft, the first call's new content is the context: give it in context_ids")


@torch.no_grad()
def generate_calls(model, context_ids: torch.Tensor, calls: list[tuple[torch.Tensor, torch.Tensor]], policy: Policy,
                   recompress: str = "never", history: str = "own", gold_answers: list[torch.Tensor] | None = None,
                   max_new_tokens: int | list[int] = 64, eos_token_id: int | list[int] | None = None, tokenizer=None,
                   pad_token_id: int | None = None, stop_strings: list[str] | None = None,
                   compress_first_query: bool = False, context_positions: torch.Tensor | None = None,
                   draft=None) -> SharedContextOutput:
    """Greedy answers to ``calls`` (each ``(new_content_ids, question_ids)``, 1-d; the first call's new content may be
    empty, its content being the context's end, and under ``never`` any call's) over one ``context_ids`` ``[1, tokens]``, asked in order as a chat
    (``history``: own or gold, as :func:`generate_shared`'s ``multi_turn``), the new content taken in under
    ``recompress`` (the module's docstring). The other arguments are :func:`generate_shared`'s; under
    ``compress_first_query`` the first call's new content and question are compressed with the context. ``draft``:
    a :class:`~.spec_calls.SpecCalls` over these calls, which picks the new content's tokens the target prefills
    (its rows add ``spec_kept_tokens``, ``draft_seconds``, ``draft_tokens_computed`` and
    ``draft_look_ahead_tokens``)."""
    _check_calls(context_ids, calls, recompress, history, gold_answers)
    if draft is not None:
        _check_draft(calls, recompress, context_positions)
    refusal = recompress_refusal(policy, recompress)
    if refusal:
        raise ValueError(refusal)
    if tokenizer is not None:
        policy.bind_tokenizer(tokenizer)
    eos, pad_token_id = eos_and_pad(model, tokenizer, eos_token_id, pad_token_id)
    limits = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(calls)
    device, stops = context_ids.device, set(eos.tolist()) if eos is not None else set()
    choose = _chooser(False, None, None, None, device)
    context_ids, context_positions, drafted = _drafted_context(draft, context_ids, context_positions)
    first, session, logits, context_seconds = prefill_first(model, policy, context_ids,
                                                            torch.cat(calls[0]) if compress_first_query else None,
                                                            context_positions)
    if recompress == "each_call" and reconstructs(policy):  # KVzip reconstructs the held text: its ids are kept
        session = keeps_fed_ids(session, first, context_positions)
    answers, stats, pending = [], [], torch.empty(0, dtype=torch.long, device=device)
    for turn, (new, question) in enumerate(calls):
        said = None if turn == 0 else gold_answers[turn - 1].to(device) if history == "gold" else answers[-1]
        new, question, kept, drafted = _call_ids(draft, turn, said, pending, new.to(device), question.to(device),
                                                 stops, drafted)
        fed = torch.cat([pending, new if kept is None else new[kept.to(device)], question])[None]
        shared = 0 if turn == 0 else int(session.state.seq_len.max())
        started, compressed = time.perf_counter(), None
        if not (turn == 0 and compress_first_query):
            logits, compressed = _feed(session, pending, new, question, recompress, first.shape[1], kept)
        ttft = time.perf_counter() - started + (context_seconds if turn == 0 else 0.0) + drafted.get("draft_seconds", 0)
        computed = fed.shape[1] if turn else first.shape[1] + (0 if compress_first_query else fed.shape[1])
        call = session.fork() if history == "gold" else session  # gold: the chat keeps the gold answer instead
        stop = stop_criteria(tokenizer, stop_strings, fed.shape[1]) if stop_strings else None
        started = time.perf_counter()
        sequences, generated, _ = decode(call, logits, fed, limits[turn], choose, eos, stop, pad_token_id)
        answers.append(sequences[0, fed.shape[1]: fed.shape[1] + int(generated[0])])
        stats.append({**_call_stats(call, turn, shared + computed, computed, shared, ttft,
                                    time.perf_counter() - started, int(generated[0]), limits[turn]),
                      "recompress": recompress, "new_content_tokens": len(new), "cache_tokens_compressed": compressed,
                      "cache_tokens_after": cache_tokens(call), **drafted})
        pending = gold_answers[turn].to(device) if history == "gold" else answers[-1][-1:]
    return SharedContextOutput(answers=answers, stats=stats)


def _drafted_context(draft, context_ids: torch.Tensor, positions: torch.Tensor | None) -> tuple:
    """The context's ids and positions the target prefills (where a draft chose them: the first call's choice, which
    the draft makes once it has read the context and the first question), and what the choice cost."""
    if draft is None:
        return context_ids, positions, {}
    kept, stats = draft.choose(0, None, context_ids[0])
    if len(kept) == context_ids.shape[1]:  # everything kept: the context as it is
        return context_ids, None, stats
    kept = kept.to(context_ids.device)
    return context_ids[:, kept], kept, stats


def _call_ids(draft, turn: int, said: torch.Tensor | None, pending: torch.Tensor, new: torch.Tensor,
              question: torch.Tensor, stops: set, drafted: dict) -> tuple:
    """A call's new content and question as fed after the last answer (:func:`_after_answer`), the indices of the new
    content the draft keeps (None: all of it, without a draft) and what the draft cost (the first call's choice,
    ``drafted``, made with the context's)."""
    given = len(new) + len(question)
    new_fed, question = _after_answer(pending, new, question, stops)
    if draft is None or turn == 0:
        return new_fed, question, None, drafted if turn == 0 else {}
    dropped = given - len(new_fed) - len(question)  # the template's end of turn the answer ended with: read once
    kept, stats = draft.choose(turn, said[: len(said) - dropped], new)
    shift = len(new) - len(new_fed)
    return new_fed, question, kept[kept >= shift] - shift, stats


def _after_answer(pending: torch.Tensor, new: torch.Tensor, question: torch.Tensor, stops: set) -> tuple:
    """A call's ids after the last answer: where the template writes the end of turn the answer ended with, fed once
    (as :func:`generate_shared` does)."""
    follow = new if len(new) else question
    if len(pending) and int(pending[-1]) in stops and int(follow[0]) == int(pending[-1]):
        return (new[1:], question) if len(new) else (new, question[1:])
    return new, question


def _feed(session: CompressionSession, pending: torch.Tensor, new: torch.Tensor, question: torch.Tensor, rule: str,
          context: int, kept: torch.Tensor | None = None) -> tuple[torch.Tensor, float | None]:
    """One call into ``session``: what the last answer left to feed, the new content under ``rule`` (only its
    ``kept`` tokens where a draft chose them), the question. Returns the logits after the question and the tokens held
    right after the compression (None: none ran)."""
    if kept is not None:
        return _feed_kept(session, pending, new, kept, question), None
    if rule == "never" or not len(new):
        return session.step(torch.cat([pending, new, question])[None])[:, -1], None
    if len(pending):
        session.step(pending[None])
    share = share_of(session.policy, len(new), context) if rule == "new_content" else None
    take_in(session, new[None], rule, share)
    compressed = cache_tokens(session)
    return session.step(question[None])[:, -1], compressed


def _feed_kept(session: CompressionSession, pending: torch.Tensor, new: torch.Tensor, kept: torch.Tensor,
               question: torch.Tensor) -> torch.Tensor:
    """What the last answer left, the ``kept`` tokens of ``new`` at their original positions and the question,
    appended to ``session`` (a run of dropped tokens: the next position moves past them, as a prefill at a draft's
    positions continues from the largest + 1). Returns the logits after the question."""
    pieces, cursor, logits = [pending], 0, None

    def flush():
        ids = torch.cat(pieces)
        pieces.clear()
        return session.step(ids[None])[:, -1] if len(ids) else logits

    for index in kept.tolist() + [len(new)]:
        if index > cursor:  # the dropped run before it
            logits = flush()
            session.state.seq_len += index - cursor
        if index < len(new):
            pieces.append(new[index: index + 1])
        cursor = index + 1
    pieces.append(question)
    return flush()
