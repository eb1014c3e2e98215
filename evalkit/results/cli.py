"""``evalkit-report``: a results directory's report (:mod:`.report`), its kvpress export (``export``,
:mod:`.kvpress_export`), its dataset on the Hugging Face Hub (``push``, :mod:`.hub`), two runs compared (``compare``,
:mod:`.compare_runs`) or the items a comparison needs (``plan``, :mod:`.power`).

    evalkit-report results/ [--out results/report] [--bootstrap 2000] [--adjust holm|bh] [--html]
    (export kvpress, push, compare, plan: docs/results.md)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import compare_runs, html_page, hub, kvpress_export, power, terminal_report
from .outputs import OneLineParser, refusing
from .paired_stats import ADJUSTMENTS
from .report import write_report


def resamples(text: str) -> int:
    """``--bootstrap``'s count: a positive integer."""
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"the number of bootstrap resamples must be a positive integer, got {text!r}")
    return count


def main(argv: list[str] | None = None) -> None:
    if (argv := sys.argv[1:] if argv is None else argv)[:1] in (["export"], ["push"]):  # each its module's main
        return (kvpress_export if argv[0] == "export" else hub).main(argv[1:])
    if argv[:1] in (["compare"], ["plan"]):  # paired statistics of two runs; the items a comparison needs
        return (compare_runs if argv[0] == "compare" else power).main(argv[1:])
    parser = OneLineParser(prog="evalkit-report", description="what a results directory says, as pivot tables, deltas against the full cache, and plots")
    parser.add_argument("results_dir", type=Path)
    parser.add_argument("--out", type=Path, default=None, help="default: <results_dir>/report")
    parser.add_argument("--bootstrap", type=resamples, default=2000,
                        help="bootstrap resamples for the delta intervals (a positive integer)")
    parser.add_argument("--html", action="store_true", help="also write report.html: the report as one page")
    parser.add_argument("--adjust", choices=sorted(ADJUSTMENTS), default="holm",
                        help="how the p-values of the report are adjusted together: holm (default) or bh")
    args = parser.parse_args(argv)
    with refusing("evalkit-report"):  # no results directory, a damaged table, an --out that cannot be written
        paths = write_report(args.results_dir, args.out, args.bootstrap, args.adjust)
        paths |= {"html": html_page.write_page(args.results_dir, paths)} if args.html else {}
    print(terminal_report.summary(args.results_dir, paths))


if __name__ == "__main__":
    main()
