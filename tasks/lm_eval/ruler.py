"""What evalkit adds to lm-eval's RULER tasks (lm_eval/tasks/ruler: niah_*, ruler_vt, ruler_cwe, ruler_fwe, ruler_qa_*).

RULER builds its documents at run time with the model's tokenizer (the run passes its model as lm-eval's CLI does:
metadata ``pretrained``; ``task.metadata.tokenizer`` names another), one set per length in
``task.metadata.max_seq_lengths``. Its metrics are named by length (``"4096"``): a document scores at its own
length and reports ``-1`` at every other one, and a length with no documents aggregates to ``-1``. Here each sample
scores at its own length, its subset is that length, and lengths that were not built leave no metric row.
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
