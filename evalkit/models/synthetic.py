"""The built-in known-answer task: long-context key -> value retrieval, generated deterministically from a seed.

A prompt lists ``n_pairs`` random entries, each a key after the two tokens of its value, written backwards
(``u<b> v<a> k<i>`` for the value ``v<a> u<b>``), then asks ``? k<i>`` for one key (the needle) whose depth in the
list varies from the first entry to the last; the answer is ``v<a> u<b>``. First value tokens are distinct within a
prompt.

Why two tokens: the first answer token is predicted from the prefill pass, which still sees the whole prompt (policies
compress after prefill). The second is predicted at the first decode step, from the compressed cache: it needs the
needle's entry to have survived. So a StreamingLLM window that no longer holds the needle loses it, and SnapKV, whose
observation window holds the question (whose attention went to the needle while reading the first token), keeps it.
Why backwards: both lookups are then the same two-layer circuit, which a tiny model learns fast
(:mod:`evalkit.models.train_tiny`): find the earlier copy of the current token and say the token before it (the asked key
gives ``v<a>``, then ``v<a>`` gives ``u<b>``).
"""

from __future__ import annotations

import random

NUM_KEYS = 256
NUM_VALUES = 128
SPECIAL = ["<pad>", "<s>", "</s>", "?", "="]


def vocabulary() -> list[str]:
    values = [f"v{i}" for i in range(NUM_VALUES)] + [f"u{i}" for i in range(NUM_VALUES)]
    return SPECIAL + [f"k{i}" for i in range(NUM_KEYS)] + values


def make_example(
    rng: random.Random, n_pairs: int, depth: float, num_keys: int = NUM_KEYS, num_values: int = NUM_VALUES
) -> dict:
    """One prompt with ``n_pairs`` pairs and the needle at relative ``depth`` in [0, 1].

    Keys and values are drawn from the first ``num_keys``/``num_values`` of the vocabulary (training starts small).
    """
    if not 1 <= n_pairs <= min(num_keys, num_values) or num_keys > NUM_KEYS or num_values > NUM_VALUES:
        raise ValueError(f"need 1 <= n_pairs <= num_keys <= {NUM_KEYS} and n_pairs <= num_values <= {NUM_VALUES}, "
                         f"got {n_pairs}, {num_keys}, {num_values}")
    keys = rng.sample(range(num_keys), n_pairs)
    values = [(a, rng.randrange(num_values)) for a in rng.sample(range(num_values), n_pairs)]
    needle = round(depth * (n_pairs - 1))
    return {
        "context": " ".join(f"u{b} v{a} k{k}" for k, (a, b) in zip(keys, values)),
        "question": f"? k{keys[needle]}",
        "answer": f"v{values[needle][0]} u{values[needle][1]}",
        "n_pairs": n_pairs,
        "needle_index": needle,
        "depth": needle / max(1, n_pairs - 1),
    }


def build_examples(n_samples: int = 100, seed: int = 1234, min_pairs: int = 40, max_pairs: int = 72) -> list[dict]:
    """``n_samples`` prompts, needle depths evenly spread over [0, 1], sizes drawn in [min_pairs, max_pairs]."""
    if n_samples < 1:
        raise ValueError(f"n_samples must be >= 1, got {n_samples}")
    if not 1 <= min_pairs <= max_pairs <= NUM_KEYS:
        raise ValueError(f"need 1 <= min_pairs <= max_pairs <= {NUM_KEYS}, got {min_pairs}, {max_pairs}")
    rng = random.Random(seed)
    depths = [index / max(1, n_samples - 1) for index in range(n_samples)]
    rng.shuffle(depths)  # so that the first N documents (limit=N) still span all depths
    rows = []
    for index, depth in enumerate(depths):
        row = make_example(rng, rng.randint(min_pairs, max_pairs), depth)
        rows.append({"id": f"kv-{seed}-{index:05d}", **row})
    return rows


def first_words(text: str, count: int = 2) -> str:
    """The first ``count`` words of a generation (what exact match compares with the answer)."""
    return " ".join(text.strip().split()[:count])


def depth_bucket(depth: float) -> str:
    """Where the needle sits, in thirds of the list: the subsets of the metrics table."""
    return "depth_early" if depth < 1 / 3 else "depth_middle" if depth < 2 / 3 else "depth_late"
