"""evalkit: an accuracy evaluation harness for KV-cache compression of large language models.

Its packages, from the top: :mod:`evalkit.run` (one evaluation), :mod:`evalkit.lm` (the lm-eval adapter),
:mod:`evalkit.config`, :mod:`evalkit.memory` (what a cache costs), :mod:`evalkit.results`, :mod:`evalkit.models`,
:mod:`evalkit.benchmark` (the Task type), :mod:`evalkit.tasks` (each task's own code), :mod:`evalkit.compression` and
:mod:`evalkit.core`.

A module's name of the earlier, flat layout (:data:`MOVED`) still imports: it is the same module under its new name.
Task folders keep importing them so: a task folder's bytes are part of its runs' identity, and rewriting its imports
would give every earlier result of the task another config digest.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

MOVED = {
    "evalkit.scoring.data": "evalkit.benchmark.data",
    "evalkit.scoring": "evalkit.benchmark",
    "evalkit.task": "evalkit.benchmark",
    "evalkit.sandbox": "evalkit.benchmark.sandbox",
    "evalkit.parallel": "evalkit.lm.parallel",
    "evalkit.lm_eval_plugin": "evalkit.lm.plugin",
    "evalkit.lm_requests": "evalkit.lm.requests",
    "evalkit.prompts": "evalkit.lm.prompts",
    "evalkit.measure": "evalkit.memory.measure",
    "evalkit.request_cost": "evalkit.memory.request_cost",
    "evalkit.progress": "evalkit.results.progress",
    "evalkit.sweep_progress": "evalkit.run.sweep_progress",
    "evalkit.gguf_models": "evalkit.models.gguf",
    "evalkit.train_tiny": "evalkit.models.train_tiny",
    "evalkit.synthetic": "evalkit.models.synthetic",
    "evalkit.attention_shape": "evalkit.core.attention_shape",
    "evalkit.method_config": "evalkit.config.method_config",
    "evalkit.method_schema": "evalkit.config.method_schema",
    "evalkit.method_settings": "evalkit.core.method_settings",
    "evalkit.budget": "evalkit.core.budget",
    "evalkit.errors": "evalkit.core.errors",
    "evalkit.paths": "evalkit.core.paths",
    "evalkit.console": "evalkit.core.console",
    "evalkit.identity": "evalkit.core.identity",
}


def moved_to(name: str) -> str | None:
    """The module an earlier name now is (``evalkit.task.folder`` -> ``evalkit.benchmark.folder``), or None."""
    old = max((old for old in MOVED if name == old or name.startswith(old + ".")), key=len, default=None)
    return None if old is None else MOVED[old] + name[len(old):]


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Asked first: an earlier name imports as the module it moved to, the very same object (one set of classes)."""

    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if moved_to(fullname) else None

    def create_module(self, spec):
        return importlib.import_module(moved_to(spec.name))

    def exec_module(self, module):
        pass  # already executed under its own name


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())
