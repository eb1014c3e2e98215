"""AIME 2024: pass@1 over n samples and cons@n, answers checked by math-verify.

Two prompt styles (``prompt_style``): ``r1``, the DeepSeek-R1 report's directive (reproduces R1's AIME table) and
``lighteval``, lighteval's ``aime_prompt_fn`` at open-r1's pin (reproduces open-r1's published AIME numbers, which
lighteval computes). Three answer extraction profiles (``extraction``): ``open_r1`` (default: open-r1's
``accuracy_reward``, src/open_r1/rewards.py, over the whole completion), ``lighteval`` (its aime24 ``math_pass@1``
metric at open-r1's pin: expressions and LaTeX, unboxed final answers too) and ``r1_final_box`` (the last
``\\boxed{}`` after the last ``</think>`` only).
"""

from __future__ import annotations

import re
import threading

from evalkit.scoring.data import RowError

HUB_IDS = ("HuggingFaceH4/aime_2024", "Maxwell-Jia/AIME_2024")
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
THINK_END = "</think>"


def normalize_row(row: dict) -> dict:
    """Both hub schemas (problem/answer and Problem/Answer) to ``problem``, ``answer`` (a string) and ``id`` (the row's
    ``id``, ``url`` or MATH-500's ``unique_id``, else the problem's start)."""
    lower = {key.lower(): value for key, value in row.items()}
    for field in ("problem", "answer"):
        if lower.get(field) is None:
            raise RowError(field, "missing (expected problem/answer or Problem/Answer)")
    if not isinstance(lower["problem"], str):
        raise RowError("problem", f"must be a string, got {type(lower['problem']).__name__}")
    if not isinstance(lower["answer"], (str, int)) or isinstance(lower["answer"], bool):
        raise RowError("answer", f"must be a string or an integer, got {type(lower['answer']).__name__}")
    identifier = lower.get("id", lower.get("url", lower.get("unique_id", lower["problem"][:40])))
    extra = {key: str(lower[key]) for key in ("level", "subject") if lower.get(key) is not None}  # MATH-500's
    return {"id": str(identifier), "problem": lower["problem"], "answer": str(lower["answer"]).strip(), **extra}


# lighteval src/lighteval/tasks/default_prompts.py `aime_prompt_fn` (at d3da6b9, open-r1's pin), after .format().
LIGHTEVAL_TEMPLATE = (
    "Solve the following math problem efficiently and clearly.  The last line of your response should be of the "
    "following format: 'Therefore, the final answer is: $\\boxed{ANSWER}$. I hope it is correct' (without quotes) "
    "where ANSWER is just the final number or expression that solves the problem. Think step by step before "
    "answering.\n\n{problem}"
)
PROMPT_STYLES = ("r1", "lighteval")
EXTRACTIONS = ("open_r1", "lighteval", "r1_final_box")


def prompt(doc: dict) -> str:
    """The user turn of ``doc["prompt_style"]`` (default r1)."""
    if doc.get("prompt_style") == "lighteval":
        return LIGHTEVAL_TEMPLATE.replace("{problem}", doc["problem"])
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


def parse_gold(gold: str, extraction: str = "open_r1") -> list:
    """The gold answer as the profile parses it: open-r1 with math-verify's default extraction (first match);
    lighteval stripped, with the same extraction as its predictions."""
    from math_verify import parse

    if extraction == "lighteval":
        return parse(gold.strip(), extraction_config=lighteval_extraction(), fallback_mode="no_fallback",
                     extraction_mode="any_match", parsing_timeout=_timeout())
    return parse(gold, extraction_mode="first_match", parsing_timeout=_timeout())


def parse_answer(response: str, extraction: str = "open_r1") -> list:
    """A response's final answer under the ``extraction`` profile; empty when there is none or it does not parse.

    - ``open_r1``: the whole completion through open-r1's configuration (:func:`open_r1_extraction`), first match;
    - ``lighteval``: the stripped completion through :func:`lighteval_extraction`, no fallback, any match (an empty
      completion has no answer);
    - ``r1_final_box``: the last ``\\boxed{}`` after any ``</think>``, parsed with open-r1's configuration.
    """
    from math_verify import parse

    if extraction not in EXTRACTIONS:
        raise ValueError(f"extraction must be one of {EXTRACTIONS}, got {extraction!r}")
    if extraction == "lighteval":
        if not response:
            return []
        return parse(response.strip(), extraction_config=lighteval_extraction(), fallback_mode="no_fallback",
                     extraction_mode="any_match", parsing_timeout=_timeout())
    if extraction == "r1_final_box":
        boxed = last_boxed(final_part(response))
        if boxed is None:
            return []
        response = f"\\boxed{{{boxed}}}"
    return parse(response, extraction_config=open_r1_extraction(), extraction_mode="first_match",
                 parsing_timeout=_timeout())


def open_r1_extraction() -> list:
    """open-r1's ``accuracy_reward`` configuration of math-verify (src/open_r1/rewards.py), exactly: LaTeX only,
    boxed answers first, nothing extracted without an anchor."""
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig

    return [LatexExtractionConfig(
        normalization_config=NormalizationConfig(nits=False, malformed_operators=False, basic_latex=True,
                                                 equations=True, boxed="all", units=True),
        boxed_match_priority=0, try_extract_without_anchor=False)]


def lighteval_extraction() -> list:
    """lighteval's aime24 targets at open-r1's pin (metrics.py ``math_pass_at_1_*``: ``[ExprExtractionConfig(),
    LatexExtractionConfig()]``) with that version's defaults (extractive_match_utils.py): anchors optional, boxed
    priority 55, LaTeX normalization with nits, malformed operators, boxed="all", units and equations."""
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    return [ExprExtractionConfig(try_extract_without_anchor=True), LatexExtractionConfig(
        try_extract_without_anchor=True, boxed_match_priority=55,
        normalization_config=NormalizationConfig(basic_latex=True, units=True, malformed_operators=True, nits=True,
                                                 boxed="all", equations=True))]


def equivalent(gold: list, answer: list) -> bool:
    """math-verify, gold first (lighteval's ``compare_gold_target``: 6 digits, strict)."""
    from math_verify import verify

    return bool(answer) and bool(verify(gold, answer, float_rounding=6, strict=True, timeout_seconds=_timeout()))


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


def score(doc: dict, responses: list[str], extraction: str = "open_r1") -> dict:
    """pass@1 (mean correctness over the samples), cons@n (the majority answer's correctness) and the extraction
    failure rate, under the ``extraction`` profile."""
    gold = parse_gold(doc["answer"], extraction)
    answers = [parse_answer(response, extraction) for response in responses]
    correct = [equivalent(gold, answer) for answer in answers]
    voted = majority(answers)
    return {
        "pass@1": sum(correct) / len(responses),
        "cons@n": float(voted is not None and equivalent(gold, voted)),
        "extraction_failed": sum(not answer for answer in answers) / len(responses),
    }
