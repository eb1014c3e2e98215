"""A run killed mid-way (SIGKILL) and started again resumes: no sample lost, none generated twice; a finished config
is skipped when a sweep is started again."""

from __future__ import annotations

import json
import signal

import pytest
from helpers import evalkit, interrupted_run

from evalkit.results import read_table
from evalkit.results.progress import Progress, request_keys


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
            "+task.generation.max_gen_toks=96", "task.truncation=left", f"results_dir={results}"]  # long generations
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

    from evalkit.core.paths import conf_dir

    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        paper = compose("config", overrides=["+experiment=paper_grid"], return_hydra_config=True)
        quick = compose("config", overrides=["+experiment=quick_grid"], return_hydra_config=True)
    params = paper.hydra.sweeper.params
    assert params["task"] == "longbench_v2,aime24,livecodebench"
    assert params["method"] == "full,streaming_llm,snapkv,snapstream" and params["budget"] == "none,2x,4x,8x"
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


def test_an_interrupted_table_write_is_redone_without_duplicate_rows(tmp_path, random_model_dir, monkeypatch):
    """Killed after the samples table and before the metrics table (the mark of a complete run): the rerun removes
    the unfinished tables and writes exactly what an uninterrupted run writes."""
    from test_harness import composed

    import evalkit.run.runner as runner
    from evalkit.run import validate

    def spec(results):
        return validate(composed(f"model.pretrained={random_model_dir}", "limit=6",
                                        "+task.generation.max_gen_toks=8", f"results_dir={results}"),
                               method_explicit=False)

    reference = runner.run(spec(tmp_path / "reference"))
    real_write = runner.write_table

    def crash_before_metrics(table, results_dir, name, run_id):
        if name == "metrics":
            (results_dir / "metrics" / f".{run_id}.parquet.123.tmp").parent.mkdir(parents=True, exist_ok=True)
            (results_dir / "metrics" / f".{run_id}.parquet.123.tmp").write_bytes(b"half a file")
            raise KeyboardInterrupt
        return real_write(table, results_dir, name, run_id)

    results = tmp_path / "results"
    monkeypatch.setattr(runner, "write_table", crash_before_metrics)
    with pytest.raises(runner.Interrupted):
        runner.run(spec(results))
    assert len(list((results / "samples").glob("*.parquet"))) == 1 and not list((results / "metrics").glob("*.parquet"))
    monkeypatch.setattr(runner, "write_table", real_write)
    again = runner.run(spec(results))
    assert again is not None
    samples, metrics = read_table(results, "samples"), read_table(results, "metrics")
    assert len(samples) == 6 and samples["doc_id"].is_unique and samples["run_id"].nunique() == 1
    assert not any(p.name.startswith(".") for p in (results / "metrics").iterdir())
    assert len(list((results / "csv" / "samples").glob("*.csv"))) == 1
    assert sorted(samples["prediction"]) == sorted(reference.samples["prediction"])
    assert scores(metrics) == scores(reference.metrics)


def test_a_second_process_on_the_same_config_is_refused_while_the_first_runs(tmp_path, random_model_dir):
    """The config's lock is held by a running process: a second one is one line and exit 2, the first unharmed."""
    import subprocess
    import sys

    from test_harness import composed

    import evalkit.run.runner as runner
    from evalkit.run import validate

    results = tmp_path / "results"
    args = [f"model.pretrained={random_model_dir}", "limit=3", "+task.generation.max_gen_toks=4", f"results_dir={results}"]
    digest = runner.config_digest(validate(composed(*args), method_explicit=False))
    (results / ".progress").mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time\n"
                               f"f = open({str(results / '.progress' / (digest + '.lock'))!r}, 'a+')\n"
                               "fcntl.flock(f, fcntl.LOCK_EX); f.write('pid 4242 on testhost'); f.flush()\n"
                               "print('locked', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        second = evalkit(*args, cwd=tmp_path)
        assert second.returncode == 2
        (line,) = [line for line in second.stderr.splitlines() if line.startswith("evalkit:")]
        assert "already running" in line and "pid 4242 on testhost" in line, line
        assert not (results / "samples").exists()
    finally:
        holder.kill()
        holder.wait()
    # the lock goes with its holder: now the config runs
    third = evalkit(*args, cwd=tmp_path)
    assert third.returncode == 0, third.stderr[-2000:]
    assert len(read_table(results, "samples")) == 3


