"""What ``evalkit-report`` prints: a line per configuration and where the report went (report.md has every column
and the plots); and which settings tell the runs apart and which they share, for the terminal and report.html
alike."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from .significance import MARKS, mark, nothing_separates
from .summary import RUN_KEYS, cell_text, config_columns, setting_columns

WIDTH = 120  # a terminal's columns
LONGEST_CELL = 30  # a longer value (a fingerprint, JSON) is cut to this many characters on the terminal
# What the policy records of its budget (the capacity, the decode rule, every field as JSON): implied by the method
# and the budget, never what sets a configuration apart.
FOLLOW_THE_BUDGET = {"policy_params", "capacity", "decode_method"}


def summary(results_dir: Path, paths: dict[str, Path]) -> str:
    """The report's summary (``paths["summary"]``) as the terminal shows it, then what was written where."""
    table = pd.read_csv(paths["summary"])
    out = paths["markdown"].parent
    names = [str(p.relative_to(out)) if p.parent == out else str(p) for p in paths.values()]
    return "\n".join([f"evalkit-report: {len(table)} configurations in {results_dir}", terminal_table(table),
                      f"written to {out}/: {', '.join(names)} (report.md: every column, the tests, the plots)"
                      f"{legend(table)}"])


def legend(table: pd.DataFrame) -> str:
    """What the marks beside the intervals say, where the table has them; where nothing separates, that, and the
    items a test would need (:func:`evalkit.results.significance.nothing_separates`): all on the last line, after the
    table (the lines above are the table's alone)."""
    if "verdict" not in table or table["verdict"].isna().all():
        return ""
    method = str(table["adjustment"].dropna().iloc[0]).split(" over ")[0]
    marks = ", ".join(f"{symbol} {verdict}" for verdict, symbol in MARKS.items())
    separates = nothing_separates(table)  # the intervals too wide to separate anything: the items that would
    return f"; marks: {marks} at {method}-adjusted p < 0.05" + (f"; {separates}" if separates else "")


def differing_settings(table: pd.DataFrame) -> list[str]:
    """The settings of a summary (:func:`evalkit.results.summary.summarize`) that differ between runs of one task,
    model and method (a swept window, limit or scope; a window that follows the budget): what sets a configuration
    apart beside those and its budget. Left out: what follows the task or the model alone (its source, context,
    chat template, options), the method alone (its defaults) or the budget (:data:`FOLLOW_THE_BUDGET`)."""

    groups = table.groupby(["task", "model", "method"], dropna=False)
    return [c for c in setting_columns(table) if c not in FOLLOW_THE_BUDGET
            and (groups[c].agg(lambda values: values.map(cell_text).nunique()) > 1).any()]


def shared_settings(metrics: pd.DataFrame) -> dict[str, object]:
    """The config columns every run of ``metrics`` has the same value in (missing in none), the task and model first,
    then in the tables' order: what report.html states once instead of in every row."""

    runs = metrics.drop_duplicates("run_id")
    columns = sorted(config_columns(runs), key=lambda c: RUN_KEYS.index(c) if c in RUN_KEYS else len(RUN_KEYS))
    return {c: runs[c].iloc[0] for c in columns
            if c != "run_id" and runs[c].notna().all() and runs[c].map(cell_text).nunique() == 1}


def _cut(text: str) -> str:
    return text if len(text) <= LONGEST_CELL else text[:LONGEST_CELL - 1] + "…"


def terminal_table(table: pd.DataFrame, width: int = WIDTH) -> str:
    """A configuration per line: its task, model, method and budget, the settings that set it apart
    (:func:`differing_settings`), its primary metric, its delta against the full cache with the 95% interval and the
    mark of its paired test (▼ worse, ▲ better, ≈ indistinguishable at the adjusted level), and how
    much smaller its KV cache was. Within ``width`` characters: where the lines would be longer, the task, model and
    metric that are the same on every line are said once above the table instead, then settings are left out from
    the last one (named under the table; report.md has them)."""

    settings = differing_settings(table)
    cells = {c: table[c].map(cell_text).map(_cut) for c in [*RUN_KEYS, *settings]}
    cells["metric"] = table["metric"]
    cells["value"] = [f"{v:.4f}" + (f" ± {e:.4f}" if pd.notna(e) else "") for v, e in zip(table["value"], table["stderr"])]
    if "delta" in table:
        verdicts = table["verdict"] if "verdict" in table else [None] * len(table)
        cells["vs full (95% CI)"] = [f"{d:+.4f} [{lo:+.2f}, {hi:+.2f}] {mark(v)}".rstrip() if pd.notna(d) else "-"
                                     for d, lo, hi, v in zip(table["delta"], table["delta_low"], table["delta_high"],
                                                             verdicts)]
    if "memory_ratio" in table:
        cells["KV smaller"] = [f"{r:.2f}x" if pd.notna(r) else "-" for r in table["memory_ratio"]]

    def lines(columns: list[str]) -> str:
        return pd.DataFrame({c: cells[c] for c in columns}).to_string(index=False)

    def fits(text: str) -> bool:
        return max(map(len, text.splitlines())) <= width

    columns, same, dropped = list(cells), [], []
    if not fits(lines(columns)):
        same = [c for c in ("task", "model", "metric") if pd.Series(cells[c]).nunique() == 1]
        columns = [c for c in columns if c not in same]
    while not fits(lines(columns)) and any(c in settings for c in columns):
        dropped.insert(0, [c for c in columns if c in settings][-1])
        columns.remove(dropped[0])
    said = [f"same in every run: {' · '.join(f'{c} {pd.Series(cells[c]).iloc[0]}' for c in same)}"] if same else []
    return "\n".join([*said, lines(columns), *([f"also set apart by {', '.join(dropped)}: see report.md"]
                                               if dropped else [])])
