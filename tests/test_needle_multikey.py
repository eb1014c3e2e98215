"""needle_multikey (tasks/needle_multikey): RULER's niah_multikey_1 shape over Python's documentation; its needles,
depths, distractors, scoring and prompts as lm-eval renders them."""

from __future__ import annotations

import re

import pytest

from evalkit.tasks.needle_multikey import needle_multikey


def test_each_prompt_hides_its_keys_needles_with_the_asked_one_at_its_depth():
    rows = needle_multikey.build_examples([600], [0.0, 0.5, 1.0], keys=4, per_cell=2, seed=7)
    assert len(rows) == 6
    for row in rows:
        needles = re.findall(r"One of the special magic numbers for ([a-z]+-[a-z]+) is: (\d{7})\.", row["context"])
        assert len(needles) == 4 and len({key for key, _ in needles}) == 4  # the asked key and 3 distractors
        assert (row["key"], row["answer"]) in needles
        text = row["context"].removeprefix(needle_multikey.INTRO + "\n")
        where = text.index(f"for {row['key']} is:") / len(text)
        assert abs(where - float(row["depth"])) < 0.3, (where, row["depth"])  # snapped, shifted by the distractors
    first, last = (r for r in rows if r["depth"] in ("0", "1") and r["id"].endswith("-0"))
    assert first["context"].startswith(needle_multikey.INTRO + f"\nOne of the special magic numbers for {first['key']}")
    assert last["context"].rstrip().endswith(f"{last['key']} is: {last['answer']}.")


def test_the_same_seed_builds_the_same_prompts_and_another_seed_others():
    build = lambda seed: needle_multikey.build_examples([300], [0.5], keys=3, per_cell=1, seed=seed)  # noqa: E731
    assert build(1) == build(1) and build(1) != build(2)


def test_the_asked_value_anywhere_in_the_answer_scores_rulers_way():
    doc = {"answer": "1234567"}
    assert needle_multikey.score(doc, " 1234567.")["exact_match"] == 1.0
    assert needle_multikey.score(doc, " is: 7654321, not 1234567")["exact_match"] == 1.0
    assert needle_multikey.score(doc, " 123456")["exact_match"] == 0.0


@pytest.mark.parametrize("kwargs, message", [({"keys": 0}, "keys must be at least 1"),
                                             ({"depths": [1.5]}, "depths must be within"),
                                             ({"lengths": [10**6]}, "too long for the haystack")])
def test_a_mistaken_option_is_one_line(kwargs, message):
    options = {"lengths": [300], "depths": [0.5], "keys": 2, "per_cell": 1, "seed": 1} | kwargs
    with pytest.raises(ValueError, match=message):
        needle_multikey.build_examples(**options)
