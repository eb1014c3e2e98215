"""What a run finds in its results directory before it starts: whether the directory can take its tables, another
process running its config (refused), the finished runs of its config (the run is skipped), the tables of runs that
do not read back or no longer match their run's manifest (moved aside into ``damaged/``, never deleted: the config
runs again) and what an attempt cut short left (removed)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import uuid
from pathlib import Path

from evalkit.core.console import say, warn
from evalkit.core.errors import RunError
from evalkit.results import manifest, migrate
from evalkit.results.tables import DAMAGED, DamagedTable, check_recorded, load_table

from .digest import config_digest, earlier_digest, identify
from .spec import RunSpec

TABLE_FOLDERS = manifest.TABLES
RUN_FILES = {**TABLE_FOLDERS, manifest.FOLDER: ".json"}  # what moves aside with a damaged run (lm-eval's files stay)


def completed_runs(results_dir: Path, spec: RunSpec) -> list[Path]:
    """Metrics files of earlier runs with this exact config whose tables are whole: they match their run's manifest
    (written last, only when the run is complete), or, for a run written before manifests existed, read back (it gains
    a manifest). The tables of a run that is not whole are set aside first (:func:`set_aside_damaged`). Runs of the
    config made before tasks declared versions take its digest first (:func:`adopt_earlier_runs`)."""
    adopt_earlier_runs(Path(results_dir), spec)
    return set_aside_damaged(Path(results_dir), config_digest(spec))


def adopt_earlier_runs(results_dir: Path, spec: RunSpec) -> None:
    """The config's runs under the digest it had before tasks declared versions (:func:`~.digest.earlier_digest`),
    renamed to its digest now, once (:func:`evalkit.results.migrate.rename_config`)."""
    earlier = earlier_digest(spec) if results_dir.is_dir() else None
    progress = bool(earlier) and (results_dir / ".progress" / f"{earlier}.jsonl").exists()
    if earlier is None or not (progress or migrate.run_ids(results_dir, earlier)):
        return
    digest = config_digest(spec)
    renamed = migrate.rename_config(results_dir, earlier, digest, {"task_definition": identify(spec)["task_definition"]})
    found = [f"{len(renamed)} finished run(s)"] * bool(renamed) + ["the progress of an interrupted one"] * progress
    say(f"  this config's digest before task versions was {earlier}: {' and '.join(found)} now under {digest}", err=True)


def set_aside_damaged(results_dir: Path, digest: str) -> list[Path]:
    """The metrics files of config ``digest``'s finished runs. A run whose table is missing, short or changed against
    its manifest, whose manifest does not read back, or (without a manifest) whose metrics or samples table does not
    read back (cut short, overwritten, another program's table: :func:`~evalkit.results.tables.load_table`) is no
    finished run: its tables (Parquet and CSV) and its manifest move to ``<results_dir>/damaged/``, as they were, and a
    warning names the damaged file and what is wrong with it."""
    finished, damaged = [], []
    runs = {path.stem for path in (results_dir / "metrics").glob(f"*-{digest}-*.parquet")}
    for run_id in sorted(runs | manifest.run_ids(results_dir, digest)):
        try:
            _check_run(results_dir, run_id)
            finished.append(results_dir / "metrics" / f"{run_id}.parquet")
        except DamagedTable as error:
            damaged.append(error)
            _move_aside(results_dir, run_id, error)
    for error in damaged:
        again = "" if finished else "; the config runs again"
        warn(f"{error.path} is damaged ({error.reason}); its run's tables are moved to {results_dir / DAMAGED}/"
             f"{again}")
    return finished


def _check_run(results_dir: Path, run_id: str) -> None:
    """Run ``run_id``'s tables held to its manifest (:class:`DamagedTable` naming the first that is not whole), or,
    for a run written before manifests existed, read back as before and recorded in a manifest of its own."""
    try:
        recorded = manifest.read(results_dir, run_id)
    except manifest.Unreadable as error:
        raise DamagedTable(error.path, error.reason) from None
    if recorded is None:
        load_table(results_dir / "metrics" / f"{run_id}.parquet", "metrics")
        if (samples := results_dir / "samples" / f"{run_id}.parquet").exists():
            load_table(samples, "samples")
        with contextlib.suppress(OSError):  # a folder this process cannot write: read as before next time too
            manifest.write(results_dir, run_id, origin="adopted")
        return
    where, tables = manifest.path_of(results_dir, run_id), recorded["tables"]
    for folder, suffix in TABLE_FOLDERS.items():  # the Parquet tables first: those the readers read
        name = f"{folder}/{run_id}{suffix}"
        if name in tables:
            check_recorded(results_dir / name, tables[name], where, folder if suffix == ".parquet" else None)
        elif folder == "metrics":
            raise DamagedTable(results_dir / name, "its run's manifest does not record it", recorded_in=where)
    changed = [name for name, record in recorded["lm_eval"].items() if manifest.fault(results_dir / name, record)]
    if changed:
        warn(f"{results_dir / changed[0]} ({len(changed)} of run {run_id}'s lm-eval files) is missing or changed "
             f"since the run wrote it ({where}); its tables are whole, so the run is not redone")


def _move_aside(results_dir: Path, run_id: str, error: DamagedTable) -> None:
    for folder, suffix in RUN_FILES.items():
        source = results_dir / folder / f"{run_id}{suffix}"
        target = results_dir / DAMAGED / folder / source.name
        try:
            if not source.exists():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            while target.exists():  # a file of that name set aside before: kept too
                target = target.with_name(f"{target.stem}.{uuid.uuid4().hex[:6]}{target.suffix}")
            os.rename(source, target)
        except FileNotFoundError:  # another process of this config moved it meanwhile
            continue
        except OSError as moving:
            raise RunError(f"{error}; moving it aside failed: {target}: {moving.strerror or moving}") from None


def remove_unfinished_tables(results_dir: Path, digest: str) -> None:
    """Tables of config ``digest`` whose run never wrote its metrics table (written after the other tables), and
    temporary files of an interrupted write (a manifest's too): an attempt cut short while writing. They go before a
    rerun writes its own tables, so that no sample is counted twice. Runs whose tables are not whole are moved aside
    first (:func:`set_aside_damaged`): their tables are kept."""
    complete = {p.stem for p in set_aside_damaged(results_dir, digest)}
    for folder in (*TABLE_FOLDERS, manifest.FOLDER):
        for path in (results_dir / folder).glob(f"*-{digest}-*"):
            if path.name.startswith(".") or path.stem not in complete:
                path.unlink(missing_ok=True)


def check_writable(results_dir: Path) -> None:
    """The results directory can take the tables: checked before the model loads, so a bad path costs nothing. The
    check leaves nothing behind (folders it made are removed again)."""
    made = [p for p in [results_dir, *results_dir.parents] if not p.exists()]
    try:
        results_dir.mkdir(parents=True, exist_ok=True)
        probe = results_dir / f".write-check-{uuid.uuid4().hex[:8]}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise RunError(f"results_dir {results_dir} is not writable: {error.strerror or error}") from None
    finally:
        for folder in made:  # deepest first
            with contextlib.suppress(OSError):
                folder.rmdir()


def hold(lock, results_dir: Path) -> None:
    """Take the config's lock (its open lock file ``lock``) and write who holds it into it; a config another process
    is running is a RunError naming that process."""
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "another process"
        raise RunError(f"this config is already running in {results_dir} ({holder}); wait for it to finish "
                       "(its tables then make this run a skip) or use another results_dir") from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"pid {os.getpid()} on {socket.gethostname()}")
    lock.flush()
