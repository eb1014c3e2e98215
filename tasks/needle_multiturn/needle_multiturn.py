"""Several needles in one haystack, asked one per turn: a session task over Python's reference documentation (the
haystack of :mod:`evalkit.tasks.needle.haystack`), built at run time from a seed.

Each session is a stretch of about ``length`` tokens with ``needles`` sentences ``The secret code of the <name> door
is <code>.`` inserted at depths spread evenly from 0 to 1 (snapped to sentence boundaries), each with its own name
and six-digit code. Turn ``t`` asks for the code of one door; the doors are asked in a shuffled order, so a turn's
depth is not its number. The answer is right when the first number in the response is that door's code.
"""

from __future__ import annotations

import random

from evalkit.tasks.needle import haystack

NEEDLE = "The secret code of the {name} door is {code}."
QUESTION = "What is the secret code of the {name} door mentioned in the text above? Answer with the code only."
NAMES = ("red", "blue", "green", "yellow", "purple", "orange", "silver", "golden", "black", "white", "brown", "grey")


def build_sessions(lengths: list[int], needles: int = 4, per_length: int = 2, seed: int = 1234) -> list[dict]:
    """One doc per (session, turn): ``session_id``, ``turn`` (1..needles), ``context``, ``question``, ``answer``,
    ``name``, ``length``, ``depth`` (of the needle the turn asks for)."""
    if not 1 <= int(needles) <= len(NAMES):
        raise ValueError(f"needles must be within [1, {len(NAMES)}], got {needles}")
    text, rng, docs = haystack.text(), random.Random(seed), []
    for length in lengths:
        size = haystack.size_of(text, length)
        for index in range(int(per_length)):
            chunk = haystack.stretch(text, rng, size)
            names = rng.sample(NAMES, int(needles))
            codes = [str(rng.randrange(100000, 1000000)) for _ in names]
            depths = [k / max(1, int(needles) - 1) for k in range(int(needles))]
            cuts = [min(haystack.sentence_start(chunk, round(depth * len(chunk))), len(chunk)) for depth in depths]
            parts, last = [], 0
            for cut, name, code in zip(cuts, names, codes):
                parts += [chunk[last:cut].strip(), NEEDLE.format(name=name, code=code)]
                last = cut
            context = " ".join(part for part in [*parts, chunk[last:].strip()] if part)
            order = rng.sample(range(int(needles)), int(needles))
            for turn, asked in enumerate(order, start=1):
                docs.append({"session_id": f"len{length}-{index}", "turn": turn, "context": context,
                             "question": QUESTION.format(name=names[asked]), "answer": codes[asked],
                             "name": names[asked], "length": str(length), "depth": f"{depths[asked]:g}"})
    return docs
