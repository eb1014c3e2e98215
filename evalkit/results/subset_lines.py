"""A heatmap task's score along each of its two fields (the needle test: against prompt length, and against depth), one
line per method and budget over every run of it: a grid run length by length, each length its own configuration
(its own ``model.max_context``), is drawn as one line, where the heatmaps draw one panel a run."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from .summary import cell_text, compression_factor

LABELS = ["model", "method", "budget", "compression_scope"]  # what a line stands for, where runs differ in it


def field_scores(samples: pd.DataFrame, task: str, axes) -> dict[str, pd.DataFrame]:
    """Per field of the task's heatmap (``axes``, :func:`.heatmaps.heatmap_axes`): the mean score and count by the
    run's labels and the field's value (numbers as numbers), every run of the task pooled."""
    (rows_field, columns_field), fields = axes
    rows = samples[(samples["task"] == task) & samples["score"].notna()]
    parts = rows["subset"].astype(str).str.split("/", expand=True)
    labels = [label for label in LABELS if label in rows and (label in ("method", "budget")
                                                              or rows[label].nunique(dropna=False) > 1)]
    tables = {}
    for field in (columns_field, rows_field):
        values = parts[fields.index(field)]
        numeric = pd.to_numeric(values, errors="coerce")
        frame = rows[labels].assign(**{field: values if numeric.isna().any() else numeric, "score": rows["score"]})
        tables[field] = (frame.groupby([*labels, field], dropna=False)["score"].agg(["mean", "count"])
                         .reset_index().rename(columns={"mean": "score", "count": "n"}))
    return tables


def line_label(row: pd.Series) -> str:
    """``snapkv 4x`` (``full`` without a budget), with the model and scope where lines differ in them."""
    parts = [str(row["model"])] if "model" in row else []
    parts.append(row["method"] if row.get("budget") is None or row["method"] == "full"
                 else f"{row['method']} {cell_text(row['budget'])}")
    if "compression_scope" in row:
        parts.append(cell_text(row["compression_scope"]))
    return " ".join(parts)


def subset_lines(samples: pd.DataFrame, task: str, path: Path, axes, label: str = "score") -> Path:
    """One panel per field of the task's heatmap, the score against it, a line per method and budget (the full
    cache dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tables = field_scores(samples, task, axes)
    figure, panels = plt.subplots(1, len(tables), figsize=(5.5 * len(tables), 4), squeeze=False)
    for axis, (field, table) in zip(panels[0], tables.items()):
        keys = [column for column in table.columns if column not in (field, "score", "n")]
        groups = sorted(table.groupby(keys, dropna=False), key=lambda group: (
            group[1]["method"].iloc[0], compression_factor(group[1]["budget"].iloc[0])))
        for _, points in groups:
            line, points = points.iloc[0], points.sort_values(field)
            axis.plot(points[field].astype(str) if points[field].dtype == object else points[field], points["score"],
                      marker="o", label=line_label(line), linestyle="--" if line["method"] == "full" else "-")
        axis.set_ylim(-0.02, 1.02)
        axis.set_title(f"{task}: {label} by {field}")
        axis.set_xlabel(field)
        axis.set_ylabel(label)
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
