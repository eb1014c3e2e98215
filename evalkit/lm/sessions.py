"""A session task's requests under ``task.mode=multi_request|multi_turn``: each session (the docs sharing a
``session_id``, asked in ``turn`` order) prefills its context once and answers its queries over it.

The ids are the single request's own: each doc's prompt as lm-eval renders it (chat template included), tokenized
whole and split where its question starts (the task's ``doc_to_question``), so that a ``multi_request`` answer is
the one the same doc gets alone under ``compression_scope=context``. A ``multi_turn`` chat continues after turn 1's
prompt with each later turn's user text (``doc_to_follow_up``; under a chat template, what the template writes
after an assistant answer and around that text), after the model's own answer or, under ``task.history=gold``, the
gold one (``doc_to_history``).

The context is compressed alone (``multi_request``; and ``multi_turn`` under ``compression_scope=context``), or,
under ``compression_scope=prompt``, together with the first query, as a chat's first prompt (``multi_turn``).
``multi_request`` runs in the engine: the context's session is copied into each query's slot (``Request(prefix=)``),
batched with the other queries, the compiled step as it is. ``multi_turn`` runs in the engine too, every session of
the run a chat (:class:`evalkit.compression.engine.Chat`, :meth:`~evalkit.compression.Engine.run_chats`): the chats
decode together, each one's turns following one another in its slot, with the answers
:func:`evalkit.compression.generate_shared` gives session by session (the eager reference, still what runs where the
engine's slots cannot be copied back into a session: ``Engine.chat_refusal``, e.g. kv_bits, ThinK, MiniCache).
Under speculative prefill (``method=spec_prefill``) the draft reads a session's context once and chooses the tokens
the target prefills; every call reuses that choice (the queries are kept whole), and the first call's time to
first token includes the draft's. In a ``multi_turn`` session whose calls bring new content (a task with
``doc_to_new_content``: the agent loop) the draft runs IN THE LOOP instead (:class:`evalkit.compression.SpecCalls`,
through :func:`evalkit.compression.generate_calls`): at each call it reads the last answer, the call's new content and
its question on top of its own cache, and picks the new content's tokens the target prefills (the first call's: the
context's); each call's row carries its ``spec_kept_tokens`` and ``draft_seconds``, and its time to first token the
draft's. A session is recorded in the progress file once all its turns are done; an
interrupted one runs again whole.
"""

from __future__ import annotations

import collections

import torch

import evalkit.compression as ec
from evalkit.benchmark import FolderTask
from evalkit.compression.engine import Chat
from evalkit.compression.engine.chats import chat_slot_tokens
from evalkit.core.console import PhaseBar
from evalkit.core.errors import RunError
from evalkit.lm.prompts import context_end
from evalkit.lm.requests import GenerationOptions, cost_stats, decoded_text
from evalkit.results.progress import request_keys, stats_keys

_ANSWER = "\x00evalkit-answer\x00"  # where an assistant answer goes in a rendered chat


