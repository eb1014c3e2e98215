"""The agent loop: sessions of calls over a growing pile of documents (Python's reference documentation, the haystack
of :mod:`evalkit.tasks.needle.haystack`), each call bringing a retrieved document (its tool output) and then a
question, built at run time from a seed or read from a file of calls.

A session's call ``k`` retrieves document ``k``, a stretch of about ``doc_tokens`` tokens with facts planted at
sentence boundaries. Its question needs facts from calls ``<= k``:

- ``recall``: document ``k`` holds ``The secret code of the <name> door is <code>.``; call ``k`` asks for the code
  of the door of a call drawn from ``1..k`` (call 1 asks its own), so later calls reach back into the pile;
- ``first_latest`` (after SCBench's multi-hop across a shared context): document 1 holds every call's
  ``The <door> door leads to the <room> room.``, document ``k`` holds ``The code of the <room> room is <code>.``;
  call ``k`` asks for the code of the room the ``k``-th door leads to, which needs the first document and the latest.

The answer is right when the first number of the response is the code (as the needle tasks score). A file of calls
(``.jsonl``, one row per call: ``session_id``, ``turn`` from 1, ``content``, ``question``, ``answer``) runs the same
way; a session missing a call, or a call without content, is refused in one line.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from evalkit.tasks.needle import haystack

PREAMBLE = ("You are an agent. Each tool call below returned a document; the facts in the documents answer the "
            "questions. Answer each question with the code only.")
DOORS = ("red", "blue", "green", "yellow", "purple", "orange", "silver", "golden", "black", "white", "brown", "grey")
ROOMS = ("library", "kitchen", "cellar", "attic", "studio", "garden", "chapel", "gallery", "vault", "workshop",
         "parlour", "tower")
VARIANTS = ("recall", "first_latest")
CODE = "The secret code of the {door} door is {code}."
LEADS = "The {door} door leads to the {room} room."
ROOM_CODE = "The code of the {room} room is {code}."
QUESTIONS = {"recall": "What is the secret code of the {door} door? Answer with the code only.",
             "first_latest": "What is the code of the room that the {door} door leads to? Answer with the code only."}


def tool_output(turn: int, content: str) -> str:
    """Call ``turn``'s document as the prompt shows it."""
    return f"\n\n[Tool output {turn}]\n{content}"


def question_part(question: str) -> str:
    return f"\n\nQuestion: {question}"


def build_calls(calls: int = 4, n_sessions: int = 2, doc_tokens: int = 200, variant: str = "recall",
                seed: int = 1234) -> list[dict]:
    """The calls of ``n_sessions`` generated sessions, ``calls`` each: rows ``session_id``, ``turn``, ``content``,
    ``question``, ``answer``, ``asked`` (the call whose planted fact the question names)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    if not 1 <= int(calls) <= len(DOORS):
        raise ValueError(f"calls must be within [1, {len(DOORS)}], got {calls}")
    text, rng, rows = haystack.text(), random.Random(seed), []
    size = haystack.size_of(text, int(doc_tokens))
    for index in range(int(n_sessions)):
        doors, rooms = rng.sample(DOORS, int(calls)), rng.sample(ROOMS, int(calls))
        codes = [str(rng.randrange(100000, 1000000)) for _ in doors]
        for turn in range(1, int(calls) + 1):
            if variant == "recall":
                planted, asked = [CODE.format(door=doors[turn - 1], code=codes[turn - 1])], rng.randint(1, turn)
            else:
                leads = [LEADS.format(door=d, room=r) for d, r in zip(doors, rooms)] if turn == 1 else []
                planted, asked = [*leads, ROOM_CODE.format(room=rooms[turn - 1], code=codes[turn - 1])], turn
            needles = [(rng.random(), sentence) for sentence in planted]
            rows.append({"session_id": f"{variant}-{index}", "turn": turn,
                         "content": haystack.insert(haystack.stretch(text, rng, size), needles),
                         "question": QUESTIONS[variant].format(door=doors[asked - 1]), "answer": codes[asked - 1],
                         "asked": asked})
    return rows


def read_calls(path: str) -> list[dict]:
    """The rows of a ``.jsonl`` file of calls; a missing file, another format or a bad line is one line."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"dataset.path: no such file: {path}")
    if file.suffix != ".jsonl":
        raise ValueError(f"dataset.path: {path}: need a .jsonl file of calls, one row per call")
    rows = []
    for number, line in enumerate(file.read_text().splitlines(), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                raise ValueError(f"dataset.path: {path}: line {number}: not valid JSON") from None
    if not rows:
        raise ValueError(f"dataset.path: {path} holds no calls")
    return rows


def sessions_of(rows: list[dict], where: str) -> dict[str, list[dict]]:
    """The rows by session, each in call order, checked: every call has content, a session's calls run 1, 2, ...
    without a gap or a repeat (one line naming the session and the call otherwise)."""
    sessions: dict[str, list[dict]] = {}
    for position, row in enumerate(rows, start=1):
        if not isinstance(row, dict) or row.get("session_id") is None or not isinstance(row.get("turn"), int) \
                or isinstance(row.get("turn"), bool):
            raise ValueError(f"{where}: row {position} has no session_id and turn (an integer from 1)")
        content = row.get("content")
        if not isinstance(content, str) or not content.strip():
            raise ValueError(f"{where}: session {row['session_id']}, call {row['turn']} has no content; every call "
                             "brings its tool output")
        sessions.setdefault(str(row["session_id"]), []).append(row)
    for session, calls in sessions.items():
        calls.sort(key=lambda row: row["turn"])
        turns = [row["turn"] for row in calls]
        missing = sorted(set(range(1, max(turns) + 1)) - set(turns))
        if missing or len(set(turns)) != len(turns):
            what = f"call {missing[0]} is missing" if missing else "a call repeats"
            raise ValueError(f"{where}: session {session}: {what} (its calls: {turns}); a session's calls run 1, 2, "
                             "... each once")
    return sessions


def docs_of(sessions: dict[str, list[dict]]) -> list[dict]:
    """One doc per call: the call's row with its session's shared ``context`` (the preamble and the first call's
    document) and ``between`` (the documents of the calls after the first and before this one, as shown)."""
    docs = []
    for session, calls in sessions.items():
        context = PREAMBLE + tool_output(1, calls[0]["content"])
        for row in calls:
            between = "".join(tool_output(earlier["turn"], earlier["content"]) for earlier in calls[1: row["turn"] - 1])
            docs.append({**row, "session_id": session, "context": context, "between": between,
                         "asked": int(row.get("asked") or row["turn"])})
    return docs
