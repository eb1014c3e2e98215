"""parallel=ray: a run's requests sharded over Ray engine replicas write the tables a single process writes, and a
replica killed mid-run loses and repeats no sample."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import evalkit

from evalkit.results import read_table

# What differs between any two runs of one config: the run's identity and what it timed.
TIMED = {"run_id", "started_at", "prefill_seconds", "decode_seconds", "time_to_first_token_s", "kv_byte_seconds"}
SAMPLED = ["+task.generation.do_sample=true", "+task.generation.temperature=1.0"]


def _args(model_dir: Path, results: Path, *extra: str) -> list[str]:
    return ["task=kv_retrieval", f"model.pretrained={model_dir}", "limit=24", f"results_dir={results}", *extra]


def _samples(results: Path):
    samples = read_table(results, "samples")
    return samples.drop(columns=[c for c in samples.columns if c in TIMED]).sort_values("doc_id").reset_index(drop=True)


def test_a_missing_or_mistaken_parallel_setting_is_one_line(tmp_path):
    for override, expected in (("parallel.replicas=0", "parallel.replicas must be a positive integer, got 0"),
                               ("+parallel.workers=2", "unknown setting parallel.workers")):
        result = evalkit("parallel=ray", override, f"results_dir={tmp_path / 'r'}", cwd=tmp_path)
        assert result.returncode == 2 and expected in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    # Without Ray installed (its import fails as it does where the package is absent): the extra to install.
    hidden = ("import sys; sys.modules['ray'] = None; sys.argv = ['evalkit', 'parallel=ray', "
              f"'results_dir={tmp_path / 'r'}']; from evalkit.cli import main; main()")
    result = subprocess.run([sys.executable, "-c", hidden], cwd=tmp_path, capture_output=True, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip() == "evalkit: config error: parallel=ray needs Ray, which is not installed: " \
                                    "pip install 'evalkit[ray]'"
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
@pytest.mark.parametrize("replicas, sampling", [(2, []), (4, SAMPLED)], ids=["2-greedy", "4-sampled"])
def test_replicas_write_the_tables_of_one_process(tmp_path, random_model_dir, replicas, sampling):
    alone, sharded = tmp_path / "alone", tmp_path / "sharded"
    assert evalkit(*_args(random_model_dir, alone, *sampling), cwd=tmp_path).returncode == 0
    result = evalkit(*_args(random_model_dir, sharded, *sampling), "parallel=ray", f"parallel.replicas={replicas}",
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    expected, got = _samples(alone), _samples(sharded)
    assert len(got) == 24 and got["doc_id"].is_unique
    pd_testing = pytest.importorskip("pandas.testing")
    pd_testing.assert_frame_equal(got, expected)  # config digest, predictions, scores, bytes: row for row
    if sampling:  # sampled predictions differ from the greedy ones: sampling really ran
        greedy = tmp_path / "greedy"
        assert evalkit(*_args(random_model_dir, greedy), cwd=tmp_path).returncode == 0
        assert (_samples(greedy)["prediction"] != got["prediction"]).any()
    metrics = read_table(sharded, "metrics").set_index(["subset", "metric"])["value"]
    assert metrics[("all", "replicas")] == replicas
    per_replica = metrics.loc[[f"replica{i}" for i in range(replicas)]]
    assert per_replica.xs("decode_tokens_per_s", level="metric").gt(0).all()
    assert per_replica.xs("kv_cache_allocated_bytes", level="metric").sum() == metrics[("all",
                                                                                     "kv_cache_allocated_bytes")]
    assert "replica0" not in result.stdout  # per-replica rows go to the tables, not the terminal


def _replica_pids() -> list[int]:
    """Processes of Ray actors running an evalkit replica."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "cmdline").read_bytes().startswith(b"ray::Replica"):
                pids.append(int(entry.name))
        except OSError:
            continue
    return sorted(pids)


