"""The hostile inputs of the trust round, each answered in one line with exit 2 and nothing written (or counted and
skipped where the protocol skips): impossible task options (checked against each task's declared dataset options
before anything loads), bad rows (checked against its declared row fields as they load), prompts and sessions too
long for the model's context (refused unless truncation is asked for, then counted on the terminal and in the
metrics)."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from tests.helpers import evalkit
from tests.test_trust import assert_one_line_error

KV_FILE = "tests/fixtures/scbench/scbench_kv.jsonl"


def refused(tmp_path, *args, fragments=()):
    results = tmp_path / "results"
    result = evalkit(*args, f"results_dir={results}", cwd=tmp_path)
    assert_one_line_error(result, tmp_path, *fragments)
    assert not results.exists() or not any(results.rglob("*")), sorted(results.rglob("*"))
    return result


@pytest.mark.parametrize("args, fragments", [
    (["task=needle", "task.dataset.lengths=[0]"], ["task.dataset.lengths must be a non-empty list of integers >= 64"]),
    (["task=needle", "task.dataset.lengths=[-100]"], ["task.dataset.lengths", "got [-100]"]),
    (["task=needle", "model=gemma3_270m", "task.dataset.lengths=[0]"], ["task.dataset.lengths"]),
    (["task=needle_multiturn", "task.dataset.lengths=[0]"], ["task.dataset.lengths"]),
    (["task=needle_multiturn", "task.mode=multi_request", "task.dataset.lengths=[0]"], ["task.dataset.lengths"]),
    (["task=needle_multiturn", "task.mode=multi_turn", "task.dataset.lengths=[-100]"], ["task.dataset.lengths"]),
    (["task=needle_multiturn", "task.dataset.per_length=0"], ["task.dataset.per_length must be a positive integer"]),
    (["task=needle_multiturn", "task.dataset.per_length=-1"], ["task.dataset.per_length", "got -1"]),
    (["task=scbench_kv", "task.dataset.lengths=[]"], ["task.dataset.lengths", "got []"]),
    (["task=scbench_kv", "task.dataset.n_sessions=1.5"], ["task.dataset.n_sessions must be a positive integer, got 1.5"]),
    (["task=scbench_kv", "task.dataset.source=file", f"task.dataset.path=$ROOT/{KV_FILE}", "task.dataset.turns=0"],
     ["task.dataset.turns must be a positive integer, got 0"]),
    (["task=scbench_kv", "task.dataset.source=file", f"task.dataset.path=$ROOT/{KV_FILE}", "task.dataset.turns=-1"],
     ["task.dataset.turns", "got -1"]),
    (["task=needle", "task.dataset.lengths=abc"], ["task.dataset.lengths", "got 'abc'"]),
    (["task=needle", "+task.dataset.length=[1000]"], ["unknown setting task.dataset.length: did you mean task.dataset.lengths?"]),
    (["task=needle", "task.truncation=sideways"], ["task.truncation must be one of left, middle or null"]),
    (["task=needle", "task.dataset.depths=[0.5,nan]"], ["task.dataset.depths"]),
    (["task=aime24", "task.dataset.path=2024"], ["task.dataset.path must be non-empty text, got 2024"]),
    (["task=needle_multiturn", "task.mode=multi_turn", "task.truncation=left"],
     ["task.truncation=left takes no effect with task.mode=multi_turn: a session is never cut"]),
    (["method=snapkv", "budget=4x", "method.window=null"], ["window"]),
])
def test_an_impossible_option_is_one_line_before_anything_loads(tmp_path, args, fragments):
    from pathlib import Path

    root = str(Path(__file__).parents[1])
    refused(tmp_path, *[a.replace("$ROOT", root) for a in args], fragments=fragments)


def _kv_rows(path, answers, context="JSON data:\n{\"a1\": \"b1\", \"a2\": \"b2\"}"):
    rows = [{"id": i, "context": context, "multi_turns": [{"input": f"Key: \"a{i}\"", "answer": answer}]}
            for i, answer in enumerate(answers)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _mf_rows(path, answer):
    rows = [{"id": 0, "context": [3, 1, 2], "multi_turns": [{"input": "The largest number of the list is: ", "answer": 3}]},
            {"id": 1, "context": [5, 9, 4], "multi_turns": [{"input": "The largest number of the list is: ", "answer": 0}]}]
    text = "".join(json.dumps(row) + "\n" for row in rows).replace('"answer": 0}', f'"answer": {answer}}}')
    path.write_text(text)
    return path


FIT = ["task.generation.max_gen_toks=8"]  # the built-in model's 256-token context holds these short sessions


def test_an_empty_gold_answer_is_refused_naming_the_row_or_skipped_and_counted(tmp_path):
    data = _kv_rows(tmp_path / "kv.jsonl", ["b0", ""])
    refused(tmp_path, "task=scbench_kv", "task.dataset.source=file", f"task.dataset.path={data}", *FIT,
            fragments=[str(data), "row 2", "session_id=1", "field 'answer'", "got ''"])
    results = tmp_path / "skipping"
    result = evalkit("task=scbench_kv", "task.dataset.source=file", f"task.dataset.path={data}", *FIT, "bad_rows=skip",
                     f"results_dir={results}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    metrics = pd.read_parquet(results / "metrics")
    assert metrics.set_index("metric")["value"]["rows_skipped"] == 1.0
    assert len(pd.read_parquet(results / "samples")) == 1


@pytest.mark.parametrize("answer", ["NaN", "Infinity", "-Infinity"])
def test_a_number_answer_that_is_not_finite_is_refused(tmp_path, answer):
    data = _mf_rows(tmp_path / "mf.jsonl", answer)
    refused(tmp_path, "task=scbench_mf", "task.dataset.source=file", f"task.dataset.path={data}", *FIT,
            fragments=[str(data), "row 2", "field 'target'", "finite number"])


def _long_kv(path, tokens: int):
    """One session whose context is about ``tokens`` tokens of real prose (4 characters each)."""
    import pydoc_data.topics

    prose = " ".join(pydoc_data.topics.topics.values())[: tokens * 4]
    return _kv_rows(path, ["b0"], context=f"JSON data:\n{prose}")


def test_a_prompt_too_long_is_refused_by_default_and_cut_only_when_asked_then_counted(tmp_path):
    data = _long_kv(tmp_path / "long.jsonl", 3000)
    args = ["task=scbench_kv", "task.dataset.source=file", f"task.dataset.path={data}", *FIT]
    result = refused(tmp_path, *args, fragments=["1 of 1 prompts of task scbench_kv do not fit the 256-token context",
                                                  "task.truncation=left or middle", "model.max_context="])
    assert "load:" in result.stdout  # found once the prompts are tokenized, before any generation
    results = tmp_path / "cut"
    result = evalkit(*args, "task.truncation=left", f"results_dir={results}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "1 of 1 prompts of task scbench_kv were cut to fit the 256-token context (truncation left)" in result.stderr
    metrics = pd.read_parquet(results / "metrics").set_index("metric")["value"]
    assert metrics["prompts_truncated"] == 1.0
    assert pd.read_parquet(results / "samples")["truncated"].tolist() == [True]


def test_a_small_valid_file_is_not_refused_by_generated_lengths(tmp_path):
    """The declared lengths size generated data only: a file of short sessions runs on the 256-token model."""
    data = _kv_rows(tmp_path / "kv.jsonl", ["b0", "b1"])
    result = evalkit("task=scbench_kv", "task.dataset.source=file", f"task.dataset.path={data}", *FIT,
                     "task.dataset.lengths=[100000]", f"results_dir={tmp_path / 'results'}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize("mode", ["multi_request", "multi_turn"])
def test_a_session_too_long_is_refused_before_anything_generates_and_leaves_nothing(tmp_path, mode):
    data = _long_kv(tmp_path / "long.jsonl", 3000)
    result = refused(tmp_path, "task=scbench_kv", "task.dataset.source=file", f"task.dataset.path={data}", *FIT,
                     f"task.mode={mode}", fragments=["1 of 1 sessions of task scbench_kv need more positions than the "
                                                      "256-token context", "a session is never cut"])
    assert "%|" not in result.stderr  # no progress bar was started


@pytest.mark.slow
def test_a_40k_token_scbench_context_on_a_2k_model(tmp_path):
    """The issue's own case: a 40k-token SCBench context on SmolLM2 (2,048 tokens), task.mode=single."""
    data = _long_kv(tmp_path / "long.jsonl", 40000)
    args = ["task=scbench_kv", "model=smollm2_135m_instruct", "task.dataset.source=file", f"task.dataset.path={data}",
            "task.generation.max_gen_toks=8"]
    refused(tmp_path, *args, fragments=["1 of 1 prompts of task scbench_kv do not fit the 2048-token context"])
    results = tmp_path / "cut"
    result = evalkit(*args, "task.truncation=middle", f"results_dir={results}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "were cut to fit the 2048-token context (truncation middle)" in result.stderr
    assert pd.read_parquet(results / "metrics").set_index("metric")["value"]["prompts_truncated"] == 1.0

