"""report.html: the report of a results directory as one self-contained page (``evalkit-report RESULTS --html``).

Everything is inline (CSS, a small sorting script, the report's plots as base64 PNG): the file opens from disk with
no network. What every run shares is said once at the top (every value one click away); the tables lead with what
sets the runs apart and their score: the primary metric by method and budget, then the runs against the full cache
(every column of them one click away). They sort by a click on a header; each run links to its own section further
down, which holds its config, its samples and relative links to its CSV tables.
"""

from __future__ import annotations

import base64
import html
import math
import numbers
import os
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

from evalkit.core import budget as budget_grammar

from . import significance
from .summary import distinguishing_settings, pivot
from .tables import CONFIG_COLUMNS, read_runs
from .terminal_report import FOLLOW_THE_BUDGET, differing_settings, shared_settings

SAMPLE_COLUMNS = ["doc_id", "subset", "repeat", "prediction", "target", "score", "prompt_tokens", "generated_tokens",
                  "compression_ratio", "kv_bytes_peak"]
MAX_SAMPLES = 500  # per run on the page; the CSV has them all
LEADING = ["metric", "value", "stderr", "baseline", "delta", "95% CI", "verdict", "p_adjusted", "unit", "paired_docs",
           "realized_ratio"]
LONG = 40  # characters: a longer cell (a fingerprint, JSON) is cut to one line, its whole text on hover

STYLE = """
:root { --ink: #1f2328; --muted: #656d76; --line: #d0d7de; --soft: #f6f8fa; --accent: #0969da; }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.5 -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; color: var(--ink);
       background: #fff; }
main { max-width: 1600px; margin: 0 auto; padding: 24px 32px 64px; }
header { border-bottom: 1px solid var(--line); margin-bottom: 8px; }
h1 { font-size: 26px; margin: 8px 0 4px; }
h2 { font-size: 19px; margin: 36px 0 8px; padding-bottom: 4px; border-bottom: 1px solid var(--line); }
h3 { font-size: 16px; margin: 0 0 6px; }
p.note, .meta { color: var(--muted); margin: 4px 0 12px; }
a { color: var(--accent); text-decoration: none; }
a:hover { text-decoration: underline; }
.scroll { overflow-x: auto; border: 1px solid var(--line); border-radius: 6px; }
table { border-collapse: collapse; width: 100%; font-variant-numeric: tabular-nums; }
th, td { padding: 5px 10px; border-bottom: 1px solid var(--line); text-align: left; vertical-align: top;
         white-space: nowrap; }
td.long { max-width: 28ch; overflow: hidden; text-overflow: ellipsis; }
th { background: var(--soft); font-weight: 600; white-space: nowrap; position: sticky; top: 0; }
table.sortable th { cursor: pointer; user-select: none; }
table.sortable th::after { content: " \\2195"; color: #afb8c1; font-size: 11px; }
table.sortable th[aria-sort=ascending]::after { content: " \\25B2"; color: var(--ink); }
table.sortable th[aria-sort=descending]::after { content: " \\25BC"; color: var(--ink); }
tbody tr:nth-child(even) { background: #fbfcfd; }
tbody tr:hover { background: #eef4ff; }
td.num { text-align: right; white-space: nowrap; }
td.text { max-width: 360px; white-space: pre-wrap; word-break: break-word; font-family: ui-monospace, monospace;
          font-size: 12px; }
td.worse { color: #b42318; font-weight: 600; }
td.better { color: #1a7f37; font-weight: 600; }
.plots { display: grid; grid-template-columns: repeat(auto-fit, minmax(520px, 1fr)); gap: 16px; }
figure { margin: 0; padding: 12px; border: 1px solid var(--line); border-radius: 6px; background: #fff; }
figure img { width: 100%; height: auto; display: block; }
figcaption { color: var(--muted); font-size: 13px; margin-top: 6px; text-align: center; }
section.run { border: 1px solid var(--line); border-radius: 6px; padding: 14px 16px; margin: 14px 0; }
section.run:target { border-color: var(--accent); box-shadow: 0 0 0 3px #0969da33; }
dl.config { display: grid; grid-template-columns: max-content 1fr; gap: 2px 16px; margin: 8px 0 12px;
            font-size: 13px; }
dl.config dt { color: var(--muted); }
dl.config dd { margin: 0; font-family: ui-monospace, monospace; word-break: break-all; }
details summary { cursor: pointer; color: var(--accent); margin: 6px 0; }
p.shared { margin: 12px 0 0; }
p.shared code { background: var(--soft); padding: 1px 5px; border-radius: 4px; }
details .scroll { max-height: 480px; overflow-y: auto; }
"""

