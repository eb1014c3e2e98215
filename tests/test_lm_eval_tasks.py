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
    pytest.param(["task.name=wikitext"], "perplexity task", marks=pytest.mark.slow),
    pytest.param(["task.name=gsm8kk"], "lm-eval knows no task 'gsm8kk'; did you mean gsm8k", marks=pytest.mark.slow),
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


@pytest.mark.slow
def test_a_group_runs_its_tasks_together_with_each_task_a_subset_and_the_groups_aggregate(tmp_path):
    """kormedmcqa (an lm-eval group of four generation tasks, aggregated by exact_match weighted by size), its data
    pointed at one local file in its schema for all four: one run, each task's rows under its name, the group's
    aggregate as lm-eval defines it."""
    rows = [{"question": f"Which is {i}?", "A": str(i), "B": "x", "C": "y", "D": "z", "E": "w", "answer": 1}
            for i in range(4)]
    data = write_jsonl(tmp_path / "kormedmcqa.jsonl", rows)
    results = tmp_path / "results"
    result = evalkit("budget=4x", "task=lm_eval", "task.name=kormedmcqa", "task.dataset.path=json",
                     f"task.dataset.kwargs={{data_files:{{test:{data}}}}}", "task.generation.max_gen_toks=4",
                     "limit=2", f"results_dir={results}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    samples, metrics = pd.read_parquet(results / "samples"), pd.read_parquet(results / "metrics")
    members = ["kormedmcqa_doctor", "kormedmcqa_nurse", "kormedmcqa_pharm", "kormedmcqa_dentist"]
    assert sorted(samples["subset"]) == sorted(members * 2) and set(samples["task"]) == {"kormedmcqa"}
    per_task = metrics[metrics["subset"].isin(members) & (metrics["metric"] == "exact_match")]
    assert len(per_task) == 4 and set(per_task["n"]) == {2}
    (group,) = metrics[(metrics["subset"] == "all") & (metrics["metric"] == "exact_match")].itertuples()
    assert group.n == 8 and group.value == pytest.approx(samples["score"].mean())
    assert samples["kept_prompt_tokens"].notna().all()


def test_group_rows_aggregate_as_lm_eval_defines_it():
    """The group's aggregate over its tasks' rows: weighted by size (the mean over all documents) or not (the mean of
    the tasks' means), with lm-eval's pooled or unweighted standard error; a task without the metric (a RULER length
    it did not build) is left out."""
    from lm_eval.api.metrics import pooled_sample_stderr

    from evalkit.results.rows import group_rows

    scores = {"a": [1.0, 0.0, 1.0, 1.0], "b": [0.0, 0.0]}

    def task(name):
        values = scores[name]
        mean = sum(values) / len(values)
        stderr = (sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values)) ** 0.5
        return ({"acc,none": mean, "acc_stderr,none": stderr},
                [{"doc_id": i, "doc": {"id": f"{name}{i}"}, "target": "t", "resps": [["x"]], "filtered_resps": ["x"],
                  "acc": v} for i, v in enumerate(values)])

    built = {name: task(name) for name in scores}
    results = {"results": {n: r for n, (r, _) in built.items()}, "samples": {n: s for n, (_, s) in built.items()},
               "configs": {n: {"metric_list": [{"metric": "acc"}]} for n in scores}}
    for by_size, expected in ((True, 3 / 6), (False, (3 / 4 + 0) / 2)):
        metrics, samples = group_rows(results, ["a", "b"], {}, {}, [{"metric": "acc", "weight_by_size": by_size}])
        (row,) = [m for m in metrics if m["subset"] == "all" and m["metric"] == "acc"]
        assert row["value"] == pytest.approx(expected) and row["n"] == 6
        assert sorted(s["subset"] for s in samples) == ["a"] * 4 + ["b"] * 2
        assert {m["subset"] for m in metrics if m["metric"] == "acc"} == {"a", "b", "all"}
    stderrs = [results["results"][n]["acc_stderr,none"] for n in scores]
    (weighted,) = [m for m in group_rows(results, ["a", "b"], {}, {}, [{"metric": "acc"}])[0]
                   if m["subset"] == "all" and m["metric"] == "acc"]
    assert weighted["stderr"] == pytest.approx(pooled_sample_stderr(stderrs, [4, 2]))
    results["results"]["b"] = {"acc,none": -1.0}
    hooks = {"b": {"metric_applies": lambda name, value: value != -1.0}}
    (only_a,) = [m for m in group_rows(results, ["a", "b"], {}, hooks, [{"metric": "acc"}])[0]
                 if m["subset"] == "all" and m["metric"] == "acc"]
    assert only_a["value"] == pytest.approx(3 / 4) and only_a["n"] == 4


