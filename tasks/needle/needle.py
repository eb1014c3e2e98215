"""Needle in a haystack over real prose nobody here wrote: Python's own reference documentation (``pydoc_data.topics``,
shipped with every CPython), built at run time from a seed, never shipped.

Each prompt is a stretch of the documentation of about ``length`` tokens (at :data:`CHARS_PER_TOKEN` characters per
token; the realized count is in the samples table) starting at a random sentence, with one sentence stating a random
six-digit code inserted at relative ``depth`` (0: first sentence, 1: last), snapped to a sentence boundary. The question
follows the document in the user turn; the answer is right when the first number in the response is the code. The
haystack depends on the Python version, which is part of the run's identity (``dataset_source``).
"""

from __future__ import annotations

import platform
import random
import re

CHARS_PER_TOKEN = 4  # English prose under BPE tokenizers: SmolLM2 reads 0.96 tokens per 4 characters of these docs
NEEDLE = "The secret code is {code}."
QUESTION = "What is the secret code mentioned in the text above? Answer with the code only."
SOURCE = "pydoc_data.topics"


def source() -> str:
    return f"{SOURCE}@python-{platform.python_version()}"


def haystack() -> str:
    from pydoc_data.topics import topics

    return " ".join(" ".join(topics[key].split()) for key in sorted(topics))


def _sentence_start(text: str, position: int) -> int:
    """The first sentence start at or after ``position`` (0 stays 0)."""
    if position <= 0:
        return 0
    found = text.find(". ", position - 2)
    return len(text) if found < 0 else found + 2


def build_examples(lengths: list[int], depths: list[float], per_cell: int = 1, seed: int = 1234) -> list[dict]:
    text = haystack()
    rng = random.Random(seed)
    rows = []
    for length in lengths:
        size = int(length) * CHARS_PER_TOKEN
        if size >= len(text) // 2:
            raise ValueError(f"length {length} is too long for the haystack ({len(text) // CHARS_PER_TOKEN} tokens)")
        for depth in depths:
            if not 0 <= float(depth) <= 1:
                raise ValueError(f"depths must be within [0, 1], got {depth}")
            for index in range(int(per_cell)):
                start = _sentence_start(text, rng.randrange(1, len(text) - 2 * size))
                chunk = text[start : start + size]
                chunk = chunk[: chunk.rfind(". ") + 1] or chunk
                code = str(rng.randrange(100000, 1000000))
                at = min(_sentence_start(chunk, round(float(depth) * len(chunk))), len(chunk))
                context = " ".join(part for part in (chunk[:at].strip(), NEEDLE.format(code=code), chunk[at:].strip()) if part)
                rows.append({"id": f"len{length}-depth{depth}-{index}", "context": context, "question": QUESTION,
                             "answer": code, "length": str(length), "depth": f"{float(depth):g}"})
    return rows


def score(doc: dict, response: str) -> dict:
    numbers = re.findall(r"\d+", response)
    return {"exact_match": float(bool(numbers) and numbers[0] == doc["answer"])}
