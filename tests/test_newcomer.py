"""What a newcomer meets on the first commands: the quick_grid sweep makes only the jobs it runs (no skipped line),
evalkit-report's terminal table fits a terminal after it, and evalkit-mem prints no line of matplotlib's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
QUICK_PAIRS = {("full", None), ("streaming_llm", "2x"), ("streaming_llm", "4x"), ("snapkv", "2x"), ("snapkv", "4x"),
               ("snapstream", "2x"), ("snapstream", "4x")}


def _run(argv: list[str], cwd: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=cwd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", **env})


@pytest.fixture(scope="module")
def quick_grid(tmp_path_factory):
    """``evalkit -m +experiment=quick_grid limit=2`` for real (the built-in tiny model; about 25 s on 2 cores): the
    command's output and its results folder."""
    where = tmp_path_factory.mktemp("quick_grid")
    result = _run(["-m", "evalkit.cli", "-m", "+experiment=quick_grid", "limit=2", f"results_dir={where / 'results'}"],
                  where)
    assert result.returncode == 0, result.stderr[-3000:]
    return result, where / "results"


def test_the_quick_grid_sweep_makes_only_the_jobs_it_runs(quick_grid):
    from evalkit.results import read_table

    result, results = quick_grid
    said = result.stdout + result.stderr
    assert "skipped" not in said, [line for line in said.splitlines() if "skipped" in line]
    assert "evalkit: sweep of 7 jobs" in result.stdout
    assert "sweep done: 7 of 7 jobs (7 ran)" in result.stdout
    runs = read_table(results, "metrics").drop_duplicates("run_id")
    assert {(method, budget if isinstance(budget, str) else None)
            for method, budget in zip(runs["method"], runs["budget"])} == QUICK_PAIRS


