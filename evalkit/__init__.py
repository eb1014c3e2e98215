"""evalkit: an accuracy evaluation harness for KV-cache compression of large language models.

Its packages, from the top: :mod:`evalkit.run` (one evaluation), :mod:`evalkit.lm` (the lm-eval adapter),
:mod:`evalkit.config`, :mod:`evalkit.memory` (what a cache costs), :mod:`evalkit.results`, :mod:`evalkit.models`,
:mod:`evalkit.benchmark` (the Task type), :mod:`evalkit.tasks` (each task's own code), :mod:`evalkit.compression` and
:mod:`evalkit.core`.

A module's name of the earlier, flat layout (:data:`MOVED`) still imports for this release, as the same module under
its new name, with a DeprecationWarning naming that name; the next release drops them.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

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
    """Asked first: an earlier name imports as the module it moved to, the very same object (one set of classes),
    with a DeprecationWarning at the import that names it."""

    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if moved_to(fullname) else None

    def create_module(self, spec):
        new = moved_to(spec.name)
        warnings.warn(f"{spec.name} is now {new}: import it from there (the earlier name goes in the next release)",
                      DeprecationWarning, stacklevel=_importer_level())
        return importlib.import_module(new)

    def exec_module(self, module):
        pass  # already executed under its own name


def _importer_level() -> int:
    """The ``stacklevel`` of the frame whose import named an earlier module, as seen from
    :meth:`_MovedModules.create_module`: past this module's frames and importlib's (the import system's bootstrap
    frames are skipped by :mod:`warnings` itself, and not counted)."""
    frame, level = sys._getframe(2), 2
    while frame is not None:
        name = frame.f_code.co_filename
        if "importlib" in name and "_bootstrap" in name:
            frame = frame.f_back
            continue
        if name != __file__ and not name.endswith(("importlib/__init__.py", "importlib\\__init__.py")):
            return level
        frame, level = frame.f_back, level + 1
    return 1


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())
