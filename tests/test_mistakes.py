"""Mistakes that used to look like success: typos in settings, weights that do not match their config, data with
duplicate ids, unequal columns or no tests. Each is now one line, exit 2 and nothing written (the CLI as users run it)."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers import evalkit
from test_benchmarks import lcb_rows, longbench_rows, write_jsonl
from test_trust import assert_one_line_error

from evalkit.scoring.data import DataError, checked_rows, load_rows


@pytest.mark.parametrize("override, fragments", [
    ("+foo=1", ["unknown setting foo", "known: bad_rows, batch_size"]),
    ("+limt=2", ["unknown setting limt: did you mean limit?"]),
    ("+model.max_contxt=3", ["unknown setting model.max_contxt: did you mean model.max_context?"]),
    ("+task.repeat=3", ["unknown setting task.repeat: did you mean task.repeats?"]),
    ("+memory.enforse=true", ["unknown setting memory.enforse: did you mean memory.enforce?"]),
    ("resume=maybe", ["resume must be true or false, got 'maybe'"]),
    ("model.apply_chat_template=sometimes", ["model.apply_chat_template must be true or false"]),
    ("+task.generation.max_gen_toks=-1", ["task.generation.max_gen_toks must be a positive integer, got -1"]),
    ("+task.dataset.path=2024", ["task.dataset.path must be a path or a hub id (text), got 2024"]),
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
    from evalkit.scoring import data, longbench

    data.skipped_rows.clear()
    kept = checked_rows(load_rows(str(path)), str(path), longbench.check_row, "skip", id_field="_id")
    assert [r["_id"] for r in kept] == ["lb-1", "lb-2"] and len(data.skipped_rows) == 1


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
