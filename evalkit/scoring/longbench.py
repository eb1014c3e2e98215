"""LongBench-v2 (Bai et al., 2024) with the official prompts, middle truncation and answer extraction.

The document is followed by :data:`evalkit.lm.CONTEXT_END`: with ``compression_scope=prompt`` (default) the adapter
drops the mark and compresses the whole prompt, so SnapKV's observation window is the prompt's last tokens after the
chat template: the end of the choices, the answer-format instruction and the template's generation prompt. With
``compression_scope=context`` only the text up to the end of the document is compressed.
"""

from __future__ import annotations

import re

from evalkit.lm import CONTEXT_END
from evalkit.scoring.data import RowError, require_text

HUB_ID = "THUDM/LongBench-v2"
CHOICES = "What is the correct answer to this question: $Q$\nChoices:\n(A) $C_A$\n(B) $C_B$\n(C) $C_C$\n(D) $C_D$\n\n"
DOCUMENT = "Please read the following text and answer the question{s} below.\n\n<text>\n$DOC$\n</text>\n\n"
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
    """The official substitution: every field stripped; the document is followed by the context-end mark."""
    text = template.replace("$Q$", doc["question"].strip()).replace("$COT$", reasoning.strip())
    for letter in "ABCD":
        text = text.replace(f"$C_{letter}$", doc[f"choice_{letter}"].strip())
    if "$DOC$" in text:
        head, tail = text.split("$DOC$")
        tail_head, _, rest = tail.partition("</text>\n\n")
        text = head + doc["context"].strip() + tail_head + "</text>\n\n" + CONTEXT_END + rest
    return text


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


def score(doc: dict, response: str) -> dict:
    predicted = extract_answer(response)
    return {"accuracy": float(predicted == doc["answer"]), "extraction_failed": float(predicted is None)}
