"""A damaged results table (cut short, overwritten, another program's) is never a finished run: the same config runs
again with the run's tables moved to ``damaged/`` (nothing deleted), and every reader of a results directory
(``evalkit-report``, ``--html``, ``export kvpress``, ``push``) refuses in one line naming the file, exit status 2, with
nothing written. So are outputs ``evalkit-report`` cannot write. One real results folder is made once and copied per
test."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import evalkit

from evalkit.results import cli, hub, kvpress_export
from evalkit.results.tables import DamagedTable, read_table
from evalkit.run.results_dir import remove_unfinished_tables, set_aside_damaged

RUNS = {"full": ["method=full"], "snapkv": ["method=snapkv", "budget=4x"]}


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """Two real runs of the built-in task on the built-in model, two documents each: the full cache and SnapKV 4x."""
    folder = tmp_path_factory.mktemp("damaged") / "results"
    for args in RUNS.values():
        result = evalkit("task=kv_retrieval", *args, "limit=2", f"results_dir={folder}", cwd=folder.parent)
        assert result.returncode == 0, result.stderr[-3000:]
    return folder


@pytest.fixture
def results(made, tmp_path) -> Path:
    """A copy of the two runs' results folder, this test's own."""
    return Path(shutil.copytree(made, tmp_path / "results"))


def table_path(results: Path, table: str, method: str) -> Path:
    (path,) = (results / table).glob(f"*-kv_retrieval-{method}-*.parquet")
    return path


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` and its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def cut_short(path: Path) -> str:
    os.truncate(path, 100)
    return "no Parquet footer: cut short, or not a Parquet file"


def overwritten(path: Path) -> str:
    path.write_bytes(b"not a table\n" * 20)
    return "no Parquet footer: cut short, or not a Parquet file"


def emptied(path: Path) -> str:
    path.write_bytes(b"")
    return "an empty file, not a Parquet table"


def foreign(path: Path) -> str:
    pq.write_table(pa.table({"x": [1, 2]}), path)
    return "no columns run_id"


def without_run_ids(path: Path) -> str:
    table = pq.read_table(path)
    pq.write_table(table.drop_columns(["run_id", "started_at"]), path)
    return "no columns run_id, started_at" if path.parent.name == "metrics" else "no column run_id"


def retyped(path: Path) -> str:
    """The scores as text: a table pyarrow reads, whose rows no reader can use or join to the others'."""
    table = pq.read_table(path)
    column = "value" if path.parent.name == "metrics" else "score"
    texts = pa.array([None if v is None else str(v) for v in table[column].to_pylist()], pa.string())
    pq.write_table(table.set_column(table.column_names.index(column), column, texts), path)
    return f"its column {column} holds string, not double"


DAMAGE = [cut_short, overwritten, emptied, foreign, without_run_ids, retyped]


# -- resume: a damaged run is no finished run --------------------------------------------------------------------

@pytest.mark.parametrize("table", ["metrics", "samples"])
def test_the_same_command_runs_a_damaged_run_again_and_keeps_its_tables_aside(results, table):
    damaged = table_path(results, table, "snapkv")
    reason = cut_short(damaged)
    before = snapshot(results)
    args = ["task=kv_retrieval", *RUNS["snapkv"], "limit=2", f"results_dir={results}"]

    again = evalkit(*args, cwd=results.parent)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "skipped" not in again.stdout and "Traceback" not in again.stderr
    (line,) = [line for line in again.stderr.splitlines() if line.startswith("evalkit:")]
    assert line == (f"evalkit: WARNING: {damaged} is damaged ({reason}); its run's tables are moved to "
                    f"{results / 'damaged'}/; the config runs again")
    aside = results / "damaged"
    moved = {f"{folder}/{damaged.stem}{suffix}" for folder, suffix in (
        ("metrics", ".parquet"), ("samples", ".parquet"), ("csv/metrics", ".csv"), ("csv/samples", ".csv"),
        ("manifests", ".json"))}
    assert {str(p.relative_to(aside)) for p in aside.rglob("*") if p.is_file()} == moved
    for name in moved:  # kept as they were found, the damaged file too
        assert (aside / name).read_bytes() == before[name]
    after = snapshot(results)
    assert all(after[name] == data for name, data in before.items() if name not in moved)  # the full run untouched
    metrics, samples = read_table(results, "metrics"), read_table(results, "samples")
    assert metrics["run_id"].nunique() == 2 and len(samples) == 4 and set(samples["method"]) == {"full", "snapkv"}

    third = evalkit(*args, cwd=results.parent)
    assert third.returncode == 0 and "skipped: this config already has results" in third.stdout
    assert not [line for line in third.stderr.splitlines() if line.startswith("evalkit:")]


