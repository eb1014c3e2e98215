"""Accuracy turn by turn: a session task's samples (``task.mode=multi_request|multi_turn``) by their ``turn``, one
line per run (model, method, budget, mode: single for the same queries asked alone), the full cache dashed. Where SCBench finds that methods which evict
lose accuracy as a chat goes on, this is the picture that shows it (or not)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from .summary import cell_text, compression_factor


def turn_scores(samples: pd.DataFrame) -> pd.DataFrame:
    """Per run and turn: the mean score and the count of scored samples, with what labels the run (``task``,
    ``model``, ``method``, ``budget``, ``task_mode``, ``task_history``). Empty where no sample has a turn."""
    if "turn" not in samples or samples["turn"].isna().all():
        return pd.DataFrame()
    rows = samples.dropna(subset=["turn", "score"])
    keys = ["run_id", "task", "model", "method", "budget", "task_mode", "task_history"]
    keys = [key for key in keys if key in rows]
    table = rows.groupby([*keys, "turn"], dropna=False)["score"].agg(["mean", "count"]).reset_index()
    return table.rename(columns={"mean": "score", "count": "n"})


SESSION_MODES = ("multi_request", "multi_turn")


def runs_without_turns(samples: pd.DataFrame) -> list[str]:
    """The runs accuracy_by_turn.png would show but cannot: their samples have no turn (no ``turn`` column, or every
    value empty), while they ran a session mode or a task the plot draws from other runs' turns."""
    if samples.empty:
        return []
    turned = samples["turn"].notna() if "turn" in samples else pd.Series(False, index=samples.index)
    with_turns = turned.groupby(samples["run_id"]).any()
    drawn = set(samples.loc[turned, "task"]) if "task" in samples else set()
    runs = samples.drop_duplicates("run_id").set_index("run_id")
    session = runs["task_mode"].isin(SESSION_MODES) if "task_mode" in runs else False
    in_plot = runs["task"].isin(drawn) if "task" in runs else False
    return sorted(runs.index[(session | in_plot) & ~with_turns.reindex(runs.index, fill_value=False)])


def left_out_line(samples: pd.DataFrame, drawn: bool) -> str | None:
    """One line naming the runs :func:`runs_without_turns` finds, and why; None where there are none."""
    missing = runs_without_turns(samples)
    if not missing:
        return None
    plot = "accuracy_by_turn.png leaves out" if drawn else "accuracy_by_turn.png is not drawn, leaving out"
    return (f"{plot} {len(missing)} run{'s' if len(missing) > 1 else ''} whose samples have no turn (no turn "
            f"column, or every turn empty): {', '.join(missing)}")


def run_label(run: pd.Series) -> str:
    """``snapkv 4x multi_turn`` (``/gold`` under the gold history), ``full multi_request``."""
    budget = "" if run["method"] == "full" else f" {cell_text(run['budget'])}"
    history = "/gold" if run.get("task_history") == "gold" else ""
    mode = cell_text(run.get("task_mode"))
    return f"{run['method']}{budget} {'single' if mode == '-' else mode}{history}"


def turn_plot(samples: pd.DataFrame, path: Path) -> Path | None:
    """The mean score by turn, one panel per task; None where no run has session rows."""
    table = turn_scores(samples)
    if table.empty:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted(table["task"].unique())
    figure, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4), squeeze=False)
    for axis, task in zip(axes[0], tasks):
        rows = table[table["task"] == task]
        runs = rows.drop_duplicates("run_id").assign(factor=lambda t: t["budget"].map(compression_factor))
        for _, run in runs.sort_values(["method", "factor"]).iterrows():
            line = rows[rows["run_id"] == run["run_id"]].sort_values("turn")
            label = run_label(run) if rows["model"].nunique() == 1 else f"{run['model']}: {run_label(run)}"
            axis.plot(line["turn"], line["score"], marker="o", label=label,
                      linestyle="--" if run["method"] == "full" else "-")
        axis.set_xticks(sorted(rows["turn"].unique()))
        axis.set_ylim(-0.02, 1.02)
        axis.set_title(task)
        axis.set_xlabel("turn")
        axis.set_ylabel("mean score")
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
