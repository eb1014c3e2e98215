"""Which differences of a report are real: the paired comparison of every configuration against its full cache as a
table, the configurations of each budget no test separates (a compact letter display), the items each configuration
lost and gained against the full cache (flips.csv), and a line for the terminal where nothing separates.

The statistics are :mod:`.paired_stats`'; the rows are :func:`evalkit.results.summary.summarize`'s."""

from __future__ import annotations

import itertools
from pathlib import Path

import pandas as pd

from .paired_stats import ADJUSTMENTS, ALPHA, adjust, compact_letters, compare, pair_items
from .power import items_needed
from .summary import cell_text, compression_factor, labels

FLIP_COLUMNS = ["configuration", "run_id", "baseline_run_id", "change", "subset", "doc_id", "sample_id", "repeat",
                "session_id", "baseline_score", "score"]
MARKS = {"worse": "▼", "better": "▲", "indistinguishable from the full cache": "≈"}


def compared(table: pd.DataFrame) -> pd.DataFrame:
    """The configurations of ``table`` that were tested against a full cache."""
    if "p_value" not in table:
        return table.iloc[:0]
    return table[table["p_value"].notna()]


def tests_table(table: pd.DataFrame) -> pd.DataFrame:
    """A row per tested configuration: unit, counts, delta with its interval, test, p-values, verdict, flips."""
    rows = compared(table)
    frame = pd.DataFrame({"configuration": labels(table, rows.index)}, index=rows.index)
    for column in ("unit", "paired_units", "paired_items", "delta", "95% CI", "test", "p_value", "p_adjusted",
                   "adjustment", "verdict", "lost", "gained"):
        frame[column] = rows[column] if column != "95% CI" else [
            f"[{low:+.4f}, {high:+.4f}]" for low, high in zip(rows["delta_low"], rows["delta_high"])]
    return frame.rename(columns={"paired_units": "units", "paired_items": "items"}).reset_index(drop=True)


def ties(table: pd.DataFrame, samples: pd.DataFrame, iterations: int = 2000, adjustment: str = "holm") -> pd.DataFrame:
    """Per budget (the configurations of one budget against one full cache), every pair of configurations tested
    (:func:`evalkit.results.paired_stats.compare` on the items both scored), the p-values adjusted over that
    budget's pairs, and the letters of a compact letter display: configurations sharing a letter are not separated.
    Budgets of one configuration are left out."""
    rows = compared(table).assign(configuration=lambda t: labels(table, t.index))
    out = []
    for (task, model, budget, _), group in rows.groupby(["task", "model", "budget", "baseline_run_id"], sort=False):
        if len(group) < 2:
            continue
        group = group.sort_values("value", ascending=False)
        pairs = list(itertools.combinations(group.index, 2))
        p_values = [compare(pair_items(samples[samples["run_id"] == group.at[i, "run_id"]],
                                       samples[samples["run_id"] == group.at[j, "run_id"]]), iterations,
                                    interval=False).p_value
                    for i, j in pairs]
        adjusted = adjust(p_values, adjustment)
        separated = {frozenset((group.at[i, "configuration"], group.at[j, "configuration"]))
                     for (i, j), p in zip(pairs, adjusted) if p < ALPHA}
        letters = compact_letters(list(group["configuration"]), separated)
        family = f"{ADJUSTMENTS[adjustment]} over {len(pairs)} pair{'s' if len(pairs) > 1 else ''}"
        out += [{"task": task, "model": model, "budget": budget, "configuration": name, "value": value,
                 "group": letters[name], "adjustment": family}
                for name, value in zip(group["configuration"], group["value"])]
    frame = pd.DataFrame(out, columns=["task", "model", "budget", "configuration", "value", "group", "adjustment"])
    order = frame["budget"].map(compression_factor).fillna(float("inf"))
    return frame.assign(order=order).sort_values(["task", "model", "order"], kind="stable").drop(columns="order")