@pytest.mark.parametrize("damage", DAMAGE)
@pytest.mark.parametrize("table", ["metrics", "samples"])
def test_a_damaged_table_is_no_finished_run_and_is_moved_not_deleted(results, table, damage, capsys):
    damaged = table_path(results, table, "snapkv")
    reason = damage(damaged)
    before = snapshot(results)
    digest = damaged.stem.split("-")[-2]

    assert set_aside_damaged(results, digest) == []
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"evalkit: WARNING: {damaged} is damaged (") and reason in line and "\n" not in line
    moved = {name for name in before if damaged.stem in name and not name.startswith("lm_eval/")}  # tables, CSVs
    kept = {name: data for name, data in before.items() if name not in moved}  # and the run's manifest
    assert len(moved) == 5 and snapshot(results) == kept | {f"damaged/{name}": before[name] for name in moved}
    full = table_path(results, "metrics", "full")
    assert set_aside_damaged(results, full.stem.split("-")[-2]) == [full]  # the good run: finished, where it was


def test_a_run_again_without_resume_keeps_the_csv_copies_of_a_damaged_run(results, capsys):
    """resume=false removes what an unfinished attempt left; a damaged run's tables, its CSV copies among them (which
    may hold the rows its Parquet file lost), are moved aside instead."""
    damaged = table_path(results, "metrics", "snapkv")
    cut_short(damaged)
    csv = results / "csv" / "metrics" / f"{damaged.stem}.csv"
    rows = csv.read_bytes()
    remove_unfinished_tables(results, damaged.stem.split("-")[-2])
    assert (results / "damaged" / "csv" / "metrics" / csv.name).read_bytes() == rows and not csv.exists()
    assert "is damaged" in capsys.readouterr().err


# -- every reader refuses in one line ------------------------------------------------------------------------------

def command(results: Path, tmp_path: Path, which: str):
    """``which`` reader of ``results``: its main, its arguments, the program name its line starts with and the
    folders it would write."""
    out = tmp_path / "out"
    return {
        "report": (cli.main, [str(results)], "evalkit-report", [results / "report"]),
        "html": (cli.main, [str(results), "--html", "--out", str(out)], "evalkit-report", [out]),
        "export": (cli.main, ["export", "kvpress", str(results), "--out", str(out)], "evalkit-report export", [out]),
        "push": (hub.main, ["me/x", str(results), "--dry-run", str(out)], "evalkit-report push", [out]),
    }[which]


def refused(main, argv: list[str], capsys) -> str:
    """The one line ``main(argv)`` says on stderr as it exits with status 2 (besides the export's notes on runs
    evaluated with ``limit``, which come before it)."""
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2
    captured = capsys.readouterr()
    lines = [line for line in captured.err.strip().splitlines() if not line.startswith("kvpress export: ")]
    assert len(lines) == 1, captured.err
    assert not captured.out
    return lines[0]


@pytest.mark.parametrize("damage", [cut_short, overwritten, foreign, without_run_ids, retyped])
@pytest.mark.parametrize("which", ["report", "html", "export", "push"])
def test_every_reader_refuses_a_damaged_table_in_one_line_and_writes_nothing(results, tmp_path, which, damage,
                                                                              capsys):
    damaged = table_path(results, "metrics", "snapkv")
    if damage is foreign:  # another program's file among the runs' tables
        damaged = damaged.with_name("notes.parquet")
    reason = damage(damaged)
    before = snapshot(results)
    main, argv, program, outputs = command(results, tmp_path, which)

    line = refused(main, argv, capsys)
    assert line.startswith(f"{program}: {damaged} is damaged (") and reason in line
    remedy = f"run its config again (evalkit moves the run's tables to {results / 'damaged'}/" if (
        damage is not foreign) else "move it out of metrics/"
    assert remedy in line
    assert snapshot(results) == before and not any(path.exists() for path in outputs)


def test_a_damaged_samples_table_is_named_with_how_many_others_are_damaged(results, tmp_path, capsys):
    first, second = sorted((results / "samples").glob("*.parquet"))
    overwritten(first)
    emptied(second)
    line = refused(cli.main, [str(results)], capsys)
    assert line.startswith(f"evalkit-report: {first} is damaged (no Parquet footer")
    assert "(and 1 more damaged file in samples/)" in line
    with pytest.raises(DamagedTable) as error:
        read_table(results, "samples")
    assert error.value.path == first


# -- outputs evalkit-report cannot write -------------------------------------------------------------------------

