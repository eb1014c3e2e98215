"""Every run also writes lm-eval's own result files (results_<date>.json, samples_<task>_<date>.jsonl); read back the
way lm-eval reads its own files, they hold the scores of the run's metrics table and the samples of its samples
table, with evalkit's columns beside lm-eval's keys."""

from __future__ import annotations

from pathlib import Path

import pytest
from lm_eval.utils import (
    get_file_datetime,
    get_file_task_name,
    get_latest_filename,
    get_results_filenames,
    get_sample_results_filenames,
    hash_string,
    sanitize_model_name,
)
from test_harness import composed

from evalkit.run import run, validate


def load_json(path: Path, tmp_path: Path):
    """A results or samples file as lm-eval's dataset card loads it (``load_dataset("json", ...)``)."""
    from datasets import load_dataset

    return load_dataset("json", data_files=str(path), split="train", cache_dir=str(tmp_path / "datasets"))


@pytest.fixture(scope="module")
def finished(random_model_dir, tmp_path_factory):
    results_dir = tmp_path_factory.mktemp("results")
    cfg = composed("task=kv_retrieval", "+budget=4x", "limit=3", f"model.pretrained={random_model_dir}",
                   f"results_dir={results_dir}")
    return run(validate(cfg, method_explicit=False)), results_dir


def test_lm_evals_readers_find_the_runs_results_and_samples(finished, random_model_dir, tmp_path):
    result, results_dir = finished
    folder = results_dir / "lm_eval" / result.run_id
    listing = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())  # as a results repo lists
    results_files, sample_files = get_results_filenames(listing), get_sample_results_filenames(listing)
    assert len(listing) == 2 and len(results_files) == len(sample_files) == 1
    model_folder = sanitize_model_name(str(random_model_dir))  # lm-eval's folder for pretrained=<that path>
    assert Path(results_files[0]).parent.name == Path(sample_files[0]).parent.name == model_folder
    assert get_latest_filename(results_files) == results_files[0]
    assert get_file_task_name(Path(sample_files[0]).name) == "kv_retrieval"
    assert get_file_datetime(Path(sample_files[0]).name) + ".json" == get_file_datetime(Path(results_files[0]).name)

    aggregated = load_json(folder / results_files[0], tmp_path)[0]
    metrics = result.metrics[result.metrics["subset"] == "all"].set_index("metric")
    scores = aggregated["results"]["kv_retrieval"]
    assert scores["exact_match,none"] == metrics.loc["exact_match", "value"]
    assert scores["exact_match_stderr,none"] == pytest.approx(metrics.loc["exact_match", "stderr"])
    assert aggregated["n-samples"]["kv_retrieval"]["effective"] == 3
    assert aggregated["model_source"] == aggregated["config"]["model"] == "evalkit"
    assert aggregated["model_name"] == str(random_model_dir) and aggregated["model_name_sanitized"] == model_folder
    assert aggregated["config"]["model_args"]["budget"] == "4x" and aggregated["config"]["model_args"]["method"] == "snapstream"
    assert aggregated["versions"]["kv_retrieval"] == 1.0 and aggregated["configs"]["kv_retrieval"]["task"] == "kv_retrieval"

    samples = load_json(folder / sample_files[0], tmp_path).to_list()
    table = result.samples.set_index("doc_id")
    assert sorted(s["doc_id"] for s in samples) == sorted(table.index) == [0, 1, 2]
    for sample in samples:
        row = table.loc[sample["doc_id"]]
        assert sample["filtered_resps"] == [row["prediction"]] and sample["target"] == row["target"]
        assert sample["exact_match"] == row["score"]
        assert sample["prompt_hash"] == hash_string(sample["arguments"]["gen_args_0"]["arg_0"])  # lm-eval's own hash
        (ours,) = sample["evalkit"]  # one request per document (no repeats): its columns of the samples table
        for column in ("prompt_tokens", "generated_tokens", "kept_prompt_tokens", "kv_bytes_peak", "kv_bytes_full"):
            assert ours[column] == row[column], column
        assert ours["kept_prompt_tokens"] < ours["prompt_tokens"]  # compressed for real at 4x
    hashes = "".join(s["doc_hash"] + s["prompt_hash"] + s["target_hash"] for s in samples)
    assert aggregated["task_hashes"]["kv_retrieval"] == hash_string(hashes)


def test_a_failure_to_write_them_is_one_line_and_leaves_the_tables(random_model_dir, tmp_path, capfd):
    from evalkit.results import read_table

    results_dir = tmp_path / "results"
    results_dir.mkdir()
    (results_dir / "lm_eval").write_text("in the way")  # a file where the folder goes
    cfg = composed("task=kv_retrieval", "limit=2", f"model.pretrained={random_model_dir}", f"results_dir={results_dir}")
    result = run(validate(cfg, method_explicit=False))
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if "lm-eval's result files" in line]
    assert len(lines) == 1 and lines[0].startswith("evalkit: WARNING: lm-eval's result files were not written:")
    assert str(results_dir / "lm_eval") in lines[0] and "Could not save" not in err  # why, once
    assert len(read_table(results_dir, "samples")) == 2 and result.run_id in set(read_table(results_dir, "metrics")["run_id"])
