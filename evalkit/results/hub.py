"""``evalkit-report push``: a results directory as a dataset on the Hugging Face Hub.

    evalkit-report push ORG/NAME [results/] [--private] [--license other] [--dry-run DIR]

The dataset's folder holds the tables as the runs wrote them (``metrics/*.parquet``, ``samples/*.parquet``), each
run's config (``configs/<run_id>.json``), the report (``report/``: report.md, summary.csv, pivot.csv and its plots)
and a dataset card (README.md) whose metadata names two configs, ``metrics`` and ``samples``, so that
``datasets.load_dataset("ORG/NAME", "metrics")`` reads every run's rows. ``--dry-run DIR`` writes that folder to DIR
and stops; otherwise it is built in a temporary folder and uploaded as one commit:
``HfApi().create_repo(repo, repo_type="dataset", private=..., exist_ok=True)`` then ``HfApi().upload_folder(...)``
(huggingface_hub shows a progress bar per large file). An upload adds and replaces files, never deletes any. The token
is huggingface_hub's: ``hf auth login`` or ``HF_TOKEN``.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import pandas as pd

from .outputs import OneLineParser, refusing, writing_into
from .tables import CONFIG_COLUMNS, read_runs

TAGS = ["evalkit", "kv-cache-compression", "long-context", "llm-evaluation"]
SHOWN = ["task", "model", "method", "budget", "metric", "value", "baseline", "delta", "realized_ratio"]


def size_category(rows: int) -> str:
    """The Hub's size bucket of a dataset with ``rows`` rows."""
    for limit, name in ((1_000, "n<1K"), (10_000, "1K<n<10K"), (100_000, "10K<n<100K"), (1_000_000, "100K<n<1M")):
        if rows < limit:
            return name
    return "1M<n<10M"


def card(repo: str, metrics: pd.DataFrame, samples: pd.DataFrame, summary: pd.DataFrame, plots: list[str],
         license: str = "other"):
    """The dataset card: metadata (configs ``metrics`` and ``samples`` over the Parquet files, license, tags, size)
    and a page saying what the runs are, how to load them and what they show."""
    from huggingface_hub import DatasetCard, DatasetCardData

    data = DatasetCardData(
        license=license, pretty_name=f"evalkit results: {repo.split('/')[-1]}", tags=TAGS,
        size_categories=size_category(len(samples)),
        configs=[{"config_name": "metrics", "data_files": [{"split": "train", "path": "metrics/*.parquet"}],
                  "default": True},
                 {"config_name": "samples", "data_files": [{"split": "train", "path": "samples/*.parquet"}]}])
    runs = summary[[c for c in SHOWN if c in summary]].round(4)
    runs = runs.astype(object).where(runs.notna(), None)  # shown as "-"
    text = [f"# evalkit results: {repo}", "",
            f"{metrics['run_id'].nunique()} runs of evalkit (KV-cache compression of LLMs evaluated for accuracy and "
            f"cost) over tasks {', '.join(sorted(metrics['task'].unique()))}: "
            f"{len(metrics)} metric rows, {len(samples)} samples. Every row carries its run's full config.", "",
            "```python", "from datasets import load_dataset", "",
            f'metrics = load_dataset("{repo}", "metrics", split="train").to_pandas()  # run x subset x metric',
            f'samples = load_dataset("{repo}", "samples", split="train").to_pandas()  # one row per sample',
            "```", "", "## Runs", "", "`delta`: score minus the full-cache baseline's on the documents both scored.", "",
            runs.to_markdown(index=False, missingval="-"), "", "## Plots", ""]
    text += [f"![{name.removesuffix('.png').replace('_', ' ')}](report/{name})\n" for name in plots]
    text += ["", "## Files", "",
             "- `metrics/<run_id>.parquet`, `samples/<run_id>.parquet`: the tables each run wrote",
             "- `configs/<run_id>.json`: each run's config",
             "- `report/`: `evalkit-report`'s report (report.md, summary.csv, pivot.csv, plots)", ""]
    return DatasetCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(text))


def build(results_dir: str | Path, folder: str | Path, repo: str, license: str = "other") -> Path:
    """The dataset's folder, ready to upload: tables, configs, report and card. A damaged table or a ``folder`` that
    cannot be written is a :class:`~evalkit.results.tables.ResultsError` before anything is copied; a build that
    fails part way removes what it wrote."""
    results_dir = Path(results_dir)
    metrics, samples = read_runs(results_dir)
    with writing_into(folder) as folder:
        for table in ("metrics", "samples"):
            shutil.copytree(results_dir / table, folder / table, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns(".*", "_*"))  # hidden: half-written temporaries
        _write_dataset(folder, repo, license, metrics, samples)
    return folder


def _write_dataset(folder: Path, repo: str, license: str, metrics: pd.DataFrame, samples: pd.DataFrame) -> None:
    """Beside the copied tables: each run's config, the report and the card."""
    from .report import write_report

    (folder / "configs").mkdir(exist_ok=True)
    columns = [c for c in CONFIG_COLUMNS if c in metrics]
    for run in metrics.drop_duplicates("run_id")[columns].to_dict("records"):
        config = {k: v for k, v in run.items() if not (v is None or (isinstance(v, float) and pd.isna(v)))}
        (folder / "configs" / f"{run['run_id']}.json").write_text(json.dumps(config, indent=2, default=str))
    paths = write_report(folder, folder / "report")
    plots = sorted(path.name for path in paths.values() if Path(path).suffix == ".png")
    summary = pd.read_csv(paths["summary"])
    card(repo, metrics, samples, summary, plots, license).save(folder / "README.md")


def upload(folder: Path, repo: str, private: bool, token: str) -> str:
    """Create the dataset repo if needed and upload ``folder`` as one commit; the commit's URL."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo, repo_type="dataset", private=private, exist_ok=True)
    commit = api.upload_folder(repo_id=repo, folder_path=folder, repo_type="dataset",
                               commit_message="evalkit-report push: results, configs and report")
    return commit.commit_url


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(prog="evalkit-report push", description=__doc__.splitlines()[0])
    parser.add_argument("repo", help="the dataset's id on the Hub: ORG/NAME")
    parser.add_argument("results", type=Path, nargs="?", default=Path("results"),
                        help="the results directory (default: results)")
    parser.add_argument("--private", action="store_true", help="create the dataset private")
    parser.add_argument("--license", default="other", help="the card's license id (default: other)")
    parser.add_argument("--dry-run", type=Path, metavar="DIR", help="write the dataset's folder to DIR, upload nothing")
    args = parser.parse_args(argv)
    if args.dry_run is not None:
        with refusing("evalkit-report push"):  # no runs, a damaged table, a DIR that cannot be written
            folder = build(args.results, args.dry_run, args.repo, args.license)
        print(f"written: {folder} (not uploaded)")
        return
    from huggingface_hub import get_token

    token = get_token()
    if token is None:
        print("evalkit-report push: not logged in to the Hugging Face Hub: run `hf auth login` (or set HF_TOKEN)",
              file=sys.stderr)
        sys.exit(2)
    with tempfile.TemporaryDirectory(prefix="evalkit-push-") as scratch:
        with refusing("evalkit-report push"):
            folder = build(args.results, Path(scratch) / "dataset", args.repo, args.license)
        try:
            url = upload(folder, args.repo, args.private, token)
        except Exception as error:  # HTTP, network or permission: one line, not a traceback
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
            print(f"evalkit-report push: uploading to {args.repo} failed: {reason}", file=sys.stderr)
            sys.exit(2)
    print(f"pushed: https://huggingface.co/datasets/{args.repo} ({url})")
