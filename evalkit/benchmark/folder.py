"""A task of evalkit's own: its folder ``tasks/<name>/`` (the lm-eval YAML, its code) and ``conf/task/<name>.yaml``; a
family of tasks shares one folder (``tasks/scbench/scbench_kv.yaml``: task ``scbench_kv``).

Beyond what lm-eval reads, the YAML's ``metadata`` may declare

- ``primary_metric``: the metric the report pivots on (default: the first of ``metric_list``);
- ``subset_field``: the document fields a sample's subset is made of (``[length, depth]``);
- ``heatmap: {rows: FIELD, columns: FIELD}``: two of the subset fields the report draws accuracy over;
- ``sessions: true``: its rows are sessions, one shared context asked several queries (each doc is one query:
  ``session_id``, ``turn`` from 1, ``answer``), so that ``task.mode=multi_request|multi_turn`` can run it
  (:mod:`evalkit.lm.sessions`);

and ``utils.py`` may define these hooks (each optional):

- ``dataset_sources(dataset_kwargs) -> str | list[str] | None``: where the data comes from when no
  ``dataset.path`` is given (hub files), for the run's identity;
- ``dataset_identity(dataset_kwargs) -> str``: the identity of data built at run time (no files to fingerprint);
- ``adjust_options(options, apply_chat_template) -> bool``: the run's task options adjusted in place before the run
  (a prompt style's system turn and stop strings), returning whether the chat template applies;
- ``doc_to_question(doc) -> str | None``: the end of ``doc_to_text(doc)`` that follows the document (the question,
  with whatever joins it to the document); ``compression_scope=context`` compresses only what precedes it in the
  prompt as sent (:func:`evalkit.benchmark.doc_to_question`). The prompt itself carries no mark, so lm-eval's own models
  read the same text as evalkit's;
- a session task's chat turns after the first (defaults in brackets): ``doc_to_follow_up(doc)``, the user text
  of a later turn [the question]; ``doc_to_follow_up_plain(doc)``, that text without a chat template
  [``doc_to_follow_up``]; ``doc_to_follow_up_prefix(doc)``, what the answer is made to start with [nothing];
  ``doc_to_history(doc)``, the gold answer a chat keeps under ``task.history=gold`` [``doc["answer"]``];
- ``generation_flow(evaluate, config, request_stats, scratch) -> (results, stats, reasoning) | None``: the task's
  own way to run its requests (LongBench-v2's chain of thought: a reasoning call, then the answer call);
  ``evaluate(config)`` runs lm-eval over a task config, ``request_stats`` holds the adapter's statistics per
  request, ``scratch`` is a path prefix for the files it keeps meanwhile (removed with the run's progress); None
  leaves the run to its one pass.

A hook that refuses its input raises ValueError; the run reports it as a config error naming ``task.``. The loader
(``custom_dataset``) gets the YAML's ``metadata`` with its ``dataset_kwargs``, the run's model (``pretrained``)
among them, to build data with the run's tokenizer.
"""

from __future__ import annotations

from pathlib import Path

from evalkit.core.errors import ConfigError
from evalkit.core.paths import tasks_dir

from . import definition as yaml_definition
from .base import DataOrigin, Task


def task_names() -> list[str]:
    """Every task evalkit ships: a folder under tasks/ holding ``<name>.yaml``, or a family's ``<name>.yaml`` beside
    others in one folder (``tasks/scbench/scbench_kv.yaml``)."""
    own = {p.name for p in tasks_dir().iterdir() if (p / f"{p.name}.yaml").is_file()}
    family = {p.stem for p in tasks_dir().glob("*/*.yaml") if p.parent.name not in own and not p.stem.startswith("_")}
    return sorted(own | family)


