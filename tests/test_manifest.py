"""A run is finished by its manifest (``manifests/<run_id>.json``, written last): a samples table that still reads as
Parquet but lost rows (deleted, rewritten with none, cut to 2 of its 4) is no finished run. The same command runs the
config again naming the table, its files moved to ``damaged/``; every reader refuses the folder in one line. A folder
written before manifests existed reads as before and gains one at its next resume. One real run (4 documents) is made
once and copied per test."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
from helpers import evalkit

from evalkit.results import cli, hub, metrics_table, samples_table, write_table
from evalkit.results.tables import load_table, read_table
from evalkit.run.results_dir import set_aside_damaged

RUN = ["task=kv_retrieval", "method=full", "limit=4"]
RUN_FILES = (("samples", ".parquet"), ("metrics", ".parquet"), ("csv/samples", ".csv"), ("csv/metrics", ".csv"),
             ("manifests", ".json"))


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("manifest") / "results"
    result = evalkit(*RUN, f"results_dir={folder}", cwd=folder.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    return folder


@pytest.fixture
def results(made, tmp_path) -> Path:
    return Path(shutil.copytree(made, tmp_path / "results"))


def the(results: Path, folder: str = "samples", suffix: str = ".parquet") -> Path:
    (path,) = (results / folder).glob(f"*{suffix}")
    return path


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def again(results: Path):
    return evalkit(*RUN, f"results_dir={results}", cwd=results.parent)


def evalkit_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("evalkit:")]


def deleted(path: Path) -> str:
    path.unlink()
    return "missing: its run wrote it with 4 rows"


def rewritten_empty(path: Path) -> str:
    pq.write_table(pq.read_table(path).slice(0, 0), path)
    return "short: 0 of the 4 rows its run wrote"


def cut_to_two(path: Path) -> str:
    pq.write_table(pq.read_table(path).slice(0, 2), path)
    return "short: 2 of the 4 rows its run wrote"


LOSSES = [deleted, rewritten_empty, cut_to_two]


def test_a_run_records_every_file_it_wrote_in_its_manifest_written_last(made):
    run_id = the(made).stem
    path = made / "manifests" / f"{run_id}.json"
    document = json.loads(path.read_text())
    assert document["run_id"] == run_id and document["origin"] == "run"
    assert set(document["tables"]) == {f"{folder}/{run_id}{suffix}" for folder, suffix in RUN_FILES[:4]}
    rows = {"samples": 4, "metrics": len(pd.read_parquet(made / "metrics" / f"{run_id}.parquet"))}
    for name, record in document["tables"].items():
        table = made / name
        assert record["sha256"] == hashlib.sha256(table.read_bytes()).hexdigest()
        assert record["bytes"] == table.stat().st_size and record["rows"] == rows[table.parent.name]
        assert table.stat().st_mtime_ns <= path.stat().st_mtime_ns
    lm_eval = sorted(str(p.relative_to(made)) for p in (made / "lm_eval" / run_id).rglob("*") if p.is_file())
    assert sorted(document["lm_eval"]) == lm_eval and len(lm_eval) == 2  # lm-eval's results and samples files


@pytest.mark.parametrize("loss", LOSSES)
def test_the_same_command_runs_a_run_whose_samples_lost_rows_again_naming_the_table(results, loss):
    samples = the(results)
    run_id = samples.stem
    reason = loss(samples)
    if samples.exists():  # still a readable Parquet table with every column: only its manifest says it lost rows
        assert len(load_table(samples, "samples")) < 4
    damaged = snapshot(results)

    rerun = again(results)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "skipped" not in rerun.stdout and "Traceback" not in rerun.stderr
    assert evalkit_lines(rerun) == [f"evalkit: WARNING: {samples} is damaged ({reason}); its run's tables are moved to "
                                    f"{results / 'damaged'}/; the config runs again"]
    aside = results / "damaged"
    moved = {f"{folder}/{run_id}{suffix}" for folder, suffix in RUN_FILES} & set(damaged)
    assert len(moved) == (4 if loss is deleted else 5)
    assert snapshot(aside) == {name: damaged[name] for name in moved}  # as they were found, never deleted
    fresh = the(results, "metrics")
    assert fresh.stem != run_id and (results / "manifests" / f"{fresh.stem}.json").is_file()
    assert sorted(read_table(results, "samples")["doc_id"]) == [0, 1, 2, 3]

    third = again(results)
    assert third.returncode == 0 and "skipped: this config already has results" in third.stdout
    assert not evalkit_lines(third)


def reader(results: Path, out: Path, which: str):
    return {"report": (cli.main, [str(results), "--out", str(out)], "evalkit-report"),
            "html": (cli.main, [str(results), "--html", "--out", str(out)], "evalkit-report"),
            "export": (cli.main, ["export", "kvpress", str(results), "--out", str(out)], "evalkit-report export"),
            "push": (hub.main, ["me/x", str(results), "--dry-run", str(out)], "evalkit-report push")}[which]


@pytest.mark.parametrize("which", ["report", "html", "export", "push"])
@pytest.mark.parametrize("loss", LOSSES)
def test_every_reader_refuses_a_run_whose_samples_lost_rows(results, tmp_path, loss, which, capsys):
    samples = the(results)
    reason = loss(samples)
    before = snapshot(results)
    main, argv, program = reader(results, tmp_path / "out", which)
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if not line.startswith("kvpress export: ")]
    assert len(lines) == 1, err
    manifest = results / "manifests" / f"{samples.stem}.json"
    assert lines[0] == (f"{program}: {samples} is damaged ({reason}): run its config again (evalkit moves the run's "
                        f"tables to {results / 'damaged'}/ and redoes the run), or move the run's tables and "
                        f"{manifest} out of {results}")
    assert snapshot(results) == before and not (tmp_path / "out").exists()


def test_a_csv_copy_that_lost_rows_makes_its_run_unfinished(results, capsys):
    csv = the(results, "csv/samples", ".csv")
    pd.read_csv(csv).head(2).to_csv(csv, index=False)
    digest = csv.stem.split("-")[-2]
    assert set_aside_damaged(results, digest) == []
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"evalkit: WARNING: {csv} is damaged (short: 2 of the 4 rows its run wrote)")
    assert (results / "damaged" / "csv" / "samples" / csv.name).is_file()


def test_a_manifest_that_does_not_read_back_is_a_damaged_run(results, capsys):
    manifest = the(results, "manifests", ".json")
    manifest.write_text('{"run_id": "')
    with pytest.raises(SystemExit):
        cli.main([str(results)])
    assert capsys.readouterr().err.startswith(f"evalkit-report: {manifest} is damaged (not a readable manifest")
    assert set_aside_damaged(results, manifest.stem.split("-")[-2]) == []
    assert "the config runs again" in capsys.readouterr().err
    assert (results / "damaged" / "manifests" / manifest.name).read_text() == '{"run_id": "'


def test_a_changed_lm_eval_file_is_said_and_the_whole_tables_still_finish_the_run(results, capsys):
    (logged,) = results.glob("lm_eval/*/*/samples_*.jsonl")
    logged.write_text("")
    metrics = the(results, "metrics")
    assert set_aside_damaged(results, metrics.stem.split("-")[-2]) == [metrics]
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"evalkit: WARNING: {logged} (1 of run {metrics.stem}'s lm-eval files) is missing or changed")
    assert "\n" not in line and not (results / "damaged").exists()


def test_a_folder_written_before_manifests_reads_as_before_and_gains_one_when_it_resumes(results, tmp_path, capsys):
    shutil.rmtree(results / "manifests")
    samples = the(results)
    before = snapshot(results)
    cli.main([str(results), "--out", str(tmp_path / "report")])  # read as before: no line, nothing written there
    assert not capsys.readouterr().err and snapshot(results) == before

    resumed = again(results)
    assert resumed.returncode == 0 and "skipped: this config already has results" in resumed.stdout
    assert not evalkit_lines(resumed)
    document = json.loads((results / "manifests" / f"{samples.stem}.json").read_text())
    assert document["origin"] == "adopted"
    assert document["tables"][f"samples/{samples.name}"]["rows"] == 4
    assert document["tables"][f"samples/{samples.name}"]["sha256"] == hashlib.sha256(samples.read_bytes()).hexdigest()
    assert document["lm_eval"] == {}  # the tables as they are, nothing else

    reason = cut_to_two(samples)  # from now on held to it
    rerun = again(results)
    assert rerun.returncode == 0 and "skipped" not in rerun.stdout
    assert evalkit_lines(rerun)[0].startswith(f"evalkit: WARNING: {samples} is damaged ({reason})")


def test_a_run_whose_samples_have_no_turn_is_named_not_dropped_from_the_turn_plot(tmp_path, capsys):
    """Two session runs with turns, one whose turns are all empty, one written without the column, and a run of
    another task (no turns, not a session task: not named)."""
    runs = {"a-full": ("needle_multiturn", "full", None, [1, 2, 1, 2]),
            "b-snapkv": ("needle_multiturn", "snapkv", "4x", [1, 2, 1, 2]),
            "c-empty": ("needle_multiturn", "streaming_llm", "4x", [None] * 4),
            "d-old": ("needle_multiturn", "knorm", "4x", None),
            "e-other": ("kv_retrieval", "full", None, [None] * 4)}
    for run_id, (task, method, budget, turns) in runs.items():
        config = {"run_id": run_id, "model": "tiny", "task": task, "method": method, "budget": budget,
                  "started_at": "2026-01-01T00:00:00"}
        rows = [{"doc_id": d, "sample_id": str(d), "repeat": 0, "score": float(d % 2), "subset": str(turns and turns[d]),
                 "turn": turns[d] if turns else None} for d in range(4)]
        table = samples_table(rows, config)
        if turns is None:  # written before the column existed
            path = write_table(table, tmp_path, "samples", run_id)
            pq.write_table(table.drop_columns(["turn"]), path)
        else:
            write_table(table, tmp_path, "samples", run_id)
        write_table(metrics_table([{"subset": "all", "metric": "exact_match", "value": 0.5, "n": 4}], config),
                    tmp_path, "metrics", run_id)
    cli.main([str(tmp_path), "--bootstrap", "20"])  # exits 0: the runs are whole, the plot is drawn
    line = ("accuracy_by_turn.png leaves out 2 runs whose samples have no turn (no turn column, or every turn empty): "
            "c-empty, d-old")
    assert capsys.readouterr().err.splitlines() == [f"evalkit-report: {line}"]
    assert (tmp_path / "report" / "accuracy_by_turn.png").is_file()
    assert f"Note: {line}." in (tmp_path / "report" / "report.md").read_text()
