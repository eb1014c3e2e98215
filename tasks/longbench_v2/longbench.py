"""LongBench-v2 (Bai et al., 2024) with the official prompts, middle truncation and answer extraction.

With ``compression_scope=prompt`` (default) the adapter compresses the whole prompt, so SnapKV's observation window is
the prompt's last tokens after the chat template: the end of the choices, the answer-format instruction and the
template's generation prompt. With ``compression_scope=context`` only the text up to the end of the document is
compressed: :func:`question` gives what follows it (the prompt itself carries no mark).
"""

from __future__ import annotations

import re

from evalkit.benchmark.data import RowError, require_text

HUB_ID = "THUDM/LongBench-v2"
CHOICES = "What is the correct answer to this question: $Q$\nChoices:\n(A) $C_A$\n(B) $C_B$\n(C) $C_C$\n(D) $C_D$\n\n"
DOCUMENT = "Please read the following text and answer the question{s} below.\n\n<text>\n$DOC$\n</text>\n\n"
DOCUMENT_END = "</text>\n\n"
ZERO_SHOT = (DOCUMENT.format(s="") + CHOICES
             + 'Format your response as follows: "The correct answer is (insert answer here)".')
# Chain of thought, two calls: the reasoning over the document, then the answer call without the document.
COT = DOCUMENT.format(s="s") + CHOICES + "Let\u2019s think step by step:"
COT_ANSWER = (
    "Please read the following text and answer the questions below.\n\nThe text is too long and omitted here.\n\n"
    + CHOICES + "Let\u2019s think step by step: $COT$\n\nBased on the above, what is the single, most likely answer "
    'choice? Format your response as follows: "The correct answer is (insert answer here)".'
)
TEMPLATES = {"zero_shot": ZERO_SHOT, "reasoning": COT, "answer": COT_ANSWER}
PATTERNS = (re.compile(r"The correct answer is \(([A-D])\)"), re.compile(r"The correct answer is ([A-D])"))
REQUIRED = ("_id", "question", "choice_A", "choice_B", "choice_C", "choice_D", "answer", "context", "difficulty", "length")


def fill(template: str, doc: dict, reasoning: str = "") -> str:
    """The official substitution (pred.py): plain ``str.replace`` in its order, ``$DOC$`` first, then ``$Q$``, the
    choices and ``$COT$`` last, every field stripped; so a document that contains ``$Q$`` gets the question there, as
    in the official prompt."""
    text = template.replace("$DOC$", doc["context"].strip()).replace("$Q$", doc["question"].strip())
    for letter in "ABCD":
        text = text.replace(f"$C_{letter}$", doc[f"choice_{letter}"].strip())
    return text.replace("$COT$", reasoning.strip())


def question(template: str, doc: dict, reasoning: str = "") -> str | None:
    """What follows the document in :func:`fill`'s prompt: the template's part after ``</text>\n\n``, filled the
    same way (no placeholder spans that boundary, so the prompt ends with it); None for a template without a
    document."""
    if "$DOC$" not in template:
        return None
    return fill(template.partition(DOCUMENT_END)[2], doc, reasoning)


def extract_answer(response: str) -> str | None:
    """A-D from "The correct answer is (X)" (or without the parentheses), after removing ``*``; else None."""
    response = response.replace("*", "")
    for pattern in PATTERNS:
        match = pattern.search(response)
        if match:
            return match.group(1)
    return None


def check_row(row: dict) -> dict:
    """The row, if it has every field the protocol reads with the right type; else :class:`RowError`."""
    require_text(row, REQUIRED)
    if row["answer"] not in ("A", "B", "C", "D"):
        raise RowError("answer", f"must be A, B, C or D, got {row['answer']!r}")
    return row


EMPTY_OUTPUT = ("skip", "zero")


def score(doc: dict, response: str, empty_output: str = "skip") -> dict:
    """Accuracy and extraction failure of one response. An empty output (of the answer call, or of the reasoning
    call under CoT) is what pred.py drops (``if output == '': continue``), so result.py leaves it out of every
    denominator: with ``empty_output="skip"`` (official) it counts only in ``empty_outputs``; ``"zero"`` scores it
    wrong."""
    if empty_output not in EMPTY_OUTPUT:
        raise ValueError(f"empty_output must be one of {EMPTY_OUTPUT}, got {empty_output!r}")
    empty = response == "" or (doc.get("prompt_mode") == "answer" and doc.get("reasoning") == "")
    if empty and empty_output == "skip":
        return {"empty_outputs": 1.0}
    predicted = extract_answer(response)
    return {"accuracy": float(predicted == doc["answer"]), "extraction_failed": float(predicted is None),
            "empty_outputs": float(empty)}
