"""Mistakes on evalkit's lm-eval surfaces are one line, exit status 2, nothing written: a bad `--model_args` of
`lm_eval --model evalkit` (checked before the model loads; a mistake found after it, by evalkit's exception hook).
lm-eval's own errors stay lm-eval's."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from evalkit.paths import tasks_dir


def one_error_line(stderr: str) -> str:
    errors = [line for line in stderr.splitlines() if line.startswith("evalkit:")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return errors[0]


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
    pytest.param(f"{MODEL},method=snapstream,budget=4x,windw=8", "did you mean window?", marks=pytest.mark.slow),
    pytest.param(f"{MODEL},method=snapstream", "config error: method=snapstream needs a budget", marks=pytest.mark.slow),
    pytest.param("method=snapstream,budget=4x", "config error: give either pretrained=", marks=pytest.mark.slow),
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
