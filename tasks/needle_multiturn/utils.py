"""lm-eval hooks of the needle_multiturn task: sessions of needles built from the Python docs, scored as needle is."""

import datasets

from evalkit.tasks.needle import haystack, needle
from evalkit.tasks.needle_multiturn import needle_multiturn


def load(lengths=(1000,), needles=4, per_length=2, seed=1234, **_options):
    docs = needle_multiturn.build_sessions(list(lengths), int(needles), int(per_length), int(seed))
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})


def doc_to_text(doc):
    return doc["context"] + doc_to_question(doc)


def doc_to_question(doc):
    """What follows the document in a single prompt: where a session's shared context ends."""
    return f"\n\n{doc['question']}"


def doc_to_follow_up(doc):
    """A later turn of the chat: the question alone."""
    return doc_to_question(doc)


def dataset_identity(dataset_kwargs):
    return f"needle_multiturn:{haystack.source()}"


def process_results(doc, results):
    return needle.score(doc, results[0])