def _kill_one_replica_midway(args: list[str], results: Path, cwd: Path, after: int = 6):
    """Start the CLI; once ``after`` generations are durable, SIGKILL one replica's process (as the OOM killer
    does). The ended process, its stderr, and how many generations were durable at the kill."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    process = subprocess.Popen([sys.executable, "-m", "evalkit.cli", *args], cwd=cwd, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline, durable = time.time() + 400, 0
    while time.time() < deadline and process.poll() is None:
        files = list((results / ".progress").glob("*.jsonl")) if (results / ".progress").is_dir() else []
        durable = len(files[0].read_text().splitlines()) if files else 0
        pids = _replica_pids()
        if durable >= after and pids:
            os.kill(pids[-1], signal.SIGKILL)
            break
        time.sleep(0.05)
    stdout, stderr = process.communicate(timeout=600)
    return process, stdout, stderr, durable


@pytest.mark.slow
def test_a_killed_replica_is_restarted_and_every_sample_is_written_once(tmp_path, random_model_dir):
    alone, sharded = tmp_path / "alone", tmp_path / "sharded"
    slow = ["limit=40", "batch_size=1", "+task.generation.max_gen_toks=96", "task.truncation=left"]
    assert evalkit(*_args(random_model_dir, alone, *slow), cwd=tmp_path).returncode == 0
    process, _, stderr, durable = _kill_one_replica_midway(
        _args(random_model_dir, sharded, *slow, "parallel=ray", "parallel.replicas=2"), sharded, tmp_path)
    assert process.returncode == 0, stderr[-3000:]
    assert durable < 40, "the run finished before a replica could be killed"
    assert "died" in stderr and "restarted, it takes its" in stderr
    assert "death 1 of 3 allowed" in stderr
    pd_testing = pytest.importorskip("pandas.testing")
    got = _samples(sharded)
    assert len(got) == 40 and got["doc_id"].is_unique
    pd_testing.assert_frame_equal(got, _samples(alone))


@pytest.mark.slow
def test_a_replica_that_keeps_dying_stops_the_run_and_its_samples_resume(tmp_path, random_model_dir):
    results = tmp_path / "results"
    args = _args(random_model_dir, results, "limit=40", "batch_size=1", "+task.generation.max_gen_toks=96",
                 "task.truncation=left")
    process, _, stderr, durable = _kill_one_replica_midway([*args, "parallel=ray", "parallel.max_restarts=0"],
                                                          results, tmp_path)
    assert process.returncode == 2, stderr[-3000:]
    line = stderr.strip().splitlines()[-1]
    assert line.startswith("evalkit: error: replica ") and "died 1 times" in line and "run the same command" in line
    assert not (results / "metrics").exists()
    kept = len(next((results / ".progress").glob("*.jsonl")).read_text().splitlines())
    assert durable <= kept < 40
    resumed = evalkit(*args, cwd=tmp_path)  # the same config in one process resumes the replicas' generations
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming: {kept} generations already done" in resumed.stdout
    samples = read_table(results, "samples")
    assert len(samples) == 40 and samples["doc_id"].is_unique


ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_scaling_benchmark_runs_and_its_runs_agree(tmp_path):
    """docs/parallel.md's `python benchmarks/bench_replicas.py` (4 prompts here)."""
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_replicas.py"), "--limit", "4",
                             "--replicas", "2", "--workdir", str(tmp_path)], capture_output=True, text=True,
                            timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    table = [line for line in result.stdout.splitlines() if line.startswith("| ray, 2 replicas")]
    assert len(table) == 1 and table[0].rstrip().endswith("| yes |"), result.stdout


def test_the_paper_grid_estimate_follows_from_the_measured_rows():
    """docs/parallel.md's `python benchmarks/paper_grid_cost.py`: its numbers recomputed here from the H100 rows."""
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "paper_grid_cost.py"), "--mean-trace", "10000",
                             "--gpus", "32"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    rows = {tuple(cells[1:3]): cells for line in result.stdout.splitlines()
            if (cells := [c.strip() for c in line.split("|")]) and len(cells) == 8 and cells[1] not in ("method", "---")}
    bandwidth = ((16.06e9 + 64 * 2048 * 131072) / 13.71e-3 + (16.06e9 + 16 * 8192 * 131072) / 13.39e-3) / 2
    slots = 54 * 2**30 // (16384 * 131072)  # SnapStream 8x of 131072: 16,384 tokens a slot
    rate = slots / ((16.06e9 + slots * 16384 * 131072) / bandwidth)
    assert rows[("snapstream", "8x")][3:6] == ["16,384", str(slots), f"{rate:,.0f}"]
    assert float(rows[("snapstream", "8x")][6]) == pytest.approx(30 * 64 * 10000 / rate / 3600, abs=0.05)
    assert rows[("full", "-")][3] == "32,928"  # a growing cache reserves the prompt and all 32,768 new tokens
    assert "on 32 GPUs" in result.stdout
