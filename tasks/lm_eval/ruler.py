"""What evalkit adds to lm-eval's RULER tasks (lm_eval/tasks/ruler: niah_*, ruler_vt, ruler_cwe, ruler_fwe, ruler_qa_*).

RULER builds its documents at run time with the model's tokenizer (the run passes its model as lm-eval's CLI does:
metadata ``pretrained``; ``task.metadata.tokenizer`` names another), one set per length in
``task.metadata.max_seq_lengths``. Its metrics are named by length (``"4096"``): a document scores at its own
length and reports ``-1`` at every other one, and a length with no documents aggregates to ``-1``. Here each sample
scores at its own length, its subset is that length, and lengths that were not built leave no metric row. The
prompt is RULER's own; :func:`doc_to_question` says where its context ends, for ``compression_scope=context``.
"""

NOT_BUILT = -1.0  # RULER's value for "no document of this length"


def sample_metric(sample: dict, metric_names: list[str]) -> str | None:
    """The metric that scores this sample: its document's length."""
    length = str((sample.get("doc") or {}).get("max_length"))
    return length if length in sample else None  # a length outside RULER's YAML list is scored too


def sample_subset(doc: dict) -> str:
    return str(doc.get("max_length"))


def metric_applies(name: str, value: float) -> bool:
    """False for a length RULER was not asked to build (it aggregates to -1)."""
    return value != NOT_BUILT


# Where each RULER template's question begins (after its context): niah (both of its wordings), vt, cwe, fwe, qa
# (lm_eval/tasks/ruler/*.py).
QUESTION_LEADS = (
    "\nWhat are all the special magic",
    "\nWhat is the special magic",  # one needle, one value: prepare_niah rewrites "are all" to "is"
    "\nQuestion: Find all variables",
    "\nQuestion: What are the 10 most common words",
    "\nQuestion: Do not provide any explanation.",
    "\n\nAnswer the question based on the given documents.",
)


def doc_to_question(doc: dict) -> str | None:
    """What follows the context in RULER's prompt (its ``{{input}}``): the question, so that
    ``compression_scope=context`` compresses the context alone (query-agnostic, as kvpress' RULER leaderboard splits
    context and question); None where no template's question is found."""
    text = doc["input"]
    start = max(text.rfind(lead) for lead in QUESTION_LEADS)
    return None if start < 0 else text[start:]
