"""``evalkit-report``: what a results directory says, as pivot tables, deltas against the full cache, and plots.

    evalkit-report results/ [--out results/report] [--bootstrap 2000] [--html]   (export kvpress, push: docs/results.md)

For every compressed run, the delta of its primary metric against the full-cache run of the same model and task, with
a paired bootstrap confidence interval over the samples both runs scored; beside it the realized compression and the
memory verdict of the run, and what the run measured of its cost (KV bytes held, memory ratio, peak memory,
prefill and decode throughput). Writes report.md, summary.csv, pivot.csv and accuracy_vs_budget.png into ``--out``,
and, where runs measured them, accuracy_vs_memory.png and accuracy_vs_speed.png (the Pareto front marked).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from evalkit import budget as budget_grammar
from evalkit.task import Task, task_names, task_of

from . import html_page, hub, kvpress_export, terminal_report
from .heatmaps import heatmap_axes, subset_grid
from .outputs import output_folder, refusing
from .tables import CONFIG_COLUMNS, read_runs
from .trace_costs import TRACE, against_full, point_label, trace_costs

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


def config_columns(metrics: pd.DataFrame) -> list[str]:
    """The run-config columns present in ``metrics`` (everything but the observations and bookkeeping)."""
    return [c for c in CONFIG_COLUMNS if c in metrics and c not in BOOKKEEPING]


def varying(runs: pd.DataFrame, columns: list[str]) -> list[str]:
    """The columns whose value differs between runs (missing values count as a value)."""
    return [c for c in columns if runs[c].map(_label).nunique() > 1]


def run_task(task: str, task_options: str | None = None) -> Task:
    """The task a run evaluated: its recorded ``task_options`` (JSON) say which kind (a name can be both: lm-eval's
    ``aime25`` is not evalkit's)."""
    try:
        options = json.loads(task_options or "{}")
    except (TypeError, ValueError):
        options = {}
    return task_of(task, options if isinstance(options, dict) else {})


def primary_metric(task: str, metrics: pd.DataFrame, task_options: str | None = None) -> str:
    """The primary metric the task declares (:meth:`evalkit.task.Task.primary_metric`); without a declaration (a
    task of lm-eval's registry), the first metric it reported."""
    declared = run_task(task, task_options).primary_metric()
    if declared is not None:
        return declared
    names = metrics[(metrics["task"] == task) & (metrics["subset"] == "all") & ~metrics["metric"].isin(SECONDARY)]
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


def summarize(metrics: pd.DataFrame, samples: pd.DataFrame, iterations: int = 2000) -> pd.DataFrame:
    """One row per distinct configuration: its score, the full-cache baseline, delta with CI, realized ratio and
    memory verdict, and every config column in which the runs differ (so no two configurations ever share a row or a
    point). Re-runs of one configuration (same config_digest) are not averaged: the newest is reported.

    The baseline of a run is the full-cache run that agrees with it on every config column outside the compression
    method (model and its source, task and options, data, limit, seed, dtype, ...). ``delta`` = value - baseline over
    the documents both scored (``paired_docs``), with a paired bootstrap 95% interval.
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
        same = (runs[matched].map(_label) == run[matched].map(_label)).all(axis=1)
        baselines = runs[same & (runs["method"] == "full")]
        if len(baselines) and run["method"] != "full":
            baseline = baselines.iloc[-1]
            base_value = metrics[(metrics["run_id"] == baseline["run_id"]) & (metrics["subset"] == "all")
                                 & (metrics["metric"] == metric)]["value"]
            delta, low, high, paired = paired_bootstrap(
                _per_doc(samples, run["run_id"]), _per_doc(samples, baseline["run_id"]), iterations
            )
            row |= {"baseline": float(base_value.iloc[0]) if len(base_value) else math.nan, "delta": delta,
                    "delta_low": low, "delta_high": high, "paired_docs": paired}
            row |= against_full(row, samples[samples["run_id"] == baseline["run_id"]])
        rows.append(row)
    table = pd.DataFrame(rows)
    table["budget"] = table["budget"].fillna("full")
    return table.sort_values(["task", "model", "method", *shown, "budget"], key=_budget_order).reset_index(drop=True)


def compression_factor(budget: str) -> float:
    """``4x`` -> 4, ``full`` -> 1; absolute budgets have no factor (NaN)."""
    if isinstance(budget, float) and math.isnan(budget):
        return 1.0
    return budget_grammar.factor(budget)


def _budget_order(column: pd.Series) -> pd.Series:
    return column.map(compression_factor) if column.name == "budget" else column.map(_label)


def _settings(table: pd.DataFrame) -> list[str]:
    """The columns beside task/model/method/budget that tell configurations apart in ``table``."""
    fixed = {*RUN_KEYS, "metric", "value", "stderr", "realized_ratio", "memory_fits", "onchip_ratio", "run_id",
             "baseline", "delta", "delta_low", "delta_high", "paired_docs", *MEASURED, *TRACE, "kv_byte_seconds_total"}
    return [c for c in table.columns if c not in fixed]


def _distinguishing(table: pd.DataFrame) -> list[str]:
    """The settings that tell apart runs of one task, model, method and budget (a swept window, say): what a label
    must show. Settings that follow from the method and budget (capacity, the policy's fields) are left out."""
    groups = table.groupby(RUN_KEYS, dropna=False)
    return [c for c in _settings(table) if (groups[c].agg(lambda v: v.map(_label).nunique()) > 1).any()]


def plot(table: pd.DataFrame, path: Path) -> Path:
    """Score against compression, one panel per task, one line per method and setting, 95% intervals as error bars
    (the full cache: a dashed line with its band)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = _distinguishing(table)
    tasks = sorted(table["task"].unique())
    figure, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4), squeeze=False)
    for axis, task in zip(axes[0], tasks):
        rows = table[table["task"] == task].assign(factor=lambda t: t["budget"].map(compression_factor))
        rows = rows.dropna(subset=["factor"])
        half = 1.96 * rows["stderr"].fillna(0.0)
        for key, group in rows[rows["method"] != "full"].groupby(["model", "method", *settings], dropna=False):
            group = group.sort_values("factor")
            label = " ".join([key[1]] + [f"{c}={_label(v)}" for c, v in zip(settings, key[2:]) if _label(v) != "-"])
            if rows["model"].nunique() > 1:
                label = f"{key[0]}: {label}"
            axis.errorbar(group["factor"], group["value"], yerr=half[group.index], marker="o", capsize=3, label=label)
        for (model, *_), base in rows[rows["method"] == "full"].groupby(["model", *settings], dropna=False):
            value, band = float(base["value"].iloc[-1]), float(half[base.index[-1]])
            line = axis.axhline(value, color="black", linestyle="--", label=f"full cache ({model})")
            axis.axhspan(value - band, value + band, color=line.get_color(), alpha=0.08)
        factors = sorted(rows["factor"].unique())
        axis.set_xscale("log", base=2)
        axis.set_xticks(factors, ["full" if f == 1 else f"{f:g}x" for f in factors])
        axis.minorticks_off()
        _finish_panel(axis, task, "KV-cache budget (compression)", rows)
    return _save(figure, path)


def pareto(x: pd.Series, y: pd.Series, lower_x_is_better: bool) -> pd.Series:
    """The points no other point beats on both axes (higher ``y``; lower or higher ``x`` as given), as a mask."""
    sign = 1.0 if lower_x_is_better else -1.0
    front = []
    for index in x.index:
        dominated = ((sign * x <= sign * x[index]) & (y >= y[index])
                     & ((sign * x < sign * x[index]) | (y > y[index]))).any()
        front.append(not dominated)
    return pd.Series(front, index=x.index)


TRADEOFFS = {  # file -> (summary column, axis label, lower is better, scale to show)
    "accuracy_vs_memory.png": ("kv_bytes_peak", "KV cache held at peak per request, measured (MiB)", True, 2**-20),
    "accuracy_vs_speed.png": ("decode_tokens_per_s", "decode throughput, measured (tokens/s)", False, 1.0),
    "accuracy_vs_byte_seconds.png": ("kv_byte_seconds_per_correct",
                                     "KV byte-seconds per correct answer, measured (MiB s)", True, 2**-20),
}


def tradeoff_plot(table: pd.DataFrame, column: str, label: str, lower_is_better: bool, scale: float,
                  path: Path) -> Path | None:
    """Score against a measured cost, one panel per task: one point per configuration with its 95% interval, the
    full cache as a black star and dashed line, the Pareto front (no configuration better on both axes) joined and
    ringed. None when no run measured ``column``."""
    rows = table.dropna(subset=[column, "value"])
    if rows.empty:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = _distinguishing(table)
    tasks = sorted(rows["task"].unique())
    figure, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4.2), squeeze=False)
    for axis, task in zip(axes[0], tasks):
        own = rows[rows["task"] == task].assign(x=lambda t: t[column] * scale)
        half = 1.96 * own["stderr"].fillna(0.0)
        for key, group in own[own["method"] != "full"].groupby(["model", "method", *settings], dropna=False):
            name = " ".join([key[1]] + [f"{c}={_label(v)}" for c, v in zip(settings, key[2:]) if _label(v) != "-"])
            if own["model"].nunique() > 1:
                name = f"{key[0]}: {name}"
            axis.errorbar(group["x"], group["value"], yerr=half[group.index], marker="o", linestyle="none",
                          capsize=3, label=name)
            for _, point in group.iterrows():
                axis.annotate(point_label(point), (point["x"], point["value"]), fontsize=7,
                              xytext=(4, 4), textcoords="offset points",
                              color="red" if point.get("spent_more_in_total") is True else "black")
        for (model, *_), base in own[own["method"] == "full"].groupby(["model", *settings], dropna=False):
            point = base.iloc[-1]
            axis.errorbar([point["x"]], [point["value"]], yerr=[half[base.index[-1]]], marker="*", markersize=12,
                          color="black", linestyle="none", capsize=3, label=f"full cache ({model})")
            axis.axhline(point["value"], color="black", linestyle="--", linewidth=0.8)
        front = own[pareto(own["x"], own["value"], lower_is_better)].sort_values("x")
        axis.plot(front["x"], front["value"], color="grey", linewidth=1, zorder=0, label="Pareto front")
        axis.scatter(front["x"], front["value"], s=160, facecolors="none", edgecolors="grey", zorder=0)
        axis.set_xscale("log")
        _finish_panel(axis, task, label, own)
    return _save(figure, path)


def _finish_panel(axis, task: str, xlabel: str, rows: pd.DataFrame) -> None:
    axis.set_xlabel(xlabel)
    axis.set_ylabel(f"{rows['metric'].iloc[0]} (95% CI)" if len(rows) else "score")
    axis.set_title(task)
    axis.legend(fontsize="small")


def _save(figure, path: Path) -> Path:
    import matplotlib.pyplot as plt

    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def _label(value) -> str:
    """A cell's value as text: missing values are "-", whole floats print as integers."""
    if value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def pivot(table: pd.DataFrame) -> pd.DataFrame:
    """Rows: task, model, method and every setting that differs between runs (window, kernel_size, limit, ...);
    columns: the budgets, full cache first, in order of compression. A cell is one configuration, never a mean.

    The full-cache baseline has no window or kernel; it shows under "-" in those columns.
    """
    index = ["task", "model", "method", *_settings(table)]
    frame = pd.concat([table[index].map(_label), table[["budget", "value"]]], axis=1)
    if frame.duplicated(index + ["budget"]).any():
        raise ValueError("two runs share a pivot cell; their configurations must differ in a shown column")
    wide = frame.pivot(index=index, columns="budget", values="value")
    order = sorted(wide.columns, key=lambda b: (b != "full", compression_factor(b) if b != "full" else 0, str(b)))
    wide = wide[order]
    wide.columns = ["full cache" if b == "full" else f"budget {b}" for b in order]
    return wide


def write_report(results_dir: str | Path, out: str | Path | None = None, iterations: int = 2000) -> dict[str, Path]:
    results_dir = Path(results_dir)
    out = Path(out) if out else results_dir / "report"
    metrics, samples = read_runs(results_dir)  # a damaged table stops the report here, before anything is written
    table = summarize(metrics, samples, iterations)
    output_folder(out)
    paths = {"summary": out / "summary.csv", "markdown": out / "report.md", "plot": out / "accuracy_vs_budget.png"}
    table.to_csv(paths["summary"], index=False)
    pivot_table = pivot(table)
    pivot_table.reset_index().to_csv(out / "pivot.csv", index=False)
    shown = table.drop(columns=["run_id"]).round(4)
    text = [f"# evalkit report: {results_dir}", "", "## Primary metric by task, model, method and budget", "",
            "One cell per configuration; runs that differ in any config column are never averaged.", "",
            pivot_table.round(4).to_markdown(), "", "## Runs against the full-cache baseline", "",
            "`delta` = value - baseline, computed on the documents both runs scored (`paired_docs`); `delta_low`/"
            "`delta_high`: paired bootstrap 95% interval. The baseline is the full-cache run with the same model, "
            "task, data and settings.", "", shown.to_markdown(index=False), "",
            f"![accuracy vs budget]({paths['plot'].name})", ""]
    if "spent_more_in_total" in table and table["spent_more_in_total"].eq(True).any():
        flagged = table[table["spent_more_in_total"].eq(True)]
        text += ["## Held less per step, spent more in total", "",
                 "These configurations held fewer KV bytes per request than the full cache yet spent more KV "
                 "byte-seconds over the run (longer traces): cheaper per step, dearer per answer.", "",
                 flagged[[*RUN_KEYS, "value", "length_ratio", "kv_byte_seconds_ratio"]].round(4).to_markdown(index=False),
                 ""]
    plot(table, paths["plot"])
    paths["pivot"] = out / "pivot.csv"
    for name, (column, label, lower, scale) in TRADEOFFS.items():
        drawn = tradeoff_plot(table, column, label, lower, scale, out / name)
        if drawn is not None:
            paths[name.removesuffix(".png")] = drawn
            text += [f"![{name.removesuffix('.png').replace('_', ' ')}]({name})", ""]
    recorded = metrics[["run_id", "task", "task_options"]].drop_duplicates() if "task_options" in metrics else None
    registry_runs = set() if recorded is None else {
        run for run, task, options in recorded.itertuples(index=False) if run_task(task, options).from_registry}
    # 2-D heatmaps: evalkit tasks that declare one (needle: depth x length), lm-eval groups with subsets below their
    # tasks (RULER: task x length)
    for registry in (False, True):
        runs = table[table["run_id"].isin(registry_runs) == registry]
        for task in sorted(runs["task"].unique()):
            chosen = runs[runs["task"] == task]
            axes = heatmap_axes(task, samples[samples["run_id"].isin(chosen["run_id"])], registry)
            if axes is None:
                continue
            name = f"{task}_registry" if registry and task in task_names() else task
            label = "score" if registry else primary_metric(task, metrics)  # a registry group's: each task's own
            paths[name] = subset_heatmaps(chosen, samples, task, out / f"{name}_heatmap.png", axes, label)
            (rows_field, columns_field), _ = axes
            text += [f"## {task}: {label} by {rows_field} and {columns_field}", "", f"![{task}]({paths[name].name})", ""]
    paths["markdown"].write_text("\n".join(text))
    return paths


def subset_heatmaps(table: pd.DataFrame, samples: pd.DataFrame, task: str, path: Path, axes=None,
                    label: str | None = None) -> Path:
    """The picture needle-style tests are read from: one heatmap of the task's two subset fields per configuration
    (method x budget x setting), the full cache first."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes_fields = axes or heatmap_axes(task)
    (rows_field, columns_field), _ = axes_fields
    runs = table.assign(factor=table["budget"].map(compression_factor)).sort_values(
        ["model", "factor", "method"], key=lambda c: c.fillna(math.inf) if c.name == "factor" else c)
    settings = _distinguishing(table)
    figure, axes = plt.subplots(1, len(runs), figsize=(3.2 * len(runs) + 1, 3.4), squeeze=False)
    for axis, (_, run) in zip(axes[0], runs.iterrows()):
        grid = subset_grid(samples, run["run_id"], task, axes_fields)
        image = axis.imshow(grid.to_numpy(), vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        axis.set_xticks(range(len(grid.columns)), [str(c) for c in grid.columns])
        axis.set_yticks(range(len(grid.index)), [f"{d:.0%}" if isinstance(d, float) else str(d) for d in grid.index])
        for (row, column), value in pd.DataFrame(grid.to_numpy()).stack().items():
            axis.text(column, row, f"{value:.2f}", ha="center", va="center", fontsize=7)
        extra = " ".join(f"{c}={_label(run[c])}" for c in settings if _label(run[c]) != "-")
        title = "full cache" if run["method"] == "full" else f"{run['method']} {run['budget']}"
        axis.set_title(f"{title}\n{extra}".strip(), fontsize=9)
        axis.set_xlabel(columns_field)
    axes[0][0].set_ylabel(rows_field)
    figure.colorbar(image, ax=axes[0].tolist(), shrink=0.8, label=label or task_of(task).primary_metric() or "score")
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)
    return path


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose mistakes are one line, ``<prog>: <what is wrong>`` and exit status 2, as the
    program's other refusals (argparse's own answer starts with the usage)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} ({self.prog} --help shows the arguments)\n")


def resamples(text: str) -> int:
    """``--bootstrap``'s count: a positive integer."""
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"the number of bootstrap resamples must be a positive integer, got {text!r}")
    return count


def main(argv: list[str] | None = None) -> None:
    if (argv := sys.argv[1:] if argv is None else argv)[:1] in (["export"], ["push"]):  # each its module's main
        return (kvpress_export if argv[0] == "export" else hub).main(argv[1:])
    parser = OneLineParser(prog="evalkit-report", description=__doc__.splitlines()[0])
    parser.add_argument("results_dir", type=Path)
    parser.add_argument("--out", type=Path, default=None, help="default: <results_dir>/report")
    parser.add_argument("--bootstrap", type=resamples, default=2000,
                        help="bootstrap resamples for the delta intervals (a positive integer)")
    parser.add_argument("--html", action="store_true", help="also write report.html: the report as one page")
    args = parser.parse_args(argv)
    with refusing("evalkit-report"):  # no results directory, a damaged table, an --out that cannot be written
        paths = write_report(args.results_dir, args.out, args.bootstrap)
        paths |= {"html": html_page.write_page(args.results_dir, paths)} if args.html else {}
    print(terminal_report.summary(args.results_dir, paths))


if __name__ == "__main__":
    main()
