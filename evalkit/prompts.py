"""What a prompt carries besides its text, without torch or lm-eval: the mark between a task's document and its
question, and LongBench's middle truncation. Task code and scoring import it from here (cheaply)."""

from __future__ import annotations

# Tasks put this character where the document ends and the question begins. The adapter always removes it; with
# compression_scope="context" it compresses only the text before it (question-agnostic compression).
CONTEXT_END = "\u2063"
SCOPES = ("prompt", "context")
TRUNCATIONS = ("left", "middle")


def truncate_middle(tokenizer, text: str, max_len: int) -> tuple[str, bool]:
    """LongBench's truncation (pred.py), on the raw prompt before any chat template: ``ids = tokenizer.encode(prompt)``
    (special tokens included, as there); if longer than ``max_len``, keep ``ids[:max_len//2] + ids[-max_len//2:]`` and
    decode with ``skip_special_tokens=True``. The :data:`CONTEXT_END` mark is put back before the text that followed
    it when that text survived the cut (otherwise the document's end was cut away and the mark is dropped)."""
    head, marker, tail = text.partition(CONTEXT_END)
    ids = tokenizer.encode(head + tail)
    if len(ids) <= max_len:
        return text, False
    ids = ids[: max_len // 2] + ids[-max_len // 2 :]
    cut = tokenizer.decode(ids, skip_special_tokens=True)
    if marker and tail and cut.endswith(tail):
        cut = cut[: len(cut) - len(tail)] + CONTEXT_END + tail
    return cut, True
