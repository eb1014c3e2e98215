"""A task's documents held to the fields it declares (``ROWS`` in ``tasks/<folder>/schema.py``) as they load: generated,
file and hub data alike, whatever its loader checked. A bad row is a :class:`~evalkit.benchmark.data.DataError` whose
one line names where the data is from, the row and the field; with ``bad_rows="skip"`` it is left out and counted."""

from __future__ import annotations

from evalkit.core.schema import Key

from .data import DataError

ID_FIELDS = ("id", "session_id", "_id", "question_id")


def doc_problems(docs, keys: dict[str, Key], where: str, wanted: int | None = None) -> tuple[list[tuple[int, str]], int]:
    """``(position, one line)`` for every doc of ``docs`` (a list or a ``datasets.Dataset``) that lacks a declared
    field or holds a value out of its declaration, and how many docs were read: all of them, or, with ``wanted``, up
    to the ``wanted``-th good one (a run's ``limit``: the docs lm-eval will take)."""
    found, good, read = [], 0, 0
    for position, doc in enumerate(docs):
        if wanted is not None and good >= wanted:
            break
        read += 1
        problem = next((f"field {name!r} " + ("is missing" if name not in doc else key.problem("", doc[name]).lstrip())
                        for name, key in keys.items() if name not in doc or key.problem("", doc[name])), None)
        if problem:
            found.append((position, f"{where}: row {position + 1} ({_named(doc)}): {problem}"))
        else:
            good += 1
    return found, read


def checked_docs(docs, keys: dict[str, Key], where: str, bad_rows: str = "error",
                 limit: int | None = None) -> tuple[list[int], list[str]]:
    """The positions of the docs to keep and a line for each one left out (``bad_rows="skip"``); with ``"error"``
    the first bad doc is a DataError. No usable doc at all is a DataError either way. With ``limit``, only the docs
    up to the ``limit``-th good one are read (those past it are kept, unread: lm-eval will not take them)."""
    problems, read = doc_problems(docs, keys, where, limit)
    if problems and bad_rows != "skip":
        raise DataError(problems[0][1])
    bad = {position for position, _ in problems}
    kept = [position for position in range(len(docs)) if position not in bad]
    if read == len(bad):
        raise DataError(f"{where}: no usable rows ({len(bad)} skipped)")
    return kept, [line for _, line in problems]


def _named(doc: dict) -> str:
    field = next((name for name in ID_FIELDS if doc.get(name) is not None), None)
    named = f"{field}={str(doc[field])[:60]}" if field else "no id"
    return f"{named}, turn {doc['turn']}" if field == "session_id" and "turn" in doc else named
