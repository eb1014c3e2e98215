"""Errors that were not clean: each is evalkit's one line, first on stderr, with the exit status of a mistake (2).
`evalkit-report push`'s refusals and `export`'s argument mistakes; a library's log line ahead of evalkit's line about
a bad data file; lm-eval's lines ahead of evalkit's under `lm_eval --model evalkit`; `from evalkit.lm import
load_model`, a name of the earlier layout."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers import evalkit
from test_lm_eval_mistakes import MODEL, lm_eval

from evalkit.results import cli, hub


# -- evalkit-report export / push ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("main, argv, line", [
    (cli.main, ["export"], "evalkit-report export: the following arguments are required: format, results_dir, --out "
                           "(evalkit-report export --help shows the arguments)"),
    (cli.main, ["export", "csv", "results", "--out", "x"], "evalkit-report export: argument format: invalid choice: "
                                                           "'csv' (choose from kvpress)"),
    (hub.main, [], "evalkit-report push: the following arguments are required: repo (evalkit-report push --help shows "
                   "the arguments)"),
])
def test_a_subcommands_argument_mistake_is_one_line_without_the_usage(capsys, main, argv, line):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    stderr = capsys.readouterr().err
    assert stderr.splitlines()[0].startswith(line.split(" (")[0]) and len(stderr.splitlines()) == 1, stderr
    assert "usage:" not in stderr


def test_push_without_a_hub_login_is_one_line_exit_2(tmp_path):
    env = {key: value for key, value in os.environ.items() if key not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")}
    result = subprocess.run([sys.executable, "-c", "from evalkit.results.cli import main; main()", "push", "me/x",
                             str(tmp_path)], env={**env, "HF_HOME": str(tmp_path / "hf")}, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == ["evalkit-report push: not logged in to the Hugging Face Hub: run `hf auth "
                                          "login` (or set HF_TOKEN)"]


# -- a library's log line on the terminal ---------------------------------------------------------------------------------
CAPTURED = """
import logging, sys
from pathlib import Path
from evalkit.core.console import libraries_to_log
assert "datasets" not in sys.modules  # imported, as in a run, while the run's output goes to its log
with libraries_to_log(Path(sys.argv[1])):
    logging.getLogger("datasets.packaged_modules.json.json").error("Failed to load JSON from file 'bad.jsonl'")
print("evalkit: error: data: bad.jsonl: line 2: not valid JSON", file=sys.stderr)
"""


def test_a_library_imported_while_the_run_logs_writes_to_the_log_not_the_terminal(tmp_path):
    log = tmp_path / "run.log"
    result = subprocess.run([sys.executable, "-c", CAPTURED, str(log)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == ["evalkit: error: data: bad.jsonl: line 2: not valid JSON"]
    assert "Failed to load JSON from file 'bad.jsonl'" in log.read_text()


@pytest.mark.slow(reason="a fresh interpreter imports torch, transformers and lm-eval (~15 s)")
def test_a_bad_local_file_of_an_lm_eval_task_is_evalkits_line_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("EVALKIT_TESTS_FRESH_PROCESS", "1")  # datasets not imported before the run starts
    data = tmp_path / "gsm8k_test.jsonl"
    data.write_text('{"question": "What is 1 plus 1?", "answer": "#### 2"}\n{"question": \n')
    result = evalkit("budget=4x", "task=lm_eval", "task.name=gsm8k", "task.dataset.path=json",
                     f"task.dataset.kwargs={{data_files:{{test:{data}}}}}", "limit=2",
                     f"results_dir={tmp_path / 'results'}", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"evalkit: error: data: {data}: line 2: not valid JSON (Expecting value)"]


# -- lm_eval --model evalkit -----------------------------------------------------------------------------------------------
def test_the_model_args_check_that_runs_as_lm_evals_command_starts():
    """What the plugin checks before lm-eval's first line (the model's arguments, then its limits from its config);
    through lm-eval's command line below."""
    from evalkit.core.errors import ConfigError, RunError
    from evalkit.lm.plugin import check_model_args

    check_model_args({"pretrained": "builtin:kv_retrieval_tiny", "max_context": 256, "method": "snapkv", "budget": "2x"})
    check_model_args("pretrained=builtin:kv_retrieval_tiny,method=gear,budget=2x,group_size=64")  # max_context: 512
    with pytest.raises(ConfigError, match="^--model_args foo: evalkit's model has no such setting"):
        check_model_args({"pretrained": "builtin:kv_retrieval_tiny", "foo": 1})
    with pytest.raises(ConfigError, match="^model.max_context=1024 is more than the 512 positions"):
        check_model_args({"pretrained": "builtin:kv_retrieval_tiny", "max_context": 1024})
    with pytest.raises(ConfigError, match=r"^method.group_size=48 must divide this model's kv_heads \* head_dim = 128"):
        check_model_args("pretrained=builtin:kv_retrieval_tiny,method=gear,budget=2x,group_size=48")
    with pytest.raises(RunError, match="^model /no/such/model: no such file or folder$"):
        check_model_args({"pretrained": "/no/such/model"})


@pytest.mark.slow(reason="lm-eval's command line starts (~10 s)")
def test_bad_model_args_are_the_only_line_before_lm_evals_own(tmp_path):
    result = lm_eval(tmp_path, f"{MODEL},method=snapstream,budget=4x,foo=1")
    assert result.returncode == 2
    first, *rest = [line for line in result.stderr.splitlines() if line.strip()]
    assert first.startswith("evalkit: config error: --model_args foo: evalkit's model has no such setting"), \
        result.stderr[-2000:]
    assert not any("[evaluator" in line or "[_cli" in line or "[config" in line for line in rest), result.stderr


@pytest.mark.slow(reason="lm-eval's command line starts (~10 s a case)")
@pytest.mark.parametrize("model_args, message", [
    ("pretrained=builtin:kv_retrieval_tiny,max_context=1024",
     "evalkit: config error: model.max_context=1024 is more than the 512 positions model builtin:kv_retrieval_tiny"),
    (f"{MODEL},method=gear,budget=2x,group_size=48",
     "evalkit: config error: method.group_size=48 must divide this model's kv_heads * head_dim = 128"),
])
def test_the_models_limits_are_checked_before_its_weights_load_under_lm_eval(tmp_path, model_args, message):
    result = lm_eval(tmp_path, model_args)
    assert result.returncode == 2 and result.stderr.strip().splitlines()[0].startswith(message), result.stderr[-2000:]
    assert "Loading weights" not in result.stderr and not (tmp_path / "out").exists()


# -- a name of the earlier layout -------------------------------------------------------------------------------------------
def test_load_model_still_imports_from_evalkit_lm_naming_its_place():
    import evalkit.models

    with pytest.warns(DeprecationWarning, match=r"^evalkit.lm.load_model is now evalkit.models.load_model"):
        from evalkit.lm import load_model
    assert load_model is evalkit.models.load_model
    with pytest.raises(ImportError, match="cannot import name 'no_such_name' from 'evalkit.lm'"):
        from evalkit.lm import no_such_name  # noqa: F401
