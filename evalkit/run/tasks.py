"""lm-eval task plumbing: a task's config with the run's options, its index, loading with the data checked, and the
two-call (reasoning, then answer) protocol."""

from __future__ import annotations

import copy
import functools
import hashlib
import json
from pathlib import Path

from evalkit.paths import tasks_dir
from evalkit.results.rows import doc_key
from evalkit.scoring import all_responses

from .errors import RunError, one_line
from .spec import LM_EVAL


def task_with_options(task: str, options: dict, bad_rows: str = "error", pretrained: str | None = None) -> dict:
    """The task's lm-eval YAML as a dict, with the run's dataset/generation/repeats options applied. ``pretrained``
    (the run's model, a local path or hub id) reaches an lm-eval task's metadata as lm-eval's CLI passes its model
    arguments: tasks that build their data with the model's tokenizer (RULER) read it there."""
    from lm_eval.tasks._yaml_loader import load_yaml

    if options.get("source") == LM_EVAL:
        return registry_task(task, options, pretrained)
    config = load_yaml(tasks_dir() / task / f"{task}.yaml", resolve_func=True)
    config["dataset_kwargs"] = {**(config.get("dataset_kwargs") or {}), **options.get("dataset", {}), "bad_rows": bad_rows}
    config["generation_kwargs"] = {**(config.get("generation_kwargs") or {}), **options.get("generation", {})}
    if "repeats" in options:
        config["repeats"] = options["repeats"]
    if options.get("gen_prefix"):
        config["gen_prefix"] = options["gen_prefix"]
    return config


@functools.lru_cache(maxsize=1)
def registry():
    """lm-eval's whole task index (thousands of tasks: ten seconds to build, so only when a run asks for one of them).
    Built once per installed lm-eval and kept on disk (``$EVALKIT_CACHE/lm_eval_index/``), keyed by lm-eval's version
    and the names, sizes and modification times of its task files: a later run loads it in about a second, and any
    change to lm-eval's tasks builds it again."""
    import os
    import pickle
    import tempfile

    import lm_eval
    from lm_eval.tasks import TaskManager

    from evalkit.identity import cache_dir

    root = Path(lm_eval.__file__).parent / "tasks"
    listing = hashlib.sha256(lm_eval.__version__.encode())
    for folder, _, files in sorted(os.walk(root)):
        for name in sorted(files):
            stat = (Path(folder) / name).stat()
            listing.update(f"{Path(folder, name).relative_to(root)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    path = cache_dir() / "lm_eval_index" / f"{listing.hexdigest()[:24]}.pkl"
    if path.is_file():
        try:
            with path.open("rb") as handle:
                return pickle.load(handle)  # evalkit's own file, written below
        except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ImportError):
            pass  # unreadable (another lm-eval's classes, a partial file): built again
    manager = TaskManager()
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, delete=False, suffix=".tmp") as handle:
            temporary = Path(handle.name)
            pickle.dump(manager, handle)
        os.replace(temporary, path)  # whole or not at all
    except (OSError, pickle.PicklingError, AttributeError, TypeError):  # no room, unpicklable: built next time
        if temporary is not None:
            temporary.unlink(missing_ok=True)
    return manager


def registry_entry(task: str):
    """lm-eval's index entry of ``task`` (a task, group or tag); a ConfigError naming the nearest names for an unknown
    one."""
    import difflib

    from .errors import ConfigError

    entry = registry().task_index.get(task)
    if entry is None:
        near = difflib.get_close_matches(task, registry().all_tasks, n=3, cutoff=0.6)
        raise ConfigError(f"lm-eval knows no task {task!r}" + (f"; did you mean {', '.join(near)}?" if near else ""))
    return entry


def registry_yaml(task: str) -> Path | None:
    """The YAML file of lm-eval's task or group ``task`` (None for a tag, which has none of its own)."""
    entry = registry_entry(task)
    return Path(entry.yaml_path) if entry.yaml_path is not None else None


def task_members(task: str, options: dict) -> list[str]:
    """The tasks a run of ``task`` evaluates: the task itself, or the tasks of an lm-eval group or tag (nested groups
    expanded, in the group's order)."""
    from .errors import ConfigError

    if options.get("source") != LM_EVAL:
        return [task]
    entry = registry_entry(task)
    if entry.kind.name in ("TASK", "PY_TASK"):
        return [task]
    names = sorted(entry.tags) if entry.kind.name == "TAG" else list((entry.cfg or {}).get("task") or [])
    members: list[str] = []
    for name in names:
        if not isinstance(name, str):
            raise ConfigError(f"lm-eval group {task} defines a task inline; evalkit runs groups of named tasks "
                              "(run the group's named tasks one at a time)")
        members += [leaf for leaf in task_members(name, options) if leaf not in members]
    return members


