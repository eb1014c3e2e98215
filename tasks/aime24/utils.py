"""lm-eval hooks of AIME24; the protocol itself lives in evalkit.scoring.aime."""

import datasets

from evalkit.scoring import aime, all_responses, keep_all_samples  # noqa: F401 (the filter named in the YAML)
from evalkit.scoring.data import checked_rows, load_rows


def load(path=aime.HUB_IDS[0], bad_rows="error", **_options):
    rows = checked_rows(load_rows(path, split="train"), path, aime.normalize_row, bad_rows)
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def doc_to_text(doc):
    return aime.prompt(doc)


def process_results(doc, results):
    return aime.score(doc, all_responses(results))