SCRIPT = """
for (const table of document.querySelectorAll("table.sortable")) {
  for (const th of table.tHead.rows[0].cells) {
    th.addEventListener("click", () => {
      const ascending = th.getAttribute("aria-sort") !== "ascending";
      for (const other of th.parentNode.cells) other.removeAttribute("aria-sort");
      th.setAttribute("aria-sort", ascending ? "ascending" : "descending");
      const key = (row) => {
        const cell = row.cells[th.cellIndex];
        const text = cell.dataset.sort ?? cell.textContent.trim();
        return text === "" || text === "-" ? null : (isFinite(Number(text)) ? Number(text) : text);
      };
      const order = (a, b) => {
        const x = key(a), y = key(b);
        if (x === null || y === null) return (x === null) - (y === null);  // missing values last
        const sign = ascending ? 1 : -1;
        if (typeof x === typeof y) return sign * (typeof x === "number" ? x - y : x.localeCompare(y));
        return typeof x === "number" ? -1 : 1;  // numbers before text
      };
      const body = table.tBodies[0];
      for (const row of Array.from(body.rows).sort(order)) body.appendChild(row);
    });
  }
}
"""


def _missing(value) -> bool:
    return value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value))


def _text(value) -> str:
    """A cell as text: missing "-", floats to 4 significant digits, whole numbers as integers (from 100,000 on with
    thousands separated)."""
    if _missing(value):
        return "-"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    large = isinstance(value, numbers.Integral) and not isinstance(value, bool) and abs(value) >= 100_000
    return f"{value:,}" if large else str(value)


def _number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and not _missing(value)


def _cell(column: str, value, numeric: bool, extra: str = "") -> str:
    """A table cell; ``numeric``: its column holds numbers (right-aligned, sorted by value, missing ones last)."""
    if column == "budget":  # sorted by compression, the full cache first
        factor = budget_grammar.factor(value) if isinstance(value, str) and value != "full" else 1.0
        return f'<td data-sort="{0 if math.isnan(factor) else factor}">{html.escape(_text(value))}</td>'
    kind = "num" if numeric or column == "95% CI" else "text" if column in ("prediction", "target") else ""
    long = kind != "text" and len(_text(value)) > LONG
    attributes = f' class="{" ".join(filter(None, [kind, "long" if long else "", extra]))}"' if kind or extra or long \
        else ""
    sort = f' data-sort="{float(value)!r}"' if _number(value) else ""
    title = f' title="{html.escape(_text(value))}"' if long else ""
    return f"<td{attributes}{sort}{title}>{html.escape(_text(value))}</td>"


def table(frame: pd.DataFrame, table_id: str, links: dict[int, str] | None = None, classes=None) -> str:
    """``frame`` as a sortable HTML table; ``links``: row position -> the anchor its first cell links to;
    ``classes``: (row position, column) -> a class for that cell."""
    head = "".join(f"<th>{html.escape(str(column))}</th>" for column in frame.columns)
    numeric = [frame[c].map(_number).any() and frame[c].map(lambda v: _number(v) or _missing(v)).all()
               for c in frame.columns]
    rows = []
    for position, values in enumerate(frame.itertuples(index=False)):
        cells = [_cell(column, value, number, (classes or {}).get((position, column), ""))
                 for column, value, number in zip(frame.columns, values, numeric)]
        if links and position in links:
            cells[0] = cells[0].replace(">", f'><a href="#{links[position]}">', 1).replace("</td>", "</a></td>")
        rows.append(f"<tr>{''.join(cells)}</tr>")
    return (f'<div class="scroll"><table id="{table_id}" class="sortable"><thead><tr>{head}</tr></thead>'
            f"<tbody>{''.join(rows)}</tbody></table></div>")


def _one_metric(summary: pd.DataFrame) -> str | None:
    """The primary metric when every run reports the same one, else None."""
    metrics = summary["metric"].dropna().unique() if "metric" in summary else []
    return str(metrics[0]) if len(metrics) == 1 else None


def _differing(summary: pd.DataFrame, column: str) -> bool:
    return summary[column].map(_text).nunique() > 1


