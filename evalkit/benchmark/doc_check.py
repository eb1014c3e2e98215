"""A task's documents held to the fields it declares (``ROWS`` in ``tasks/<folder>/schema.py``) as they load: generated,
file and hub data alike, whatever its loader checked. A bad row is a :class:`~evalkit.benchmark.data.DataError` whose
one line names where the data is from, the row and the field; with ``bad_rows="skip"`` it is left out and counted."""

from __future__ import annotations

from evalkit.core.schema import Key

from .data import DataError

ID_FIELDS = ("id", "session_id", "_id", "question_id")


def doc_problems(docs, keys: dict[str, Key], where: str) -> list[tuple[int, str]]:
    """``(position, one line)`` for every doc of ``docs`` (a list or a ``datasets.Dataset``) that lacks a declared
    field or holds a value out of its declaration."""
    found = []
    for position, doc in enumerate(docs):
        for name, key in keys.items():
            problem = "is missing" if name not in doc else key.problem("", doc[name])
            if problem:
                problem = problem.removeprefix(" ")
                found.append((position, f"{where}: row {position + 1} ({_named(doc)}): field {name!r} {problem}"))
                break
    return found


def checked_docs(docs, keys: dict[str, Key], where: str, bad_rows: str = "error") -> tuple[list[int], list[str]]:
    """The positions of the docs to keep and a line for each one left out (``bad_rows="skip"``); with ``"error"``
    the first bad doc is a DataError. No usable doc at all is a DataError either way."""
    problems = doc_problems(docs, keys, where)
    if problems and bad_rows != "skip":
        raise DataError(problems[0][1])
    bad = {position for position, _ in problems}
    kept = [position for position in range(len(docs)) if position not in bad]
    if not kept:
        raise DataError(f"{where}: no usable rows ({len(bad)} skipped)")
    return kept, [line for _, line in problems]


def _named(doc: dict) -> str:
    field = next((name for name in ID_FIELDS if doc.get(name) is not None), None)
    named = f"{field}={str(doc[field])[:60]}" if field else "no id"
    return f"{named}, turn {doc['turn']}" if field == "session_id" and "turn" in doc else named
