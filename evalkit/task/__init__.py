"""A task evalkit runs, of either kind: one of evalkit's own folders (:class:`FolderTask`, ``tasks/<name>/``) or a
task of lm-eval's registry (:class:`RegistryTask`, ``task=lm_eval``). :func:`task_of` says which a run's task is; the
harness asks the :class:`Task` and never names a task nor tests its kind. Reading a task needs neither torch nor
lm-eval (a registry task loads lm-eval when asked for its members or config)."""

from __future__ import annotations

from .base import LM_EVAL, DataOrigin, Task
from .folder import FolderTask, task_names
from .registry import RegistryTask

__all__ = ["LM_EVAL", "DataOrigin", "FolderTask", "RegistryTask", "Task", "task_names", "task_of"]


def task_of(name: str, options: dict | None = None) -> Task:
    """The task ``name`` with a run's task options: lm-eval's registry task when ``options["source"]`` is ``lm_eval``
    (a name can be both: lm-eval's ``aime25`` is not evalkit's), else evalkit's own."""
    return RegistryTask(name) if (options or {}).get("source") == LM_EVAL else FolderTask(name)
