"""Multi-key needle in a haystack, RULER's ``niah_multikey_1`` shape (Hsieh et al., arXiv 2404.06654; NVIDIA/RULER
``scripts/data/synthetic/niah.py``), over Python's reference documentation (:mod:`evalkit.tasks.needle.haystack`).

Each prompt (RULER's template: its opening line, the text, the question) hides ``keys`` sentences "One of the special magic numbers for {key} is: {value}." in a stretch of about
``length`` tokens; one key is asked for, its needle at relative ``depth`` (snapped to a sentence boundary), the
others (distractors with other keys) at random depths. Keys are adjective-noun pairs, values 7-digit numbers, as
RULER draws them. The answer is right when the asked value appears in the response (RULER's ``string_match_all``).
"""

from __future__ import annotations

import random

from evalkit.tasks.needle import haystack

NEEDLE = "One of the special magic numbers for {key} is: {value}."
INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. I will quiz you "
         "about the numbers afterwards.")
QUESTION = "What are all the special magic numbers for {key} mentioned in the provided text?"
ANSWER_PREFIX = "The special magic numbers for {key} mentioned in the provided text are"
ADJECTIVES = ("abrupt", "amber", "ancient", "brave", "brisk", "calm", "clever", "crimson", "curious", "damp", "eager",
              "faint", "fierce", "gentle", "glossy", "hollow", "humble", "icy", "jolly", "keen", "lively", "lucky",
              "mellow", "misty", "noble", "odd", "pale", "quiet", "rapid", "rustic", "silent", "sturdy", "tender",
              "vivid", "wary", "witty", "young", "zealous")
NOUNS = ("anchor", "badger", "barn", "beacon", "canyon", "cedar", "comet", "delta", "ember", "falcon", "fjord",
         "garnet", "harbor", "heron", "island", "jasper", "kettle", "lantern", "meadow", "monsoon", "nectar", "orchid",
         "otter", "pebble", "quarry", "raven", "saddle", "spruce", "thistle", "tundra", "valley", "walrus", "willow",
         "yarrow", "zephyr")


def _keys(rng: random.Random, count: int) -> list[str]:
    pairs = rng.sample([f"{a}-{n}" for a in ADJECTIVES for n in NOUNS], count)
    return pairs


def build_examples(lengths: list[int], depths: list[float], keys: int = 4, per_cell: int = 1,
                   seed: int = 1234) -> list[dict]:
    if int(keys) < 1:
        raise ValueError(f"keys must be at least 1 (the asked needle), got {keys}")
    rng, rows = random.Random(seed), []
    for length, depth, index, chunk in haystack.cells(lengths, depths, per_cell, rng):
        names = _keys(rng, int(keys))
        values = [str(rng.randrange(1_000_000, 10_000_000)) for _ in names]
        needles = [(float(depth), NEEDLE.format(key=names[0], value=values[0]))]
        needles += [(rng.random(), NEEDLE.format(key=k, value=v)) for k, v in zip(names[1:], values[1:])]
        rows.append({"id": f"len{length}-depth{depth}-{index}", "context": f"{INTRO}\n{haystack.insert(chunk, needles)}",
                     "key": names[0], "answer": values[0], "length": str(length), "depth": f"{float(depth):g}"})
    return rows


def score(doc: dict, response: str) -> dict:
    return {"exact_match": float(doc["answer"] in response)}
