"""``evalkit-report compare RUN_A RUN_B``: any two runs on the same items, paired, as sacrebleu's ``--paired-bs``
compares a baseline system with another: the unit resampled, the paired test, the delta's interval and the flips.

    evalkit-report compare RUN_A RUN_B [--results results/] [--bootstrap 2000] [--flips FILE]

RUN_A is the baseline: ``delta`` = RUN_B - RUN_A, ``lost`` the items RUN_A scored higher (got right and RUN_B got
wrong), ``gained`` the others. A run is a run id (or the start of one that no other shares) in ``--results``, or the
path of its samples table (``results/samples/<run_id>.parquet``). Runs of different tasks, or that share no item
(subset, doc_id, sample_id and repeat), are refused in one line.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from .outputs import OneLineParser, refusing
from .paired_stats import compare, pair_items
from .summary import cell_text, primary_metric
from .tables import ResultsError, read_runs

SHOWN_FLIPS = 10  # per kind on the terminal; --flips writes them all


def resolve(run: str, results: Path) -> tuple[Path, str]:
    """The results directory and run id ``run`` names: a samples table's path, or a run id (or its start)."""
    path = Path(run)
    if path.suffix == ".parquet":
        if not path.is_file():
            raise ResultsError(f"{run}: no such samples table")
        return path.resolve().parent.parent, path.stem
    return results, run


def find_run(run: str, metrics: pd.DataFrame, results: Path) -> str:
    """The one run id of ``metrics`` that is ``run`` or starts with it."""
    runs = sorted(metrics["run_id"].unique())
    if run in runs:
        return run
    matches = [r for r in runs if r.startswith(run)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise ResultsError(f"no run {run!r} in {results} (its {len(runs)} runs are listed in {results}/metrics/)")
    raise ResultsError(f"{run!r} starts {len(matches)} run ids in {results} ({', '.join(matches[:3])}"
                       f"{', ...' if len(matches) > 3 else ''}): give more of it")


def load(run: str, results: Path, cache: dict) -> tuple[pd.Series, pd.DataFrame, pd.DataFrame]:
    """A run's config (its first metrics row), its samples, and its results directory's metrics."""
    folder, name = resolve(run, results)
    if folder not in cache:
        cache[folder] = read_runs(folder)
    metrics, samples = cache[folder]
    run_id = find_run(name, metrics, folder)
    return metrics[metrics["run_id"] == run_id].iloc[0], samples[samples["run_id"] == run_id], metrics


def label(config: pd.Series) -> str:
    budget = cell_text(config.get("budget"))
    return f"{config['method']}{'' if budget == '-' else ' ' + budget} ({config['model']}, run {config['run_id']})"


def flip_lines(items: pd.DataFrame) -> list[str]:
    """The flipped items, a line per kind: their ids (doc, repeat where several) and subsets."""
    lines = []
    for kind, chosen in (("lost (A higher, B lower)", items["score"] < items["baseline"]),
                         ("gained (B higher, A lower)", items["score"] > items["baseline"])):
        rows = items[chosen]
        named = [f"doc {row.doc_id}" + (f" #{row.repeat}" if items["repeat"].max() > 0 else "")
                 + (f" [{row.subset}]" if row.subset else "") for row in rows.head(SHOWN_FLIPS).itertuples()]
        more = f", and {len(rows) - SHOWN_FLIPS} more" if len(rows) > SHOWN_FLIPS else ""
        lines.append(f"{kind}: {len(rows)}" + (f": {', '.join(named)}{more}" if named else ""))
    return lines


def report(a: str, b: str, results: Path, iterations: int, flips: Path | None) -> list[str]:
    """The comparison's lines (and ``flips`` written, where given)."""
    cache: dict = {}
    (config_a, samples_a, metrics_a), (config_b, samples_b, _) = load(a, results, cache), load(b, results, cache)
    if config_a["task"] != config_b["task"]:
        raise ResultsError(f"{a} and {b} ran different tasks ({config_a['task']}, {config_b['task']}): no items to pair")
    items = pair_items(samples_b, samples_a)
    if items.empty:
        raise ResultsError(f"{a} and {b} share no items: none of the {samples_a['score'].notna().sum()} and "
                           f"{samples_b['score'].notna().sum()} scored rows has the same subset, doc_id, sample_id "
                           "and repeat in both")
    result = compare(items, iterations)
    metric = primary_metric(config_a["task"], metrics_a, config_a.get("task_options"))
    if flips is not None:
        flipped = items[items["score"] != items["baseline"]]
        flipped.assign(change=["lost" if s < t else "gained" for s, t in zip(flipped["score"], flipped["baseline"])],
                       ).rename(columns={"baseline": "score_a", "score": "score_b"}).drop(columns="unit_key").to_csv(
            flips, index=False)
    return [f"evalkit-report compare: A {label(config_a)} vs B {label(config_b)}",
            f"task {config_a['task']} · metric {metric} · unit {result.unit}: {result.items} paired items in "
            f"{result.units} {result.unit}s (A scored {samples_a['score'].notna().sum()}, "
            f"B {samples_b['score'].notna().sum()})",
            f"A {items['baseline'].mean():.4f} · B {items['score'].mean():.4f} · delta (B - A) {result.delta:+.4f}, "
            f"95% CI [{result.low:+.4f}, {result.high:+.4f}] (paired bootstrap over {result.unit}s, {iterations} "
            "resamples)",
            f"{result.test}: p = {result.p_value:.4g} ({result.lost} lost, {result.gained} gained)",
            *flip_lines(items), *([f"flips written to {flips}"] if flips is not None else [])]


def main(argv: list[str]) -> None:
    parser = OneLineParser(prog="evalkit-report compare",
                           description="two runs on the same items: paired test, interval, flips (RUN_A the baseline)")
    parser.add_argument("run_a", help="the baseline: a run id (or its start) or a samples table's path")
    parser.add_argument("run_b", help="the run compared with it")
    parser.add_argument("--results", type=Path, default=Path("results"), help="where run ids are looked up")
    parser.add_argument("--bootstrap", type=_resamples, default=2000, help="bootstrap and permutation resamples")
    parser.add_argument("--flips", type=Path, default=None, help="write every flipped item to this CSV file")
    args = parser.parse_args(argv)
    with refusing("evalkit-report compare"):
        print("\n".join(report(args.run_a, args.run_b, args.results, args.bootstrap, args.flips)))


def _resamples(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"the number of resamples must be a positive integer, got {text!r}")
    return int(text)