class FolderTask(Task):
    @property
    def yaml_path(self) -> Path:
        """``tasks/<name>/<name>.yaml``, else the family folder holding ``<name>.yaml`` (``tasks/scbench/``)."""
        own = tasks_dir() / self.name / f"{self.name}.yaml"
        if own.is_file() or self.name.startswith("_"):
            return own
        return next(iter(sorted(tasks_dir().glob(f"*/{self.name}.yaml"))), own)

    def check(self) -> None:
        if not self.yaml_path.is_file():
            raise ConfigError(f"unknown task {self.name!r}; available: {task_names()}")
        if self.version() is None:
            where = yaml_definition.declaring(self.yaml_path, "metadata").relative_to(tasks_dir().parent)
            raise ConfigError(f"task {self.name} declares no version: add `metadata: {{version: 1.0}}` to {where} "
                              "(its identity: bump it whenever the task's prompts or scores change)")

    def definition(self) -> dict:
        """The task's YAML as a dict (``!function`` references as text); {} for a task evalkit does not ship."""
        return yaml_definition.read(self.yaml_path) if self.yaml_path.is_file() else {}

    def configs(self, options: dict, bad_rows: str = "error", pretrained: str | None = None) -> list[dict]:
        return [self.config(options, bad_rows, pretrained)]

    def config(self, options: dict, bad_rows: str = "error", pretrained: str | None = None) -> dict:
        """The task's lm-eval config with the run's dataset/generation/repeats options applied."""
        config = yaml_definition.read(self.yaml_path, resolve=True)
        config["dataset_kwargs"] = {**(config.get("dataset_kwargs") or {}), **options.get("dataset", {}),
                                    "bad_rows": bad_rows}
        config["generation_kwargs"] = {**(config.get("generation_kwargs") or {}), **options.get("generation", {})}
        if "repeats" in options:
            config["repeats"] = options["repeats"]
        if options.get("gen_prefix"):
            config["gen_prefix"] = options["gen_prefix"]
        if pretrained:
            config["metadata"] = {**(config.get("metadata") or {}), "pretrained": pretrained}
        return config

    def definition_paths(self) -> list[Path]:
        """Its YAML and the YAML files it includes: what it runs is named by them and by its :meth:`version`, not by
        its code's bytes (an edit that keeps the behaviour keeps the identity; tests/test_task_versions.py pins it)."""
        return yaml_definition.files(self.yaml_path)

    def version(self) -> str | None:
        declared = self.metadata().get("version")
        return None if declared is None else str(declared)

    def data_origin(self, configs: list[dict]) -> DataOrigin:
        dataset = configs[0].get("dataset_kwargs") or {}
        revision = dataset.get("revision")
        if dataset.get("path"):
            return DataOrigin(dataset["path"], revision=revision)
        sources = self._call("dataset_sources", dataset)
        if sources:  # the task's hub files
            return DataOrigin(sources, revision=revision)
        return DataOrigin(built=self._call("dataset_identity", dataset))

    def adjust_options(self, options: dict, apply_chat_template: bool) -> bool:
        adjust = self.hook("adjust_options")
        return apply_chat_template if adjust is None else self._call("adjust_options", options, apply_chat_template)

    def generation_flow(self):
        return self.hook("generation_flow")

    def hook(self, name: str):
        """The task's ``utils.<name>`` function, or None when it defines none."""
        return getattr(yaml_definition.module(self.yaml_path.parent, "utils"), name, None)

    def _call(self, name: str, *args):
        hook = self.hook(name)
        if hook is None:
            return None
        try:
            return hook(*args)
        except ValueError as error:
            raise ConfigError(f"task.{error}") from None

    def metadata(self) -> dict:
        return self.definition().get("metadata") or {}

    def primary_metric(self) -> str | None:
        declared = self.metadata().get("primary_metric")
        metrics = [entry["metric"] for entry in self.definition().get("metric_list") or []]
        return declared or (metrics[0] if metrics else None)

    def sessions(self) -> bool:
        return bool(self.metadata().get("sessions"))

    def subset_fields(self) -> list[str]:
        fields = self.metadata().get("subset_field") or []
        return [fields] if isinstance(fields, str) else list(fields)

    def heatmap(self) -> tuple[str, str] | None:
        declared = self.metadata().get("heatmap")
        if not declared:
            return None
        fields = self.subset_fields()
        rows, columns = declared.get("rows"), declared.get("columns")
        if rows not in fields or columns not in fields:
            raise ValueError(f"task {self.name}: metadata.heatmap names {rows!r} x {columns!r}; both must be in its "
                             f"subset_field {fields}")
        return rows, columns
