"""A run's identity (what skip and resume compare), and mistakes that end in one line, exit 2 and nothing written."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time

import pytest
import torch
from helpers import evalkit, interrupted_run
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from test_benchmarks import longbench_rows, write_jsonl
from test_harness import composed

import evalkit.compression as ec
from evalkit.core.identity import fingerprint, source_identity
from evalkit.core.paths import conf_dir
from evalkit.results import read_table
from evalkit.run import (
    InvalidCombination,
    config_digest,
    identify,
    validate,
)


@pytest.fixture(scope="module")
def other_model_dir(random_model_dir, tmp_path_factory):
    """The same architecture and tokenizer as random_model_dir, other weights: only the content differs."""
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("other_model")
    shutil.copytree(random_model_dir, path, dirs_exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        model.lm_head.weight.mul_(-1)
    model.save_pretrained(path)
    return path


def spec_with(*overrides: str):
    return validate(composed(*overrides), method_explicit=False)


# -- identity ------------------------------------------------------------------------------------------------------
def test_digest_covers_the_model_the_data_and_stays_put(random_model_dir, other_model_dir, tmp_path):
    a = spec_with("+budget=4x", f"model.pretrained={random_model_dir}")
    b = spec_with("+budget=4x", f"model.pretrained={other_model_dir}")
    again = spec_with("+budget=4x", f"model.pretrained={random_model_dir}")
    assert config_digest(a) != config_digest(b) and config_digest(a) == config_digest(again)
    assert a.identity["model_source"].startswith("local:sha256:") and a.identity["device_class"] == "cpu"
    # A dataset file whose content changes under the same path is another run.
    data = write_jsonl(tmp_path / "lb.jsonl", longbench_rows())
    first = config_digest(spec_with("task=longbench_v2", f"task.dataset.path={data}"))
    write_jsonl(data, longbench_rows()[::-1])  # same size, same path
    second = spec_with("task=longbench_v2", f"task.dataset.path={data}")
    assert first != config_digest(second)
    assert second.identity["dataset_source"].startswith("local:sha256:")


def test_digest_covers_policy_and_speculative_prefill_settings():
    assert config_digest(spec_with("+budget=4x", "method.gqa_reduce=max")) != config_digest(spec_with("+budget=4x"))
    base = ["method=spec_prefill", "method.draft_model=builtin:kv_retrieval_tiny"]
    assert config_digest(spec_with(*base, "method.pool_kernel=5")) != config_digest(spec_with(*base))
    assert identify(spec_with(*base))["draft_source"].startswith("local:sha256:")


def test_fingerprint_reads_content_not_names(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "w.bin").write_bytes(b"\x00" * 1000)
    before = fingerprint([tmp_path / "a"])
    (tmp_path / "a" / "w.bin").write_bytes(b"\x00" * 999 + b"\x01")  # same size, same name
    assert fingerprint([tmp_path / "a"]) != before
    assert source_identity("org/model").startswith("hub:org/model@")


@pytest.mark.parametrize("age_s", [0, 60], ids=["same-second", "old-and-cached"])
def test_a_rewrite_with_the_same_size_and_modification_time_is_seen(tmp_path, monkeypatch, age_s):
    """A data file rewritten in place with its size and modification time kept (as ``cp -p`` or an unpacked archive
    leave it), within the same second or long after the first hash was cached: the fingerprint changes."""
    monkeypatch.setenv("EVALKIT_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "data.jsonl"
    data.write_text('{"answer": "A"}\n')
    stamp = data.stat().st_mtime_ns - age_s * 10**9
    os.utime(data, ns=(stamp, stamp))
    if age_s:  # the file's change time is what lets the cache keep its hash: make it old too
        real_time = time.time
        monkeypatch.setattr(time, "time", lambda: real_time() + 2 * age_s)
    before = fingerprint([data])
    inode = data.stat().st_ino
    with open(data, "r+") as handle:  # in place: same inode
        handle.write('{"answer": "B"}\n')
    os.utime(data, ns=(stamp, stamp))
    assert (data.stat().st_ino, data.stat().st_size, data.stat().st_mtime_ns) == (inode, 16, stamp)
    assert fingerprint([data]) != before


@pytest.mark.slow
def test_runs_differing_only_in_the_model_never_share_state(tmp_path, random_model_dir, other_model_dir):
    results = tmp_path / "results"
    common = ["task=kv_retrieval", "limit=3", f"results_dir={results}"]
    first = evalkit(*common, f"model.pretrained={random_model_dir}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    other = evalkit(*common, f"model.pretrained={other_model_dir}", cwd=tmp_path)
    assert other.returncode == 0 and "skipped" not in other.stdout, other.stdout[-2000:]
    metrics = read_table(results, "metrics")
    assert metrics["run_id"].nunique() == 2 and metrics["model_source"].nunique() == 2
    assert metrics["config_digest"].nunique() == 2
    again = evalkit(*common, f"model.pretrained={other_model_dir}", cwd=tmp_path)
    assert again.returncode == 0 and "skipped" in again.stdout


# -- one-line errors -----------------------------------------------------------------------------------------------
def error_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("evalkit:")]


def assert_one_line_error(result, tmp_path, *fragments):
    assert result.returncode == 2, result.stderr[-2000:]
    (line,) = error_lines(result)
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in line, line
    assert not (tmp_path / "results").exists()


def test_missing_model_path(tmp_path):
    result = evalkit("model.pretrained=/no/such/model", f"results_dir={tmp_path / 'results'}", cwd=tmp_path)
    assert_one_line_error(result, tmp_path, "model.pretrained", "/no/such/model does not exist")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_cuda_without_cuda(tmp_path):
    result = evalkit("device=cuda", f"results_dir={tmp_path / 'results'}", cwd=tmp_path)
    assert_one_line_error(result, tmp_path, "device=cuda", "CUDA is not available")


def test_unwritable_results_dir_is_found_before_loading(tmp_path):
    (tmp_path / "a_file").write_text("")
    result = evalkit(f"results_dir={tmp_path / 'a_file' / 'results'}", cwd=tmp_path)
    assert_one_line_error(result, tmp_path, "results_dir", "not writable")
    assert "Loading weights" not in result.stderr  # nothing was loaded


@pytest.mark.parametrize("content, fragments", [
    ('{"_id": "a"}\n{broken\n', ["bad.jsonl: line 2: not valid JSON"]),
    ("[1, 2]", ["bad.jsonl", "expected a list of JSON objects"]),
])
def test_malformed_data_file(tmp_path, content, fragments):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    result = evalkit("task=longbench_v2", f"task.dataset.path={path}", f"results_dir={tmp_path / 'results'}", cwd=tmp_path)
    assert_one_line_error(result, tmp_path, *fragments)
    assert "Loading weights" not in result.stderr


def bad_longbench(tmp_path):
    rows = longbench_rows()
    rows.insert(1, dict(rows[0], _id="lb-bad", question=7))
    rows.append(dict(rows[0], _id="lb-worse", answer="E"))
    return write_jsonl(tmp_path / "lb.jsonl", rows)


def test_bad_row_names_file_row_and_field(tmp_path):
    path = bad_longbench(tmp_path)
    result = evalkit("task=longbench_v2", f"task.dataset.path={path}", f"results_dir={tmp_path / 'results'}", cwd=tmp_path)
    assert_one_line_error(result, tmp_path, "lb.jsonl: row 2 (_id=lb-bad): field 'question': must be a string, got int")


@pytest.mark.slow
def test_bad_rows_can_be_counted_and_skipped(tmp_path, random_model_dir):
    path, results = bad_longbench(tmp_path), tmp_path / "results"
    result = evalkit("task=longbench_v2", f"task.dataset.path={path}", "bad_rows=skip", f"model.pretrained={random_model_dir}",
                     "task.generation.max_gen_toks=2", f"results_dir={results}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    metrics, samples = read_table(results, "metrics"), read_table(results, "samples")
    skipped = metrics[metrics["metric"] == "rows_skipped"]
    assert skipped["value"].tolist() == [2.0] and len(samples) == 2
    assert set(samples["sample_id"]) == {"lb-1", "lb-2"} and (metrics["bad_rows"] == "skip").all()


@pytest.mark.slow
def test_ctrl_c_keeps_generations_and_the_restart_resumes(tmp_path, random_model_dir):
    results = tmp_path / "results"
    args = ["task=kv_retrieval", f"model.pretrained={random_model_dir}", "limit=40", "batch_size=1",
            "+task.generation.max_gen_toks=96", "task.truncation=left", f"results_dir={results}"]
    process, stderr, lines = interrupted_run(args, results, tmp_path, signal.SIGINT)
    assert process.returncode == 130, stderr[-2000:]
    kept = len(lines)
    (line,) = [line for line in stderr.splitlines() if line.startswith("evalkit:") and "WARNING" not in line]
    assert line == f"evalkit: interrupted: {kept} generations kept; run the same command again to resume"
    assert "Traceback" not in stderr and not (results / "metrics").exists()
    again = evalkit(*args, cwd=tmp_path)
    assert again.returncode == 0 and f"resuming: {kept} generations already done" in again.stdout
    assert len(read_table(results, "samples")) == 40


# -- every preset's grid ---------------------------------------------------------------------------------------------
def sweep_jobs(preset: str) -> list[list[str]]:
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose("config", overrides=[f"+experiment={preset}"], return_hydra_config=True)
    params = OmegaConf.to_container(cfg.hydra.sweeper.params, resolve=True)
    jobs = [[]]
    for key, values in params.items():
        jobs = [job + [f"{key}={value}"] for job in jobs for value in str(values).split(",")]
    return jobs


# Overrides no config interpolates: each job's config is one composition of its other overrides with these set on it
# (values typed by Hydra's own parser), which is what Hydra composes for the job.
SCALAR_OVERRIDES = ("budget", "kv_bits", "compression_scope", "task.mode")


def job_configs(preset: str, chosen=lambda job: True):
    """Every job of ``preset``'s sweep (those ``chosen``) and its composed config, composing once per choice of the
    other overrides."""
    import copy

    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser, composed_once = OverridesParser.create(), {}
    for job in filter(chosen, sweep_jobs(preset)):
        rest = tuple(o for o in job if o.split("=", 1)[0] not in SCALAR_OVERRIDES)
        if rest not in composed_once:
            composed_once[rest] = composed(f"+experiment={preset}", *rest)
        cfg = copy.deepcopy(composed_once[rest])
        for override in job:
            if override.split("=", 1)[0] in SCALAR_OVERRIDES:
                parsed = parser.parse_override(override)
                *path, key = parsed.key_or_group.split(".")
                node = cfg
                for part in path:
                    node = node[part]
                node[key] = parsed.value()
        yield job, cfg


def test_a_job_config_is_what_hydra_composes_for_it():
    for preset, one in (("reasoning_grid", {"task=math500", "method=snapstream"}),
                        ("ruler_grid", {"model.max_context=4096", "method=snapkv"})):
        jobs = list(job_configs(preset, lambda job, one=one: one <= set(job)))
        assert len(jobs) == 8  # every budget, with each value of the other scalar override
        for job, cfg in jobs:
            assert cfg == composed(f"+experiment={preset}", *job), job


# baselines_grid's 111 jobs are validated, and counted, by test_baselines_grid_is_the_paper_grid_with_every_method.
# The two largest grids (scbench_grid's 576 jobs, leaderboard_small's 648: 35-56 s) in the slow tier.
HEAVY_PRESETS = ("leaderboard_small", "scbench_grid")


@pytest.mark.parametrize("preset", [
    pytest.param(p, marks=pytest.mark.slow) if p in HEAVY_PRESETS else p
    for p in sorted(p.stem for p in (conf_dir() / "experiment").glob("*.yaml") if p.stem != "baselines_grid")])
def test_every_job_of_every_preset_validates(preset):
    valid, pairings = 0, 0
    for _, cfg in job_configs(preset):
        try:
            spec = validate(cfg, method_explicit=True)
            valid += 1
            assert spec.task and spec.policy is not None
        except InvalidCombination:  # full with a budget, a compressing method without one: skipped by design
            pairings += 1
    assert valid >= 4 and pairings <= valid, (preset, valid, pairings)


@pytest.mark.slow
def test_quick_grid_runs_every_job(tmp_path, random_model_dir):
    results = tmp_path / "results"
    result = evalkit("-m", "+experiment=quick_grid", f"model.pretrained={random_model_dir}", "limit=2",
                     f"results_dir={results}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = read_table(results, "metrics").drop_duplicates("run_id")
    skips = [line for line in result.stdout.splitlines() if "skipped in this sweep" in line]
    assert len(runs) == len(sweep_jobs("quick_grid")) - len(skips) == 7
    assert all("needs a budget" in line or "takes no budget" in line for line in skips)  # pairings only
    assert json.loads(runs["task_options"].iloc[0]) == {}


@pytest.mark.slow
def test_the_kvpress_leaderboard_grid_runs_offline_one_row_per_method_and_ratio(tmp_path):
    """SmolLM2 on the needle task (the preset's defaults), every method x kvpress' four ratios and the full cache once:
    one metrics table per run, each method's 4x and 8x rows really compressed (7 min 32 s on 2 cores)."""
    results = tmp_path / "results"
    result = evalkit("-m", "+experiment=kvpress_leaderboard", "limit=1", f"results_dir={results}", cwd=tmp_path,
                     timeout=1800)
    assert result.returncode == 0, result.stderr[-3000:]
    jobs = sweep_jobs("kvpress_leaderboard")
    methods = {job[0].split("=")[1] for job in jobs} - {"full"}
    ratios = {job[1].split("=")[1] for job in jobs} - {"none"}
    metrics = read_table(results, "metrics")
    runs = metrics.drop_duplicates("run_id")
    assert len(runs) == 1 + len(methods) * len(ratios)
    assert set(zip(runs["method"], runs["budget"].fillna("none"))) == {("full", "none")} | {
        (method, ratio) for method in methods for ratio in ratios}
    saving = metrics[metrics["metric"] == "memory_ratio_mean"].set_index(["method", "budget"])["value"]
    for method in methods:
        assert saving[(method, "4x")] > 1.5 and saving[(method, "8x")] > 3, method


def test_baselines_grid_is_the_paper_grid_with_every_method():
    """Every method x budget of the grid validated on one of its three tasks (which pairs exist does not depend on
    the task; every_job_of_every_preset validates the other presets' tasks whole)."""
    jobs = sweep_jobs("baselines_grid")
    valid = 0
    for _, cfg in job_configs("baselines_grid", lambda job: job[0] == "task=aime24"):
        try:
            spec = validate(cfg, method_explicit=True)
        except InvalidCombination:
            continue
        valid += 1
        assert spec.model_name == "llama31_8b_instruct"
    methods = {job[1].split("=")[1] for job in jobs}
    assert methods == set(ec.POLICIES)  # every method the harness knows
    budgetless = sum(not ec.POLICIES[m].takes_budget for m in methods)  # full, simlayerkv, ...: once per task
    assert {job[0] for job in jobs} == {"task=longbench_v2", "task=aime24", "task=livecodebench"}
    assert len(jobs) == 3 * len(methods) * 4  # 3 tasks x every method x none, 2x, 4x, 8x
    assert valid == budgetless + (len(methods) - budgetless) * 3  # no-budget methods once, every other one x 3 budgets