def runs_table(summary: pd.DataFrame, compact: bool = False) -> tuple[pd.DataFrame, dict]:
    """The summary's columns worth a reader's eye, in reading order (columns no run filled are left out), and the
    delta and verdict cells of configurations worse or better than the full cache (the paired test at the adjusted
    level, :mod:`.significance`). ``compact``: what sets the runs apart (task and model
    where they differ, method, budget, :func:`evalkit.results.terminal_report.differing_settings`) and the score
    (the column named after the primary metric where all runs share one), its delta and how much smaller the KV
    cache was."""
    frame = summary.copy()
    if {"delta_low", "delta_high"} <= set(frame):
        frame["95% CI"] = [f"[{low:.3f}, {high:.3f}]" if not (_missing(low) or _missing(high)) else None
                           for low, high in zip(frame["delta_low"], frame["delta_high"])]
    settings = list(summary.columns[4:list(summary.columns).index("metric")]) if "metric" in summary else []
    rest = [c for c in frame.columns if c not in {"task", "model", "method", "budget", *settings, *LEADING,
                                                   "run_id", "delta_low", "delta_high", "#"}]
    frame["#"] = range(1, len(frame) + 1)  # the report's order; links to the run's section
    columns = ["#", "task", "model", "method", "budget", *settings, *[c for c in LEADING if c in frame], *rest]
    if compact:
        keys = [c for c in ("task", "model") if _differing(summary, c)]
        score = ["value", "stderr"] if _one_metric(summary) else ["metric", "value", "stderr"]
        columns = ["#", *keys, "method", "budget", *differing_settings(summary), *score, "delta", "95% CI",
                   "verdict", "memory_ratio"]
    frame = frame[[c for c in columns if c in frame]].dropna(axis=1, how="all")
    if compact:
        frame = frame.rename(columns={"value": _one_metric(summary) or "value", "stderr": "±",
                                      "memory_ratio": "KV smaller (×)"})
    classes = {}
    if "delta" in frame and "verdict" in summary:  # the paired test's verdict at the adjusted level
        for position, verdict in enumerate(summary["verdict"]):
            if verdict in ("worse", "better"):
                classes[(position, "delta")] = classes[(position, "verdict")] = verdict
    return frame, classes


def score_pivot(summary: pd.DataFrame) -> pd.DataFrame:
    """The primary metric with the budgets as columns (the full cache first) and as rows the method, the task and
    model where they differ, and the settings that tell apart runs of one method and budget (a swept window): the
    settings that only follow the budget (StreamingLLM's window) share a row. Where that would put two runs in one
    cell, the rows are report.md's pivot's (every setting that differs)."""

    settings = [c for c in distinguishing_settings(summary) if c not in FOLLOW_THE_BUDGET]
    try:
        wide = pivot(summary[["task", "model", "method", *settings, "budget", "value"]]).reset_index()
    except ValueError:  # two runs in one cell: every setting that differs makes the rows
        wide = pivot(summary).reset_index()
    return wide.drop(columns=[c for c in ("task", "model") if not _differing(summary, c)])


def shared_block(shared: dict) -> str:
    """What every run shares, said once: the short values on a line, every value one click away."""
    short = " · ".join(f"{html.escape(key)} <code>{html.escape(_text(value))}</code>"
                       for key, value in shared.items() if len(_text(value)) <= LONG)
    every = "".join(f"<dt>{html.escape(key)}</dt><dd>{html.escape(_text(value))}</dd>" for key, value in shared.items())
    long = sum(len(_text(value)) > LONG for value in shared.values())
    return (f'<p class="shared" id="shared">Same in every run: {short or "-"}</p>'
            f"<details><summary>Every setting the runs share ({len(shared)}"
            f"{f', {long} of them fingerprints or JSON' if long else ''})</summary>"
            f'<dl class="config">{every}</dl></details>')


def _anchor(run_id: str) -> str:
    return "run-" + "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in str(run_id))


def run_section(run_id: str, config: dict, samples: pd.DataFrame, results_dir: Path, out: Path) -> str:
    """One run: its config, links to its CSV tables and its samples (the first :data:`MAX_SAMPLES`)."""
    title = " · ".join(_text(config.get(key)) for key in ("task", "model", "method", "budget")
                       if not _missing(config.get(key)))
    links = []
    for name in ("metrics", "samples"):
        path = results_dir / "csv" / name / f"{run_id}.csv"
        if path.exists():
            links.append(f'<a href="{html.escape(os.path.relpath(path, out))}">{name}.csv</a>')
    shown = [c for c in SAMPLE_COLUMNS if c in samples and samples[c].notna().any()]
    rows = samples.sort_values([c for c in ("doc_id", "repeat") if c in samples])[shown]
    note = f"{len(rows)} samples" + (f", the first {MAX_SAMPLES} shown" if len(rows) > MAX_SAMPLES else "")
    settings = "".join(f"<dt>{html.escape(key)}</dt><dd>{html.escape(_text(value))}</dd>"
                       for key, value in config.items() if not _missing(value))
    return (f'<section class="run" id="{_anchor(run_id)}"><h3>{html.escape(title)}</h3>'
            f'<p class="meta">run <code>{html.escape(run_id)}</code> · {" · ".join(links) or "no CSV tables"} · '
            f'<a href="#runs">back to the runs</a></p><dl class="config">{settings}</dl>'
            f"<details><summary>{note}</summary>{table(rows.head(MAX_SAMPLES), f'samples-{_anchor(run_id)}')}"
            "</details></section>")


