"""Needle in a haystack over real prose nobody here wrote: Python's own reference documentation (the haystack of
:mod:`evalkit.tasks.needle.haystack`), built at run time from a seed, never shipped.

Each prompt is a stretch of the documentation of about ``length`` tokens starting at a random sentence, with one
sentence stating a random six-digit code inserted at relative ``depth`` (0: first sentence, 1: last), snapped to a
sentence boundary. The question follows the document in the user turn; the answer is right when the first number in
the response is the code.
"""

from __future__ import annotations

import random
import re

from evalkit.tasks.needle import haystack

NEEDLE = "The secret code is {code}."
QUESTION = "What is the secret code mentioned in the text above? Answer with the code only."


def build_examples(lengths: list[int], depths: list[float], per_cell: int = 1, seed: int = 1234) -> list[dict]:
    rng, rows = random.Random(seed), []
    for length, depth, index, chunk in haystack.cells(lengths, depths, per_cell, rng):
        code = str(rng.randrange(100000, 1000000))
        rows.append({"id": f"len{length}-depth{depth}-{index}",
                     "context": haystack.insert(chunk, [(float(depth), NEEDLE.format(code=code))]),
                     "question": QUESTION, "answer": code, "length": str(length), "depth": f"{float(depth):g}"})
    return rows


def score(doc: dict, response: str) -> dict:
    numbers = re.findall(r"\d+", response)
    return {"exact_match": float(bool(numbers) and numbers[0] == doc["answer"])}
