"""lm-eval hooks of LongBench-v2; the protocol itself lives beside them, in longbench.py."""

import copy
import json

import datasets

from evalkit.benchmark import all_responses
from evalkit.benchmark.data import checked_rows, load_rows
from evalkit.results.rows import doc_key
from evalkit.tasks.longbench_v2 import longbench


def load(path=longbench.HUB_ID, cot=False, reasoning_file=None, reasoning_max_gen_toks=1024, bad_rows="error",
         empty_output="skip", **_metadata):
    """``cot``: the two-call protocol (:func:`generation_flow` runs the reasoning call, then passes its
    ``reasoning_file``).
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


def doc_to_question(doc):
    return longbench.question(longbench.TEMPLATES[doc["prompt_mode"]], doc, doc["reasoning"])


def process_results(doc, results):
    return longbench.score(doc, results[0], doc["empty_output"])


def count(items):
    """lm-eval aggregation: how many (``empty_outputs`` is 1 per empty output)."""
    return float(sum(items))


def generation_flow(evaluate, config, request_stats, scratch):
    """The two-call chain of thought (``dataset.cot``, LongBench-v2's CoT protocol): first the reasoning over the
    whole prompt, then the answer call, which gets the reasoning and the question but not the document. Its rows carry
    the reasoning call's statistics (the compression that matters happened on the document) and the reasoning per
    document. None without ``cot``: the run's one pass."""
    if not config["dataset_kwargs"].get("cot"):
        return None
    task = config["task"]
    first = copy.deepcopy(config)
    first["generation_kwargs"]["max_gen_toks"] = int(first["dataset_kwargs"].get("reasoning_max_gen_toks", 1024))
    reasoning, stats = {}, {}
    for sample in evaluate(first)["samples"][task]:
        key = doc_key(sample["doc"])
        reasoning[key] = all_responses(sample.get("resps") or [])[0]
        stats[key] = request_stats.get((task, sample["doc_id"], 0), {})
    path = scratch.with_name(f"{scratch.name}-reasoning.jsonl")
    path.write_text("".join(json.dumps({"id": k, "reasoning": v}) + "\n" for k, v in reasoning.items()))
    answer = copy.deepcopy(config)
    answer["dataset_kwargs"]["reasoning_file"] = str(path)
    results = evaluate(answer)
    answer_stats = {(task, s["doc_id"], 0): stats.get(doc_key(s["doc"]), {}) for s in results["samples"][task]}
    return results, answer_stats, reasoning
