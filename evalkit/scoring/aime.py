"""AIME 2024 with the DeepSeek-R1 protocol: boxed answers checked by math-verify, pass@1 over n samples and cons@n."""

from __future__ import annotations

import re
import threading

from evalkit.scoring.data import RowError

HUB_IDS = ("HuggingFaceH4/aime_2024", "Maxwell-Jia/AIME_2024")
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
THINK_END = "</think>"


def normalize_row(row: dict) -> dict:
    """Both hub schemas (problem/answer and Problem/Answer) to ``problem``, ``answer`` (a string) and ``id``."""
    lower = {key.lower(): value for key, value in row.items()}
    for field in ("problem", "answer"):
        if lower.get(field) is None:
            raise RowError(field, "missing (expected problem/answer or Problem/Answer)")
    if not isinstance(lower["problem"], str):
        raise RowError("problem", f"must be a string, got {type(lower['problem']).__name__}")
    if not isinstance(lower["answer"], (str, int)) or isinstance(lower["answer"], bool):
        raise RowError("answer", f"must be a string or an integer, got {type(lower['answer']).__name__}")
    identifier = lower.get("id", lower.get("url", lower["problem"][:40]))
    return {"id": str(identifier), "problem": lower["problem"], "answer": str(lower["answer"]).strip()}


def prompt(doc: dict) -> str:
    return f"{doc['problem']}\n{INSTRUCTION}"


def final_part(response: str) -> str:
    """What a thinking model says after its ``</think>`` block (all of it when there is none)."""
    return response.rsplit(THINK_END, 1)[-1]


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` with balanced braces, or None."""
    start = None
    for match in re.finditer(r"\\boxed\s*\{", text):
        start = match.end()
    if start is None:
        return None
    depth = 1
    for index in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth == 0:
            return text[start:index]
    return None


def _timeout() -> int | None:
    """math-verify's timeouts use signals, which work only in the main thread; elsewhere they are disabled."""
    return 5 if threading.current_thread() is threading.main_thread() else None


def parse_gold(gold: str) -> list:
    """The gold answer as open-r1 parses it: math-verify's default extraction, first match."""
    from math_verify import parse

    return parse(gold, extraction_mode="first_match", parsing_timeout=_timeout())


def parse_answer(response: str) -> list:
    """A response's final answer: the last ``\\boxed{}`` after any ``</think>``, parsed by math-verify with
    open-r1's configuration (:func:`open_r1_extraction`); empty when there is none or it does not parse."""
    from math_verify import parse

    boxed = last_boxed(final_part(response))
    if boxed is None:
        return []
    return parse(f"\\boxed{{{boxed}}}", extraction_config=open_r1_extraction(), extraction_mode="first_match",
                 parsing_timeout=_timeout())


def open_r1_extraction() -> list:
    """open-r1's ``accuracy_reward`` configuration of math-verify (src/open_r1/rewards.py): LaTeX only, boxed
    answers first, nothing extracted without an anchor; ``equations`` is left out, as math-verify now handles
    equations in its parser and warns on the flag."""
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig

    return [LatexExtractionConfig(
        normalization_config=NormalizationConfig(nits=False, malformed_operators=False, basic_latex=True, boxed="all",
                                                 units=True),
        boxed_match_priority=0, try_extract_without_anchor=False)]


def equivalent(gold: list, answer: list) -> bool:
    """math-verify, gold first."""
    from math_verify import verify

    return bool(answer) and bool(verify(gold, answer, timeout_seconds=_timeout()))


def majority(answers: list[list]) -> list | None:
    """The answer most samples agree on, where agreeing means math-verify equivalence (``204``, ``\\text{204}`` and
    ``204.0`` vote together); ties go to the answer seen first. None when no sample has an answer."""
    groups: list[tuple[list, int]] = []
    for answer in answers:
        if not answer:
            continue
        for index, (representative, count) in enumerate(groups):
            if equivalent(representative, answer):
                groups[index] = (representative, count + 1)
                break
        else:
            groups.append((answer, 1))
    return max(groups, key=lambda group: group[1])[0] if groups else None


def score(doc: dict, responses: list[str]) -> dict:
    """pass@1 (mean correctness over the samples), cons@n (the majority answer's correctness) and the extraction
    failure rate."""
    gold = parse_gold(doc["answer"])
    answers = [parse_answer(response) for response in responses]
    correct = [equivalent(gold, answer) for answer in answers]
    voted = majority(answers)
    return {
        "pass@1": sum(correct) / len(responses),
        "cons@n": float(voted is not None and equivalent(gold, voted)),
        "extraction_failed": sum(not answer for answer in answers) / len(responses),
    }
