"""What the harness asks of a task, whatever kind it is (one of evalkit's folders, or a task of lm-eval's registry)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import ClassVar

LM_EVAL = "lm_eval"  # task.source of a task from lm-eval's own registry (conf/task/lm_eval.yaml)


@dataclasses.dataclass(frozen=True)
class DataOrigin:
    """Where a task's data comes from, for the run's identity: ``source`` (files or a hub id, named by the setting
    ``label`` in messages) at ``revision``; else ``hubs`` (several hub datasets, each at its commit); else ``built``
    (the identity of data built at run time)."""

    source: str | list[str] | None = None
    label: str = "task.dataset.path"
    revision: str | None = None
    hubs: tuple[str, ...] = ()
    built: str | None = None


class Task:
    """A task: its lm-eval config with a run's options, the tasks it runs (``members``: itself, or an lm-eval group's
    tasks), what its definition is made of (``definition_paths``, fingerprinted into the run's identity), where its data
    comes from, its hooks, and what the report reads first (``primary_metric``)."""

    from_registry: ClassVar[bool] = False

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    def check(self) -> None:
        """Raise ConfigError for a task that cannot exist, where that is known without lm-eval."""

    def members(self) -> list[str]:
        return [self.name]

    def configs(self, options: dict, bad_rows: str = "error", pretrained: str | None = None) -> list[dict]:
        """The lm-eval config (a dict, functions resolved) of each member with the run's ``options``. ``pretrained``
        (the run's model, a local path or hub id) reaches each config's ``metadata`` as lm-eval's CLI passes its model
        arguments: a task that builds its data with the model's tokenizer reads it there (its loader gets the metadata
        with its dataset arguments)."""
        raise NotImplementedError

    def definition_paths(self) -> list[Path]:
        raise NotImplementedError

    def version(self) -> str | None:
        """The version the task declares (``metadata.version`` in its YAML), which names what it does together with
        :meth:`definition_paths`; None: its files are its identity, code and all (a task of lm-eval's registry)."""
        return None

    def data_origin(self, configs: list[dict]) -> DataOrigin:
        """Where the data of the member ``configs`` (:meth:`config` of each member) comes from."""
        raise NotImplementedError

    def adjust_options(self, options: dict, apply_chat_template: bool) -> bool:
        """The run's task options adjusted in place before the run; returns whether the chat template applies."""
        return apply_chat_template

    def generation_flow(self):
        """The task's own way to run its requests (LongBench-v2's two-call chain of thought), or None: one pass."""
        return None

    def family_hooks(self, member: str) -> dict:
        """What evalkit adds to the scoring of ``member``'s rows (``sample_metric``, ``sample_subset``,
        ``metric_applies``; see :mod:`evalkit.results.rows`)."""
        return {}

    def aggregates(self) -> list[dict]:
        """An lm-eval group's ``aggregate_metric_list``."""
        return []

    def primary_metric(self) -> str | None:
        """The metric the report pivots on (None: the first the run reported)."""
        return None

    def sessions(self) -> bool:
        """Whether its rows are sessions (one context, several queries: ``task.mode=multi_request|multi_turn``)."""
        return False

    def subset_fields(self) -> list[str]:
        return []

    def heatmap(self) -> tuple[str, str] | None:
        """(rows, columns): two subset fields the report draws accuracy over; None when the task declares none."""
        return None
