"""examples/analysis.ipynb, executed on a real sweep the way docs/notebook.md says: every cell runs, its table holds
the runs' numbers, its plot cell an image, its per-sample table every compressed sample; committed without outputs."""

from __future__ import annotations

import base64
import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from test_harness import composed

from evalkit.results import read_table
from evalkit.run import run, validate

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "analysis.ipynb"
DOCS = ROOT / "docs" / "notebook.md"
BUDGETS = (None, "2x", "4x")
LIMIT = 3
# metrics table row -> the notebook's column (the table rounds to 4 decimals)
SHOWN = {"exact_match": "value", "realized_ratio_mean": "realized_ratio", "memory_ratio_mean": "memory_ratio",
         "kv_bytes_peak_mean": "kv_bytes_peak", "prefill_tokens_per_s": "prefill_tokens_per_s",
         "decode_tokens_per_s": "decode_tokens_per_s"}


@pytest.fixture(scope="module")
def layout(random_model_dir, tmp_path_factory):
    """A checkout's layout: examples/analysis.ipynb and results/ holding the full cache and SnapStream 2x and 4x."""
    root = tmp_path_factory.mktemp("checkout")
    (root / "examples").mkdir()
    shutil.copy(NOTEBOOK, root / "examples")
    for budget in BUDGETS:
        cfg = composed("task=kv_retrieval", f"limit={LIMIT}", f"model.pretrained={random_model_dir}",
                       f"results_dir={root / 'results'}", *([f"+budget={budget}"] if budget else []))
        run(validate(cfg, method_explicit=False))
    return root


def documented(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", DOCS.read_text(), flags=re.S)


def started(command: list[str], cwd: Path) -> subprocess.Popen:
    env = os.environ | {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def failed(process: subprocess.Popen) -> str | None:
    """The end of what ``process`` printed where it failed or ran past 300 s (then killed); None where it passed."""
    try:
        output, _ = process.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
    return None if process.returncode == 0 else output[-4000:]


def cell(notebook, id: str):
    (found,) = [c for c in notebook.cells if c.get("id") == id]
    return found


def shown_table(output) -> pd.DataFrame:
    return pd.read_html(io.StringIO(output["data"]["text/html"]))[0]


def check(executed: Path, results: Path) -> None:
    notebook = nbformat.read(executed, as_version=4)
    metrics, samples = read_table(results, "metrics"), read_table(results, "samples")
    code = [c for c in notebook.cells if c.cell_type == "code"]
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, errors[0].get("traceback")
    assert all(c.outputs for c in code if c.id != "parameters"), "a cell showed nothing"

    (result,) = [o for o in cell(notebook, "summary").outputs if o.output_type == "execute_result"]
    table = shown_table(result)
    assert sorted(zip(table["method"], table["budget"])) == [("full", "full"), ("snapstream", "2x"), ("snapstream", "4x")]
    assert len(table) == metrics["run_id"].nunique() == len(BUDGETS)
    full_value = None
    for _, row in table.iterrows():
        chosen = metrics[(metrics["method"] == row["method"]) & (metrics["subset"] == "all")
                         & (metrics["budget"].fillna("full") == row["budget"])]
        observed = chosen.set_index("metric")["value"]
        assert row["metric"] == "exact_match"
        for metric, column in SHOWN.items():
            assert row[column] == pytest.approx(observed[metric], abs=1e-4, rel=1e-6), (row["budget"], column)
        full_value = observed["exact_match"] if row["method"] == "full" else full_value
    compressed = table[table["method"] != "full"]
    assert compressed["delta"].tolist() == pytest.approx((compressed["value"] - full_value).tolist(), abs=1e-4)
    assert compressed["memory_ratio"].gt(1.5).all() and table["kv_bytes_peak"].gt(0).all()

    images = [o for o in cell(notebook, "memory-plot").outputs if "image/png" in o.get("data", {})]
    assert len(images) == 1
    png = base64.b64decode(images[0]["data"]["image/png"])
    assert png[:4] == b"\x89PNG" and len(png) > 10_000

    outputs = cell(notebook, "per-sample").outputs
    agreement = shown_table(next(o for o in outputs if o.output_type == "display_data"))
    full = samples[samples["method"] == "full"].set_index("doc_id")["prediction"]
    for _, row in agreement.iterrows():
        own = samples[samples["budget"] == row["budget"]].set_index("doc_id")["prediction"]
        assert row["method"] == "snapstream" and row["samples"] == LIMIT
        assert row["same_prediction"] == pytest.approx((own == full[own.index]).mean(), abs=1e-4)
    assert sorted(agreement["budget"]) == ["2x", "4x"]
    printed = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert f"of {2 * LIMIT} samples differ from the full cache" in printed


def test_the_committed_notebook_has_no_outputs_and_a_parameters_cell():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(notebook)
    code = [c for c in notebook.cells if c.cell_type == "code"]
    assert all(c.outputs == [] and c.execution_count is None for c in code)
    (parameters,) = [c for c in code if "parameters" in c.metadata.get("tags", [])]
    assert parameters is code[0] and parameters.source.startswith('RESULTS = "results"')
    assert NOTEBOOK.stat().st_size < 20_000


@pytest.fixture(scope="module")
def executed(layout, tmp_path_factory):
    """docs/notebook.md's two ways, run at once: ``jupyter execute`` on the checkout's results/, and the snippet on a
    copy of them elsewhere. Their executed notebooks and the results folders they read."""
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    shutil.copytree(layout / "results", elsewhere / "sweep")
    shutil.copytree(layout / "examples", elsewhere / "examples")
    (commands,) = documented("bash")
    (snippet,) = documented("python")
    assert "/data/sweeps/llama_4k" in snippet
    runs = [(command.split(), layout) for command in commands.strip().splitlines()]
    runs.append(([sys.executable, "-c", snippet.replace("/data/sweeps/llama_4k", str(elsewhere / "sweep"))], elsewhere))
    processes = [started(*run) for run in runs]
    failures = [(run, failure) for run, process in zip(runs, processes) if (failure := failed(process)) is not None]
    # Two kernels starting at once (or beside another test's sockets) can draw the same free port: that one runs again.
    failures = [failure if "Address already in use" not in failure else failed(started(*run))
                for run, failure in failures]
    failures = [failure for failure in failures if failure is not None]
    assert not failures, failures[0]
    return {"jupyter execute": (layout / "results" / "analysis.ipynb", layout / "results"),
            "snippet": (elsewhere / "llama_4k.ipynb", elsewhere / "sweep")}


def test_jupyter_execute_runs_it_on_the_repository_results(executed):
    check(*executed["jupyter execute"])


def test_the_documented_snippet_runs_it_on_another_results_folder(executed):
    check(*executed["snippet"])