def flips(table: pd.DataFrame, samples: pd.DataFrame) -> pd.DataFrame:
    """Per tested configuration, the items its full cache scored higher (``lost``: right there, wrong here) and
    lower (``gained``), with their ids, subsets and both scores."""
    rows = compared(table)
    parts = []
    for label, (_, row) in zip(labels(table, rows.index), rows.iterrows()):
        items = pair_items(samples[samples["run_id"] == row["run_id"]],
                           samples[samples["run_id"] == row["baseline_run_id"]])
        changed = items[items["score"] != items["baseline"]]
        parts.append(changed.assign(
            configuration=label, run_id=row["run_id"], baseline_run_id=row["baseline_run_id"],
            change=["lost" if s < b else "gained" for s, b in zip(changed["score"], changed["baseline"])],
        ).rename(columns={"baseline": "baseline_score"}))
    frame = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=FLIP_COLUMNS)
    return frame[FLIP_COLUMNS].replace({"subset": {"": None}, "session_id": {"": None}})


def mark(verdict) -> str:
    """The terminal's mark of a verdict: ▼ worse, ▲ better, ≈ indistinguishable from the full cache."""
    return MARKS.get(verdict, "") if isinstance(verdict, str) else ""


def markdown(table: pd.DataFrame, tied: pd.DataFrame, flips_name: str) -> list[str]:
    """report.md's section: the tests, the ties per budget and the flips' counts, with the link to the flips."""
    tested = tests_table(table)
    if tested.empty:
        return []
    adjustment = tested["adjustment"].iloc[0]
    text = ["## Which differences are real", "",
            "Each configuration against its full cache on the items both scored, resampling the independent `unit`: "
            "the session where rows are turns of one session (they share its context), the problem where a "
            "document was sampled several times, the document otherwise. `delta` with its 95% paired bootstrap "
            "interval over units; `test`: McNemar's exact test on the discordant items where scores are 0/1 and "
            "each unit is one item, else (a unit of several items, or scores that are not 0/1) a paired permutation "
            f"test on the units' summed differences; `p_adjusted`: {adjustment} comparisons of this report "
            f"(`adjustment`); `verdict` at adjusted p < {ALPHA:g}. `lost`/`gained`: items the full cache scored "
            f"higher/lower, listed in [{flips_name}]({flips_name}).", "",
            tested.round(4).to_markdown(index=False), ""]
    if not tied.empty:
        text += ["## Ties at each budget", "",
                 "Configurations of one budget (against one full cache) that share a letter in `group` are not "
                 f"separated by a paired test at adjusted p < {ALPHA:g} (the same tests, adjusted over that budget's "
                 "pairs); the best first.", "", tied.round(4).to_markdown(index=False), ""]
    return text


def nothing_separates(table: pd.DataFrame, delta: float = 0.05) -> str | None:
    """Where no tested configuration is worse or better than its full cache at the adjusted level: one line saying
    so, and how many items a McNemar test would need to see a change of ``delta`` at the report's largest observed
    discordance (at least ``delta``). None where something separates or nothing was tested."""
    tested = compared(table)
    if tested.empty or tested["verdict"].isin(["worse", "better"]).any():
        return None
    method = str(tested["adjustment"].iloc[0]).split(" over ")[0]
    line = (f"no configuration separates from its full cache at {method}-adjusted p < {ALPHA:g} (on "
            f"{cell_text(int(tested['paired_items'].max()))} items at most)")
    binary = tested[tested["test"] == "McNemar exact"]
    if binary.empty:
        return line
    discordance = max(float(((binary["lost"] + binary["gained"]) / binary["paired_items"]).max()), delta)
    items, _ = items_needed(min(discordance, 1.0), delta, ALPHA / len(tested))
    return (f"{line}: a change of {delta:g} at a discordance of {discordance:.2g} takes about {items} items for 80% "
            f"power over {len(tested)} comparisons (evalkit-report plan shows the arithmetic)")


def write(table: pd.DataFrame, samples: pd.DataFrame, out: Path, iterations: int,
          adjustment: str) -> tuple[dict[str, Path], list[str]]:
    """ties.csv and flips.csv into ``out`` and report.md's section (nothing where nothing was tested)."""
    if compared(table).empty:
        return {}, []
    tied, flipped = ties(table, samples, iterations, adjustment), flips(table, samples)
    paths = {"ties": out / "ties.csv", "flips": out / "flips.csv"}
    tied.to_csv(paths["ties"], index=False)
    flipped.to_csv(paths["flips"], index=False)
    return paths, markdown(table, tied, paths["flips"].name)
