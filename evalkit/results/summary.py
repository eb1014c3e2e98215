"""A results directory summarized: one row per configuration with its task's primary metric, its delta against the
full-cache run with a paired bootstrap interval, what it measured of its cost, and the pivot of those rows over budgets
(the tables report.md, report.html and the terminal's summary show)."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd

from evalkit.benchmark import Task, task_of
from evalkit.core import budget as budget_grammar

from .paired_stats import ADJUSTMENTS, adjust, compare, pair_items, verdict
from .tables import CONFIG_COLUMNS
from .trace_costs import TRACE, against_full, trace_costs

SECONDARY = {"realized_ratio_mean", "extraction_failed", "rows_skipped", "wall_seconds", "prefill_tokens_per_s",
             "decode_tokens_per_s", "slot_utilization", "kv_bytes_peak_mean", "kv_bytes_full_mean",
             "kv_bytes_reserved_mean", "memory_ratio_mean", "memory_freed", "kv_bytes_predicted_error_max", "over_budget",
             "kv_cache_allocated_bytes", "peak_rss_bytes", "peak_cuda_memory_bytes", "decode_step_seconds",
             "decode_step_bytes", "copy_bandwidth_bytes_per_s", "decode_step_seconds_roofline", "decode_efficiency",
             "decode_step_seconds_predicted", "decode_step_measured_over_predicted"}
RUN_KEYS = ["task", "model", "method", "budget"]
# What each run measured of its own cost (summary column -> metric row); NaN for runs that measured nothing.
MEASURED = {"kv_bytes_peak": "kv_bytes_peak_mean", "memory_ratio": "memory_ratio_mean",
            "peak_memory_bytes": "peak_cuda_memory_bytes", "peak_rss_bytes": "peak_rss_bytes",
            "prefill_tokens_per_s": "prefill_tokens_per_s", "decode_tokens_per_s": "decode_tokens_per_s"}
# Columns that say nothing about what was evaluated: never a reason to keep runs apart.
BOOKKEEPING = {"run_id", "started_at", "evalkit_version", "torch_version", "transformers_version", "lm_eval_version",
               "git_revision", "config_digest", "chat_template_sha"}
# What the compression method is made of: the full-cache baseline of a run agrees with it on everything else.
METHOD_COLUMNS = {"method", "budget", "capacity", "window", "kernel_size", "pooling", "gqa_reduce", "sink", "recent",
                  "kv_bits", "kv_group_size", "kv_residual",
                  "policy_params", "decode_method", "draft_model", "draft_source", "keep_fraction", "spec_prefill",
                  "compression_scope", "fidelity_tokens", "deployment", "hardware"}


# The columns of a run's paired comparison against its full cache (:func:`_against_baseline`, :func:`adjusted`).
PAIRED = ("baseline_run_id", "unit", "paired_units", "paired_items", "test", "p_value", "lost", "gained",
          "p_adjusted", "adjustment", "verdict")


def config_columns(metrics: pd.DataFrame) -> list[str]:
    """The run-config columns present in ``metrics`` (everything but the observations and bookkeeping)."""
    return [c for c in CONFIG_COLUMNS if c in metrics and c not in BOOKKEEPING]


def varying(runs: pd.DataFrame, columns: list[str]) -> list[str]:
    """The columns whose value differs between runs (missing values count as a value)."""
    return [c for c in columns if runs[c].map(cell_text).nunique() > 1]


def run_task(task: str, task_options: str | None = None) -> Task:
    """The task a run evaluated: its recorded ``task_options`` (JSON) say which kind (a name can be both: lm-eval's
    ``aime25`` is not evalkit's)."""
    try:
        options = json.loads(task_options or "{}")
    except (TypeError, ValueError):
        options = {}
    return task_of(task, options if isinstance(options, dict) else {})


def primary_metric(task: str, metrics: pd.DataFrame, task_options: str | None = None) -> str:
    """The primary metric the task declares (:meth:`evalkit.benchmark.Task.primary_metric`); without a declaration (a
    task of lm-eval's registry), the first metric it reported."""
    declared = run_task(task, task_options).primary_metric()
    if declared is not None:
        return declared
    names = metrics[(metrics["subset"] == "all") & ~metrics["metric"].isin(SECONDARY)]
    if "task" in metrics:  # a report's joined tables; a run's own metric rows carry no task column
        names = names[names["task"] == task]
    if task_options is not None and "task_options" in metrics:
        names = names[names["task_options"] == task_options]
    if names.empty:
        raise ValueError(f"no metric for task {task!r} in the results")
    return names["metric"].iloc[0]


def paired_bootstrap(compressed: pd.Series, baseline: pd.Series, iterations: int = 2000, seed: int = 0):
    """Mean difference compressed - baseline over the documents both scored, and its 95% percentile interval."""
    joined = pd.concat([compressed.rename("a"), baseline.rename("b")], axis=1, join="inner").dropna()
    if joined.empty:
        return math.nan, math.nan, math.nan, 0
    differences = (joined["a"] - joined["b"]).to_numpy()
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(differences), size=(iterations, len(differences)))
    means = differences[draws].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return float(differences.mean()), float(low), float(high), len(differences)


