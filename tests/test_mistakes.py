"""Mistakes that used to look like success: typos in settings, weights that do not match their config, data with
duplicate ids, unequal columns or no tests. Each is now one line, exit 2 and nothing written (the CLI as users run it)."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers import evalkit
from test_benchmarks import lcb_rows, longbench_rows, write_jsonl
from test_trust import assert_one_line_error

from evalkit.benchmark.data import DataError, checked_rows, load_rows


@pytest.mark.parametrize("override, fragments", [
    ("+foo=1", ["unknown setting foo", "known: bad_rows, batch_size"]),
    ("+limt=2", ["unknown setting limt: did you mean limit?"]),
    ("+model.max_contxt=3", ["unknown setting model.max_contxt: did you mean model.max_context?"]),
    ("+task.repeat=3", ["unknown setting task.repeat: did you mean task.repeats?"]),
    ("+memory.enforse=true", ["unknown setting memory.enforse: did you mean memory.enforce?"]),
    ("resume=maybe", ["resume must be true or false, got 'maybe'"]),
    ("model.apply_chat_template=sometimes", ["model.apply_chat_template must be true or false"]),
    ("+task.generation.max_gen_toks=-1", ["task.generation.max_gen_toks must be a positive integer or null, got -1"]),
    ("+task.dataset.path=2024", ["unknown setting task.dataset.path"]),  # kv_retrieval builds its data
])
def test_a_setting_that_is_unknown_or_mistyped_is_one_line(tmp_path, override, fragments):
    result = evalkit(override, f"results_dir={tmp_path / 'results'}", cwd=tmp_path)
    assert_one_line_error(result, tmp_path, *fragments)


def test_a_method_parameter_typo_names_the_nearest_one(tmp_path):
    result = evalkit("+budget=4x", "method=snapkv", "+method.windw=8", f"results_dir={tmp_path / 'results'}", cwd=tmp_path)
    assert_one_line_error(result, tmp_path, "unknown setting method.windw: did you mean method.window?")


@pytest.fixture
def broken_models(random_model_dir, tmp_path):
    """Copies of a saved model: one whose config asks for a layer its weights lack, one with a truncated weights
    file, one whose weights file is random bytes."""
    made = {}
    for name in ("more_layers", "truncated", "noise"):
        made[name] = shutil.copytree(random_model_dir, tmp_path / name)
    config = json.loads((made["more_layers"] / "config.json").read_text())
    config["num_hidden_layers"] += 1
    (made["more_layers"] / "config.json").write_text(json.dumps(config))
    weights = next(made["truncated"].glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    next(made["noise"].glob("*.safetensors")).write_bytes(bytes(range(256)) * 20)
    return made


@pytest.mark.parametrize("name, fragments", [
    ("more_layers", ["do not match its config", "missing weight(s) (model.layers."]),
    ("truncated", ["model.safetensors: not a readable safetensors file"]),
    ("noise", ["model.safetensors: not a readable safetensors file"]),
])
def test_weights_that_do_not_match_or_cannot_be_read_stop_the_run(broken_models, tmp_path, name, fragments):
    result = evalkit(f"model.pretrained={broken_models[name]}", "limit=2", f"results_dir={tmp_path / 'results'}",
                     cwd=tmp_path)
    assert_one_line_error(result, tmp_path, str(broken_models[name]), *fragments)


def test_successful_runs_print_nothing_from_git_outside_a_checkout(tmp_path, random_model_dir):
    result = evalkit(f"model.pretrained={random_model_dir}", "limit=2", f"results_dir={tmp_path / 'results'}",
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "fatal" not in result.stderr and "not a git repository" not in result.stderr


def test_duplicate_longbench_ids_are_a_data_error_or_skipped_and_counted(tmp_path):
    rows = longbench_rows()
    rows.append(dict(rows[0], question="Another question about the same id?"))
    path = write_jsonl(tmp_path / "lb.jsonl", rows)
    result = evalkit("task=longbench_v2", f"task.dataset.path={path}", f"results_dir={tmp_path / 'results'}", cwd=tmp_path)
    assert_one_line_error(result, tmp_path, "lb.jsonl: row 3 (_id=lb-1): field '_id': duplicate id 'lb-1' (first at row 1)")
    from evalkit.benchmark import data
    from evalkit.tasks.longbench_v2 import longbench

    with data.collecting_skipped_rows() as skipped:
        kept = checked_rows(load_rows(str(path)), str(path), longbench.check_row, "skip", id_field="_id")
    assert [r["_id"] for r in kept] == ["lb-1", "lb-2"] and len(skipped) == 1


def test_a_livecodebench_problem_without_tests_is_a_data_error(tmp_path):
    rows = lcb_rows()
    rows[0] = dict(rows[0], public_test_cases="[]", private_test_cases="[]")
    path = write_jsonl(tmp_path / "lcb.jsonl", rows)
    result = evalkit("task=livecodebench", f"task.dataset.path={path}", f"results_dir={tmp_path / 'results'}",
                     cwd=tmp_path)
    assert_one_line_error(result, tmp_path, "lcb.jsonl", "question_id=abc001_a", "no tests at all")


@pytest.mark.parametrize("content, fragment", [
    ('{"_id": ["a", "b"], "question": ["q"]}', "columns of unequal length (_id: 2, question: 1)"),
    ("7", "expected a list of JSON objects"),
    ('[{"_id": "a"}, 3]', "expected a list of JSON objects"),
])
def test_malformed_json_layouts_are_named(tmp_path, content, fragment):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(DataError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        load_rows(str(path))


# -- a results folder that runs out of room -------------------------------------------------------------------------
_FULL_DISK = r"""
set -u
results=$1; out=$2; shift 2
mount -t tmpfs -o size=1m tmpfs "$results" || exit 99
"$@" limit=2 > "$out/a.out" 2> "$out/a.err"; echo $? > "$out/a.rc"
free=$(python3 -c "import os, sys; s = os.statvfs(sys.argv[1]); print(s.f_bavail * s.f_frsize)" "$results")
head -c $((free - 4096)) /dev/zero > "$results/filler" 2>/dev/null
"$@" limit=6 > "$out/b.out" 2> "$out/b.err"; echo $? > "$out/b.rc"
cp -a "$results" "$out/after_full"
rm "$results/filler"
"$@" limit=6 > "$out/c.out" 2> "$out/c.err"; echo $? > "$out/c.rc"
cp -a "$results" "$out/after_room"
"""


def _check_full_disk_outcome(out, results, reason):
    """The run that met the limit: one line naming the file and the reason, exit 2; the earlier run's tables intact,
    the progress file valid; with room again the same command finishes with each sample once."""
    import pandas as pd

    from evalkit.results import read_table
    from evalkit.results.progress import Progress

    assert (out / "a.rc").read_text().strip() == "0", (out / "a.err").read_text()[-2000:]
    assert (out / "b.rc").read_text().strip() == "2", (out / "b.err").read_text()[-2000:]
    (line,) = [line for line in (out / "b.err").read_text().splitlines() if line.startswith("evalkit:")]
    assert "Traceback" not in (out / "b.err").read_text()
    assert line.startswith(f"evalkit: error: {results}/") and reason in line and "intact" in line, line
    full = out / "after_full"
    assert len(read_table(full, "metrics")["run_id"].unique()) == 1 and len(read_table(full, "samples")) == 2
    for progress in (full / ".progress").glob("*.jsonl"):
        lines = progress.read_text().splitlines()
        assert len(Progress(progress).done) >= len(lines) - 1  # at most the line the full disk cut short
    assert (out / "c.rc").read_text().strip() == "0", (out / "c.err").read_text()[-2000:]
    samples = pd.read_parquet(out / "after_room" / "samples")
    assert sorted(samples.groupby("run_id").size().tolist()) == [2, 6]
    assert samples.groupby("run_id")["doc_id"].apply(lambda ids: ids.is_unique).all()


@pytest.mark.slow
@pytest.mark.skipif(not shutil.which("unshare"), reason="needs util-linux unshare")
def test_a_full_disk_is_one_line_and_loses_nothing(tmp_path, random_model_dir):
    import os
    import subprocess
    import sys

    results, out = tmp_path / "results", tmp_path / "out"
    results.mkdir()
    out.mkdir()
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True)
    if probe.returncode:
        pytest.skip("no unprivileged mount namespace to make a small filesystem in")
    command = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", _FULL_DISK, "full-disk", str(results),
               str(out), sys.executable, "-m", "evalkit.cli", f"model.pretrained={random_model_dir}",
               "+task.generation.max_gen_toks=8", f"results_dir={results}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    _check_full_disk_outcome(out, results, "No space left on device")


@pytest.mark.slow
def test_a_file_size_limit_is_one_line_and_loses_nothing(tmp_path, random_model_dir):
    """Under a file-size limit (``ulimit -f``) the tables cannot be written (EFBIG): the same outcome as a full disk."""
    import os
    import resource
    import subprocess
    import sys

    out = tmp_path / "out"
    out.mkdir()
    common = [sys.executable, "-m", "evalkit.cli", f"model.pretrained={random_model_dir}",
              "+task.generation.max_gen_toks=8", f"results_dir={tmp_path / 'results'}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "EVALKIT_CACHE": str(tmp_path / "cache")}

    def step(name, limit, fsize=None):
        def limited():
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

        done = subprocess.run([*common, f"limit={limit}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600, preexec_fn=limited if fsize else None)
        (out / f"{name}.rc").write_text(str(done.returncode))
        (out / f"{name}.err").write_text(done.stderr)
        if name != "a":
            shutil.copytree(tmp_path / "results", out / ("after_full" if name == "b" else "after_room"))

    step("a", 2)
    step("b", 6, fsize=3000)  # progress lines fit, a table does not
    step("c", 6)
    _check_full_disk_outcome(out, tmp_path / "results", "File too large")


def test_a_sweep_skips_a_group_option_that_does_not_exist_and_runs_the_others(tmp_path, random_model_dir):
    from evalkit.results import read_table

    results = tmp_path / "results"
    done = evalkit("-m", "method=nosuch,snapkv", "+budget=4x", f"model.pretrained={random_model_dir}", "limit=2",
                   "+task.generation.max_gen_toks=4", f"results_dir={results}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("evalkit: skipped")]
    assert "method=nosuch" in line and "Available options in 'method'" in line and "snapkv" in line
    assert set(read_table(results, "metrics")["method"]) == {"snapkv"}
    none_left = evalkit("-m", "method=nosuch,nope", "+budget=4x", f"results_dir={tmp_path / 'other'}", cwd=tmp_path)
    assert none_left.returncode == 2 and "no option of method in this sweep exists" in none_left.stderr
    assert not (tmp_path / "other").exists()


@pytest.mark.parametrize("method_args, cli_args", [
    ("method=snapkv,budget=4x,window=0", ["method=snapkv", "+budget=4x", "method.window=0"]),
    ("method=snapkv,budget=4x,windw=8", ["method=snapkv", "+budget=4x", "+method.windw=8"]),
    ("method=snapkv", ["method=snapkv", "~budget"]),
])
def test_a_bad_method_value_reads_alike_through_lm_eval_and_the_cli(tmp_path, random_model_dir, method_args, cli_args):
    """`lm_eval --model evalkit --model_args method=...` builds its policy as the evalkit CLI does
    (:func:`evalkit.run.spec.policy_from_config`): the same mistake, the same one line."""
    from evalkit.core.errors import ConfigError
    from evalkit.lm import EvalkitLM

    result = evalkit(*cli_args, f"model.pretrained={random_model_dir}", "model.max_context=256",
                     f"results_dir={tmp_path / 'results'}", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    with pytest.raises(ConfigError) as refused:
        EvalkitLM.create_from_arg_string(f"pretrained={random_model_dir},max_context=256,device=cpu,{method_args}")
    assert "\n" not in str(refused.value) and str(refused.value) in result.stderr
    assert_one_line_error(result, tmp_path, str(refused.value))
