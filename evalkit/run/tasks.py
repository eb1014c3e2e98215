"""lm-eval task plumbing: a task's config with the run's options, its index, loading with the data checked, and the
two-call (reasoning, then answer) protocol."""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

from evalkit.paths import tasks_dir
from evalkit.results.rows import doc_key
from evalkit.scoring import all_responses

from .errors import RunError


def task_with_options(task: str, options: dict, bad_rows: str = "error") -> dict:
    """The task's lm-eval YAML as a dict, with the run's dataset/generation/repeats options applied."""
    from lm_eval.tasks._yaml_loader import load_yaml

    config = load_yaml(tasks_dir() / task / f"{task}.yaml", resolve_func=True)
    config["dataset_kwargs"] = {**(config.get("dataset_kwargs") or {}), **options.get("dataset", {}), "bad_rows": bad_rows}
    config["generation_kwargs"] = {**(config.get("generation_kwargs") or {}), **options.get("generation", {})}
    if "repeats" in options:
        config["repeats"] = options["repeats"]
    if options.get("gen_prefix"):
        config["gen_prefix"] = options["gen_prefix"]
    return config


@functools.lru_cache(maxsize=1)
def task_manager():
    """lm-eval's task index over evalkit's tasks only (indexing lm-eval's own thousands of tasks takes seconds)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(tasks_dir()), include_defaults=False)


def task_object(config: dict):
    """The lm-eval task built from its config dict (dataset loaded)."""
    from lm_eval.tasks import get_task_dict

    (task,) = get_task_dict([config], task_manager()).values()
    return task


def load_task(config: dict):
    """The task with its data loaded and checked, and the rows it skipped (``bad_rows=skip``). A malformed file or
    row is a :class:`RunError` naming the file, the row and the field."""
    from evalkit.scoring.data import DataError, collecting_skipped_rows

    with collecting_skipped_rows() as skipped:
        try:
            task = task_object(config)
        except DataError as error:
            raise RunError(f"data: {error}") from None
    return task, skipped


def reasoning_pass(evaluate, task_config: dict, request_stats: dict, progress_path: Path):
    """Two-call chain of thought (LongBench-v2's CoT protocol): first the reasoning over the whole prompt, then the
    answer call, which gets the reasoning and the question but not the document.

    Returns the answer pass's task config, the reasoning pass's statistics per document (the compression that
    matters happened on the document), and the reasoning per document.
    """
    first = copy.deepcopy(task_config)
    first["generation_kwargs"]["max_gen_toks"] = int(first["dataset_kwargs"].get("reasoning_max_gen_toks", 1024))
    task = task_config["task"]
    results = evaluate(first)
    reasoning, stats = {}, {}
    for sample in results["samples"][task]:
        key = doc_key(sample["doc"])
        reasoning[key] = all_responses(sample.get("resps") or [])[0]
        stats[key] = request_stats.get((task, sample["doc_id"], 0), {})
    path = progress_path.with_name(f"{progress_path.stem}-reasoning.jsonl")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": k, "reasoning": v}) + "\n" for k, v in reasoning.items()))
    answer = copy.deepcopy(task_config)
    answer["dataset_kwargs"]["reasoning_file"] = str(path)
    return answer, stats, reasoning


def stats_of_reasoning_pass(results: dict, task: str, stats_by_doc: dict) -> dict:
    """The answer pass's requests mapped to the reasoning pass's statistics of the same document."""
    return {(task, sample["doc_id"], 0): stats_by_doc.get(doc_key(sample["doc"]), {}) for sample in results["samples"][task]}