def test_rulers_prompts_say_where_their_context_ends():
    """For compression_scope=context: in every RULER template of the installed lm-eval (niah in both wordings, vt, cwe,
    fwe, qa) the context ends right before its question (given out of band); the prompt is RULER's own."""
    import importlib

    from evalkit.benchmark.registry import family_hooks
    from evalkit.lm.prompts import context_end

    hooks = family_hooks("ruler")
    assert "doc_to_text" not in hooks  # RULER's own prompt
    question = hooks["doc_to_question"]
    templates = {"niah": importlib.import_module("lm_eval.tasks.ruler.niah_utils").TEMPLATE}
    for name in ("vt", "cwe", "fwe", "qa"):
        pytest.importorskip("wonderwords")
        config = importlib.import_module(f"lm_eval.tasks.ruler.{name}_utils").CONFIG
        templates[name] = config.get("variable_tracking", config)["template"]
    one = templates["niah"].replace("Some", "A").replace("are all", "is").replace("are", "is")  # prepare_niah's
    for name, template in {**templates, "niah_one": one}.items():
        text = template.format(context="CONTEXT-BODY", query="QUERY", type_needle_v="numbers", num_v=1)
        end = context_end(text, question({"input": text}))
        head, tail = text[:end], text[end:]
        assert head.rstrip().endswith("CONTEXT-BODY") and "CONTEXT-BODY" not in tail, name
        assert "{query}" not in template or "QUERY" in tail, name  # the question follows the context's end


class FakeIndex:
    """Stands in for lm-eval's TaskManager (ten seconds to build); module level, so that it pickles."""

    built: list = []

    def __init__(self):
        FakeIndex.built.append(1)
        self.task_index = {"gsm8k": "entry"}


def test_lm_evals_index_is_built_once_and_then_read_from_disk(tmp_path, monkeypatch):
    """The index of lm-eval's tasks is built on first use and kept under EVALKIT_CACHE; later processes read it; a
    damaged file is built again."""
    import lm_eval.tasks

    from evalkit.benchmark import registry

    built = FakeIndex.built
    built.clear()
    monkeypatch.setenv("EVALKIT_CACHE", str(tmp_path))
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", FakeIndex)
    registry.index.cache_clear()
    try:
        assert registry.index().task_index == {"gsm8k": "entry"} and len(built) == 1
        (kept,) = (tmp_path / "lm_eval_index").glob("*.pkl")
        registry.index.cache_clear()  # a new process
        assert registry.index().task_index == {"gsm8k": "entry"} and len(built) == 1
        kept.write_bytes(b"not a pickle")
        registry.index.cache_clear()
        assert registry.index().task_index == {"gsm8k": "entry"} and len(built) == 2
        assert not list((tmp_path / "lm_eval_index").glob("*.tmp"))
    finally:
        registry.index.cache_clear()


def test_two_installs_of_the_same_lm_eval_keep_their_own_index(tmp_path, monkeypatch):
    """The index holds its tasks' file paths: a second environment with the same release and the same files (a wheel
    keeps their times) has its own, not one whose paths point into the first, which may be gone."""
    import os

    from evalkit.benchmark import registry

    monkeypatch.setenv("EVALKIT_CACHE", str(tmp_path / "cache"))
    for env in ("one", "two"):
        task = tmp_path / env / "lm_eval" / "tasks" / "gsm8k" / "gsm8k.yaml"
        task.parent.mkdir(parents=True)
        task.write_text("task: gsm8k\n")
        os.utime(task, ns=(1_700_000_000_000_000_000,) * 2)
    first, second = (registry.index_file(tmp_path / env / "lm_eval" / "tasks", "0.4.13") for env in ("one", "two"))
    assert first != second and first.parent == second.parent == tmp_path / "cache" / "lm_eval_index"
    assert registry.index_file(tmp_path / "one" / "lm_eval" / "tasks", "0.4.13") == first  # the same install: kept
    (tmp_path / "one" / "lm_eval" / "tasks" / "gsm8k" / "gsm8k.yaml").write_text("task: gsm8k  \n")
    assert registry.index_file(tmp_path / "one" / "lm_eval" / "tasks", "0.4.13") != first  # a changed file: built again
