"""lm-eval hooks of the needle task; the haystack and scoring live beside them, in needle.py."""

import datasets

from evalkit.tasks.needle import haystack, needle


def load(lengths=(1000, 1800), depths=(0.0, 0.25, 0.5, 0.75, 1.0), per_cell=2, seed=1234, **_options):
    rows = needle.build_examples(list(lengths), list(depths), int(per_cell), int(seed))
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def doc_to_text(doc):
    return doc["context"] + doc_to_question(doc)


def doc_to_question(doc):
    """What follows the document in the prompt: compression_scope=context compresses only what precedes it."""
    return f"\n\n{doc['question']}"


def dataset_identity(dataset_kwargs):
    """The haystack is built at run time from the Python docs: their version is the data's identity."""
    return haystack.source()


def process_results(doc, results):
    return needle.score(doc, results[0])
