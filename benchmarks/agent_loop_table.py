"""Accuracy by call of the agent loop (tasks/agent_loop) per method and ``session.recompress`` rule, with the mean
``cache_tokens_after``, each with a 95% interval that resamples sessions (a session's calls share one cache: the
session is the independent unit; :func:`evalkit.results.paired_stats.bootstrap_interval`).

    python benchmarks/agent_loop_table.py                 # run the sweep, then print the table
    python benchmarks/agent_loop_table.py --skip-runs     # only read the runs already under --results

One ``evalkit -m`` per method over the three rules (the full cache without a budget), sized to run on two CPU cores:
docs/benchmarks.md, "An agent loop".
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

from evalkit.results.paired_stats import bootstrap_interval
from evalkit.results.tables import read_runs

METHODS = ("full", "snapkv", "snapstream", "streaming_llm", "h2o", "kvzip")
RULES = ("never", "each_call", "new_content")


def sweep_command(method: str, args: argparse.Namespace) -> list[str]:
    """The ``evalkit -m`` command of one method over every rule."""
    budget = [] if method == "full" else [f"+budget={args.budget}"]
    return ["evalkit", "-m", "task=agent_loop", f"model={args.model}", f"model.max_context={args.max_context}",
            "task.mode=multi_turn", f"method={method}", *budget, f"+session.recompress={','.join(RULES)}",
            f"task.dataset.n_sessions={args.sessions}", f"task.dataset.calls={args.calls}",
            f"task.dataset.doc_tokens={args.doc_tokens}", f"threads={args.threads}", f"results_dir={args.results}",
            *args.override]


def interval(sums: np.ndarray, counts: np.ndarray) -> str:
    """``mean [low, high]`` of sum(sums) / sum(counts), the interval resampling the units (sessions); "-" where no
    unit has a value."""
    if not counts.sum():
        return "-"
    low, high = bootstrap_interval(sums, counts)
    return f"{sums.sum() / counts.sum():.2f} [{low:.2f}, {high:.2f}]"


def table(samples: pd.DataFrame) -> str:
    """The markdown table: a row per (method, rule), accuracy per call and mean ``cache_tokens_after``."""
    samples = samples.assign(rule=samples["session_recompress"].fillna("never"))
    # Appended, a cache never drops within a call: what it held at the answer's end is the call's peak (rows written
    # before cache_tokens_after was recorded under never carry only that).
    appended = samples["rule"] == "never"
    samples["cache_tokens_after"] = samples["cache_tokens_after"].where(~appended | samples["cache_tokens_after"].notna(),
                                                                        samples["peak_cache_tokens"])
    calls = sorted(samples["turn"].dropna().astype(int).unique())
    header = ["method", "rule", "sessions", *(f"call {call}" for call in calls), "cache_tokens_after"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    order = {name: index for index, name in enumerate(METHODS)}
    for (method, rule), rows in sorted(samples.groupby(["method", "rule"]),
                                       key=lambda item: (order.get(item[0][0], 99), RULES.index(item[0][1]))):
        cells = [method, rule, str(rows["session_id"].nunique())]
        for call in calls:
            scored = rows[rows["turn"] == call].groupby("session_id")["score"].sum()
            cells.append(interval(scored.to_numpy(float), np.ones(len(scored))) if len(scored) else "")
        held = rows.groupby("session_id")["cache_tokens_after"].agg(["sum", "count"]).query("count > 0")
        cells.append(interval(held["sum"].to_numpy(float), held["count"].to_numpy(float)).replace(".00", ""))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default="results/agent_loop", help="the sweep's results directory")
    parser.add_argument("--skip-runs", action="store_true", help="only read the runs already under --results")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated methods")
    parser.add_argument("--model", default="smollm2_135m_instruct")
    parser.add_argument("--budget", default="4x")
    parser.add_argument("--max-context", type=int, default=1280)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--doc-tokens", type=int, default=350)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--override", nargs="*", default=[], help="further evalkit overrides, passed as they are")
    args = parser.parse_args(argv)
    methods = [name for name in args.methods.split(",") if name]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        parser.error(f"unknown methods {unknown}; the table's are {', '.join(METHODS)}")
    if not args.skip_runs:
        started = time.perf_counter()
        for method in methods:
            command = sweep_command(method, args)
            print("$", " ".join(command), flush=True)
            if subprocess.run(command).returncode != 0:
                print(f"agent_loop_table: the sweep of {method} failed", file=sys.stderr)
                return 1
        print(f"sweep wall time: {(time.perf_counter() - started) / 60:.1f} min", flush=True)
    if not Path(args.results).is_dir():
        print(f"agent_loop_table: no results under {args.results}: run without --skip-runs first", file=sys.stderr)
        return 2
    samples = read_runs(args.results)[1]
    samples = samples[(samples["task"] == "agent_loop") & samples["method"].isin(methods)]
    if samples.empty:
        print(f"agent_loop_table: no agent_loop runs of {', '.join(methods)} under {args.results}", file=sys.stderr)
        return 2
    print(table(samples))
    return 0


if __name__ == "__main__":
    sys.exit(main())
