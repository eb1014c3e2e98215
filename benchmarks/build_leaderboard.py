"""Builds docs/leaderboard.md: kvpress' leaderboard grid on the two real models that install offline
(conf/experiment/leaderboard_small.yaml), with evalkit's paired statistics.

    python benchmarks/build_leaderboard.py --limit 2

Per model it runs the preset's query-agnostic sweep and its query-aware half (resumable: a finished run is skipped),
then `evalkit-report RESULTS --html`, `evalkit-report export kvpress` and `evalkit-report plan`, and writes the page:
per method and ratio the score over every task's items, its delta against the full cache with the paired bootstrap
interval, McNemar's exact test Holm-adjusted over the model's comparisons (evalkit.results.paired_stats, the unit a
document of one task), the realized memory ratio; a plot of score against ratio; the tie groups per ratio; the items
most often lost (the report's flips.csv); the plan's item counts; the commands and their wall times. Beside the page
(docs/leaderboard/<model>/): the plot, report.html, summary.csv, flips.csv and the kvpress export.
`--skip-runs` builds the page from the results already there; `--models`, `--tasks`, `--methods` run a part (a
pilot). Every number on the page is read from the results directory.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
MODELS = ["smollm2_135m_instruct", "gemma3_270m"]
NAMES = {"smollm2_135m_instruct": "SmolLM2-135M-Instruct", "gemma3_270m": "Gemma 3 270M (base)"}
TASKS = ["niah_single_1", "niah_multikey_2", "niah_multikey_3", "ruler_vt", "ruler_cwe", "ruler_fwe", "needle",
         "needle_multikey"]
RULER = ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
         "niah_multiquery", "niah_multivalue", "ruler_vt", "ruler_cwe", "ruler_fwe", "ruler_qa_squad", "ruler_qa_hotpot"]
QUERY_AWARE = ["snapkv", "snapstream", "tova", "pyramidkv", "adakv", "chunkkv"]
RATIOS = {"1.333x": 0.25, "2x": 0.5, "4x": 0.75, "8x": 0.875}  # budget -> kvpress' compression ratio
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
PROGRAMS = {"evalkit": "evalkit.cli", "evalkit-report": "evalkit.results.cli"}  # run as this interpreter's modules


def shown(text: str) -> str:
    """A command or path as the page shows it: relative to the repository."""
    return text.replace(f"{ROOT}/", "")


def execute(command: list[str], **options) -> subprocess.CompletedProcess:
    """``command`` as the page shows it (evalkit ..., evalkit-report ...), run with this interpreter, offline."""
    return subprocess.run([sys.executable, "-m", PROGRAMS[command[0]], *command[1:]], cwd=ROOT,
                          env=os.environ | OFFLINE, **options)


def sweep_commands(model: str, args) -> list[list[str]]:
    """The preset's two sweeps for one model: query-agnostic (every method), then query-aware (QUERY_AWARE)."""
    results = args.results / model
    base = ["evalkit", "-m", "+experiment=leaderboard_small", f"model={model}", f"limit={args.limit}",
            f"threads={args.threads}", f"results_dir={results}", f"hydra.sweep.dir={results / 'sweeps'}"]
    base += [f"+experiment/leaderboard_task={','.join(args.tasks)}"] if args.tasks != TASKS else []
    base += [f"++task.generation.max_gen_toks={args.max_gen_toks}"] if args.max_gen_toks else []
    budgets = args.budgets or list(RATIOS)
    context = base + ([f"method={','.join(args.methods)}"] if args.methods else [])
    context += ["budget=" + ",".join(["none", *budgets])] if args.budgets else []
    aware = [m for m in QUERY_AWARE if not args.methods or m in args.methods]
    prompt = base + ["compression_scope=prompt", f"method={','.join(aware)}", "budget=" + ",".join(budgets)]
    return ([context] if "context" in args.scopes else []) + ([prompt] if aware and "prompt" in args.scopes else [])


