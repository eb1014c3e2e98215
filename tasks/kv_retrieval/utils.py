"""lm-eval hooks of the kv_retrieval task: the dataset comes from evalkit.models.synthetic, scoring is exact match."""

import datasets

from evalkit.models import synthetic


def load(n_samples=100, seed=1234, min_pairs=40, max_pairs=72, **_metadata):
    rows = synthetic.build_examples(int(n_samples), int(seed), int(min_pairs), int(max_pairs))
    for row in rows:
        row["depth_bucket"] = synthetic.depth_bucket(row["depth"])
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def process_results(doc, results):
    return {"exact_match": float(synthetic.first_words(results[0]) == doc["answer"])}
