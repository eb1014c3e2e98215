"""The haystack the needle tasks share: Python's own reference documentation (``pydoc_data.topics``, shipped with every
CPython), prose nobody here wrote, built at run time and never shipped; and how a task draws its stretches and puts its
needle sentences in them. The haystack depends on the Python version, which is part of the run's identity
(``dataset_source``: :func:`source`).

A stretch of about ``length`` tokens (at :data:`CHARS_PER_TOKEN` characters per token; the realized count is in the
samples table) starts at a random sentence and ends at a sentence's end; a needle at relative depth ``d`` (0: first
sentence, 1: last) is put at the sentence boundary nearest after ``d`` of the stretch.
"""

from __future__ import annotations

import platform
import random
from collections.abc import Iterator

CHARS_PER_TOKEN = 4  # English prose under BPE tokenizers: SmolLM2 reads 0.96 tokens per 4 characters of these docs
SOURCE = "pydoc_data.topics"


def source() -> str:
    return f"{SOURCE}@python-{platform.python_version()}"


def text() -> str:
    from pydoc_data.topics import topics

    return " ".join(" ".join(topics[key].split()) for key in sorted(topics))


def sentence_start(text: str, position: int) -> int:
    """The first sentence start at or after ``position`` (0 stays 0)."""
    if position <= 0:
        return 0
    found = text.find(". ", position - 2)
    return len(text) if found < 0 else found + 2


def size_of(text: str, length: int) -> int:
    """The characters of a stretch of ``length`` tokens; ValueError where the haystack is too short for it."""
    size = int(length) * CHARS_PER_TOKEN
    if size >= len(text) // 2:
        raise ValueError(f"length {length} is too long for the haystack ({len(text) // CHARS_PER_TOKEN} tokens)")
    return size


def stretch(text: str, rng: random.Random, size: int) -> str:
    """A stretch of ``size`` characters from a random sentence start, cut back to its last sentence's end."""
    start = sentence_start(text, rng.randrange(1, len(text) - 2 * size))
    chunk = text[start : start + size]
    return chunk[: chunk.rfind(". ") + 1] or chunk


def insert(chunk: str, needles: list[tuple[float, str]]) -> str:
    """``chunk`` with each needle sentence at its relative depth (sentence boundaries, deepest inserted first)."""
    for depth, sentence in sorted(needles, key=lambda item: -item[0]):
        at = min(sentence_start(chunk, round(depth * len(chunk))), len(chunk))
        chunk = " ".join(part for part in (chunk[:at].strip(), sentence, chunk[at:].strip()) if part)
    return chunk


def cells(lengths: list[int], depths: list[float], per_cell: int, rng: random.Random) -> Iterator[tuple]:
    """``(length, depth, index, stretch)`` for each of ``per_cell`` prompts of every length and depth, in that order,
    each stretch drawn from ``rng`` when its prompt's turn comes (what the caller draws for it comes before the next)."""
    haystack = text()
    for length in lengths:
        size = size_of(haystack, length)
        for depth in depths:
            if not 0 <= float(depth) <= 1:
                raise ValueError(f"depths must be within [0, 1], got {depth}")
            for index in range(int(per_cell)):
                yield length, depth, index, stretch(haystack, rng, size)