def run_sweeps(model: str, args) -> None:
    """Runs the model's sweeps and appends each command's wall time to RESULTS/<model>/wall_times.json."""
    log = args.results / model / "wall_times.json"
    log.parent.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped build still records its time
    for command in sweep_commands(model, args):
        print("$", shown(" ".join(command)), flush=True)
        start, code = time.time(), "stopped"
        try:
            code = execute(command).returncode
        finally:
            times = json.loads(log.read_text()) if log.exists() else []
            times.append({"command": shown(" ".join(command)), "seconds": round(time.time() - start, 1), "exit": code,
                          "finished": datetime.datetime.now().isoformat(timespec="seconds")})
            log.write_text(json.dumps(times, indent=1))
        if code:  # a sweep goes on past a job that fails: the page reads what its runs wrote, and says the status
            print(f"build_leaderboard: `{shown(' '.join(command))}` exited {code}; going on", file=sys.stderr)


def probe_ruler(path: Path, model: str) -> dict[str, str]:
    """Which RULER tasks build at 4096 tokens with the network off (each task's lm-eval builder, the model's
    tokenizer): 'ok' or the error's first line. Cached in ``path``."""
    if path.exists():
        return json.loads(path.read_text())
    code = ("import importlib, json, sys, yaml\n"
            "from evalkit.config import compose\nfrom evalkit.models import resolve_pretrained\n"
            "from lm_eval.tasks import TaskManager\n"
            f"tok = resolve_pretrained(compose('model={model}')['model']['pretrained'])\n"
            "manager, out = TaskManager(), {}\n"
            f"for task in {RULER!r}:\n"
            "    try:\n"
            "        manager.load_task_or_group([task])[task].dataset\n"
            "        out[task] = 'ok'\n"
            "    except Exception as error:\n"
            "        out[task] = (type(error).__name__ + ': ' + str(error)).splitlines()[0][:160]\n"
            "print('PROBE ' + json.dumps(out))\n")
    code = code.replace("TaskManager()", "TaskManager(metadata={'max_seq_lengths': [4096], 'pretrained': tok})")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=os.environ | OFFLINE, capture_output=True,
                          text=True)
    line = [x for x in done.stdout.splitlines() if x.startswith("PROBE ")]
    if not line:
        sys.exit(f"build_leaderboard: the RULER probe failed: {done.stderr.strip().splitlines()[-1:]}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(line[0].removeprefix("PROBE "))
    return json.loads(path.read_text())


def preset_methods() -> list[str]:
    """The compressing methods the preset sweeps (its `method:` line, the full cache left out)."""
    text = (ROOT / "conf" / "experiment" / "leaderboard_small.yaml").read_text()
    methods = re.search(r"^      method: (.+)$", text, flags=re.M)[1].split(",")
    return [m for m in methods if m != "full"]


def report_commands(model: str, args) -> dict[str, list[str]]:
    results, assets = args.results / model, args.assets / model
    return {"report": ["evalkit-report", str(results), "--out", str(results / "report"), "--html"],
            "export": ["evalkit-report", "export", "kvpress", str(results), "--out", str(assets / "kvpress")],
            "plan": ["evalkit-report", "plan", str(results), "--delta", "0.05"]}


def report_output(command: list[str]) -> str:
    """What an ``evalkit-report`` command prints, run in this process (its main, as the command runs it)."""
    from evalkit.results.cli import main as evalkit_report

    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            evalkit_report(command[1:])
    except SystemExit as stop:
        if stop.code:
            sys.exit(f"build_leaderboard: `{shown(' '.join(command))}` exited {stop.code}")
    return printed.getvalue()


def run_reports(model: str, args) -> list[str]:
    """evalkit-report's report, export and plan for one model; the plan's lines."""
    assets = args.assets / model
    shutil.rmtree(assets, ignore_errors=True)
    assets.mkdir(parents=True)
    out = {}
    for name, command in report_commands(model, args).items():
        print("$", shown(" ".join(command)), flush=True)
        out[name] = report_output(command)
    report = args.results / model / "report"
    for name in ("report.html", "summary.csv", "flips.csv", "ties.csv"):
        if (report / name).exists():
            shutil.copy(report / name, assets / name)
    for extra in (assets / "kvpress").rglob("*"):  # the export's tables and JSON, nothing else
        if extra.is_file() and extra.suffix not in (".csv", ".json", ".yaml"):
            extra.unlink()
    return out["plan"].strip().splitlines()


# ---- the page's numbers, from the results directory -------------------------------------------------------------

def configuration(row) -> tuple[str, str, str]:
    scope = row.get("compression_scope")
    scope = "prompt" if scope == "prompt" else "context"
    return (row["method"], row["budget"], "-" if row["method"] == "full" else scope)


def pooled_items(summary: pd.DataFrame, samples: pd.DataFrame) -> dict[tuple, pd.DataFrame]:
    """Per configuration (method, budget, scope), its items paired with its full cache's over every task: each
    task's items keyed by task, so that a unit is one document of one task."""
    from evalkit.results.paired_stats import pair_items

    by_run = {run: rows for run, rows in samples.groupby("run_id")}
    pooled: dict[tuple, list[pd.DataFrame]] = {}
    for row in summary.to_dict("records"):
        baseline = row.get("baseline_run_id")
        if row["method"] == "full" or not isinstance(baseline, str) or baseline not in by_run:
            continue
        items = pair_items(by_run[row["run_id"]], by_run[baseline])
        items["subset"] = row["task"] + "/" + items["subset"]
        items["unit_key"] = row["task"] + "\x1f" + items["unit_key"]
        items["task"] = row["task"]
        pooled.setdefault(configuration(row), []).append(items)
    return {key: pd.concat(parts, ignore_index=True) for key, parts in pooled.items()}


def score_interval(scores: pd.Series, units: pd.Series) -> tuple[float, float]:
    """95% bootstrap interval of a mean score over units (evalkit's paired_stats.bootstrap_interval)."""
    from evalkit.results.paired_stats import bootstrap_interval

    codes, _ = pd.factorize(units)
    sums = np.bincount(codes, weights=scores.to_numpy(float))
    return bootstrap_interval(sums, np.bincount(codes).astype(float))


def leaderboard(summary: pd.DataFrame, samples: pd.DataFrame) -> pd.DataFrame:
    """A row per configuration: pooled score and interval, delta and interval, McNemar p, Holm-adjusted p, verdict,
    lost/gained, mean memory ratio over its tasks' runs."""
    from evalkit.results.paired_stats import adjust, compare, verdict

    rows = []
    for (method, budget, scope), items in pooled_items(summary, samples).items():
        result = compare(items)
        low, high = score_interval(items["score"], items["unit_key"])
        runs = summary[(summary["method"] == method) & (summary["budget"] == budget)
                       & (summary.apply(configuration, axis=1).map(lambda c: c[2]) == scope)]
        rows.append({"method": method, "budget": budget, "ratio": RATIOS.get(budget, math.nan), "scope": scope,
                     "tasks": items["task"].nunique(), "items": result.items, "score": items["score"].mean(),
                     "score_low": low, "score_high": high, "full": items["baseline"].mean(), **result.as_row(),
                     "memory_ratio": runs["memory_ratio"].mean() if "memory_ratio" in runs else math.nan})
    table = pd.DataFrame(rows)
    if table.empty:
        return table
    table["p_adjusted"] = adjust(table["p_value"])
    table["verdict"] = [verdict(d, p) for d, p in zip(table["delta"], table["p_adjusted"])]
    return table.sort_values(["scope", "method", "ratio"], ignore_index=True)


def full_cache(summary: pd.DataFrame, samples: pd.DataFrame) -> dict:
    """The full cache's pooled score, interval and items, and its memory ratio."""
    full = summary[summary["method"] == "full"]
    rows = samples[samples["run_id"].isin(full["run_id"])].dropna(subset=["score"])
    units = rows["task"].astype(str) + "\x1f" + rows["doc_id"].astype(str)
    low, high = score_interval(rows["score"], units) if len(rows) else (math.nan, math.nan)
    return {"score": rows["score"].mean(), "low": low, "high": high, "items": len(rows), "tasks": full["task"].nunique(),
            "per_task": rows.groupby("task")["score"].agg(["mean", "size"]).to_dict("index")}


def tie_groups(pooled: dict[tuple, pd.DataFrame], board: pd.DataFrame, budget: str) -> list[tuple[str, str, float]]:
    """The configurations of one budget and the full cache, best first, with their compact letters: every pair tested
    on the items both scored (McNemar exact), Holm-adjusted over the budget's pairs."""
    from evalkit.results.paired_stats import adjust, compact_letters, compare

    at = board[board["budget"] == budget].sort_values("score", ascending=False)
    names = {label(r): (r["method"], r["budget"], r["scope"]) for r in at.to_dict("records")}
    keyed = {name: pooled[key].set_index(["subset", "doc_id", "sample_id", "repeat"]) for name, key in names.items()}
    full = next(iter(keyed.values()))[["baseline", "unit_key"]].rename(columns={"baseline": "score"})
    scores = {name: frame[["score", "unit_key"]] for name, frame in keyed.items()} | {"full cache": full}
    order = sorted(scores, key=lambda n: -scores[n]["score"].mean())
    pairs, p_values = [], []
    for i, first in enumerate(order):
        for second in order[i + 1:]:
            both = scores[first].join(scores[second]["score"].rename("baseline"), how="inner")
            pairs.append(frozenset((first, second)))
            p_values.append(compare(both.reset_index(), interval=False).p_value)
    separated = {pair for pair, p in zip(pairs, adjust(p_values)) if p < 0.05}
    letters = compact_letters(order, separated)
    return [(name, letters[name], scores[name]["score"].mean()) for name in order]


def label(row) -> str:
    return row["method"] + (" (query-aware)" if row["scope"] == "prompt" else "")


def lost_most(flips: pd.DataFrame, summary: pd.DataFrame, samples: pd.DataFrame, top: int = 5) -> pd.DataFrame:
    """The items most often lost (flips.csv's `lost` rows), with how many configurations lost them and the target."""
    lost = flips[flips["change"] == "lost"].merge(summary[["run_id", "task"]], on="run_id")
    counts = lost.groupby(["task", "subset", "doc_id"]).size().rename("lost_by").reset_index()
    counts = counts.sort_values(["lost_by", "task", "doc_id"], ascending=[False, True, True]).head(top)
    targets = samples.drop_duplicates(["task", "subset", "doc_id"])[["task", "subset", "doc_id", "target"]]
    targets = targets.assign(subset=targets["subset"].astype(str))
    counts = counts.assign(subset=counts["subset"].astype(str))
    return counts.merge(targets, on=["task", "subset", "doc_id"], how="left")


def plot(board: pd.DataFrame, full: dict, path: Path, title: str) -> None:
    """Score against kvpress' ratio, one line per method with its 95% band, query-agnostic and query-aware panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scopes = [s for s in ("context", "prompt") if (board["scope"] == s).any()]
    figure, axes = plt.subplots(1, len(scopes), figsize=(5.4 * len(scopes) + 1.4, 4.2), sharey=True, squeeze=False)
    colours = plt.get_cmap("tab20").colors + plt.get_cmap("tab20b").colors
    methods = sorted(board["method"].unique())
    for axis, scope in zip(axes[0], scopes):
        axis.axhline(full["score"], color="black", linestyle="--", linewidth=1.2, label="full cache")
        axis.axhspan(full["low"], full["high"], color="black", alpha=0.08)
        for method, rows in board[board["scope"] == scope].groupby("method"):
            rows = rows.sort_values("ratio")
            colour = colours[methods.index(method) % len(colours)]
            axis.plot(rows["ratio"], rows["score"], marker="o", markersize=3, linewidth=1, color=colour, label=method)
            axis.fill_between(rows["ratio"], rows["score_low"], rows["score_high"], color=colour, alpha=0.07)
        axis.set_title(f"{title}: {'query-aware' if scope == 'prompt' else 'query-agnostic'}", fontsize=9)
        axis.set_xlabel("compression ratio (kvpress: share of the 4096-token context removed)", fontsize=8)
        axis.set_xticks(list(RATIOS.values()))
        axis.set_ylim(-0.03, 1.03)
    axes[0][-1].legend(*axes[0][0].get_legend_handles_labels(), fontsize=6, loc="center left",
                       bbox_to_anchor=(1.01, 0.5))
    axes[0][0].set_ylabel("score over every task's items (95% interval)", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=72)
    plt.close(figure)


# ---- the page -----------------------------------------------------------------------------------------------------

MARKS = {"worse": "▼", "better": "▲", "indistinguishable from the full cache": "≈", "-": ""}


def pct(value: float) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{100 * value:.1f}"


def cell(row: dict) -> str:
    """One table cell: score, delta [interval] mark, memory ratio."""
    return (f"{pct(row['score'])} ({100 * row['delta']:+.1f} [{100 * row['delta_low']:+.1f}, "
            f"{100 * row['delta_high']:+.1f}] {MARKS.get(row['verdict'], '')}) ×{row['memory_ratio']:.2f}")


def board_markdown(board: pd.DataFrame, full: dict) -> list[str]:
    budgets = [b for b in RATIOS if (board["budget"] == b).any()]
    lines = [f"| method | scope | {' | '.join(f'{RATIOS[b]} ({b})' for b in budgets)} |",
             "|---|---|" + "---|" * len(budgets),
             f"| full cache | - | {pct(full['score'])} [{pct(full['low'])}, {pct(full['high'])}] ×1.00"
             + " |" * len(budgets)]
    for (scope, method), rows in board.groupby(["scope", "method"], sort=True):
        by_budget = {r["budget"]: r for r in rows.to_dict("records")}
        cells = [cell(by_budget[b]) if b in by_budget else "-" for b in budgets]
        lines.append(f"| {method} | {'query-aware' if scope == 'prompt' else 'query-agnostic'} | {' | '.join(cells)} |")
    return lines


def holding(board: pd.DataFrame) -> list[str]:
    """Per ratio, the configurations whose 95% delta interval reaches zero and whose test does not say worse."""
    lines = []
    for budget in RATIOS:
        at = board[board["budget"] == budget]
        if at.empty:
            continue
        held = at[(at["delta_low"] <= 0) & (at["verdict"] != "worse")]
        near = held[held["delta"] >= -0.05].sort_values("score", ascending=False)
        lines.append(f"- {RATIOS[budget]} ({budget}): {len(near)} of {len(at)} within 5 points of the full cache with "
                     f"an interval reaching zero ({', '.join(label(r) for r in near.to_dict('records')) or 'none'}); "
                     f"{int((at['verdict'] == 'worse').sum())} marked worse")
    return lines


def model_section(model: str, args, plan: list[str]) -> tuple[list[str], dict]:
    """The model's section of the page, and what the page's head says of it (tasks, items, planned counts)."""
    from evalkit.results.tables import read_runs

    results, assets = args.results / model, args.assets / model
    metrics, samples = read_runs(results)
    summary = pd.read_csv(results / "report" / "summary.csv")
    summary, partial = finished_tasks(summary)
    samples = samples[samples["run_id"].isin(summary["run_id"])]
    board, full = leaderboard(summary, samples), full_cache(summary, samples)
    pooled = pooled_items(summary, samples)
    plot(board, full, assets / "score_vs_ratio.png", NAMES.get(model, model))
    times = json.loads((results / "wall_times.json").read_text()) if (results / "wall_times.json").exists() else []
    per_task = ", ".join(f"{task} {v['size']}" for task, v in sorted(full["per_task"].items()))
    link = assets.relative_to(args.page.parent).as_posix()
    lines = [f"## {NAMES.get(model, model)} (`model={model}`)", "",
             f"{len(summary)} runs: the full cache and {len(board)} configurations on {full['tasks']} "
             f"task{'s' * (full['tasks'] > 1)}; items per task: {per_task}. Wall time of its sweeps "
             f"({len(times)} command{'s' * (len(times) != 1)}, each with its exit status; a sweep stopped part way "
             f"resumes where it stopped): {sum(t['seconds'] for t in times) / 60:.1f} min in all.", ""]
    grid = len(preset_methods()) * len(RATIOS) + len(QUERY_AWARE) * len(RATIOS)
    if len(board) < grid:
        lines += [f"**Partial grid:** {len(board)} of the preset's {grid} configurations per task ran in the time "
                  "there was (the sweeps run the methods in the preset's order, or some of the ratios first with "
                  "`--budgets`; the same command resumes the rest).",
                  ""]
    if partial:
        lines += ["**Left out of the tables:** " + "; ".join(f"{task} ({n} of {most} configurations ran before the "
                                                           "build stopped)" for task, (n, most) in partial.items())
                  + ": a task enters the tables once it has every configuration the others have, so that every "
                  "cell pools the same tasks (its runs are in report.html).", ""]
    if any(t["exit"] != 0 for t in times):
        lines += ["A sweep whose exit status is not 0 had a job fail after or before its run; every run it wrote is "
                  "read as written (each held to its manifest), and a configuration with no run shows as -.", ""]
    lines += [f"- `{shown(t['command'])}`: {t['seconds'] / 60:.1f} min, exit {t['exit']}, finished {t['finished']}"
              for t in times]
    lines += ["", "Each cell: the score over every task's items (%), its delta against the full cache in points with "
              "the paired bootstrap 95% interval, the mark of McNemar's exact test Holm-adjusted over the model's "
              f"{len(board)} comparisons (▼ worse, ▲ better, ≈ indistinguishable at p < 0.05), and the realized memory "
              "ratio (×: the full cache's KV bytes over the compressed cache's, mean over its runs).", "",
              *board_markdown(board, full), "", f"![score against ratio, {model}]({link}/score_vs_ratio.png)", "",
              "What holds, per ratio:", "", *holding(board), "",
              "Tie groups per ratio (compact letters: configurations sharing a letter are not separated by any "
              "pairwise McNemar test, Holm-adjusted over that ratio's pairs; best first):", ""]
    for budget in RATIOS:
        if (board["budget"] == budget).any():
            groups = tie_groups(pooled, board, budget)
            lines.append(f"- {RATIOS[budget]} ({budget}): " + ", ".join(f"{n} {pct(s)} **{g}**" for n, g, s in groups))
    lines += ["", "The five items most often lost against the full cache (flips.csv):", "",
              "| task | subset | doc | lost by | target |", "|---|---|---|---|---|"]
    flips = pd.read_csv(results / "report" / "flips.csv") if (results / "report" / "flips.csv").exists() else None
    if flips is not None and len(flips):
        for row in lost_most(flips, summary, samples).to_dict("records"):
            lines.append(f"| {row['task']} | {row['subset']} | {row['doc_id']} | {row['lost_by']} of {len(board)} "
                         f"configurations | {str(row['target'])[:60]} |")
    lines += ["", *what_it_cannot_show(board, full, plan), "",
              f"Beside this page: [report.html]({link}/report.html) (evalkit-report's page: every run, per task), "
              f"[summary.csv]({link}/summary.csv), [flips.csv]({link}/flips.csv), [ties.csv]({link}/ties.csv) (per "
              f"task), and the kvpress export `docs/{link}/kvpress/` (a folder per run: predictions.csv, "
              "metrics.json, evalkit.json and kvpress' config.yaml).", ""]
    seconds = metrics[metrics["metric"] == "wall_seconds"].drop_duplicates("run_id")
    return lines, {"tasks": sorted(full["per_task"]), "run_seconds": seconds[seconds["method"] != "full"]["value"],
                   "full_seconds": seconds[seconds["method"] == "full"]["value"]}


def finished_tasks(summary: pd.DataFrame) -> tuple[pd.DataFrame, dict[str, tuple[int, int]]]:
    """The runs of the tasks that have the full cache and as many configurations as the most covered task, and the
    others' (configurations run, most run)."""
    counts = summary[summary["method"] != "full"].apply(configuration, axis=1).groupby(summary["task"]).nunique()
    with_full = set(summary.loc[summary["method"] == "full", "task"])
    most = int(counts.max()) if len(counts) else 0
    partial = {task: (int(n), most) for task, n in counts.items() if n < most or task not in with_full}
    return summary[~summary["task"].isin(partial)], partial


def interval_items(p: float, half: float = 0.05, z: float = 1.959964) -> int:
    """The fewest items whose Wilson 95% interval around a score ``p`` is at most ``half`` either side."""
    n = 1
    while z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) > half:
        n += 1
    return n