def test_the_reports_out_being_a_file_is_one_line(results, tmp_path, capsys):
    out = tmp_path / "report.txt"
    out.write_text("mine")
    before = snapshot(results)
    assert refused(cli.main, [str(results), "--out", str(out)], capsys) == (
        f"evalkit-report: {out} is a file, not a folder")
    assert out.read_text() == "mine" and snapshot(results) == before
    under = out / "report"
    assert refused(cli.main, [str(results), "--out", str(under), "--html"], capsys) == (
        f"evalkit-report: {under}: {out} is a file, not a folder")


@pytest.mark.parametrize("case", ["missing folder", "a file", "under a file", "unwritable folder"])
def test_export_into_a_place_it_cannot_write_is_one_line_and_writes_nothing(results, tmp_path, case, capsys):
    where = tmp_path / "place"
    if case == "missing folder":
        out, expected = where / "deeper" / "kvpress", f"{where / 'deeper' / 'kvpress'}: its folder {where / 'deeper'} does not exist"
    elif case == "a file":
        where.write_text("mine")
        out, expected = where, f"{where} is a file, not a folder"
    elif case == "under a file":
        where.write_text("mine")
        out, expected = where / "kvpress", f"{where / 'kvpress'}: {where} is a file, not a folder"
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into any folder")
        where.mkdir(mode=0o555)
        out, expected = where / "kvpress", f"{where / 'kvpress'}: cannot make this folder: Permission denied"
    before = snapshot(tmp_path)
    line = refused(cli.main, ["export", "kvpress", str(results), "--out", str(out)], capsys)
    assert line == f"evalkit-report export: {expected}"
    assert snapshot(tmp_path) == before and sorted(tmp_path.iterdir()) == sorted([results, *[where] * where.exists()])


@pytest.mark.parametrize("which", ["report", "export", "push"])
def test_a_results_folder_without_runs_is_one_line(tmp_path, which, capsys):
    empty = tmp_path / "empty"
    for table in ("metrics", "samples"):
        (empty / table).mkdir(parents=True)
    main, argv, program, outputs = command(empty, tmp_path, which)
    assert refused(main, argv, capsys) == f"{program}: {empty / 'metrics'} holds no runs"
    assert not any(path.exists() for path in outputs)


def test_an_export_that_fails_part_way_removes_what_it_wrote(results, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("mine")
    ratio = pd.read_parquet(table_path(results, "samples", "snapkv"))["compression_ratio"].mean()
    taken = out / f"kv_retrieval__kv_retrieval_tiny__snapkv__{ratio:.2f}__query_aware"  # the second run's folder
    taken.write_text("a file where the export puts a folder")
    line = refused(cli.main, ["export", "kvpress", str(results), "--out", str(out)], capsys)
    assert line == f"evalkit-report export: {taken}: File exists"
    assert sorted(p.name for p in out.iterdir()) == sorted(["mine.txt", taken.name])  # the first run's folder: gone


def test_a_dry_run_that_fails_part_way_removes_its_copies(results, tmp_path, capsys):
    out = tmp_path / "dataset"
    out.mkdir()
    (out / "report").write_text("a file where the dry run puts the report")
    before = snapshot(tmp_path)
    line = refused(hub.main, ["me/x", str(results), "--dry-run", str(out)], capsys)
    assert line == f"evalkit-report push: {out / 'report'} is a file, not a folder"
    assert snapshot(tmp_path) == before and sorted(p.name for p in out.iterdir()) == ["report"]
    fresh = tmp_path / "fresh"
    (results / "metrics" / "notes.parquet").write_bytes(b"")
    assert refused(hub.main, ["me/x", str(results), "--dry-run", str(fresh)], capsys).startswith(
        f"evalkit-report push: {results / 'metrics' / 'notes.parquet'} is damaged (an empty file")
    assert not fresh.exists()


def test_good_tables_read_as_pandas_reads_them_and_export(results):
    for table in ("metrics", "samples"):
        pd.testing.assert_frame_equal(read_table(results, table), pd.read_parquet(results / table))
    assert kvpress_export.export(results, results.parent / "kvpress")  # the good folder still exports


def test_a_file_whose_column_clashes_with_the_others_is_named(tmp_path):
    for name, values in (("a", [1, 2]), ("b", ["one", "two"])):
        (tmp_path / "memory").mkdir(exist_ok=True)
        pq.write_table(pa.table({"x": values}), tmp_path / "memory" / f"{name}.parquet")
    with pytest.raises(DamagedTable) as error:
        read_table(tmp_path, "memory")
    assert error.value.path == tmp_path / "memory" / "b.parquet" and "clashes with the other files'" in str(error.value)
