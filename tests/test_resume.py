"""A run killed mid-way (SIGKILL) and started again resumes: no sample lost, none generated twice; a finished config
is skipped when a sweep is started again."""

from __future__ import annotations

import json
import signal

import pytest
from helpers import evalkit, interrupted_run

from evalkit.progress import Progress, request_keys
from evalkit.results import read_table


def test_progress_ignores_a_line_cut_short_by_a_crash(tmp_path):
    path = tmp_path / "p.jsonl"
    progress = Progress(path)
    progress.add([{"key": "a", "text": "x", "stats": {}}, {"key": "b", "text": "y", "stats": {}}])
    with open(path, "a") as handle:
        handle.write('{"key": "c", "te')  # the crash
    again = Progress(path)
    assert again.resumed == 2 and again.get("a")["text"] == "x" and again.get("c") is None


def test_repeats_of_one_request_get_distinct_keys():
    keys = request_keys([("p", {"t": 1}), ("p", {"t": 1}), ("q", {"t": 1}), ("p", {"t": 2})])
    assert len(set(keys)) == 4
    assert keys == request_keys([("p", {"t": 1}), ("p", {"t": 1}), ("q", {"t": 1}), ("p", {"t": 2})])


@pytest.mark.slow
def test_killed_run_resumes_without_losing_or_repeating_samples(tmp_path, random_model_dir):
    results = tmp_path / "results"
    args = ["task=kv_retrieval", f"model.pretrained={random_model_dir}", "limit=40", "batch_size=1",
            "+task.generation.max_gen_toks=96", f"results_dir={results}"]
    process, _, lines = interrupted_run(args, results, tmp_path, signal.SIGKILL)  # no cleanup of any kind
    assert process.returncode == -9, "the run finished before it could be killed"
    assert not (results / "metrics").exists()
    done_before = [json.loads(line) for line in lines if line.endswith("}")]

    result = evalkit(*args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"resuming: {len(done_before)} generations already done" in result.stdout
    samples = read_table(results, "samples")
    assert len(samples) == 40 and samples["doc_id"].is_unique
    predictions = samples["prediction"].tolist()
    assert all(record["text"] in predictions for record in done_before)
    assert not any((results / ".progress").glob("*.jsonl"))  # removed once the tables are written

    again = evalkit(*args, cwd=tmp_path)
    assert again.returncode == 0 and "skipped" in again.stdout
    assert len(list((results / "metrics").glob("*.parquet"))) == 1


def test_experiment_presets_define_their_grids():
    from hydra import compose, initialize_config_dir

    from evalkit.paths import conf_dir

    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        paper = compose("config", overrides=["+experiment=paper_grid"], return_hydra_config=True)
        quick = compose("config", overrides=["+experiment=quick_grid"], return_hydra_config=True)
    params = paper.hydra.sweeper.params
    assert params["task"] == "longbench_v2,aime24,livecodebench"
    assert params["method"] == "full,streaming_llm,snapkv,snapstream" and params["+budget"] == "none,2x,4x,8x"
    assert paper.model.name == "llama31_8b_instruct" and quick.model.name == "kv_retrieval_tiny"


@pytest.mark.slow
def test_submitit_local_executor_runs_a_two_job_sweep(tmp_path, random_model_dir):
    results = tmp_path / "results"
    result = evalkit("-m", "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=10", "+budget=2x,4x",
                     "task=kv_retrieval", f"model.pretrained={random_model_dir}", "limit=4",
                     f"results_dir={results}", f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_table(results, "metrics")
    assert metrics["run_id"].nunique() == 2 and set(metrics["budget"]) == {"2x", "4x"}


@pytest.mark.slow
def test_sweep_skips_method_budget_pairs_that_do_not_exist(tmp_path, random_model_dir):
    results = tmp_path / "results"
    result = evalkit("-m", "method=full,snapkv", "+budget=none,4x", "task=kv_retrieval", "limit=4",
                     f"model.pretrained={random_model_dir}", f"results_dir={results}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("skipped in this sweep") == 2
    runs = read_table(results, "metrics").drop_duplicates("run_id").fillna({"budget": "none"})
    assert set(zip(runs["method"], runs["budget"])) == {("full", "none"), ("snapkv", "4x")}