def what_it_cannot_show(board: pd.DataFrame, full: dict, plan: list[str]) -> list[str]:
    """The plan's numbers: items for a ±5-point interval on the full cache, and McNemar's items per comparison."""
    p = full["score"]
    counts = [int(line.split(": ")[-1].split(" items")[0]) for line in plan[1:] if " items for " in line]
    text = ("**What this table cannot show at this scale.** "
            f"The full cache scored {pct(p)}% on {full['items']} items (95% interval {pct(full['low'])}-"
            f"{pct(full['high'])}). A ±5-point 95% interval on the full cache's score takes {interval_items(p)} items "
            f"at that score (Wilson) and {interval_items(0.5)} at 0.5, the worst case, per task for a per-task score; "
            f"here a task has {max(v['size'] for v in full['per_task'].values())}.")
    if counts:
        text += (f" To detect a 5-point change against the full cache with 80% power, McNemar's exact test with alpha "
                 f"split over the {len(counts)} comparisons needs {min(counts):,}-{max(counts):,} items (median "
                 f"{int(np.median(counts)):,}) at the discordance each comparison showed, raised to 0.05 where it "
                 "was smaller (`evalkit-report plan RESULTS --delta 0.05`).")
    marked = int(board["verdict"].isin(["worse", "better"]).sum()) if len(board) else 0
    text += (f" {marked} of {len(board)} configurations separate from the full cache here: an unmarked cell is no "
             "evidence that a method holds, only that these items cannot tell, and the order of methods inside a "
             "tie group is noise.")
    return [text]


