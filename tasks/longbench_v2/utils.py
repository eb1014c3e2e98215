"""lm-eval hooks of LongBench-v2; the protocol itself lives beside them, in longbench.py."""

import json

import datasets

from evalkit.scoring.data import checked_rows, load_rows
from evalkit.tasks.longbench_v2 import longbench


def load(path=longbench.HUB_ID, cot=False, reasoning_file=None, reasoning_max_gen_toks=1024, bad_rows="error",
         empty_output="skip", **_metadata):
    """``cot``: the two-call protocol; the runner first runs the reasoning call, then passes its ``reasoning_file``.
    ``empty_output``: skip (official: out of the denominator) or zero (scored wrong)."""
    if empty_output not in longbench.EMPTY_OUTPUT:
        raise ValueError(f"task.dataset.empty_output must be one of {longbench.EMPTY_OUTPUT}, got {empty_output!r}")
    rows = checked_rows(load_rows(path, split="train"), path, longbench.check_row, bad_rows, id_field="_id")
    reasoning = {}
    if reasoning_file:
        with open(reasoning_file, encoding="utf-8") as handle:
            reasoning = {r["id"]: r["reasoning"] for r in map(json.loads, handle)}
    mode = "answer" if cot and reasoning_file else "reasoning" if cot else "zero_shot"
    rows = [{**row, "id": row["_id"], "prompt_mode": mode, "reasoning": reasoning.get(row["_id"], ""),
             "empty_output": empty_output} for row in rows]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def doc_to_text(doc):
    return longbench.fill(longbench.TEMPLATES[doc["prompt_mode"]], doc, doc["reasoning"])


def process_results(doc, results):
    return longbench.score(doc, results[0], doc["empty_output"])


def count(items):
    """lm-eval aggregation: how many (``empty_outputs`` is 1 per empty output)."""
    return float(sum(items))