MEASURED = {"wall_seconds", "prefill_tokens_per_s", "decode_tokens_per_s", "slot_utilization", "peak_rss_bytes",
            "kv_cache_allocated_bytes", "decode_step_seconds", "decode_step_bytes", "copy_bandwidth_bytes_per_s",
            "decode_step_seconds_roofline", "decode_efficiency"}


def scores(metrics) -> dict:
    """A run's metrics without the costs it measured (times differ between any two runs)."""
    return metrics[~metrics["metric"].isin(MEASURED)].set_index("metric")["value"].to_dict()


def _interrupt_at(point: str, monkeypatch):
    """Make a run raise KeyboardInterrupt (what Ctrl-C raises) at ``point``."""
    import evalkit.lm
    import evalkit.results.progress
    import evalkit.run.runner as runner

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    if point == "task loading":
        monkeypatch.setattr(runner, "load_task", interrupt)
    elif point == "model loading":
        monkeypatch.setattr(evalkit.lm.EvalkitLM, "__init__", interrupt)
    elif point == "generation":  # after two generations were made durable
        real_add, calls = evalkit.results.progress.Progress.add, []

        def add_then_interrupt(self, records):
            real_add(self, records)
            calls.append(1)
            if len(calls) == 2:
                raise KeyboardInterrupt

        monkeypatch.setattr(evalkit.results.progress.Progress, "add", add_then_interrupt)
    elif point == "scoring":
        monkeypatch.setattr(runner, "tidy_rows", interrupt)
    elif point in ("samples table", "metrics table"):
        real_write = runner.write_table

        def write_then_interrupt(table, results_dir, name, run_id):
            if point.startswith(name):
                raise KeyboardInterrupt
            return real_write(table, results_dir, name, run_id)

        monkeypatch.setattr(runner, "write_table", write_then_interrupt)


@pytest.mark.parametrize("point", ["task loading", "model loading", "generation", "scoring", "samples table",
                                   "metrics table"])
def test_ctrl_c_at_any_point_leaves_a_state_the_same_command_finishes_exactly(tmp_path, random_model_dir,
                                                                             monkeypatch, point):
    """Interrupted anywhere, the run says so (Interrupted: how many generations it kept), and running the same
    config again writes exactly what an uninterrupted run writes: no sample lost, none twice."""
    from test_harness import composed

    import evalkit.run.runner as runner
    from evalkit.run import validate

    def spec(results):
        return validate(composed(f"model.pretrained={random_model_dir}", "limit=6", "batch_size=2",
                                        "+task.generation.max_gen_toks=8", f"results_dir={results}"),
                               method_explicit=False)

    reference = runner.run(spec(tmp_path / "reference"))
    results = tmp_path / "results"
    with monkeypatch.context() as patch:
        _interrupt_at(point, patch)
        with pytest.raises(runner.Interrupted) as interrupted:
            runner.run(spec(results))
    assert interrupted.value.kept == {"task loading": 0, "model loading": 0, "generation": 2}.get(point, 6)
    assert not list((results / "metrics").glob("*.parquet")) if (results / "metrics").exists() else True
    again = runner.run(spec(results))
    assert again is not None
    samples, metrics = read_table(results, "samples"), read_table(results, "metrics")
    assert len(samples) == 6 and samples["doc_id"].is_unique and samples["run_id"].nunique() == 1
    assert sorted(samples["prediction"]) == sorted(reference.samples["prediction"])
    assert scores(metrics) == scores(reference.metrics)
    assert not any(p.name.startswith(".") for folder in ("samples", "metrics") for p in (results / folder).iterdir())