def gen_cap(args) -> str:
    if not args.max_gen_toks:
        return ""
    return (f", except that generation stops after {args.max_gen_toks} tokens (`task.generation.max_gen_toks`; "
            "RULER's niah tasks allow 128 and score the needle's value anywhere in the answer: an answer that "
            "would have come later is lost, and a cache that loses the needle no longer rambles for 128 tokens at "
            "about one token a second here)")


def page(args, sections: list[str], probe: dict[str, str], said: dict[str, dict], argv: list[str]) -> str:
    built = [t for t, outcome in probe.items() if outcome == "ok"]
    failed = {t: outcome for t, outcome in probe.items() if outcome != "ok"}
    ran = sorted({t for s in said.values() for t in s["tasks"]})
    cut = [t for t in TASKS if t not in ran]
    head = ["# Leaderboard: kvpress' grid on two small real models", "",
            f"Built {datetime.date.today().isoformat()} with", "", "```text",
            shown(" ".join(["python benchmarks/build_leaderboard.py", *argv])), "```", "",
            "(`python benchmarks/build_leaderboard.py --limit N` runs the whole grid; `--tasks` runs some of its "
            "tasks, `--skip-runs` rebuilds the page from results already there). Per model it runs the preset "
            "`conf/experiment/leaderboard_small.yaml` (query-agnostic, every method) and its query-aware half "
            "(resumable: a finished run is skipped), then `evalkit-report RESULTS --html`, `evalkit-report export "
            "kvpress` and `evalkit-report plan RESULTS --delta 0.05`; every number below is read from those results. "
            "The sweeps each model ran, with their wall times, are listed in its section.", "",
            "**The grid.** kvpress' leaderboard ranks methods on RULER at 4k (Qwen3-8B). The preset: a 4096-token "
            f"context; the RULER tasks that build offline ({', '.join(built)}; with the network off the other "
            f"{len(failed)} fail to build: "
            + "; ".join(f"{t}: `{o[:58]}`" for t, o in failed.items() if t in ("niah_single_2", "ruler_qa_squad",
                                                                               "ruler_qa_hotpot"))
            + f", and so on for the essay ones) and evalkit's `needle` and `needle_multikey` at ~3,500 tokens; "
            "kvpress' ratios 0.25/0.5/0.75/0.875 as budgets 1.333x/2x/4x/8x of the 4096 tokens; the methods that need "
            "no learned weights (kvpress_leaderboard.yaml's and SnapStream) query-agnostic "
            "(`compression_scope=context`: the context compressed before the question is read) and "
            f"{', '.join(QUERY_AWARE)} also query-aware (`compression_scope=prompt`); the full cache once. The jobs "
            "of a task share the model and each prompt's prefill. Greedy decoding, each task's own generation "
            f"settings{gen_cap(args)}; the first documents of each task, at most {args.limit} (each model's section "
            "says how many it ran: its sweeps' `limit`).",
            ""]
    if cut:
        head += [f"**Cut here: tasks first.** This build ran {', '.join(ran)} only (the methods each model ran: "
                 f"its section); {', '.join(cut)} are in the preset but did not fit the time: on 2 CPU cores shared with other "
                 "work a compressed run (one job: its items at 4k tokens, batched) took "
                 + "; ".join(f"{int(s['run_seconds'].quantile(0.1))}-{int(s['run_seconds'].quantile(0.9))} s "
                             f"(10th-90th percentile, {model}), its full cache {int(s['full_seconds'].max())} s"
                             for model, s in said.items() if len(s["run_seconds"]) and len(s["full_seconds"]))
                 + f" (each run's `wall_seconds`), and the whole preset is {len(TASKS)} x "
                 f"{1 + (len(preset_methods()) + len(QUERY_AWARE)) * len(RATIOS)} runs per model.", ""]
    return "\n".join(head + sections)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, required=True, help="items per task")
    parser.add_argument("--models", nargs="+", default=MODELS, help="conf/model names (default: the two real ones)")
    parser.add_argument("--tasks", nargs="+", default=TASKS, choices=TASKS)
    parser.add_argument("--methods", nargs="+", default=None, help="a part of the grid (a pilot); default: all")
    parser.add_argument("--budgets", nargs="+", default=None, choices=list(RATIOS),
                        help="a part of the ratios (default: all four; the full cache runs with any)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--scopes", nargs="+", default=["context", "prompt"], choices=["context", "prompt"],
                        help="the preset's query-agnostic sweep, its query-aware half, or both (default)")
    parser.add_argument("--max-gen-toks", type=int, default=None,
                        help="cap every task's generation (default: each task's own; RULER's niah tasks allow 128)")
    parser.add_argument("--results", type=Path, default=Path("results/leaderboard"))
    parser.add_argument("--page", type=Path, default=Path("docs/leaderboard.md"))
    parser.add_argument("--skip-runs", action="store_true", help="build the page from the results already there")
    parser.add_argument("--runs-only", action="store_true", help="run the sweeps and stop (build the page later)")
    args = parser.parse_args(argv)
    args.results, args.page = args.results.resolve(), args.page.resolve()
    args.assets = args.page.parent / args.page.stem
    if args.methods and "full" not in args.methods:
        args.methods = ["full", *args.methods]
    probe = probe_ruler(args.results / "ruler_offline.json", args.models[0])
    sections, said = [], {}
    for model in args.models:
        if not args.skip_runs:
            run_sweeps(model, args)
        if args.runs_only:
            continue
        lines, said[model] = model_section(model, args, run_reports(model, args))
        sections += lines
    if args.runs_only:
        return
    args.page.write_text(page(args, sections, probe, said, argv))
    print(f"build_leaderboard: wrote {shown(str(args.page))} and {shown(str(args.assets))}/")


if __name__ == "__main__":
    main()
