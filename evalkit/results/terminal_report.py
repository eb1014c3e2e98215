"""What ``evalkit-report`` prints: a line per configuration and where the report went (report.md has every column
and the plots)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

# Config columns left to report.md: long, or implied by the budget and the method.
NOT_ON_THE_TERMINAL = {"policy_params", "capacity", "decode_method"}


def summary(results_dir: Path, paths: dict[str, Path]) -> str:
    """The report's summary (``paths["summary"]``) as the terminal shows it, then what was written where."""
    table = pd.read_csv(paths["summary"])
    out = paths["markdown"].parent
    names = [str(p.relative_to(out)) if p.parent == out else str(p) for p in paths.values()]
    return "\n".join([f"evalkit-report: {len(table)} configurations in {results_dir}", terminal_table(table),
                      f"written to {out}/: {', '.join(names)} (report.md: every column, the plots)"])


def terminal_table(table: pd.DataFrame) -> str:
    """A configuration per line (the keys in which runs differ), its primary metric, its delta against the full cache
    with the 95% interval, and how much smaller its KV cache was."""
    from .report import _label  # a cell as report.md writes it ("-" for missing, whole floats as integers)

    keys = [c for c in table.columns[:table.columns.get_loc("metric")] if c not in NOT_ON_THE_TERMINAL]
    shown = table[keys].map(_label)
    shown["metric"] = table["metric"]
    shown["value"] = [f"{v:.4f}" + (f" ± {e:.4f}" if pd.notna(e) else "") for v, e in zip(table["value"], table["stderr"])]
    if "delta" in table:
        shown["vs full (95% CI)"] = [f"{d:+.4f} [{lo:+.3f}, {hi:+.3f}]" if pd.notna(d) else "-"
                                     for d, lo, hi in zip(table["delta"], table["delta_low"], table["delta_high"])]
    if "memory_ratio" in table:
        shown["KV smaller"] = [f"{r:.2f}x" if pd.notna(r) else "-" for r in table["memory_ratio"]]
    return shown.to_string(index=False)