def generate_sessions(lm, requests, mode: str, history: str, disable_tqdm: bool = False,
                      slot_tokens: int | None = None) -> list[str]:
    """The answers to ``requests`` (lm-eval's, of a session task), session by session; each one's statistics go to
    ``lm.request_stats`` and each finished session to ``lm.progress``. ``slot_tokens``: the slot size the
    engine reserves for chats (default: what these need; :func:`run_chat_slot_tokens`)."""
    keys = request_keys([(r.args[0], r.args[1]) for r in requests])
    owners = stats_keys(requests)
    outputs: list[str | None] = [None] * len(requests)
    sessions = sessions_of(requests)
    done = 0
    for members in sessions.values():
        records = [lm.progress.get(keys[i]) if lm.progress is not None else None for i in members]
        if all(records):  # generated before an interruption
            for index, record in zip(members, records):
                outputs[index], lm.request_stats[owners[index]] = record["text"], record["stats"]
            done += len(members)
    pending = [members for members in sessions.values() if outputs[members[0]] is None]
    plans = [_plan_session(lm, [requests[i] for i in members], mode, history) for members in pending]
    _check_fit(lm, plans, len(sessions), requests[0].task_name)  # before anything generates
    drafts_calls = any(plan["texts"] for plan in plans)
    if drafts_calls and lm.recompress != "never":
        raise RunError(f"method=spec_prefill in the agent loop takes each call's new content under "
                       f"session.recompress=never only (the draft's kept tokens keep their original positions, which "
                       f"{lm.recompress} does not recompress yet); leave session.recompress out")
    meter = lm.throughput
    meter.start(lm.device)
    try:
        with PhaseBar(len(requests), done, disable=disable_tqdm) as bar:

            def finished(members: list[int], texts: list[str], stats: list[dict]) -> None:
                for index, text, stat in zip(members, texts, stats):
                    outputs[index], lm.request_stats[owners[index]] = text, stat
                    meter.add({**stat, "prompt_tokens": stat["prefill_tokens_computed"]})
                if lm.progress is not None:
                    lm.progress.add([{"key": keys[i], "text": outputs[i], "stats": lm.request_stats[owners[i]]}
                                     for i in members])
                bar.update(len(members))

            engine_chats = mode == "multi_turn" and pending and lm.recompress == "never" and not drafts_calls
            chat_refusal = getattr(lm.engine, "chat_refusal", None) if engine_chats else None
            if chat_refusal is not None and chat_refusal() is None:
                _chats_over_engine(lm, plans, history, lambda i, texts, stats: finished(pending[i], texts, stats),
                                   slot_tokens)
            else:
                for members, plan in zip(pending, plans):
                    finished(members, *_run_session(lm, plan, mode, history))
    finally:
        meter.stop(lm._engine, lm.model)  # the engine's counts (its utilization, its cache), where it ran
    return outputs


def sessions_of(requests) -> dict[str, list[int]]:
    """The requests' indices by session, each in turn order; a doc without a session or a turn is one line."""
    sessions: dict[str, list[int]] = collections.defaultdict(list)
    for index, request in enumerate(requests):
        doc = request.doc or {}
        if doc.get("session_id") is None or not isinstance(doc.get("turn"), int):
            raise RunError(f"task {request.task_name}: doc {request.doc_id} has no session_id and turn; a session "
                           "task's docs carry both (task.mode=single runs any task)")
        sessions[str(doc["session_id"])].append(index)
    for session, members in sessions.items():
        members.sort(key=lambda i: requests[i].doc["turn"])
        turns = [requests[i].doc["turn"] for i in members]
        if len(set(turns)) != len(turns):
            raise RunError(f"session {session}: turn {turns} repeats a turn; each turn of a session is one query")
    return sessions


def _plan_session(lm, members: list, mode: str, history: str) -> dict:
    """One session as ids, checked (its docs share one context, it decodes greedily): its context, its queries,
    the gold answers it keeps (``history=gold``), each turn's token limit and the positions it needs at most."""
    task = FolderTask(members[0].task_name)
    options = [GenerationOptions.from_lm_eval(r.args[1]) for r in members]
    if any(option.do_sample for option in options):
        raise RunError(f"task {task.name}: a session decodes greedily; task.generation.do_sample=false")
    session_id = members[0].doc["session_id"]
    context, first_query, context_text = _split(lm, task, members[0], session_id)
    queries, contents = [first_query], [0]  # contents: how many of a query's ids are new content
    drafts = lm.spec_prefill is not None and mode == "multi_turn" and task.hook("doc_to_new_content") is not None
    prompt = members[0].args[0]  # the draft reads the calls as text (the first: the context and its question)
    texts = [_call_text(lm, prompt, context + first_query, len(context), lm.prompts.add_special_tokens(prompt))
             ] if drafts else None
    for request in members[1:]:
        own_context, query, _ = _split(lm, task, request, session_id)
        if own_context != context:
            raise RunError(f"session {session_id}: turn {request.doc['turn']}'s prompt does not begin with the same "
                           "context as turn 1's; a session's docs share one context")
        query, content, text = (query, 0, "") if mode == "multi_request" else _follow_up(lm, task, request.doc)
        queries.append(query)
        contents.append(content)
        if drafts:
            texts.append(_call_text(lm, text, query, content))
    gold = [_ids(lm, _hook(task, "doc_to_history", r.doc)) for r in members] if history == "gold" else None
    limits = [option.max_new_tokens for option in options]
    positions = len(context) + (sum(map(len, queries)) + sum(limits) + sum(map(len, gold or []))
                                if mode == "multi_turn" else max(map(len, queries)) + max(limits))
    return {"members": members, "options": options, "context": context, "context_text": context_text,
            "queries": queries, "contents": contents, "gold": gold, "limits": limits, "positions": positions,
            "texts": texts}


