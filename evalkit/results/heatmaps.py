"""The grids a heatmap of a task's samples is drawn from: which two subset fields a task's heatmap shows, and one
run's mean score over them (the needle test's depth by prompt length)."""

from __future__ import annotations

import pandas as pd

from evalkit.benchmark import task_of


def heatmap_axes(task: str, samples: pd.DataFrame | None = None, registry: bool = False):
    """``((rows, columns), fields)``: what a heatmap of ``task`` shows and how its samples' subsets are made. An
    evalkit task declares it (:meth:`evalkit.benchmark.Task.heatmap`); a group of lm-eval's registry whose samples carry a
    subset below their task (RULER: ``niah_single_1/4096``) is drawn task x that subset. None: no heatmap."""
    if not registry:
        declared = task_of(task)
        axes = declared.heatmap()
        return (axes, declared.subset_fields()) if axes else None
    subsets = samples["subset"].dropna().astype(str) if samples is not None and len(samples) else pd.Series(dtype=str)
    if subsets.empty or not subsets.str.count("/").eq(1).all():
        return None
    return ("task", "subset"), ["task", "subset"]


def subset_grid(samples: pd.DataFrame, run_id: str, task: str, axes=None) -> pd.DataFrame:
    """Mean score of one run over the task's two heatmap fields (:func:`heatmap_axes`): rows the first, columns the
    second, read from the samples' subsets (numbers sorted as numbers)."""
    (rows_field, columns_field), fields = axes or heatmap_axes(task)
    rows = samples[samples["run_id"] == run_id]
    parts = rows["subset"].str.split("/", expand=True)

    def column(field: str) -> pd.Series:
        values = parts[fields.index(field)]
        numeric = pd.to_numeric(values, errors="coerce")
        return values if numeric.isna().any() else numeric

    frame = pd.DataFrame({rows_field: column(rows_field), columns_field: column(columns_field), "score": rows["score"]})
    return frame.pivot_table(index=rows_field, columns=columns_field, values="score", aggfunc="mean").sort_index()


def needle_grid(samples: pd.DataFrame, run_id: str) -> pd.DataFrame:
    """Accuracy of one needle run: rows the needle depth, columns the prompt length."""
    return subset_grid(samples, run_id, "needle")
