"""evalkit: an accuracy evaluation harness for KV-cache compression of large language models.

Its packages, from the top: :mod:`evalkit.run` (one evaluation), :mod:`evalkit.lm` (the lm-eval adapter),
:mod:`evalkit.config`, :mod:`evalkit.memory` (what a cache costs), :mod:`evalkit.results`, :mod:`evalkit.models`,
:mod:`evalkit.benchmark` (the Task type), :mod:`evalkit.tasks` (each task's own code), :mod:`evalkit.compression` and
:mod:`evalkit.core`. A module of an earlier layout raises an ImportError that names where it went (:data:`MOVED`).
"""

from __future__ import annotations

import importlib.abc
import sys

MOVED = {
    "evalkit.scoring.data": "evalkit.benchmark.data",
    "evalkit.scoring": "evalkit.benchmark.responses (evalkit.scoring.data to evalkit.benchmark.data)",
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
    "evalkit.synthetic": "evalkit.tasks.kv_retrieval.synthetic",
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


class _MovedModules(importlib.abc.MetaPathFinder):
    """Consulted after every other finder: an import of a module that moved fails with its new name."""

    def find_spec(self, fullname, path=None, target=None):
        for old, new in MOVED.items():
            if fullname == old or fullname.startswith(old + "."):
                raise ModuleNotFoundError(f"{fullname} moved to {new}{fullname[len(old):]}: import it from there",
                                          name=new)
        return None


def __getattr__(name: str):
    if f"evalkit.{name}" in MOVED:  # from evalkit import <a moved module>
        raise ImportError(f"evalkit.{name} moved to {MOVED['evalkit.' + name]}: import it from there")
    raise AttributeError(f"module 'evalkit' has no attribute {name!r}")


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())