def _per_doc(samples: pd.DataFrame, run_id: str) -> pd.Series:
    rows = samples[samples["run_id"] == run_id]
    return rows.groupby("doc_id")["score"].mean()


def summarize(metrics: pd.DataFrame, samples: pd.DataFrame, iterations: int = 2000,
              adjustment: str = "holm") -> pd.DataFrame:
    """One row per distinct configuration: its score, the full-cache baseline, delta with CI and test, realized
    ratio and memory verdict, and every config column in which the runs differ (so no two configurations ever share a
    row or a point). Re-runs of one configuration (same config_digest) are not averaged: the newest is reported.

    The baseline of a run is the full-cache run that agrees with it on every config column outside the compression
    method (model and its source, task and options, data, limit, seed, dtype, ...). ``delta`` = value - baseline over
    the items both scored (``paired_items``, of ``paired_docs`` documents), with a paired bootstrap 95% interval and
    a paired test at the independent unit (:mod:`.paired_stats`); the p-values of the whole table are adjusted
    together (``adjustment``: holm or bh) and each configuration gets its ``verdict`` at the adjusted level.
    """
    runs = metrics.sort_values("started_at" if "started_at" in metrics else "run_id").drop_duplicates("run_id")
    if "config_digest" in runs:  # a configuration run again (resume=false): its newest run
        runs = runs[runs["config_digest"].isna() | ~runs.duplicated("config_digest", keep="last")]
    columns = config_columns(runs)
    shown = [c for c in varying(runs, columns) if c not in RUN_KEYS]
    matched = [c for c in columns if c not in METHOD_COLUMNS]
    rows = []
    for _, run in runs.iterrows():
        metric = primary_metric(run["task"], metrics, run.get("task_options"))
        own = metrics[(metrics["run_id"] == run["run_id"])]
        primary = own[(own["subset"] == "all") & (own["metric"] == metric)]
        realized = own[own["metric"] == "realized_ratio_mean"]["value"]
        memory = own[own["subset"] == "memory"].set_index("metric")["value"]
        measured = own[own["subset"] == "all"].drop_duplicates("metric", keep="last").set_index("metric")["value"]
        row = {key: run[key] for key in RUN_KEYS} | {column: run[column] for column in shown} | {
            "metric": metric, "value": float(primary["value"].iloc[0]) if len(primary) else math.nan,
            "stderr": float(primary["stderr"].iloc[0]) if len(primary) and pd.notna(primary["stderr"].iloc[0]) else math.nan,
            "realized_ratio": float(realized.iloc[0]) if len(realized) else math.nan,
            "memory_fits": bool(memory["fits"]) if "fits" in memory else None,
            "onchip_ratio": float(memory["onchip_ratio"]) if "onchip_ratio" in memory else math.nan,
            **{column: float(measured[name]) if name in measured else math.nan for column, name in MEASURED.items()},
            "run_id": run["run_id"],
        } | trace_costs(samples[samples["run_id"] == run["run_id"]])
        same = (runs[matched].map(cell_text) == run[matched].map(cell_text)).all(axis=1)
        baselines = runs[same & (runs["method"] == "full")]
        if len(baselines) and run["method"] != "full":
            row |= _against_baseline(row, baselines.iloc[-1]["run_id"], metrics, samples, iterations)
        rows.append(row)
    table = pd.DataFrame(rows)
    table["budget"] = table["budget"].astype(object).fillna("full")  # no run with a budget: a column of NaN
    table = table.sort_values(["task", "model", "method", *shown, "budget"], key=_budget_order).reset_index(drop=True)
    return adjusted(table, adjustment)