def test_ctrl_c_while_the_libraries_load_is_one_line(tmp_path):
    """Ctrl-C during the CLI's imports (torch, transformers, lm-eval: seconds): the interrupted line, exit 130."""
    import signal
    import subprocess
    import sys
    import time

    from helpers import interruptible

    process = subprocess.Popen([sys.executable, "-m", "evalkit.cli", f"results_dir={tmp_path / 'results'}"],
                               cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=interruptible)
    time.sleep(0.8)  # Python's own Ctrl-C handler is in place; the libraries are still loading
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr[-2000:]
    assert "Traceback" not in stderr
    assert [line for line in stderr.splitlines() if line.strip()] == [
        "evalkit: interrupted before the run started; nothing written"]
    assert not (tmp_path / "results").exists()


def test_a_run_records_the_throughput_it_measured(tmp_path, random_model_dir):
    """Prefill and decode throughput, wall time, slot utilization, the cache's allocation and the peak memory are
    metrics rows of the run."""
    from test_harness import composed

    import evalkit.run.runner as runner
    from evalkit.run import validate

    spec = validate(composed(f"model.pretrained={random_model_dir}", "limit=4", "batch_size=2",
                                    "+task.generation.max_gen_toks=8", f"results_dir={tmp_path / 'r'}"),
                           method_explicit=False)
    result = runner.run(spec)
    rows = result.metrics.set_index("metric")
    assert MEASURED <= set(rows.index)
    assert (rows.loc[list(MEASURED), "value"] > 0).all() and (rows.loc[list(MEASURED), "n"] == 4).all()
    assert 0 < rows.loc["slot_utilization", "value"] <= 1
    # the cache the engine allocated: 2 slots x its reserved tokens x the bytes of a token
    per_token = result.samples["kv_bytes_reserved"].iloc[0] / result.samples["reserved_cache_tokens"].iloc[0]
    assert rows.loc["kv_cache_allocated_bytes", "value"] == 2 * result.samples["reserved_cache_tokens"].max() * per_token
    assert rows.loc["peak_rss_bytes", "value"] > 50 * 2**20  # the process with torch and a model: at least 50 MiB
    # the decode step beside its roofline: the bytes it reads (parameters + the whole static cache) over the copy
    # bandwidth measured now; a step can beat neither
    from evalkit.models import load_model

    loaded, _ = load_model(str(random_model_dir))
    parameters = sum(p.numel() * p.element_size() for p in loaded.parameters())
    assert rows.loc["decode_step_bytes", "value"] == parameters + rows.loc["kv_cache_allocated_bytes", "value"]
    assert rows.loc["decode_step_seconds_roofline", "value"] == pytest.approx(
        rows.loc["decode_step_bytes", "value"] / rows.loc["copy_bandwidth_bytes_per_s", "value"])
    assert 0 < rows.loc["decode_efficiency", "value"] < 1.5
    assert "decode_step_seconds_predicted" not in rows.index  # no conf/hardware describes a CPU
    generated = result.samples["generated_tokens"].sum()
    # decode tokens over decode time: fewer tokens than generated (each first token is the prefill's) in less time
    assert rows.loc["decode_tokens_per_s", "value"] * rows.loc["wall_seconds", "value"] >= generated - 4


def test_the_throughput_meter_splits_prefill_from_decode():
    from evalkit.memory.measure import Throughput

    meter = Throughput()
    meter.add({"prompt_tokens": 1000, "generated_tokens": 11, "prefill_seconds": 0.5})
    meter.add({"prompt_tokens": 3000, "generated_tokens": 21, "prefill_seconds": 1.5})
    meter.wall_seconds = 4.0
    assert meter.prefill_rate() == 2000.0  # 4000 prompt tokens in 2 s
    assert meter.decode_rate() == 15.0  # 30 decoded tokens in the other 2 s
    assert Throughput().rows() == []
