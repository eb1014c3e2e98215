"""lm-eval hooks of the needle_multikey task; the haystack and scoring live beside them, in needle_multikey.py."""

import datasets

from evalkit.tasks.needle import haystack
from evalkit.tasks.needle_multikey import needle_multikey


def load(lengths=(1000, 1800), depths=(0.0, 0.25, 0.5, 0.75, 1.0), keys=4, per_cell=2, seed=1234, **_options):
    rows = needle_multikey.build_examples(list(lengths), list(depths), int(keys), int(per_cell), int(seed))
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def doc_to_text(doc):
    return doc["context"] + doc_to_question(doc)


def doc_to_question(doc):
    """What follows the document in the prompt: compression_scope=context compresses only what precedes it."""
    return "\n" + needle_multikey.QUESTION.format(key=doc["key"])


def dataset_identity(dataset_kwargs):
    """The haystack is built at run time from the Python docs: their version is the data's identity."""
    return haystack.source()


def process_results(doc, results):
    return needle_multikey.score(doc, results[0])
