"""Benchmarks as evalkit runs them: the Task type (here), a task's rows (:mod:`.data`), the responses its scorer reads
(:mod:`.responses`) and the sandbox generated code runs in (:mod:`.sandbox`).

A task evalkit runs is of either kind: one of evalkit's own folders (:class:`FolderTask`, ``tasks/<name>/``) or a
task of lm-eval's registry (:class:`RegistryTask`, ``task=lm_eval``). :func:`task_of` says which a run's task is; the
harness asks the :class:`Task` and never names a task nor tests its kind. Reading a task needs neither torch nor
lm-eval (a registry task loads lm-eval when asked for its members or config)."""

from __future__ import annotations

import functools

from evalkit.core.errors import ConfigError

from .base import LM_EVAL, DataOrigin, Task
from .folder import FolderTask, task_names
from .registry import RegistryTask, family_hooks, yaml_path
from .responses import all_responses, keep_all_samples  # noqa: F401 (task code reads them here too)

__all__ = ["LM_EVAL", "DataOrigin", "FolderTask", "RegistryTask", "Task", "doc_to_question", "task_names", "task_of"]


def task_of(name: str, options: dict | None = None) -> Task:
    """The task ``name`` with a run's task options: lm-eval's registry task when ``options["source"]`` is ``lm_eval``
    (a name can be both: lm-eval's ``aime25`` is not evalkit's), else evalkit's own."""
    return RegistryTask(name) if (options or {}).get("source") == LM_EVAL else FolderTask(name)


@functools.cache
def doc_to_question(name: str | None):
    """The ``doc_to_question(doc)`` hook of the task lm-eval runs as ``name`` (what follows the document in its
    prompt: where ``compression_scope=context`` stops compressing), or None where it has none: one of evalkit's
    folders (``tasks/<name>/utils.py``), else a task of lm-eval's registry whose family has one
    (``tasks/lm_eval/<folder>.py``: RULER)."""
    if not name:
        return None
    folder = FolderTask(name)
    if folder.yaml_path.is_file():
        return folder.hook("doc_to_question")
    try:
        path = yaml_path(name)
    except ConfigError:  # neither evalkit's nor lm-eval's (a task of another include path)
        return None
    return family_hooks(path.parent.name).get("doc_to_question") if path is not None else None
