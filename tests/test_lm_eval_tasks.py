"""Tasks of lm-eval's own registry through `evalkit task=lm_eval task.name=...`: lm-eval's YAML of the task, its data
pointed at local files in the real schema (written here: nothing can be downloaded), and everything an evalkit run
adds (identity, tables, realized compression). Missing hub data and tasks evalkit cannot run fail in one line."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from helpers import evalkit


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture
def gsm8k_files(tmp_path):
    rows = [{"question": f"What is {i} plus {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(6)]
    return write_jsonl(tmp_path / "gsm8k_test.jsonl", rows), write_jsonl(tmp_path / "gsm8k_train.jsonl", rows[:3])


@pytest.mark.slow
def test_a_generation_task_of_lm_evals_registry_runs_with_its_own_protocol(tmp_path, random_model_dir, gsm8k_files):
    """gsm8k (lm-eval's YAML: its prompt, few-shot, stop strings, both of its filters) on local files."""
    test, train = gsm8k_files
    results = tmp_path / "results"
    result = evalkit("budget=4x", "method=streaming_llm", "task=lm_eval", "task.name=gsm8k", "task.dataset.path=json",
                     f"task.dataset.kwargs={{data_files:{{test:{test},train:{train}}}}}", "task.num_fewshot=2",
                     "task.generation.max_gen_toks=6", f"model.pretrained={random_model_dir}", "limit=3",
                     f"results_dir={results}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    samples, metrics = pd.read_parquet(results / "samples"), pd.read_parquet(results / "metrics")
    assert len(samples) == 3 and set(samples["task"]) == {"gsm8k"} and samples["doc_id"].is_unique
    assert samples["dataset_source"].str.startswith("local:sha256:").all()
    options = json.loads(samples["task_options"].iloc[0])
    assert options["source"] == "lm_eval" and options["num_fewshot"] == 2
    # Two filters, both reported as lm-eval names them; the prompt holds two shots, so it is longer than one question.
    names = set(metrics["metric"])
    assert {"exact_match,strict-match", "exact_match,flexible-extract"} <= names
    assert (samples["prompt_tokens"] > 20).all() and (samples["generated_tokens"] <= 6).all()
    assert (samples["peak_cache_tokens"] <= samples["capacity"]).all()  # StreamingLLM's fixed cache held its budget


@pytest.mark.slow
def test_a_multiple_choice_task_is_scored_against_the_compressed_context(tmp_path, random_model_dir):
    """arc_easy (log-likelihood of each choice after the compressed question): one row per choice, the choices'
    scores from the compressed cache, accuracy as lm-eval reports it."""
    rows = [{"id": f"q{i}", "question": f"Which number is larger, {i} or {i + 5}?",
             "choices": {"text": [str(i), str(i + 5), "both", "neither"], "label": ["A", "B", "C", "D"]},
             "answerKey": "B"} for i in range(4)]
    test = write_jsonl(tmp_path / "arc.jsonl", rows)
    results = tmp_path / "results"
    result = evalkit("budget=4x", "method=snapkv", "method.window=4", "task=lm_eval", "task.name=arc_easy",
                     "task.dataset.path=json", f"task.dataset.kwargs={{data_files:{{test:{test}}}}}",
                     f"model.pretrained={random_model_dir}", "limit=4", f"results_dir={results}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    samples, metrics = pd.read_parquet(results / "samples"), pd.read_parquet(results / "metrics")
    assert len(samples) == 16 and set(samples.groupby("doc_id")["repeat"].apply(tuple)) == {(0, 1, 2, 3)}
    assert {"acc", "acc_norm"} <= set(metrics[metrics["subset"] == "all"]["metric"])
    assert samples["kept_prompt_tokens"].notna().all() and (samples["method"] == "snapkv").all()


@pytest.mark.parametrize("overrides, message", [
    (["task.name=gsm8k"], "dataset openai/gsm8k cannot be loaded here"),
    (["task.name=wikitext"], "perplexity task"),
    (["task.name=gsm8kk"], "lm-eval knows no task 'gsm8kk'; did you mean gsm8k"),
    (["task.name=ruler"], "ruler is an lm-eval group; run its tasks one at a time"),
    ([], "task.name is required"),
])
def test_what_cannot_run_is_one_line_before_the_model_loads(tmp_path, overrides, message):
    results = tmp_path / "results"
    result = evalkit("task=lm_eval", *overrides, f"results_dir={results}", cwd=tmp_path)
    errors = [line for line in result.stderr.splitlines() if line.startswith("evalkit:")]
    assert result.returncode == 2 and len(errors) == 1 and message in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "Loading weights" not in result.stderr
    assert not (results / "metrics").exists()


@pytest.mark.slow
def test_ruler_builds_its_data_with_the_runs_tokenizer_and_scores_each_sample_at_its_length(tmp_path):
    """RULER's niah_single_1 (a repeated-sentence haystack: nothing to download) at a length given in the task's
    metadata, built with the run's own tokenizer as lm-eval's CLI passes it, seeded as lm-eval seeds: each sample
    scored at its own length (its subset), the lengths RULER was not asked for (its -1) leave no row."""
    results = tmp_path / "results"

    def run(*extra):
        return evalkit("budget=4x", "task=lm_eval", "task.name=niah_single_1", *extra, "limit=2",
                       f"results_dir={results}", "resume=false", cwd=tmp_path)

    for _ in range(2):
        result = run("task.metadata.max_seq_lengths=[200]")
        assert result.returncode == 0, result.stderr[-3000:]
    samples, metrics = pd.read_parquet(results / "samples"), pd.read_parquet(results / "metrics")
    assert set(samples["subset"]) == {"200"} and samples["score"].notna().all()
    scored = metrics[(metrics["subset"] == "all") & metrics["metric"].str.fullmatch(r"\d+")]
    assert set(scored["metric"]) == {"200"}  # not 4096, RULER's default that was not built
    first, second = (group.sort_values("doc_id")["target"].tolist() for _, group in samples.groupby("run_id"))
    assert first == second and len(first) == 2  # the same documents in both runs: seeded before they are built
    assert (samples["kept_prompt_tokens"] < samples["prompt_tokens"]).all()  # compressed
    result = run("task.metadata.max_seq_lengths=[100]")  # no room for the template and its 128 answer tokens
    errors = [line for line in result.stderr.splitlines() if line.startswith("evalkit:")]
    assert result.returncode == 2 and len(errors) == 1 and "could not build its data" in errors[0], result.stderr[-2000:]
