"""AIME 2024: pass@1 over n samples and cons@n, answers checked by math-verify.

Two prompt styles (``prompt_style``): ``r1``, the DeepSeek-R1 report's directive (reproduces R1's AIME table) and
``lighteval``, lighteval's ``aime_prompt_fn`` at open-r1's pin (reproduces open-r1's published AIME numbers, which
lighteval computes). Three answer extraction profiles (``extraction``): ``open_r1`` (default: open-r1's
``accuracy_reward``, src/open_r1/rewards.py, over the whole completion), ``lighteval`` (its aime24 ``math_pass@1``
metric at open-r1's pin: expressions and LaTeX, unboxed final answers too) and ``r1_final_box`` (the last
``\\boxed{}`` after the last ``</think>`` only).

The ``open_r1`` and ``r1_final_box`` profiles pick a completion's final answer as math-verify 0.5.2 (open-r1's pin)
does (:func:`final_answer_052`) and let the installed math-verify read only that, so a completion that boxes more
than once scores as open-r1 scored it whatever math-verify release is installed.
"""

from __future__ import annotations

import functools
import re
import threading

from evalkit.benchmark.data import RowError

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

    Under ``open_r1`` and ``r1_final_box`` math-verify reads only :func:`final_answer_052`'s choice.
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
    chosen = final_answer_052(response)
    if chosen is None:
        return []
    return parse(chosen, extraction_config=open_r1_extraction(), extraction_mode="first_match",
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


# -- The final answer as math-verify 0.5.2 picks it ----------------------------------------------------------------
# open-r1 pins math-verify 0.5.2, which pins latex2sympy2-extended 1.0.6 and so antlr4-python3-runtime 4.13.2, while
# hydra-core needs antlr4 4.9: the pin cannot be installed beside evalkit. Later releases choose another final answer
# when a completion boxes more than once. Both read the span from the first ``\boxed{`` to the last ``}`` and keep the
# last box of it, with the boxes just before it that are part of the same answer; 1.0.6 counts a box as part of it
# only when nothing but "and", "or" or a comma (and spaces) stands between, latex2sympy2-extended 1.10 and later also
# when fewer than 10 characters stand between or a separator word within 70 does (``<think>\boxed{7}</think>
# \boxed{204}`` reads 7,204; ``So \boxed{100} and then \boxed{204}`` 100,204), and 1.11 drops a repeated box. So the
# match is chosen here with 0.5.2's patterns (math_verify/parser.py ``lazy_latex_regex`` for open-r1's configuration:
# boxed first, nothing without an anchor) and 1.0.6's box selection (math_normalization.py ``extract_boxed_content``),
# and the installed math-verify reads that match alone, each of its boxed parts given as the one box 0.5.2 read.
_ENV_CONTENTS = {  # 0.5.2's make_latex_env_pattern: each LaTeX environment, its delimiters and what it may contain
    "latexDisplayDollar": (r"(?<!\\)\$\$", r"(?:[^$]|\$(?!\$))", r"(?<!\\)\$\$"),
    "latexDisplayBracket": (r"(?<!\\)\\\[", r"(?:[^\\]|\\(?!\]))", r"(?<!\\)\\\]"),
    "latexInlineDollar": (r"(?<!\\|\d)\$", r"(?:\\[$]|[^\n$])", r"(?<!\\)\$"),
    "latexInlineParenthesis": (r"(?<!\\)\\\(", r"(?:[^\\\n]|\\(?!\)))", r"(?<!\\)\\\)"),
    "latexInlineBracket": (r"\s\[", r"[^\n\]\[]", r"\]\s"),
}
_SEPARATOR_052 = re.compile(r"^\s*(?:and|or|,)\s*$")  # latex2sympy2-extended 1.0.6's VALID_SEPARATOR_PATTERN


def _environments_052(prefix: str, boxed: bool) -> str:
    """0.5.2's ``make_latex_env_pattern``: any one LaTeX environment (holding a ``\\boxed{}`` where ``boxed``), an
    optional percent sign after it."""
    patterns = []
    for name, (start, body, end) in _ENV_CONTENTS.items():
        content = rf"{body}*?\\boxed{{{body}+?}}{body}*?" if boxed else rf"{body}+?"
        patterns.append(rf"{start}(?P<{prefix}{name}>{content}){end}")
    if not boxed:
        number = r"-?\d+(?:[.,]\d+)?"
        patterns.append(rf"(?P<{prefix}latexFraction>-?\\frac{{{number}}}{{{number}}})")
    return rf"(?:(?:{'|'.join(patterns)})\s*(?P<{prefix}percent>(?:\\?%|[Pp]ercent|[Pp]ercentage|[Pp]ct))?)"


@functools.lru_cache(maxsize=1)
def _patterns_052() -> list[tuple[int, re.Pattern]]:
    """0.5.2's ``lazy_latex_regex`` for open-r1's configuration, as (priority, pattern) in its order: up to six
    environments joined by "and", "or" or commas after a final-answer or answer anchor, or holding boxes, or the span
    from the first ``\\boxed{`` to the last ``}``."""
    def chain(boxed: bool) -> str:
        return _environments_052("first_", boxed) + "".join(
            rf"(?:\s*(?:and|or|,)\s*{_environments_052(f'next{index}_', boxed)})?" for index in range(1, 6))

    latex = f"(?:{chain(False)})"
    patterns = [(0, rf"(?i:final answer is)\:?\s*{latex}\.?\s?I hope"),
                (50, rf"(?i:final answer.{{0,100}}?)\s+is\:?\s*{latex}"),
                (100, rf"(?i:answer):.{{0,50}}?{latex}"), (200, rf"(?i:answer).{{0,50}}?{latex}"),
                (0, chain(True)), (0, r"(?P<first_latexBoxed>\\boxed{.+})")]
    return [(priority, re.compile(pattern, re.DOTALL)) for priority, pattern in patterns]


def _closing_brace(text: str, opening: int, end: int) -> int | None:
    depth = 1
    for index in range(opening + 1, end):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth == 0:
            return index
    return None


def _boxes_052(text: str, last: bool) -> str | None:
    """latex2sympy2-extended 1.0.6's ``extract_boxed_content``: the contents of the boxes of ``text`` joined by commas
    (``last``: only the last box and those joined to it by nothing but "and", "or" or a comma), read from the right.
    None where 1.0.6 returns something else (no box, or the last box unclosed or not followed by ``{``): there the
    later releases return the same thing, since they read the last box as 1.0.6 does and stop there."""
    contents, end, right = [], len(text), len(text)
    while (start := max(text.rfind("\\boxed", 0, right), text.rfind("\\fbox", 0, right))) >= 0:
        opening = start + (6 if text.startswith("\\boxed", start) else 5)
        while opening < end and text[opening].isspace():
            opening += 1
        closing = _closing_brace(text, opening, end) if opening < end and text[opening] == "{" else None
        if closing is None:
            return None if not contents else ",".join(reversed(contents))
        if last and contents and not _SEPARATOR_052.match(text[closing + 1:end]):
            break
        contents.append(text[opening + 1:closing].strip())
        end = right = start
    return ",".join(reversed(contents)) if contents else None


def final_answer_052(response: str) -> str | None:
    """The part of ``response`` that math-verify 0.5.2 reads under open-r1's configuration, each LaTeX part that holds
    boxes given as the one box of what 0.5.2 takes from them; None where 0.5.2 finds nothing. math-verify from 0.8 on
    reads the result as 0.5.2 read the response (``first_match``: the match ending last among the first priority that
    has any, the earliest-starting one on a tie)."""
    patterns = _patterns_052()
    for priority in sorted({priority for priority, _ in patterns}):
        matches = [match for level, pattern in patterns if level == priority for match in pattern.finditer(response)]
        if matches:
            break
    else:
        return None
    match = max(matches, key=lambda found: (found.end(), -found.start()))
    pieces, cursor = [], match.start()
    for name, value in match.groupdict().items():
        if value and "_latex" in name and (boxes := _boxes_052(value, name.endswith("_latexBoxed"))) is not None:
            pieces += [response[cursor:match.start(name)], f"\\boxed{{{boxes or ' '}}}"]  # math-verify matches no {}
            cursor = match.end(name)
    return "".join(pieces) + response[cursor:match.end()]


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
