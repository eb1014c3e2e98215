"""The one reader of a task's lm-eval YAML, without torch or lm-eval: ``include:`` merged as lm-eval merges it (the
including file's keys winning), ``!function module.name`` read as its text, or resolved to the function."""

from __future__ import annotations

import copy
import functools
import importlib
from pathlib import Path

import yaml

from evalkit.core.paths import tasks_dir


class FunctionRef(str):
    """The text of a ``!function module.name`` reference."""


class _Loader(yaml.SafeLoader):
    """YAML with lm-eval's ``!function`` tags read as :class:`FunctionRef`."""


_Loader.add_constructor("!function", lambda loader, node: FunctionRef(loader.construct_scalar(node)))


def read(path: Path, resolve: bool = False) -> dict:
    """The task YAML at ``path`` as a dict, its includes merged. With ``resolve``, each ``!function module.name`` is
    the function: ``module.py`` beside the YAML that names it (imported as ``evalkit.tasks.<folder>.<module>``, so a
    task's modules import one another as a package's), else an importable module, as lm-eval looks them up."""
    own = copy.deepcopy(_parsed(path, path.stat().st_mtime_ns))
    if resolve:
        own = _resolved(own, path.parent)
    merged = {}
    for include in includes(own.pop("include", None)):
        merged.update(read((path.parent / include).resolve(), resolve))
    return {**merged, **own}


@functools.lru_cache(maxsize=256)
def _parsed(path: Path, stamp: int) -> dict:
    """The YAML at ``path`` as it was at modification time ``stamp`` (a sweep's jobs read each task's once)."""
    return yaml.load(path.read_text(), Loader=_Loader)


def includes(value) -> list[str]:
    return [] if not value else [value] if isinstance(value, str) else list(value)


def files(path: Path) -> list[Path]:
    """The YAML files that define the task at ``path``: itself, and those it includes (nested includes too)."""
    found, pending = [], [path]
    while pending:
        path = pending.pop()
        if not path.is_file() or path in found:
            continue
        found.append(path)
        pending += [(path.parent / item).resolve() for item in includes(_parsed(path, path.stat().st_mtime_ns)
                                                                        .get("include"))]
    return found


def folders(path: Path) -> list[Path]:
    """The folders that define the task YAML at ``path``: its own, and those of the YAML files it includes."""
    return list(dict.fromkeys(file.parent for file in files(path)))


def declaring(path: Path, key: str) -> Path:
    """The file among :func:`files` whose own keys hold ``key`` (``metadata``), the one :func:`read` takes it from:
    ``path`` first, then what it includes; ``path`` where none does."""
    return next((file for file in files(path) if key in _parsed(file, file.stat().st_mtime_ns)), path)


def module(folder: Path, name: str):
    """The module ``name`` of a task folder under tasks/ (``evalkit.tasks.<folder>.<name>``), or None if it has none."""
    if not (folder / f"{name}.py").is_file():
        return None
    importlib.invalidate_caches()  # a task folder made after the import system last looked (a test's throwaway task)
    package = ".".join(folder.resolve().relative_to(tasks_dir().resolve()).parts)
    return importlib.import_module(f"evalkit.tasks.{package}.{name}")


def _resolved(value, folder: Path):
    if isinstance(value, FunctionRef):
        module_name, _, function = value.rpartition(".")
        found = module(folder, module_name) or importlib.import_module(module_name)
        return getattr(found, function)
    if isinstance(value, dict):
        return {key: _resolved(item, folder) for key, item in value.items()}
    if isinstance(value, list):
        return [_resolved(item, folder) for item in value]
    return value