def _against_baseline(row: dict, baseline_id: str, metrics: pd.DataFrame, samples: pd.DataFrame,
                      iterations: int) -> dict:
    """A run's columns against its full-cache run: the baseline's value, the paired comparison, the trace costs."""
    base_value = metrics[(metrics["run_id"] == baseline_id) & (metrics["subset"] == "all")
                         & (metrics["metric"] == row["metric"])]["value"]
    items = pair_items(samples[samples["run_id"] == row["run_id"]], samples[samples["run_id"] == baseline_id])
    comparison = compare(items, iterations).as_row()
    out = {"baseline": float(base_value.iloc[0]) if len(base_value) else math.nan, "baseline_run_id": baseline_id}
    out |= {key: comparison.pop(key) for key in ("delta", "delta_low", "delta_high")}
    out |= {"paired_docs": len(items.drop_duplicates(["subset", "doc_id"]))} | comparison
    return out | against_full(row, samples[samples["run_id"] == baseline_id])


def adjusted(table: pd.DataFrame, adjustment: str = "holm") -> pd.DataFrame:
    """``table`` with its p-values adjusted together (``p_adjusted``, the method and count in ``adjustment``) and
    each configuration's ``verdict`` against its full cache at the adjusted level."""
    if "p_value" not in table:
        return table
    table = table.copy()
    table["p_adjusted"] = adjust(table["p_value"], adjustment)
    tested = int(table["p_value"].notna().sum())
    table["adjustment"] = [f"{ADJUSTMENTS[adjustment]} over {tested}" if pd.notna(p) else None
                           for p in table["p_value"]]
    table["verdict"] = [verdict(d, p) if pd.notna(p) else None for d, p in zip(table["delta"], table["p_adjusted"])]
    return table


def compression_factor(budget: str) -> float:
    """``4x`` -> 4, ``full`` -> 1; absolute budgets have no factor (NaN)."""
    if isinstance(budget, float) and math.isnan(budget):
        return 1.0
    return budget_grammar.factor(budget)


def _budget_order(column: pd.Series) -> pd.Series:
    return column.map(compression_factor) if column.name == "budget" else column.map(cell_text)


def setting_columns(table: pd.DataFrame) -> list[str]:
    """The columns beside task/model/method/budget that tell configurations apart in ``table``."""
    fixed = {*RUN_KEYS, "metric", "value", "stderr", "realized_ratio", "memory_fits", "onchip_ratio", "run_id",
             "baseline", "delta", "delta_low", "delta_high", "paired_docs", *MEASURED, *TRACE, "kv_byte_seconds_total",
             *PAIRED}
    return [c for c in table.columns if c not in fixed]


def distinguishing_settings(table: pd.DataFrame) -> list[str]:
    """The settings that tell apart runs of one task, model, method and budget (a swept window, say): what a label
    must show. Settings that follow from the method and budget (capacity, the policy's fields) are left out."""
    groups = table.groupby(RUN_KEYS, dropna=False)
    return [c for c in setting_columns(table) if (groups[c].agg(lambda v: v.map(cell_text).nunique()) > 1).any()]


def labels(table: pd.DataFrame, index=None) -> list[str]:
    """How the configurations of ``index`` (default: all) are named in one line: the task and model where they
    differ, the method, the budget, and the settings that tell runs of one method and budget apart."""
    keys = [c for c in ("task", "model") if table[c].map(cell_text).nunique() > 1]
    settings = distinguishing_settings(table)
    rows = table if index is None else table.loc[index]
    return [" ".join([*(cell_text(row[c]) for c in keys), cell_text(row["method"]), cell_text(row["budget"]),
                      *(f"{c}={cell_text(row[c])}" for c in settings if cell_text(row[c]) != "-")])
            for _, row in rows.iterrows()]


def cell_text(value) -> str:
    """A cell's value as text: missing values are "-", whole floats print as integers."""
    if value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def pivot(table: pd.DataFrame) -> pd.DataFrame:
    """Rows: task, model, method and every setting that differs between runs (window, kernel_size, limit, ...);
    columns: the budgets, full cache first, in order of compression. A cell is one configuration, never a mean.

    The full-cache baseline has no window or kernel; it shows under "-" in those columns.
    """
    index = ["task", "model", "method", *setting_columns(table)]
    frame = pd.concat([table[index].map(cell_text), table[["budget", "value"]]], axis=1)
    if frame.duplicated(index + ["budget"]).any():
        raise ValueError("two runs share a pivot cell; their configurations must differ in a shown column")
    wide = frame.pivot(index=index, columns="budget", values="value")
    order = sorted(wide.columns, key=lambda b: (b != "full", compression_factor(b) if b != "full" else 0, str(b)))
    wide = wide[order]
    wide.columns = ["full cache" if b == "full" else f"budget {b}" for b in order]
    return wide


