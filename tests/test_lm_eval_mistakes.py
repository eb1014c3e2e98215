"""Mistakes on evalkit's two lm-eval surfaces are one line, exit status 2, nothing written: a task of lm-eval's registry
whose local data file is malformed or empty (`evalkit task=lm_eval task.dataset.path=json ...`), and a bad
`--model_args` of `lm_eval --model evalkit` (checked before the model loads; a mistake found after it, by evalkit's
exception hook). lm-eval's own errors stay lm-eval's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from helpers import evalkit

from evalkit.core.paths import tasks_dir


def one_error_line(stderr: str) -> str:
    errors = [line for line in stderr.splitlines() if line.startswith("evalkit:")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return errors[0]


# -- evalkit task=lm_eval: the task's local data files ----------------------------------------------------------------
@pytest.mark.parametrize("text, message", [
    ('{"question": "What is 1 plus 1?", "answer": "#### 2"}\n{"question": \n', "line 2: not valid JSON"),
    ("", "empty: no rows"),
])
def test_a_malformed_or_empty_data_file_is_one_line_naming_it(tmp_path, text, message):
    data = tmp_path / "gsm8k_test.jsonl"
    data.write_text(text)
    results = tmp_path / "results"
    result = evalkit("budget=4x", "task=lm_eval", "task.name=gsm8k", "task.dataset.path=json",
                     f"task.dataset.kwargs={{data_files:{{test:{data}}}}}", "limit=2", f"results_dir={results}",
                     cwd=tmp_path)
    line = one_error_line(result.stderr)
    assert result.returncode == 2 and str(data) in line and message in line, result.stderr[-2000:]
    assert "Loading weights" not in result.stderr and not results.exists()


def test_the_local_file_problem_names_the_file_and_what_is_wrong(tmp_path):
    from datasets.exceptions import DatasetGenerationError

    from evalkit.tasks.lm_eval.local_files import problem

    good, bad, blank = tmp_path / "good.jsonl", tmp_path / "bad.jsonl", tmp_path / "blank.jsonl"
    good.write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    bad.write_text(good.read_text() + "[1, 2]\n")
    blank.write_text("\n\n")
    assert problem({"data_files": {"train": str(good), "test": [str(bad)]}}) == \
        f"{bad}: line 2: a row must be a JSON object, got list"
    assert problem({"data_files": str(tmp_path / "b*.jsonl")}) == f"{bad}: line 2: a row must be a JSON object, got list"
    assert problem({"data_files": {"test": str(blank)}}) == f"{blank}: empty: no rows"
    # Files that read: datasets' own failure on them is its first cause, with the files; any other error is not theirs.
    try:
        try:
            raise TypeError("column 'answer' changed from number to string in row 1")
        except TypeError as cause:
            raise DatasetGenerationError("An error occurred while generating the dataset") from cause
    except DatasetGenerationError as error:
        assert problem({"data_files": str(good)}, error) == \
            f"{good}: datasets could not read them: column 'answer' changed from number to string in row 1"
    assert problem({"data_files": str(good)}, ValueError("not the data's")) is None
    assert problem({"data_files": str(tmp_path / "missing.jsonl")}, StopIteration()) is None  # no file here
    assert problem(None) is None and problem({"path": "openai/gsm8k"}) is None


# -- lm_eval --model evalkit --model_args ... --------------------------------------------------------------------------
MODEL = "pretrained=builtin:kv_retrieval_tiny,max_context=256"


def lm_eval(tmp_path, model_args: str, *, tasks: str = "kv_retrieval") -> subprocess.CompletedProcess:
    executable = shutil.which("lm_eval", path=os.path.dirname(sys.executable))
    assert executable, "lm-eval's CLI is not installed beside this python"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([executable, "--model", "evalkit", "--model_args", model_args, "--device", "cpu",
                           "--include_path", str(tasks_dir()), "--tasks", tasks, "--limit", "2",
                           "--output_path", str(tmp_path / "out")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("model_args, message", [
    (f"{MODEL},method=snapstream,budget=4x,foo=1",
     "config error: --model_args foo: evalkit's model has no such setting; the model's are apply_chat_template,"),
    pytest.param(f"{MODEL},method=snapstream,budget=removed_1.5",
                 "config error: budget 'removed_1.5' removes every token", marks=pytest.mark.slow),
    pytest.param(f"{MODEL},method=snapstream,budget=4x,kv_bits=3",
                 "config error: --model_args kv_bits: evalkit's model has no such setting;", marks=pytest.mark.slow),
    pytest.param(f"{MODEL},method=snapstream,budget=4x,windw=8", "unknown setting method.windw: did you mean method.window?",
                 marks=pytest.mark.slow),
    pytest.param(f"{MODEL},method=snapstream", "config error: method=snapstream needs a budget", marks=pytest.mark.slow),
    pytest.param("method=snapstream,budget=4x", "config error: give either pretrained=", marks=pytest.mark.slow),
    pytest.param("pretrained=/no/such/model", "error: model /no/such/model: no such file or folder",
                 marks=pytest.mark.slow),
])
def test_bad_model_args_are_evalkits_one_line_before_the_model_loads(tmp_path, model_args, message):
    result = lm_eval(tmp_path, model_args)
    line = one_error_line(result.stderr)
    assert result.returncode == 2 and message in line, result.stderr[-2000:]
    assert "Loading weights" not in result.stderr and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_mistake_found_after_the_model_loads_is_one_line_too(tmp_path):
    """A removed_R budget on a method whose cache has a fixed size is refused as the policy is built, after the weights
    load: the exception hook says it."""
    result = lm_eval(tmp_path, f"{MODEL},method=snapstream,budget=removed_0.5")
    line = one_error_line(result.stderr)
    assert result.returncode == 2 and "snapstream keeps a cache of a fixed size" in line, result.stderr[-2000:]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_lm_evals_own_errors_stay_lm_evals(tmp_path):
    result = lm_eval(tmp_path, f"{MODEL},method=snapstream,budget=4x", tasks="no_such_task")
    assert result.returncode == 1 and "Tasks not found: no_such_task" in result.stderr, result.stderr[-2000:]
    assert "Traceback" in result.stderr and not any(line.startswith("evalkit:") for line in result.stderr.splitlines())