def group_aggregates(task: str, options: dict) -> list[dict]:
    """The ``aggregate_metric_list`` of lm-eval group ``task`` ([] for a task, a tag or an evalkit task)."""
    if options.get("source") != LM_EVAL:
        return []
    entry = registry_entry(task)
    return list((entry.cfg or {}).get("aggregate_metric_list") or []) if entry.kind.name == "GROUP" else []


def registry_task(task: str, options: dict, pretrained: str | None = None) -> dict:
    """lm-eval's own config of ``task`` (its official YAML, includes resolved) with the run's options: ``dataset``
    (``path``, ``name``, ``kwargs``: where its data is, e.g. local files), ``generation`` (over its
    generation_kwargs), ``num_fewshot``, ``metadata`` (lm-eval's task metadata), ``repeats``."""
    from lm_eval.tasks._yaml_loader import load_yaml

    from .errors import ConfigError

    try:
        config = load_yaml(registry_yaml(task), resolve_func=True)
    except ImportError as error:  # the task's own code needs a package lm-eval does not install (RULER: nltk)
        raise RunError(f"lm-eval's task {task} needs a package that is not installed: {one_line(error)}") from None
    if config.get("output_type") == "loglikelihood_rolling":
        raise ConfigError(f"{task} is a perplexity task (loglikelihood_rolling), which has no compressed meaning in "
                          "evalkit: a compressed cache is scored by the tokens it generates or the choices it ranks")
    dataset = options.get("dataset") or {}
    if dataset.get("path") is not None:  # another source: its own config name (none unless given)
        config["dataset_path"], config["dataset_name"] = dataset["path"], dataset.get("name")
    elif dataset.get("name") is not None:
        config["dataset_name"] = dataset["name"]
    if dataset.get("kwargs"):
        config["dataset_kwargs"] = {**(config.get("dataset_kwargs") or {}), **dataset["kwargs"]}
        files = dataset["kwargs"].get("data_files")
        if isinstance(files, dict):  # local files per split: the task's splits that have none are not there
            for field in ("training_split", "validation_split", "test_split", "fewshot_split"):
                if config.get(field) is not None and config[field] not in files:
                    config[field] = None
    generation = {key: value for key, value in (options.get("generation") or {}).items() if value is not None}
    if generation:
        config["generation_kwargs"] = {**(config.get("generation_kwargs") or {}), **generation}
    for key in ("num_fewshot", "repeats"):
        if key in options:
            config[key] = options[key]
    text = family_hooks(task, options).get("doc_to_text")
    if text is not None:  # evalkit's prompt for the family (RULER's, its context's end marked)
        config["doc_to_text"] = text
    model = {"pretrained": pretrained} if pretrained else {}
    metadata = {key: value for key, value in (options.get("metadata") or {}).items() if value is not None}
    if model or metadata:
        config["metadata"] = {**model, **(config.get("metadata") or {}), **metadata}
    return config


def family_hooks(task: str, options: dict) -> dict:
    """What evalkit adds to the lm-eval task family of ``task`` (:func:`evalkit.task_defs.family_hooks`); {} for
    evalkit's own tasks."""
    from evalkit import task_defs

    if options.get("source") != LM_EVAL:
        return {}
    return task_defs.family_hooks(registry_yaml(task).parent.name)


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
        except (ValueError, AssertionError, ImportError) as error:  # a task that builds its data refused (RULER)
            raise RunError(f"task {config.get('task')} could not build its data: {one_line(error)}") from None
        except (ConnectionError, FileNotFoundError) as error:  # a hub dataset that is not here and cannot be fetched
            source = f"dataset {config['dataset_path']}" if config.get("dataset_path") else "the data it is built from"
            raise RunError(f"data of task {config.get('task')}: {source} cannot be loaded here ({one_line(error)}); "
                           "load it once where the hub can be reached (HF_DATASETS_CACHE sets where it is kept) or "
                           "point task.dataset.path (and task.dataset.kwargs.data_files) at local files") from None
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

