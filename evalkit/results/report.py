"""The report of a results directory (``evalkit-report``, :mod:`.cli`): pivot tables, deltas against the full cache, and plots.

    evalkit-report results/ [--out results/report] [--bootstrap 2000] [--html]   (export kvpress, push: docs/results.md)

For every compressed run, the delta of its primary metric against the full-cache run of the same model and task, with
a paired bootstrap confidence interval over the samples both runs scored; beside it the realized compression and the
memory verdict of the run, and what the run measured of its cost (KV bytes held, memory ratio, peak memory,
prefill and decode throughput). Writes report.md, summary.csv, pivot.csv and accuracy_vs_budget.png into ``--out``,
and, where runs measured them, accuracy_vs_memory.png and accuracy_vs_speed.png (the Pareto front marked); for
session tasks accuracy_by_turn.png.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pandas as pd

from evalkit.benchmark import task_names, task_of

from . import lm_eval_files, significance
from .heatmaps import heatmap_axes, subset_grid
from .outputs import output_folder
from .subset_lines import subset_lines
from .summary import (
    RUN_KEYS,
    cell_text,
    compression_factor,
    distinguishing_settings,
    pivot,
    primary_metric,
    run_task,
    summarize,
)
from .tables import read_runs
from .trace_costs import point_label
from .turns import left_out_line, turn_plot


def plot(table: pd.DataFrame, path: Path) -> Path:
    """Score against compression, one panel per task, one line per method and setting, 95% intervals as error bars
    (the full cache: a dashed line with its band)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = distinguishing_settings(table)
    tasks = sorted(table["task"].unique())
    figure, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4), squeeze=False)
    for axis, task in zip(axes[0], tasks):
        rows = table[table["task"] == task].assign(factor=lambda t: t["budget"].map(compression_factor))
        rows = rows.dropna(subset=["factor"])
        half = 1.96 * rows["stderr"].fillna(0.0)
        for key, group in rows[rows["method"] != "full"].groupby(["model", "method", *settings], dropna=False):
            group = group.sort_values("factor")
            label = " ".join([key[1]] + [f"{c}={cell_text(v)}" for c, v in zip(settings, key[2:]) if cell_text(v) != "-"])
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

    settings = distinguishing_settings(table)
    tasks = sorted(rows["task"].unique())
    figure, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4.2), squeeze=False)
    for axis, task in zip(axes[0], tasks):
        own = rows[rows["task"] == task].assign(x=lambda t: t[column] * scale)
        half = 1.96 * own["stderr"].fillna(0.0)
        for key, group in own[own["method"] != "full"].groupby(["model", "method", *settings], dropna=False):
            name = " ".join([key[1]] + [f"{c}={cell_text(v)}" for c, v in zip(settings, key[2:]) if cell_text(v) != "-"])
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


def write_report(results_dir: str | Path, out: str | Path | None = None, iterations: int = 2000,
                 adjustment: str = "holm") -> dict[str, Path]:
    results_dir = Path(results_dir)
    out = Path(out) if out else results_dir / "report"
    metrics, samples = read_runs(results_dir)  # a damaged table stops the report here, before anything is written
    table = summarize(metrics, samples, iterations, adjustment)
    output_folder(out)
    paths = {"summary": out / "summary.csv", "markdown": out / "report.md", "plot": out / "accuracy_vs_budget.png"}
    table.to_csv(paths["summary"], index=False)
    pivot_table = pivot(table)
    pivot_table.reset_index().to_csv(out / "pivot.csv", index=False)
    shown = table.drop(columns=["run_id"]).round(4)
    text = [f"# evalkit report: {results_dir}", "", "## Primary metric by task, model, method and budget", "",
            "One cell per configuration; runs that differ in any config column are never averaged.", "",
            pivot_table.round(4).to_markdown(), "", "## Runs against the full-cache baseline", "",
            "`delta` = value - baseline, computed on the documents both runs scored (`paired_docs`; `paired_items`: "
            "their generations, `paired_units`: the independent units they make); `delta_low`/`delta_high`: paired "
            "bootstrap 95% interval over those units; `verdict`: the paired test's, below. The baseline is the "
            "full-cache run with the same model, task, data and settings.", "", shown.to_markdown(index=False), "",
            f"![accuracy vs budget]({paths['plot'].name})", ""]
    tested, section = significance.write(table, samples, out, iterations, adjustment)
    paths |= tested
    if (separates := significance.nothing_separates(table)) is not None:  # the terminal says it too
        section += [f"Note: {separates}.", ""]
    text += section
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
    text += turn_section(samples, out, paths) + heatmap_section(table, metrics, samples, out, paths)
    if written := lm_eval_files.with_statistics(results_dir, out, table):
        paths["lm_eval"] = written
    paths["markdown"].write_text("\n".join(text))
    return paths