def _check_fit(lm, plans: list[dict], sessions: int, task: str) -> None:
    """One line, before anything generates, where sessions need more positions than the model's context: how many,
    the longest, and the ``model.max_context`` that fits them (a session is never cut)."""
    over = [plan["positions"] for plan in plans if plan["positions"] > lm.max_context]
    if over:
        need = -(-max(over) // 1024) * 1024
        raise RunError(f"{len(over)} of {sessions} sessions of task {task} need more positions than the "
                       f"{lm.max_context}-token context (model.max_context; the longest needs {max(over)}); a session "
                       f"is never cut: set model.max_context={need} where the model takes that many, or shorten the "
                       "sessions (task.dataset)")


def _run_session(lm, plan: dict, mode: str, history: str) -> tuple[list[str], list[dict]]:
    """One session's answers (texts cut at their stop strings) and per-turn statistics."""
    members, options, context, queries = plan["members"], plan["options"], plan["context"], plan["queries"]
    gold, limits, context_text = plan["gold"], plan["limits"], plan["context_text"]
    stops = _stop_strings(lm, options)
    texts = plan["texts"]
    context, positions, draft = _drafted(lm, context_text, members[0].args[0], context) if not texts else \
        (context, None, {})
    context_ids = torch.tensor([context], device=lm.device)
    if mode == "multi_request":
        answers, stats = _over_engine(lm, context_ids, positions, queries, limits, stops)
        compressed = len(context)
    else:
        first_in_prefix = lm.prompts.compression_scope == "prompt"
        shared = dict(history=history, max_new_tokens=limits, eos_token_id=lm.stop_token_ids, tokenizer=lm.tokenizer,
                      gold_answers=[torch.tensor(g, dtype=torch.long) for g in gold] if gold else None,
                      stop_strings=stops or None, compress_first_query=first_in_prefix, context_positions=positions)
        if lm.recompress == "never" and not texts:
            out = ec.generate_shared(lm.model, context_ids, [torch.tensor(q, dtype=torch.long) for q in queries],
                                     lm.policy, mode=mode, **shared)
        else:  # each call's new content taken in by the rule, or chosen by the draft (evalkit.compression.agent_calls)
            calls = [(torch.tensor(q[:n], dtype=torch.long), torch.tensor(q[n:], dtype=torch.long))
                     for q, n in zip(queries, plan["contents"])]
            out = ec.generate_calls(lm.model, context_ids, calls, lm.policy, recompress=lm.recompress, **shared,
                                    draft=ec.SpecCalls(lm.spec_prefill, lm.tokenizer, texts) if texts else None)
        # appended, a chat's cache never drops within a call: what it held at its answer's end is its peak
        answers, stats = [answer.tolist() for answer in out.answers], [
            {"cache_tokens_after": s["peak_cache_tokens"], **s, "turn": s["turn"] + 1} for s in out.stats]
        compressed = (out.stats[0]["spec_kept_tokens"] if texts else len(context)) + \
            (len(queries[0]) if first_in_prefix else 0)
    return _session_rows(lm, options, answers, stats, draft, compressed)


def _stop_strings(lm, options: list[GenerationOptions]) -> list[str]:
    """The stop strings of a session's turns (those the model's end-of-sequence tokens spell left to its ids)."""
    return sorted({s for option in options for s in option.until if s and s not in lm.stop_token_texts})


def _session_rows(lm, options: list, answers: list, stats: list[dict], draft: dict,
                  compressed: int) -> tuple[list[str], list[dict]]:
    """A session's texts (cut at their stop strings) and rows' statistics from its answers' ids and its calls' stats
    (``draft``: what a speculative prefill's draft cost, charged to the first call; ``compressed``: the prompt tokens
    compressed once)."""
    if draft:  # the draft read the context once; its time is the first call's
        stats[0] = {**stats[0], **draft, "time_to_first_token_s": stats[0]["time_to_first_token_s"] + draft["draft_seconds"]}
    return [decoded_text(lm.tokenizer, answer, option.until) for answer, option in zip(answers, options)], [
        {**stat, "truncated": False, **cost_stats(lm, stat, compressed)} for stat in stats]


def run_chat_slot_tokens(lm, sessions: list[list], mode: str, history: str) -> int | None:
    """The slot size one engine running all of ``sessions`` (each its lm-eval requests in turn order) as chats
    reserves, for a run that spreads them over several engines (None where they do not run as chats, or where a
    draft picks the contexts' tokens: each engine then sizes its own)."""
    if mode != "multi_turn" or lm.recompress != "never" or lm.spec_prefill is not None or not sessions:
        return None
    plans = [_plan_session(lm, members, mode, history) for members in sessions]
    return chat_slot_tokens(lm.model.config, lm.policy, [_chat(lm, plan, history)[0] for plan in plans])


def _chats_over_engine(lm, plans: list[dict], history: str, finished, slot_tokens: int | None = None) -> None:
    """``multi_turn`` in the engine: every session a chat, all of them decoded together (``Engine.run_chats``, its
    slots ``slot_tokens`` long, default what these chats need); as each chat's last turn is done,
    ``finished(index, texts, stats)`` gets its rows, as :func:`_run_session` gives them."""
    chats, sessions = [], []
    for plan in plans:
        chat, session = _chat(lm, plan, history)
        chats.append(chat)
        sessions.append(session)

    def on_chat(index: int, completions: list) -> None:
        plan, (first_tokens, compressed, context_seconds, draft) = plans[index], sessions[index]
        stats = []
        for turn, completion in enumerate(completions):
            stat = {**completion.stats, "turn": turn + 1}
            if turn == 0:  # the context's prefill is the first call's (its tokens, wherever a draft put them)
                stat["prefill_tokens_computed"] = stat["prompt_tokens"] = first_tokens
                stat["prefill_tokens_shared"] = 0
                stat["tokens_seen"] = first_tokens + max(stat["generated_tokens"] - 1, 0)
                stat["realized_ratio"] = stat["tokens_seen"] / stat["peak_cache_tokens"]
                for name in ("prefill_seconds", "time_to_first_token_s"):
                    stat[name] = (stat.get(name) or 0.0) + context_seconds
            stat["ttft_seconds"] = stat["time_to_first_token_s"]
            stat["cache_tokens_after"] = stat["peak_cache_tokens"]  # appended: held at the answer's end
            stats.append(stat)
        finished(index, *_session_rows(lm, plan["options"], [c.tokens for c in completions], stats, draft, compressed))

    lm.engine.run_chats(chats, on_chat=on_chat, slot_tokens=slot_tokens)


def _chat(lm, plan: dict, history: str) -> tuple[Chat, tuple[int, int, float, dict]]:
    """A session as a chat: its first turn over the context (compressed with the first query under
    ``compression_scope=prompt``, else alone: at admission, or before the run where a draft chose the context's
    tokens and positions), its later turns the user's ids; and the first call's prompt tokens, those compressed
    once, the seconds a context prefilled before the run took, and what its draft cost."""
    options, queries, limits = plan["options"], plan["queries"], plan["limits"]
    stops = _stop_strings(lm, options)
    context, positions, draft = _drafted(lm, plan["context_text"], plan["members"][0].args[0], plan["context"])
    first_ids, seconds = torch.tensor(context + queries[0], dtype=torch.long), 0.0
    if lm.prompts.compression_scope == "prompt":  # a chat's first prompt, compressed whole
        after = positions.max().cpu() + 1 + torch.arange(len(queries[0])) if positions is not None else None
        first = ec.Request(first_ids, limits[0], stop_strings=stops,
                           position_ids=torch.cat([positions.cpu(), after]) if after is not None else None)
        compressed = len(first_ids)
    elif positions is None:
        first = ec.Request(first_ids, limits[0], stop_strings=stops, compress_prefix=len(context))
        compressed = len(context)
    else:  # the draft's tokens at their positions: prefilled and compressed alone before the run
        prefix, seconds = ec.prefill_context(lm.model, lm.policy, torch.tensor([context], device=lm.device),
                                             positions[None].to(lm.device))
        first = ec.Request(torch.tensor(queries[0], dtype=torch.long), limits[0], stop_strings=stops, prefix=prefix)
        compressed = len(context)
    later = [ec.Request(torch.tensor(query, dtype=torch.long), limit, stop_strings=stops)
             for query, limit in zip(queries[1:], limits[1:])]
    gold = plan["gold"] if history == "gold" else None
    return Chat([first, *later], gold), (len(first_ids), compressed, seconds, draft)


def _drafted(lm, text: str, prompt: str, context: list[int]) -> tuple[list[int], torch.Tensor | None, dict]:
    """Under speculative prefill (``method=spec_prefill``), the tokens the draft keeps of the context (``text``, the
    start of turn 1's ``prompt``), chosen once for the session from the context alone, their original positions and
    what the choice cost; else the context's ids ``context`` as they are."""
    if lm.spec_prefill is None:
        return context, None, {}
    ids, _, positions, (spec,) = lm.spec_prefill.select([text], lm.tokenizer, lm.tokenizer.pad_token_id,
                                                        add_special_tokens=[lm.prompts.add_special_tokens(prompt)])
    return ids[0].tolist(), positions[0], {"spec_kept_tokens": spec["kept_tokens"], "draft_seconds": spec["draft_seconds"]}


def _over_engine(lm, context_ids: torch.Tensor, positions, queries: list, limits: list, stops: list) -> tuple[list, list]:
    """``multi_request`` in the engine: the context (at ``positions``, where a draft chose its tokens) prefilled and
    compressed once, each query a request continuing a copy of it in its own slot (batched as any requests are). The
    first call is charged the context's prefill."""
    prefix, seconds = ec.prefill_context(lm.model, lm.policy, context_ids,
                                         positions[None].to(lm.device) if positions is not None else None)
    requests = [ec.Request(torch.tensor(query, dtype=torch.long), max_new_tokens=limit, stop_strings=stops,
                           prefix=prefix) for query, limit in zip(queries, limits)]
    done: dict[int, ec.Completion] = {}
    lm.engine.run(requests, on_finish=lambda completion: done.__setitem__(completion.index, completion))
    answers, stats = [done[i].tokens for i in range(len(queries))], []
    for turn in range(len(queries)):
        stat = {**done[turn].stats, "turn": turn + 1}
        if turn == 0:
            stat["prefill_tokens_computed"] += context_ids.shape[1]
            stat["prefill_tokens_shared"] = 0
            for name in ("prefill_seconds", "time_to_first_token_s"):
                stat[name] = (stat.get(name) or 0.0) + seconds
        stats.append(stat)
    return answers, stats


def _split(lm, task: FolderTask, request, session_id) -> tuple[list[int], list[int], str]:
    """A doc's prompt as ids, split where its question starts: (context, query), and the context's text."""
    text, question = request.args[0], _hook(task, "doc_to_question", request.doc)
    end = context_end(text, question)
    if end is None:
        raise RunError(f"session {session_id}, turn {request.doc['turn']}: the task's doc_to_question is not in its "
                       "prompt, so where the shared context ends is unknown")
    ids, split = lm.prompts.tokenize(text, end)
    if not split or split >= len(ids):
        raise RunError(f"session {session_id}, turn {request.doc['turn']}: its prompt leaves no context or no query")
    return ids[:split], ids[split:], text[:end]


def _follow_up(lm, task: FolderTask, doc: dict) -> tuple[list[int], int, str]:
    """A later turn's ids in a chat, how many of them are new content (:func:`_with_content_end`) and its text: its user text
    (``doc_to_follow_up``), under a chat template with what the template writes between an assistant answer and the
    next generation prompt, then what the answer is made to start with (``doc_to_follow_up_prefix``); without a chat
    template, the task's plain text (``doc_to_follow_up_plain``)."""
    if lm.use_chat_template:
        chat = [{"role": "user", "content": "-"}, {"role": "assistant", "content": _ANSWER},
                {"role": "user", "content": _hook(task, "doc_to_follow_up", doc)}]
        rendered = lm.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        text = rendered[rendered.index(_ANSWER) + len(_ANSWER):] + _hook(task, "doc_to_follow_up_prefix", doc)
    else:
        text = _hook(task, "doc_to_follow_up_plain", doc)
    return (*_with_content_end(lm, task, doc, text), text)


def _with_content_end(lm, task: FolderTask, doc: dict, text: str) -> tuple[list[int], int]:
    """A follow-up's ids (``text`` tokenized) and how many of them are the new content it brings before its question
    (an agent's tool output, ``doc_to_new_content``; 0 for a task without that hook): the ids up to its end."""
    hook = task.hook("doc_to_new_content")
    content = hook(doc) if hook is not None else ""
    if not content:
        return _ids(lm, text), 0
    if content not in text:
        raise RunError(f"task {task.name}: session {doc.get('session_id')}, turn {doc.get('turn')}: its "
                       "doc_to_new_content is not in its follow-up text")
    end = text.index(content) + len(content)
    encoded = lm.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = encoded["offset_mapping"]
    return encoded["input_ids"], next((i for i, (start, _) in enumerate(offsets) if start >= end), len(offsets))


def _call_text(lm, text: str, ids: list[int], content: int, special: bool = False) -> ec.CallText:
    """A call as the draft of speculative prefill reads it: its ``text``, where each of its target ``ids`` lies in it
    (the tokenizer's offsets; the ids must be the text's own) and how many of them are new ``content``."""
    try:
        encoded = lm.tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
    except NotImplementedError:  # a slow tokenizer
        raise RunError("method=spec_prefill in the agent loop maps the draft's text to the target's tokens by their "
                       "characters, which needs a fast tokenizer") from None
    if encoded["input_ids"] != ids:
        raise RunError("a call's ids are not its text's own as the tokenizer reads it alone, so the draft cannot "
                       "place them; method=spec_prefill in the agent loop needs a tokenizer that keeps them")
    return ec.CallText(text, [tuple(span) for span in encoded["offset_mapping"]], content)


def _ids(lm, text: str) -> list[int]:
    return lm.tokenizer(text, add_special_tokens=False)["input_ids"]


def _hook(task: FolderTask, name: str, doc: dict) -> str:
    """The task's hook ``name`` on ``doc``; without one, the question stands for a follow-up (plain or not), the
    answer starts with nothing, and ``answer`` is the gold history."""
    hook = task.hook(name)
    if hook is not None:
        return hook(doc)
    defaults = {"doc_to_follow_up": "doc_to_question", "doc_to_follow_up_plain": "doc_to_follow_up"}
    if name in defaults:
        return _hook(task, defaults[name], doc)
    if name == "doc_to_follow_up_prefix":
        return ""
    if name == "doc_to_history":
        return str(doc["answer"])
    raise RunError(f"task {task.name} has no {name} hook; a session task defines it in its utils.py")
