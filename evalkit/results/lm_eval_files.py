"""lm-eval's own result files for a run, written by lm-eval's own writer (its ``EvaluationTracker``), as
``lm_eval --output_path DIR --log_samples`` writes them: ``DIR/<model>/results_<date>.json`` (scores, configs, versions,
task hashes, model and environment) and ``DIR/<model>/samples_<task>_<date>.jsonl`` (one line per document and filter,
with its hashes), where DIR is ``<results_dir>/lm_eval/<run_id>/`` (one folder per run, named as its tables are) and
``<model>`` is lm-eval's sanitized model name. The model is recorded as lm-eval's ``evalkit`` model with the run's
config as its arguments; each sample line also carries evalkit's columns of its requests under the key ``evalkit``
(one entry per repeat: tokens kept, bytes, timings, as in the samples table), beside lm-eval's keys."""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

from evalkit.benchmark.responses import all_responses
from evalkit.core.console import warn
from evalkit.core.errors import one_line

from .rows import BYTE_COLUMNS, STAT_COLUMNS, sample_row

FOLDER = "lm_eval"
MODEL = "evalkit"  # the lm-eval model name evalkit registers (lm_eval --model evalkit)
REQUEST_COLUMNS = ("repeat", *STAT_COLUMNS, *BYTE_COLUMNS, "over_budget", "reasoning")


def write(spec, run_id: str, results: dict, stats: dict, reasoning: dict | None, tokenizer) -> Path | None:
    """Write the run's lm-eval files (``results``: what ``simple_evaluate`` returned, with its samples; ``stats``: the
    adapter's per-request statistics) and return their folder. A failure is one line on stderr and None: the run's
    tables, written before, stay as they are."""
    try:
        return _write(spec, Path(spec.results_dir) / FOLDER / run_id, results, stats, reasoning, tokenizer)
    except Exception as error:  # noqa: BLE001 (whatever went wrong, the run itself is complete)
        warn(f"lm-eval's result files were not written: {one_line(error)}")
        return None


def _write(spec, folder: Path, results: dict, stats: dict, reasoning: dict | None, tokenizer) -> Path:
    from lm_eval.loggers import EvaluationTracker

    tracker = EvaluationTracker(output_path=str(folder))
    general = tracker.general_config_tracker
    model_args = {"pretrained": spec.pretrained,
                  **{key: value for key, value in spec.flat_config().items() if key != "model_pretrained"}}
    template = getattr(tokenizer, "chat_template", None) if spec.apply_chat_template else None
    general.log_experiment_args(model_source=MODEL, model_args=model_args, chat_template=template,
                                system_instruction=spec.task_options.get("system_instruction"),
                                fewshot_as_multiturn=False)
    general.start_time -= time.time() - float(results.get("date") or time.time())  # since lm-eval started evaluating
    aggregated = {key: value for key, value in results.items() if key != "samples"}
    aggregated["config"] = {**(results.get("config") or {}), "model": MODEL, "model_args": model_args}
    samples = {task: [with_requests(sample, task, stats, reasoning) for sample in logged]
               for task, logged in results["samples"].items()}
    written = folder / general.model_name_sanitized
    written.mkdir(parents=True, exist_ok=True)  # a folder that cannot be made says so here, in its own words
    with tracker_failures() as failures:  # the tracker logs what went wrong instead of raising it
        tracker.save_results_aggregated(results=aggregated, samples=samples)
        if not hasattr(tracker, "date_id"):
            raise OSError(f"lm-eval's EvaluationTracker did not write its results file in {written}: {failures}")
        for task in (task for task in aggregated["configs"] if task in samples):
            tracker.save_results_samples(task_name=task, samples=samples[task])
            if not (written / f"samples_{task}_{tracker.date_id}.jsonl").is_file():
                raise OSError(f"lm-eval's EvaluationTracker did not write the samples of {task} in {written}: {failures}")
    return written


@contextlib.contextmanager
def tracker_failures():
    """What lm-eval's EvaluationTracker logs meanwhile, kept (off the terminal): its last message is why it failed."""
    logger = logging.getLogger("lm_eval.loggers.evaluation_tracker")
    kept = _Kept()
    propagate, level = logger.propagate, logger.level
    logger.addHandler(kept)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    try:
        yield kept
    finally:
        logger.removeHandler(kept)
        logger.propagate = propagate
        logger.setLevel(level)


class _Kept(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __str__(self) -> str:
        return self.messages[-1] if self.messages else "no reason given"


def with_requests(sample: dict, task: str, stats: dict, reasoning: dict | None) -> dict:
    """lm-eval's logged ``sample`` (a copy) with evalkit's columns of each of its requests under ``evalkit``."""
    responses = all_responses(sample.get("filtered_resps") or sample.get("resps") or [])
    rows = [sample_row(sample, repeat, response, None, None, stats.get((task, sample.get("doc_id"), repeat), {}),
                       reasoning) for repeat, response in enumerate(responses)]
    return {**sample, "evalkit": [{column: row[column] for column in REQUEST_COLUMNS} for row in rows]}


# What evalkit-report adds to a compared run's lm-eval results file, under its own key (lm-eval's fields unchanged).
STATISTICS = ("metric", "value", "baseline", "baseline_run_id", "delta", "delta_low", "delta_high", "unit",
              "paired_units", "paired_items", "paired_docs", "test", "p_value", "p_adjusted", "adjustment", "verdict",
              "lost", "gained")


def with_statistics(results_dir: Path, out: Path, table) -> Path | None:
    """For every run of ``table`` (a report's summary) compared with its full cache and holding lm-eval's results
    file: a copy of that file under ``out/lm_eval/<run_id>/`` (the same path below it) with lm-eval's fields as they
    are and the paired comparison under ``evalkit.against_full_cache``. The run's own file is never changed (its
    manifest holds it). The folder, or None where no run has such a file."""
    import json
    import math

    written = None
    for _, row in table.iterrows():
        folder = Path(results_dir) / FOLDER / str(row["run_id"])
        files = sorted(folder.glob("*/results_*.json")) if pd_notna(row.get("p_value")) and folder.is_dir() else []
        if not files:
            continue
        results = json.loads(files[-1].read_text())
        statistics = {key: row.get(key) for key in STATISTICS}
        statistics = {key: None if isinstance(v, float) and math.isnan(v) else v.item() if hasattr(v, "item") else v
                      for key, v in statistics.items()}
        evalkit = results.get("evalkit") if isinstance(results.get("evalkit"), dict) else {}
        results["evalkit"] = {**evalkit, "against_full_cache": {**statistics, "interval_level": 0.95}}
        target = Path(out) / FOLDER / files[-1].relative_to(Path(results_dir) / FOLDER)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(results, indent=2, ensure_ascii=False), encoding="utf-8")
        written = Path(out) / FOLDER
    return written


def pd_notna(value) -> bool:
    return value is not None and not (isinstance(value, float) and value != value)