def heatmap_section(table: pd.DataFrame, metrics: pd.DataFrame, samples: pd.DataFrame, out: Path,
                    paths: dict[str, Path]) -> list[str]:
    """2-D heatmaps (added to ``paths``) and their lines of report.md: evalkit tasks that declare one (needle: depth
    x length), lm-eval groups with subsets below their tasks (RULER: task x length)."""
    text = []
    recorded = metrics[["run_id", "task", "task_options"]].drop_duplicates() if "task_options" in metrics else None
    registry_runs = set() if recorded is None else {
        run for run, task, options in recorded.itertuples(index=False) if run_task(task, options).from_registry}
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
            if not registry:  # every run of a method and budget as one line, along each field
                paths[f"{name}_lines"] = subset_lines(samples[samples["run_id"].isin(chosen["run_id"])], task,
                                                      out / f"{name}_by_{columns_field}_and_{rows_field}.png", axes,
                                                      label)
                text += [f"![{task} lines]({paths[f'{name}_lines'].name})", ""]
    return text


def turn_section(samples: pd.DataFrame, out: Path, paths: dict[str, Path]) -> list[str]:
    """Session tasks: accuracy_by_turn.png (added to ``paths``) and its lines of report.md. A run the plot cannot show
    (its samples have no turn) is named in one line on stderr and in report.md, never dropped without a word."""
    text = []
    if turn_plot(samples, out / "accuracy_by_turn.png") is not None:  # score turn by turn
        paths["accuracy_by_turn"] = out / "accuracy_by_turn.png"
        text += ["## Accuracy by turn (one context, many calls)", "", "![accuracy by turn](accuracy_by_turn.png)", ""]
    if (left_out := left_out_line(samples, "accuracy_by_turn" in paths)) is not None:
        print(f"evalkit-report: {left_out}", file=sys.stderr)
        text += [f"Note: {left_out}.", ""]
    return text


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
    settings = distinguishing_settings(table)
    figure, axes = plt.subplots(1, len(runs), figsize=(3.2 * len(runs) + 1, 3.4), squeeze=False)
    for axis, (_, run) in zip(axes[0], runs.iterrows()):
        grid = subset_grid(samples, run["run_id"], task, axes_fields)
        image = axis.imshow(grid.to_numpy(), vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        axis.set_xticks(range(len(grid.columns)), [str(c) for c in grid.columns])
        axis.set_yticks(range(len(grid.index)), [f"{d:.0%}" if isinstance(d, float) else str(d) for d in grid.index])
        for (row, column), value in pd.DataFrame(grid.to_numpy()).stack().items():
            axis.text(column, row, f"{value:.2f}", ha="center", va="center", fontsize=7)
        extra = " ".join(f"{c}={cell_text(run[c])}" for c in settings if cell_text(run[c]) != "-")
        title = "full cache" if run["method"] == "full" else f"{run['method']} {run['budget']}"
        axis.set_title(f"{title}\n{extra}".strip(), fontsize=9)
        axis.set_xlabel(columns_field)
    axes[0][0].set_ylabel(rows_field)
    figure.colorbar(image, ax=axes[0].tolist(), shrink=0.8, label=label or task_of(task).primary_metric() or "score")
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)
    return path


