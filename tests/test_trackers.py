"""`logger=trackio` and `logger=wandb`: a run logs its config, its metrics table's values and its metrics and samples
tables to the tracker, offline, and each is read back with the tracker's own reader and compared with the run's
tables; a sweep's jobs share a group; a missing tracker is one config line; a tracker that fails costs one warning
line and never the tables (docs/trackers.md)."""

from __future__ import annotations

import json
import os
import re
import shlex
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from test_harness import composed

from evalkit.results.tables import CONFIG_COLUMNS
from evalkit.results.trackers import logger_settings
from evalkit.run import ConfigError, run, validate

DOCS = Path(__file__).resolve().parents[1] / "docs" / "trackers.md"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
# trackio's own reader (trackio.Api, its SQLite storage) in a child: trackio picks its store when it is imported.
TRACKIO_READER = """
import json, sys
import trackio
from trackio.sqlite_storage import SQLiteStorage
project = sys.argv[1]
print(json.dumps([{"name": run.name, "config": run.config, "logs": SQLiteStorage.get_logs(project, run.name,
                                                                                      run_id=run.id)}
                  for run in trackio.Api().runs(project)], default=str))
"""


def trackio_runs(store: Path, project: str = "evalkit") -> dict[str, dict]:
    """Every run of ``project`` in trackio's store ``store``, by name, as trackio's API reads it back."""
    done = subprocess.run([sys.executable, "-c", TRACKIO_READER, project], env={**ENV, "TRACKIO_DIR": str(store)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return {run["name"]: run for run in json.loads(done.stdout.strip().splitlines()[-1])}


def wandb_records(path: Path) -> list:
    """The records of a ``.wandb`` run file, each parsed with wandb's own protobuf schema (``Record``). The file is
    wandb's transaction log: a 7-byte header (``:W&B``, magic 0xBEE1, version 0), then LevelDB's log format (32 KiB
    blocks of chunks, each ``crc32 | length | type`` and its bytes; every checksum is checked here)."""
    from wandb.proto.wandb_internal_pb2 import Record

    data, block = path.read_bytes(), 32768
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0)
    records, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        chunk = data[pos + 7:pos + 7 + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"{path}: chunk at byte {pos}"
        pending = chunk if kind in (1, 2) else pending + chunk  # full, first | middle, last
        if kind in (1, 4):
            record = Record()
            record.ParseFromString(pending)
            records.append(record)
        pos += 7 + length
    return records


def wandb_run(folder: Path) -> dict:
    """An offline wandb run folder read back: its run record (project, name, group), its config and its logged
    values (nested keys joined by '|'), and the tables it logged (their files in the folder)."""
    (path,) = folder.glob("run-*.wandb")
    records = wandb_records(path)
    (meta,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {item.key: json.loads(item.value_json) for item in meta.config.update}
    for record in records:
        if record.WhichOneof("record_type") == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
    values = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            values.update({"|".join(item.nested_key) or item.key: json.loads(item.value_json)
                           for item in record.history.item})
    tables = {}
    for name in ("metrics_table", "samples_table"):
        table = json.loads((folder / "files" / values[f"{name}|path"]).read_text())
        tables[name] = [dict(zip(table["columns"], row)) for row in table["data"]]
    return {"project": meta.project, "name": meta.display_name, "group": meta.run_group, "config": config,
            "values": values, "tables": tables}


def tables_of(results_dir: Path, run_id: str) -> tuple[list[dict], list[dict]]:
    """The run's metrics and samples tables as written, row by row."""
    return tuple(pq.read_table(results_dir / name / f"{run_id}.parquet").to_pylist() for name in ("metrics", "samples"))


def expected_values(metrics: list[dict]) -> dict[str, float]:
    return {f"{row['metric']}/{row['subset']}": row["value"] for row in metrics if row["value"] is not None}


def without_config(rows: list[dict]) -> list[dict]:
    return [{key: value for key, value in row.items() if key not in CONFIG_COLUMNS} for row in rows]


def logged_run(model_dir: Path, results_dir: Path, *overrides: str):
    cfg = composed("task=kv_retrieval", "+budget=4x", "limit=3", f"model.pretrained={model_dir}",
                   f"results_dir={results_dir}", *overrides)
    return run(validate(cfg, method_explicit=False))


@pytest.fixture(scope="module")
def trackio_logged(random_model_dir, tmp_path_factory):
    results_dir = tmp_path_factory.mktemp("trackio_results")
    return logged_run(random_model_dir, results_dir, "logger=trackio"), results_dir


@pytest.fixture(scope="module")
def wandb_logged(random_model_dir, tmp_path_factory):
    results_dir = tmp_path_factory.mktemp("wandb_results")
    return logged_run(random_model_dir, results_dir, "logger=wandb", "logger.group=budgets"), results_dir


def test_trackio_holds_the_runs_config_metric_values_and_samples(trackio_logged):
    result, results_dir = trackio_logged
    metrics, samples = tables_of(results_dir, result.run_id)
    runs = trackio_runs(results_dir / "trackio")
    assert list(runs) == [result.run_id]
    logged = runs[result.run_id]
    assert logged["config"]["_Group"] is None  # a single run: no group
    assert {key: logged["config"][key] for key in CONFIG_COLUMNS} == {key: metrics[0][key] for key in CONFIG_COLUMNS}
    (step,) = logged["logs"]
    values = expected_values(metrics)
    assert {"exact_match/all", "kv_bytes_peak_mean/all", "peak_rss_bytes/all", "decode_tokens_per_s/all"} <= set(values)
    assert {key: step[key] for key in values} == values  # scores and measured costs, exactly
    assert step["metrics_table"]["_value"] == without_config(metrics)
    assert len(samples) == 3 and step["samples_table"]["_value"] == without_config(samples)


def test_wandb_offline_run_file_holds_the_runs_config_metric_values_and_samples(wandb_logged):
    result, results_dir = wandb_logged
    metrics, samples = tables_of(results_dir, result.run_id)
    (folder,) = (results_dir / "wandb").glob("offline-run-*")
    logged = wandb_run(folder)
    assert (logged["project"], logged["name"], logged["group"]) == ("evalkit", result.run_id, "budgets")
    assert {key: logged["config"][key] for key in CONFIG_COLUMNS} == {key: metrics[0][key] for key in CONFIG_COLUMNS}
    values = expected_values(metrics)
    assert {"exact_match/all", "kv_bytes_peak_mean/all", "peak_rss_bytes/all", "decode_tokens_per_s/all"} <= set(values)
    assert {key: logged["values"][key] for key in values} == pytest.approx(values, rel=1e-12)
    assert logged["values"]["samples_table|nrows"] == len(samples) == 3
    assert logged["tables"]["samples_table"] == without_config(samples)
    assert logged["tables"]["metrics_table"] == without_config(metrics)


@pytest.mark.parametrize("tracker", ["trackio", "wandb"])
def test_a_missing_tracker_is_one_config_line_before_the_model_loads(tracker, tmp_path):
    hidden = (f"import sys; sys.modules[{tracker!r}] = None; sys.argv = ['evalkit', 'logger={tracker}', "
              f"'results_dir={tmp_path / 'r'}']; from evalkit.cli import main\ntry:\n    main()\nfinally:\n"
              "    print('torch loaded' if 'torch' in sys.modules else 'no torch')")
    done = subprocess.run([sys.executable, "-c", hidden], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip() == (f"evalkit: config error: logger={tracker} needs {tracker}, which is not installed: "
                                   f"pip install 'evalkit[{tracker}]'")
    assert done.stdout.strip() == "no torch" and not (tmp_path / "r").exists()


@pytest.mark.slow
def test_a_run_without_a_tracker_neither_imports_nor_needs_one(random_model_dir, tmp_path):
    code = ("import sys; sys.modules['trackio'] = sys.modules['wandb'] = None  # their import fails, as uninstalled\n"
            "from evalkit.config import compose\nfrom evalkit.run import run, validate\n"
            f"cfg = compose('task=kv_retrieval', 'limit=1', 'model.pretrained={random_model_dir}', "
            f"'results_dir={tmp_path / 'r'}')\n"
            "print(len(run(validate(cfg, method_explicit=False)).samples))")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "1" and "logged to" not in done.stdout
    assert not {"trackio", "wandb"} & {path.name for path in (tmp_path / "r").iterdir()}


def test_a_tracker_failing_at_log_time_is_one_warning_and_leaves_the_tables(random_model_dir, tmp_path, capfd):
    (tmp_path / "in_the_way").write_text("a file where trackio's store goes")
    result = logged_run(random_model_dir, tmp_path / "results", "logger=trackio",
                        f"logger.dir={tmp_path / 'in_the_way' / 'store'}")
    lines = [line for line in capfd.readouterr().err.splitlines() if "logger=trackio" in line]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"evalkit: WARNING: logger=trackio: run {result.run_id} was not logged (")
    assert lines[0].endswith("); its tables are written")
    metrics, samples = tables_of(tmp_path / "results", result.run_id)
    assert len(samples) == 3 and expected_values(metrics) == expected_values(result.metrics.to_dict("records"))
    assert not (tmp_path / "results" / ".progress").exists()  # the run finished as any other


def test_logger_settings_are_checked_and_stay_out_of_the_config_digest():
    from evalkit.run.digest import config_digest

    plain = validate(composed("task=kv_retrieval", "+budget=4x"), method_explicit=False)
    tracked = validate(composed("task=kv_retrieval", "+budget=4x", "logger=wandb", "logger.project=kv"),
                       method_explicit=False)
    assert plain.logger is None and (tracked.logger.name, tracked.logger.project) == ("wandb", "kv")
    assert config_digest(plain) == config_digest(tracked)  # the same run, logged or not
    for section, message in (({"name": "mlflow"}, "logger must be none, trackio or wandb, got 'mlflow'"),
                             ({"name": "trackio", "entity": "me"}, "logger=trackio has no setting 'entity'"),
                             ({"name": "wandb", "project": ""}, "logger.project must be a name"),
                             ({"name": "wandb", "group": 3}, "logger.group must be a name or null")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            logger_settings(section)
    assert logger_settings({"name": "none"}) is None


# -- the commands of docs/trackers.md, as a user runs them -----------------------------------------------------------
def docs_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", DOCS.read_text(), flags=re.S)


@pytest.fixture(scope="module")
def documented(tmp_path_factory):
    """Every bash command of docs/trackers.md run in one folder (evalkit's with limit=2), then its Python snippet;
    TMPDIR is the folder's tmp/, where a sweep's Hydra folder (its group's name) is made."""
    cwd = tmp_path_factory.mktemp("documented")
    env = {**ENV, "TMPDIR": str(cwd / "tmp")}
    (cwd / "tmp").mkdir()
    outputs = {}
    commands = [line.strip() for block in docs_blocks("bash") for line in block.splitlines() if line.strip()]
    for command in commands:
        argv = shlex.split(command)
        program = [sys.executable, "-m", "evalkit.cli"] if argv[0] == "evalkit" else [str(Path(sys.executable).parent
                                                                                          / argv[0])]
        done = subprocess.run([*program, *argv[1:], *(["limit=2"] if argv[0] == "evalkit" else [])], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, (command, done.stderr[-3000:])
        outputs[command] = done.stdout + done.stderr
    (snippet,) = docs_blocks("python")
    done = subprocess.run([sys.executable, "-c", snippet], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return cwd, commands, outputs, done.stdout


@pytest.mark.slow
def test_the_documented_commands_log_group_and_read_back(documented):
    cwd, commands, outputs, printed = documented
    assert [c.split()[0] for c in commands] == ["evalkit", "evalkit", "evalkit", "wandb"]
    metrics = pq.read_table(cwd / "results" / "metrics").to_pylist()
    scores = {row["run_id"]: row["value"] for row in metrics if (row["metric"], row["subset"]) == ("exact_match", "all")}
    samples = pq.read_table(cwd / "results" / "samples").to_pylist()
    assert len(scores) == 4  # trackio: one run, then a sweep of two; wandb: one
    runs = trackio_runs(cwd / "results" / "trackio")
    assert len(runs) == 3
    lines = sorted(printed.strip().splitlines())
    expected = sorted(f"{runs[name]['config']['_Group']} {name} {scores[name]} "
                      f"{sum(row['run_id'] == name for row in samples)}" for name in runs)
    assert lines == expected  # the snippet prints each trackio run: group, name, score, samples
    (folder,) = (cwd / "results" / "wandb").glob("offline-run-*")
    assert wandb_run(folder)["name"] in set(scores) - set(runs)
    assert f"run-{folder.name.rsplit('-', 1)[1]}.wandb" in outputs["wandb sync --dry-run results/wandb"]


@pytest.mark.slow
def test_a_sweeps_jobs_land_in_one_group_named_after_it(documented):
    cwd, _, _, _ = documented
    (sweep,) = (cwd / "tmp" / "evalkit-multirun").iterdir()  # the sweep's Hydra folder
    runs = trackio_runs(cwd / "results" / "trackio").values()
    groups = sorted((run["config"]["_Group"] or "", run["config"]["budget"]) for run in runs)
    assert groups == [("", "4x"), (sweep.name, "2x"), (sweep.name, "3x")]