def tests_block(summary: pd.DataFrame, paths: dict[str, Path]) -> str:
    """The paired tests against the full cache, the ties of each budget and the link to the flips (report.md's
    section "Which differences are real"); empty where nothing was tested."""
    tests = significance.tests_table(summary)
    if tests.empty:
        return ""
    classes = {(position, "verdict"): verdict for position, verdict in enumerate(tests["verdict"])
               if verdict in ("worse", "better")}
    ties = pd.read_csv(paths["ties"]) if "ties" in paths else pd.DataFrame()
    flips = Path(paths["flips"]).name if "flips" in paths else None
    text = [f"""<h2 id="tests">Which differences are real</h2>
<p class="note">Each configuration against its full cache on the items both scored, resampling the independent
<code>unit</code> (the session where rows are turns of one session, the problem where a document was sampled several
times, the document otherwise): McNemar's exact test where scores are 0/1 and each unit one item, else a paired
permutation test on the units' summed differences (named in <code>test</code>); <code>p_adjusted</code>:
{html.escape(str(tests["adjustment"].iloc[0]))} comparisons; <code>verdict</code> at adjusted p &lt; 0.05.</p>
{table(tests, "tests-table", classes=classes)}"""]
    if not ties.empty:
        text.append(f"""<h2 id="ties">Ties at each budget</h2>
<p class="note">Configurations of one budget that share a letter in <code>group</code> are not separated by a paired
test at adjusted p &lt; 0.05 (adjusted over that budget's pairs); the best first.</p>
{table(ties, "ties-table")}""")
    if flips:
        text.append(f'<p class="note">The items each configuration lost and gained against its full cache, with their '
                    f'ids and subsets: <a href="{html.escape(flips)}">{html.escape(flips)}</a>.</p>')
    return "\n".join(text)


def figure(path: Path) -> str:
    data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
    caption = Path(path).stem.replace("_", " ")
    return (f'<figure><img alt="{html.escape(caption)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{html.escape(caption)}</figcaption></figure>")


def write_page(results_dir: str | Path, paths: dict[str, Path]) -> Path:
    """report.html beside the report's other files (``paths``: what :func:`evalkit.results.report.write_report`
    wrote)."""
    results_dir, out = Path(results_dir), Path(paths["markdown"]).parent
    summary = pd.read_csv(paths["summary"], keep_default_na=True)
    metrics, samples = read_runs(results_dir)
    configs = metrics.drop_duplicates("run_id", keep="last").set_index("run_id")
    config_columns = [c for c in CONFIG_COLUMNS if c in configs and c != "run_id"]
    shared = shared_settings(metrics[metrics["run_id"].isin(summary["run_id"])])
    runs, classes = runs_table(summary, compact=True)
    every, _ = runs_table(summary)
    links = {position: _anchor(run_id) for position, run_id in enumerate(summary["run_id"])}
    plots = [p for p in paths.values() if Path(p).suffix == ".png"]
    sections = [run_section(run_id, configs.loc[run_id, config_columns].to_dict(),
                            samples[samples["run_id"] == run_id], results_dir, out) for run_id in summary["run_id"]]
    made = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>evalkit report: {html.escape(str(results_dir))}</title><style>{STYLE}</style></head>
<body><main>
<header><h1>evalkit report</h1><p class="meta"><code>{html.escape(str(results_dir))}</code> · {len(summary)} runs ·
tasks {html.escape(", ".join(sorted(summary["task"].astype(str).unique())))} · written {made}</p></header>
{shared_block(shared)}
<h2 id="pivot">{html.escape(_one_metric(summary) or "Primary metric")} by method and budget</h2>
<p class="note">One cell per configuration; runs that differ in any config column are never averaged.
Click a header to sort.</p>
{table(score_pivot(summary), "pivot-table")}
<h2 id="runs">Runs against the full-cache baseline</h2>
<p class="note"><code>delta</code> = value - baseline on the documents both runs scored (<code>paired_docs</code>),
with its paired bootstrap 95% interval over the independent units; red where the paired test finds the configuration
worse than the full cache at the adjusted level, green where better (<a href="#tests">the tests</a>). A run's number
links to its config and samples.</p>
{table(runs, "runs-table", links, classes)}
<details id="every-column"><summary>Every column of these runs ({len(every.columns)}: each setting that differs, what
each run measured)</summary>{table(every, "runs-full-table", links, classes)}</details>
{tests_block(summary, paths)}
<h2 id="plots">Plots</h2>
<div class="plots">{"".join(figure(p) for p in plots)}</div>
<h2 id="details">Runs: config and samples</h2>
{"".join(sections)}
</main><script>{SCRIPT}</script></body></html>
"""
    path = out / "report.html"
    path.write_text(page, encoding="utf-8")
    return path
