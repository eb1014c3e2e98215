"""A config's runs given the config digest it has now, where only how its identity is computed changed (not what ran).

When tasks came to be identified by their YAML and declared version instead of their folders' bytes
(:func:`evalkit.run.digest.task_definition`), every config's digest changed once. A run made before, by a task
that is still as it was then, is a run of the same config: :func:`rename_config` renames it from the digest ``old`` to
``new`` so that it resumes (a finished run is skipped, an interrupted one continues from its progress file). For each
run of ``old`` it writes the tables (Parquet and CSV) under the new run id with the ``run_id`` and ``config_digest``
columns and the given ``columns`` (``task_definition``) rewritten and every other cell as it was, moves lm-eval's
folder of the run, writes its manifest (the tables' new sizes and sha256; ``migrated_from`` names the old run id), and
removes the old files; then the progress file of an interrupted attempt. Run again after a crash, it finishes the job.
A run whose tables do not match its manifest is left as it is (the new digest never finds it, and nothing is lost).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from evalkit.core.console import warn

from . import manifest

LM_EVAL = "lm_eval"  # <results_dir>/lm_eval/<run_id>/: lm-eval's own files of a run


def run_ids(results_dir: Path, digest: str) -> list[str]:
    """The run ids of config ``digest`` with a table or a manifest in ``results_dir``."""
    found = {path.stem for folder in (*manifest.TABLES, manifest.FOLDER)
             for path in (results_dir / folder).glob(f"*-{digest}-*") if not path.name.startswith(".")}
    return sorted(found)


def renamed(run_id: str, old: str, new: str) -> str:
    head, digest, tail = run_id.rsplit("-", 2)
    return f"{head}-{new}-{tail}" if digest == old else run_id


def rename_config(results_dir: str | os.PathLike, old: str, new: str, columns: dict[str, str]) -> list[str]:
    """Config ``old``'s runs in ``results_dir`` as runs of config ``new`` (``columns``: other config columns to set);
    returns the new run ids of the runs renamed."""
    results_dir, done = Path(results_dir), []
    for run_id in run_ids(results_dir, old):
        fault = _fault(results_dir, run_id)
        if fault:
            warn(f"{fault}: run {run_id} is left as it is, under its earlier config digest {old}")
            continue
        done.append(_rename_run(results_dir, run_id, renamed(run_id, old, new), columns))
    progress = results_dir / ".progress"
    for path in sorted(progress.glob(f"{old}*")):  # <digest>.jsonl, <digest>-<scratch>, <digest>.lock
        target = progress / f"{new}{path.name[len(old):]}"
        if path.suffix == ".lock" or target.exists():
            path.unlink(missing_ok=True)
        else:
            os.replace(path, target)
    return done


def _fault(results_dir: Path, run_id: str) -> str | None:
    """What keeps run ``run_id`` from being renamed: a manifest that does not read back, or a table not as it records."""
    try:
        recorded = manifest.read(results_dir, run_id)
    except manifest.Unreadable as error:
        return str(error)
    for name, record in (recorded or {}).get("tables", {}).items():
        fault = manifest.fault(results_dir / name, record)
        if fault:
            return f"{results_dir / name}: {fault}"
    return None


def _rename_run(results_dir: Path, run_id: str, new_id: str, columns: dict[str, str]) -> str:
    values = {**columns, "run_id": new_id, "config_digest": new_id.rsplit("-", 2)[1]}
    for name in ("samples", "metrics"):  # metrics last: its Parquet file marks a complete run
        parquet = results_dir / name / f"{run_id}.parquet"
        if parquet.exists():
            _write_table(_with_values(pq.read_table(parquet), values), results_dir, name, new_id)
    folder = results_dir / LM_EVAL / run_id
    if folder.is_dir():
        os.replace(folder, results_dir / LM_EVAL / new_id)
    recorded = manifest.read(results_dir, run_id)
    if recorded is not None:
        _write_manifest(results_dir, run_id, new_id, recorded)
    for folder, suffix in {**manifest.TABLES, manifest.FOLDER: ".json"}.items():
        (results_dir / folder / f"{run_id}{suffix}").unlink(missing_ok=True)
    return new_id


def _write_table(table: pa.Table, results_dir: Path, name: str, run_id: str) -> None:
    """As :func:`evalkit.results.tables.write_table` writes a run's table: its CSV copy, then the Parquet file."""
    _atomic(results_dir / "csv" / name / f"{run_id}.csv", lambda tmp: table.to_pandas().to_csv(tmp, index=False))
    _atomic(results_dir / name / f"{run_id}.parquet", lambda tmp: pq.write_table(table, tmp))


def _with_values(table: pa.Table, values: dict[str, str]) -> pa.Table:
    for column, value in values.items():
        if column in table.column_names:
            table = table.set_column(table.column_names.index(column), pa.field(column, pa.string()),
                                     pa.array([value] * len(table), pa.string()))
    return table


def _write_manifest(results_dir: Path, run_id: str, new_id: str, recorded: dict) -> None:
    """The run's manifest under its new id: its tables' entries as they are now, lm-eval's files under their new
    folder (their bytes did not change)."""
    tables = {f"{folder}/{new_id}{suffix}": results_dir / folder / f"{new_id}{suffix}"
              for folder, suffix in manifest.TABLES.items()}
    old_prefix, new_prefix = f"{LM_EVAL}/{run_id}/", f"{LM_EVAL}/{new_id}/"
    document = {**recorded, "run_id": new_id, "migrated_from": run_id,
                "tables": {name: manifest.entry(path) for name, path in tables.items() if path.exists()},
                "lm_eval": {(new_prefix + name[len(old_prefix):] if name.startswith(old_prefix) else name): entry
                            for name, entry in recorded["lm_eval"].items()}}
    _atomic(manifest.path_of(results_dir, new_id), lambda tmp: tmp.write_text(json.dumps(document, indent=2) + "\n",
                                                                              encoding="utf-8"))


def _atomic(path: Path, write) -> None:
    """``write(tmp)`` to a hidden temporary name beside ``path``, renamed into place: whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
