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
    """``evalkit -m +experiment=quick_grid limit=1`` for real (the built-in tiny model; about 20 s on 2 cores): the
    command's output and its results folder."""
    where = tmp_path_factory.mktemp("quick_grid")
    result = _run(["-m", "evalkit.cli", "-m", "+experiment=quick_grid", "limit=1", f"results_dir={where / 'results'}"],
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
    from evalkit.paths import conf_dir
    from evalkit.run.digest import config_digest
    from evalkit.sweep_progress import sweep_jobs

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
        [sys.executable, "-c", "from evalkit import sandbox\n"
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
