"""What the harness reads from a task's own folder (``tasks/<name>/``), so that no other module names a task.

A task is its folder: the lm-eval YAML (the official protocol, once) and ``utils.py``. Beyond what lm-eval reads,
the YAML's ``metadata`` may declare

- ``primary_metric``: the metric the report pivots on (default: the first of ``metric_list``);
- ``subset_field``: the document fields a sample's subset is made of (``[length, depth]``);
- ``heatmap: {rows: FIELD, columns: FIELD}``: two of the subset fields the report draws accuracy over;

and ``utils.py`` may define these hooks (each optional):

- ``dataset_sources(dataset_kwargs) -> str | list[str] | None``: where the data comes from when no
  ``dataset.path`` is given (hub files), for the run's identity;
- ``dataset_identity(dataset_kwargs) -> str``: the identity of data built at run time (no files to fingerprint);
- ``adjust_options(options, apply_chat_template) -> bool``: the run's task options adjusted in place before the run
  (a prompt style's system turn and stop strings), returning whether the chat template applies.

A hook that refuses its input raises ValueError; the run reports it as a config error naming ``task.``.

Tasks of lm-eval's own registry (``task=lm_eval``) keep lm-eval's YAML; where a family needs more than its YAML says
(RULER's per-length metrics), ``tasks/lm_eval/<folder>.py`` (the folder of lm-eval's YAML, e.g. ``ruler``) may define

- ``sample_metric(sample, metric_names) -> str | None``: the metric that scores a sample (default: the first);
- ``sample_subset(doc) -> str``: a sample's subset;
- ``metric_applies(name, value) -> bool``: False drops a metric row (a value that means "nothing measured");
- ``doc_to_text(doc) -> str``: the prompt in place of the YAML's (RULER's, with the end of its context marked).
Reading the YAML needs neither torch nor lm-eval (``!function`` tags are left unresolved).
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import yaml

from evalkit.paths import tasks_dir


class _Loader(yaml.SafeLoader):
    """YAML with lm-eval's ``!function module.name`` tags read as their text."""


_Loader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))


def task_names() -> list[str]:
    """Every task evalkit ships (a folder under tasks/ holding ``<name>.yaml``)."""
    return sorted(p.name for p in tasks_dir().iterdir() if (p / f"{p.name}.yaml").is_file())


@functools.cache
def definition(name: str) -> dict:
    """The task's lm-eval YAML as a dict (``!function`` references as text; ``include:`` merged as lm-eval merges it,
    the including file's keys winning); {} for a task evalkit does not ship."""
    path = tasks_dir() / name / f"{name}.yaml"
    return _read(path) if path.is_file() else {}


def _read(path: Path) -> dict:
    own = yaml.load(path.read_text(), Loader=_Loader)
    merged = {}
    for include in _includes(own.pop("include", None)):
        merged.update(_read((path.parent / include).resolve()))
    return {**merged, **own}


def _includes(value) -> list[str]:
    return [] if not value else [value] if isinstance(value, str) else list(value)


def folders(name: str) -> list[Path]:
    """The folders that define task ``name``: its own, and those of the YAML files it includes."""
    found, pending = [], [tasks_dir() / name / f"{name}.yaml"]
    while pending:
        path = pending.pop()
        if not path.is_file() or path.parent in found:
            continue
        found.append(path.parent)
        include = yaml.load(path.read_text(), Loader=_Loader).get("include")
        pending += [(path.parent / item).resolve() for item in _includes(include)]
    return found


def metadata(name: str) -> dict:
    return definition(name).get("metadata") or {}


def primary_metric(name: str) -> str | None:
    """The metric a report reads first: ``metadata.primary_metric``, else the first of ``metric_list``."""
    declared = metadata(name).get("primary_metric")
    metrics = [entry["metric"] for entry in definition(name).get("metric_list") or []]
    return declared or (metrics[0] if metrics else None)


def subset_fields(name: str) -> list[str]:
    fields = metadata(name).get("subset_field") or []
    return [fields] if isinstance(fields, str) else list(fields)


def heatmap(name: str) -> tuple[str, str] | None:
    """(rows, columns): the two subset fields the report draws a heatmap over; None when the task declares none."""
    declared = metadata(name).get("heatmap")
    if not declared:
        return None
    fields = subset_fields(name)
    rows, columns = declared.get("rows"), declared.get("columns")
    if rows not in fields or columns not in fields:
        raise ValueError(f"task {name}: metadata.heatmap names {rows!r} x {columns!r}; both must be in its "
                         f"subset_field {fields}")
    return rows, columns


def _utils(name: str):
    return _module(tasks_dir() / name / "utils.py", f"evalkit_task_{name}_utils")


@functools.cache
def _module(path: Path, module_name: str):
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def family_file(folder: str) -> Path:
    return tasks_dir() / "lm_eval" / f"{folder}.py"


def family_hooks(folder: str) -> dict:
    """The hooks evalkit keeps for the lm-eval task family in ``folder`` (``tasks/lm_eval/<folder>.py``): {} if none."""
    module = _module(family_file(folder), f"evalkit_lm_eval_{folder}")
    names = ("sample_metric", "sample_subset", "metric_applies", "doc_to_text")
    return {name: getattr(module, name) for name in names if hasattr(module, name)} if module else {}


def hook(name: str, hook_name: str):
    """The task's ``utils.<hook_name>`` function, or None when it defines none."""
    module = _utils(name)
    return getattr(module, hook_name, None) if module is not None else None