def test_the_quick_grid_jobs_are_the_method_budget_pairs_with_their_digests():
    """Each job of the preset's list has the config digest of the same method and budget given as ``method=``
    ``budget=`` (the product the preset swept before): the same runs, so results made before are still skipped."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import evalkit.run as runner
    from evalkit.core.paths import conf_dir
    from evalkit.run.digest import config_digest
    from evalkit.run.sweep_progress import sweep_jobs

    def digest(overrides: list[str]) -> tuple:
        plain = OmegaConf.to_container(compose("config", overrides=overrides), resolve=True)
        spec = runner.validate(plain, method_explicit=True)
        return spec.method, spec.budget, config_digest(spec)

    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        preset = compose("config", overrides=["+experiment=quick_grid"], return_hydra_config=True)
        preset.hydra.overrides.task = ["+experiment=quick_grid"]
        jobs = sweep_jobs(preset)
        listed = [digest(job) for job in jobs]
        product = [digest(["+experiment=quick_grid", "task=kv_retrieval", f"method={method}",
                           f"budget={budget or 'none'}"]) for method, budget in sorted(QUICK_PAIRS, key=str)]
    assert len(jobs) == 7 and {(method, budget) for method, budget, _ in listed} == QUICK_PAIRS
    assert sorted(listed, key=str) == sorted(product, key=str)


def test_after_the_sweep_evalkit_reports_a_table_a_terminal_holds(quick_grid):
    """The 7 runs differ in method and budget: the table shows those, the settings that set runs of a method apart
    (StreamingLLM's window, SnapStream's recent tokens) and the score, within 120 characters; the task, model and
    metric every run shares are said once above it; no fingerprint or JSON (report.md and report.html keep them)."""
    _, results = quick_grid
    result = _run(["-m", "evalkit.results.cli", str(results), "--bootstrap", "200"], results.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0] == f"evalkit-report: 7 configurations in {results}"
    assert lines[1] == "same in every run: task kv_retrieval · model kv_retrieval_tiny · metric exact_match"
    assert lines[2].split() == ["method", "budget", "window", "recent", "value", "vs", "full", "(95%", "CI)", "KV",
                                "smaller"]
    table = lines[1:10]
    assert len(lines) == 11 and lines[10].startswith(f"written to {results / 'report'}/: summary.csv, report.md")
    assert max(map(len, table)) <= 120, max(map(len, table))
    assert sum("kv_retrieval_tiny" in line for line in lines) == 1  # stated once, not on every row
    assert not [line for line in table if "sha256" in line or "{" in line or "builtin:" in line]
    rows = {tuple(line.split()[:2]): line.split() for line in lines[3:10]}
    assert set(rows) == {(method, budget or "full") for method, budget in QUICK_PAIRS}
    assert rows[("streaming_llm", "2x")][2:4] == ["124", "-"] and rows[("snapstream", "4x")][2:4] == ["32", "16"]


def test_a_folder_of_two_models_reports_what_sets_runs_apart_within_120_characters(tmp_path):
    """Runs of two models (each with its source fingerprint, path, chat template and context) on two tasks (each
    with its options and data fingerprint): those follow the model or the task and stay in report.md; the lines hold
    the task, model, method, budget, the window and the score, within 120 characters."""
    import json

    from evalkit.results import metrics_table, samples_table, write_table
    from evalkit.results.cli import main

    for model, task, pairs in (("kv_retrieval_tiny", "kv_retrieval", [(None, 1.0), ("2x", 0.9), ("4x", 0.5)]),
                               ("smollm2_135m_instruct", "needle", [(None, 0.65), ("4x", 0.3)])):
        for method, budget, value in [("full", None, pairs[0][1]), *(
                (name, budget, value) for budget, value in pairs[1:] for name in ("snapkv", "streaming_llm"))]:
            run_id = f"{task}-{method}-{budget or 'full'}"
            capacity = 256 // int(budget[:-1]) if budget else None
            window = (capacity - 4 if method == "streaming_llm" else 32) if budget else None
            config = {"run_id": run_id, "model": model, "model_pretrained": f"/models/{model}",
                      "model_source": f"local:sha256:{hash(model) & (2**64 - 1):032x}", "task": task,
                      "apply_chat_template": model.startswith("smollm2"), "task_options": json.dumps({"task": task}),
                      "dataset_source": f"local:sha256:{hash(task) & (2**64 - 1):032x}", "method": method,
                      "budget": budget, "capacity": capacity, "window": window,
                      "policy_params": json.dumps({"capacity": capacity, "window": window})}
            samples = [{"doc_id": doc, "sample_id": str(doc), "repeat": 0, "score": float(doc < value * 20),
                        "subset": f"{1000 + 800 * (doc % 2)}/{doc % 5 / 4}"} for doc in range(20)]  # length/depth
            metrics = [{"subset": "all", "metric": "exact_match", "value": value, "stderr": 0.1, "n": 20}]
            write_table(samples_table(samples, config), tmp_path, "samples", run_id)
            write_table(metrics_table(metrics, config), tmp_path, "metrics", run_id)
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()) as out:
        main([str(tmp_path), "--bootstrap", "100"])
    lines = out.getvalue().splitlines()
    table = lines[1:-1]
    assert lines[1] == "same in every run: metric exact_match"
    assert lines[2].split()[:5] == ["task", "model", "method", "budget", "window"] and len(table) == 1 + 1 + 8
    assert max(map(len, table)) <= 120
    assert not [line for line in table if "sha256" in line or "{" in line or "/models/" in line]
    markdown = (tmp_path / "report" / "report.md").read_text()
    assert "/models/smollm2_135m_instruct" in markdown and "local:sha256:" in markdown  # report.md keeps them


def test_evalkit_mem_prints_no_line_of_matplotlibs_on_its_first_run(tmp_path):
    """A first run builds matplotlib's font cache (a fresh MPLCONFIGDIR here): its INFO line "generated new
    fontManager" stays off the terminal (its logger is held at WARNING: its warnings and errors would print)."""
    config = tmp_path / "matplotlib"
    result = _run(["-m", "evalkit.memory.cli", f"results_dir={tmp_path / 'results'}"], tmp_path,
                  MPLCONFIGDIR=str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    assert list(config.glob("fontlist-*.json"))  # the cache was built in this run
    said = (result.stdout + result.stderr).splitlines()
    assert not [line for line in said if "fontManager" in line or "matplotlib" in line.lower()], said
    assert "decode tokens/s" in result.stdout and "written: " in result.stdout


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_grader_ended_by_a_signal_removes_its_sandboxes_folders(tmp_path, signum):
    """Two sandboxes running (run_many's pool); the grader gets SIGTERM (or SIGHUP): it dies of that signal as before,
    and leaves no temporary folder behind (a kill -9 leaves them to the next start: test_hostile.py)."""
    grader = subprocess.Popen(
        [sys.executable, "-c", "from evalkit.benchmark import sandbox\n"
         "sandbox.run_many([{'code': 'import time; time.sleep(120)', 'timeout_s': 120}] * 2, workers=2)"],
        env={**os.environ, "TMPDIR": str(tmp_path)}, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while len(folders := list(tmp_path.glob(f"evalkit-sandbox-{grader.pid}-*"))) < 2 or not all(
            (folder / "stdout").exists() for folder in folders):
        assert time.monotonic() < deadline and grader.poll() is None, "the sandboxes never started"
        time.sleep(0.1)
    time.sleep(0.5)  # both programs launched
    grader.send_signal(signum)
    assert grader.wait(timeout=30) == -signum
    assert not list(tmp_path.glob("evalkit-sandbox-*"))
