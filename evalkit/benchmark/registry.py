"""A task of lm-eval's own registry (``task=lm_eval task.name=gsm8k``): lm-eval's YAML, as lm-eval ships it, with the
run's options. lm-eval loads only when one is run.

Where a family needs more than its YAML says (RULER's per-length metrics), ``tasks/lm_eval/<folder>.py`` (the folder
of lm-eval's YAML, e.g. ``ruler``) may define

- ``sample_metric(sample, metric_names) -> str | None``: the metric that scores a sample (default: the first);
- ``sample_subset(doc) -> str``: a sample's subset;
- ``metric_applies(name, value) -> bool``: False drops a metric row (a value that means "nothing measured");
- ``doc_to_text(doc) -> str``: the prompt in place of the YAML's;
- ``doc_to_question(doc) -> str | None``: the end of the prompt that follows its context (RULER's question), for
  ``compression_scope=context`` (:func:`evalkit.benchmark.doc_to_question`).
"""

from __future__ import annotations

import difflib
import functools
import hashlib
from pathlib import Path

from evalkit.core.errors import ConfigError, RunError, one_line
from evalkit.core.paths import tasks_dir

from . import definition as yaml_definition
from .base import DataOrigin, Task

FAMILY_HOOKS = ("sample_metric", "sample_subset", "metric_applies", "doc_to_text", "doc_to_question")


class RegistryTask(Task):
    from_registry = True

    def members(self) -> list[str]:
        """The task itself, or the tasks of an lm-eval group or tag (nested groups expanded, in the group's order)."""
        return _members(self.name)

    def configs(self, options: dict, bad_rows: str = "error", pretrained: str | None = None) -> list[dict]:
        return [member_config(name, options, pretrained) for name in self.members()]

    def definition_paths(self) -> list[Path]:
        """The YAML folders of its members and of the group itself (a tag has none), and what evalkit adds to their
        families (``tasks/lm_eval/<folder>.py``: prompts, scoring per length)."""
        own = yaml_path(self.name)
        folders = {yaml_path(name).parent for name in self.members()} | ({own.parent} if own else set())
        hooks = {family_file(folder.name) for folder in folders}
        return sorted(folders | {path for path in hooks if path.is_file()})

    def data_origin(self, configs: list[dict]) -> DataOrigin:
        """Its data files (``task.dataset.kwargs.data_files``), else its hub dataset (each member's, for a group over
        several)."""
        dataset = configs[0].get("dataset_kwargs") or {}
        files = dataset.get("data_files")
        files = list(files.values()) if isinstance(files, dict) else files
        if files:
            return DataOrigin([str(f) for f in ([files] if isinstance(files, str) else files)],
                              "task.dataset.kwargs.data_files", dataset.get("revision"))
        hubs = tuple(sorted({c.get("dataset_path") for c in configs if c.get("dataset_path")}))
        if len(hubs) == 1:
            return DataOrigin(hubs[0], revision=dataset.get("revision"))
        return DataOrigin(hubs=hubs)

    def family_hooks(self, member: str) -> dict:
        return family_hooks(yaml_path(member).parent.name)

    def aggregates(self) -> list[dict]:
        entry = registry_entry(self.name)
        return list((entry.cfg or {}).get("aggregate_metric_list") or []) if entry.kind.name == "GROUP" else []


def member_config(task: str, options: dict, pretrained: str | None = None) -> dict:
    """lm-eval's own config of ``task`` (its official YAML, includes resolved) with the run's options: ``dataset``
    (``path``, ``name``, ``kwargs``: where its data is, e.g. local files), ``generation`` (over its
    generation_kwargs), ``num_fewshot``, ``metadata`` (lm-eval's task metadata), ``repeats``."""
    from lm_eval.tasks._yaml_loader import load_yaml

    try:
        config = load_yaml(yaml_path(task), resolve_func=True)
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
    text = family_hooks(yaml_path(task).parent.name).get("doc_to_text")
    if text is not None:  # evalkit's prompt for the family
        config["doc_to_text"] = text
    model = {"pretrained": pretrained} if pretrained else {}
    metadata = {key: value for key, value in (options.get("metadata") or {}).items() if value is not None}
    if model or metadata:
        config["metadata"] = {**model, **(config.get("metadata") or {}), **metadata}
    return config


def _members(task: str) -> list[str]:
    entry = registry_entry(task)
    if entry.kind.name in ("TASK", "PY_TASK"):
        return [task]
    names = sorted(entry.tags) if entry.kind.name == "TAG" else list((entry.cfg or {}).get("task") or [])
    members: list[str] = []
    for name in names:
        if not isinstance(name, str):
            raise ConfigError(f"lm-eval group {task} defines a task inline; evalkit runs groups of named tasks "
                              "(run the group's named tasks one at a time)")
        members += [leaf for leaf in _members(name) if leaf not in members]
    return members


def family_file(folder: str) -> Path:
    return tasks_dir() / "lm_eval" / f"{folder}.py"


def family_hooks(folder: str) -> dict:
    """The hooks evalkit keeps for the lm-eval task family in ``folder`` (``tasks/lm_eval/<folder>.py``): {} if none."""
    module = yaml_definition.module(tasks_dir() / "lm_eval", folder)
    return {name: getattr(module, name) for name in FAMILY_HOOKS if hasattr(module, name)} if module else {}


@functools.lru_cache(maxsize=1)
def index():
    """lm-eval's whole task index (thousands of tasks: ten seconds to build, so only when a run asks for one of them).
    Built once per installed lm-eval and kept on disk (``$EVALKIT_CACHE/lm_eval_index/``, :func:`index_file`): a later
    run loads it in about a second, and any change to lm-eval's tasks builds it again."""
    import os
    import pickle
    import tempfile

    import lm_eval
    from lm_eval.tasks import TaskManager

    path = index_file(Path(lm_eval.__file__).parent / "tasks", lm_eval.__version__)
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


def index_file(root: Path, version: str) -> Path:
    """Where the index of the lm-eval (``version``) whose tasks are in ``root`` is kept: keyed by the version, the
    folder (the index holds its files' paths: another environment's install of the same release has its own) and
    the names, sizes and modification times of its task files."""
    import os

    from evalkit.core.identity import cache_dir

    listing = hashlib.sha256(f"{version}\0{root.resolve()}\n".encode())
    for folder, _, files in sorted(os.walk(root)):
        for name in sorted(files):
            stat = (Path(folder) / name).stat()
            listing.update(f"{Path(folder, name).relative_to(root)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return cache_dir() / "lm_eval_index" / f"{listing.hexdigest()[:24]}.pkl"


def registry_entry(task: str):
    """lm-eval's index entry of ``task`` (a task, group or tag); a ConfigError naming the nearest names for an unknown
    one."""
    entry = index().task_index.get(task)
    if entry is None:
        near = difflib.get_close_matches(task, index().all_tasks, n=3, cutoff=0.6)
        raise ConfigError(f"lm-eval knows no task {task!r}" + (f"; did you mean {', '.join(near)}?" if near else ""))
    return entry


def yaml_path(task: str) -> Path | None:
    """The YAML file of lm-eval's task or group ``task`` (None for a tag, which has none of its own)."""
    entry = registry_entry(task)
    return Path(entry.yaml_path) if entry.yaml_path is not None else None
