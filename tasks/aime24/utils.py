"""lm-eval hooks of AIME24; the protocol itself lives beside them, in aime.py."""

import datasets

from evalkit.benchmark import all_responses, keep_all_samples  # noqa: F401 (the filter named in the YAML)
from evalkit.benchmark.data import DataError, checked_rows, load_rows
from evalkit.tasks.aime24 import aime


def load(path=aime.HUB_IDS[0], prompt_style="r1", extraction="open_r1", bad_rows="error", split="train", **_options):
    for name, value, choices in (("prompt_style", prompt_style, aime.PROMPT_STYLES),
                                 ("extraction", extraction, aime.EXTRACTIONS)):
        if value not in choices:
            raise DataError(f"task.dataset.{name} must be one of {list(choices)}, got {value!r}")
    rows = checked_rows(load_rows(path, split=split), path, aime.normalize_row, bad_rows)
    rows = [{**row, "prompt_style": prompt_style, "extraction": extraction} for row in rows]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def doc_to_text(doc):
    return aime.prompt(doc)


def process_results(doc, results):
    return aime.score(doc, all_responses(results), doc["extraction"])
