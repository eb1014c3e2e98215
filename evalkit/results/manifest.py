"""A run's manifest: what the run wrote, recorded last, the mark of a complete run.

    manifests/<run_id>.json   under ``results_dir``, beside metrics/ and samples/

It names each file the run wrote by its path under the results directory (the samples and metrics tables, their CSV
copies, lm-eval's own files where the run wrote them) with its row count, its size and the sha256 of its bytes. It is
written after all of them, to a hidden temporary name renamed into place: a run without one never finished. A file
that is missing, holds fewer rows or other bytes than its manifest records is damaged (:func:`fault`). A run written
before manifests existed has none; the next resume reads its tables as before and writes it one from them as they are
(``"origin": "adopted"``).
"""

from __future__ import annotations

import csv
import datetime as dt
import hashlib
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from evalkit.core.paths import naming

FOLDER = "manifests"
# A run's tables (folder -> suffix), in the order a check names them: the Parquet tables readers read, then the CSVs.
TABLES = {"samples": ".parquet", "metrics": ".parquet", "csv/samples": ".csv", "csv/metrics": ".csv"}


class Unreadable(ValueError):
    """A manifest file that does not read back as one (cut short, edited, another program's): ``path`` and what is
    wrong (``reason``)."""

    def __init__(self, path: Path, reason: str):
        self.path, self.reason = Path(path), reason
        super().__init__(f"{path}: {reason}")


def path_of(results_dir: str | os.PathLike, run_id: str) -> Path:
    return Path(results_dir) / FOLDER / f"{run_id}.json"


def run_ids(results_dir: str | os.PathLike, digest: str = "") -> set[str]:
    """The run ids with a manifest (of config ``digest`` only, where given)."""
    pattern = f"*-{digest}-*.json" if digest else "*.json"
    return {p.stem for p in (Path(results_dir) / FOLDER).glob(pattern) if not p.name.startswith(".")}


def rows(path: Path) -> int | None:
    """The rows of a table file (Parquet from its footer, CSV without its header), the lines of a JSONL file; None
    where the file does not read as such."""
    try:
        if path.suffix == ".parquet":
            return pq.ParquetFile(path).metadata.num_rows
        with open(path, newline="", encoding="utf-8") as handle:
            if path.suffix == ".csv":
                return max(sum(1 for _ in csv.reader(handle)) - 1, 0)
            return sum(1 for _ in handle) if path.suffix == ".jsonl" else None
    except (pa.ArrowException, OSError, UnicodeDecodeError, csv.Error):
        return None


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def entry(path: Path) -> dict:
    """What the manifest records of one file."""
    return {"rows": rows(path), "bytes": path.stat().st_size, "sha256": sha256(path)}


def write(results_dir: str | os.PathLike, run_id: str, lm_eval: str | os.PathLike | None = None,
          origin: str = "run") -> Path:
    """Record the run's tables as they are now (and every file under ``lm_eval``, lm-eval's folder of the run, where
    given) in ``manifests/<run_id>.json``, written whole or not at all."""
    results_dir = Path(results_dir)
    tables = {f"{folder}/{run_id}{suffix}": results_dir / folder / f"{run_id}{suffix}" for folder, suffix in
              TABLES.items()}
    files = sorted(p for p in Path(lm_eval).rglob("*") if p.is_file()) if lm_eval is not None else []
    document = {"run_id": run_id, "origin": origin,
                "written_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                "tables": {name: entry(path) for name, path in tables.items() if path.exists()},
                "lm_eval": {_relative(p, results_dir): entry(p) for p in files}}
    target = path_of(results_dir, run_id)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with naming(tmp):
            tmp.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
            os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def _relative(path: Path, results_dir: Path) -> str:
    return Path(os.path.relpath(path, results_dir)).as_posix()


def read(results_dir: str | os.PathLike, run_id: str) -> dict | None:
    """Run ``run_id``'s manifest, None where it has none (a run written before manifests existed), or
    :class:`Unreadable` saying what is wrong with it."""
    path = path_of(results_dir, run_id)
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise Unreadable(path, f"not a readable manifest: {type(error).__name__}") from None
    valid = isinstance(document, dict) and document.get("run_id") == run_id and all(
        isinstance(document.get(key), dict) and all(isinstance(e, dict) and isinstance(e.get("sha256"), str)
                                                    for e in document[key].values()) for key in ("tables", "lm_eval"))
    if not valid:
        raise Unreadable(path, f"not a manifest of run {run_id}: no run_id, tables or lm_eval entries of one")
    return document


def recorded(results_dir: str | os.PathLike, folder: str) -> dict[Path, tuple[dict, Path]]:
    """Every file of table folder ``folder`` the results directory's manifests record: its path, its entry and the
    manifest recording it. An unreadable manifest is :class:`Unreadable`."""
    results_dir, found = Path(results_dir), {}
    for run_id in sorted(run_ids(results_dir)):
        for name, record in (read(results_dir, run_id) or {}).get("tables", {}).items():
            if name.rpartition("/")[0] == folder:
                found[results_dir / name] = (record, path_of(results_dir, run_id))
    return found


def fault(path: Path, record: dict) -> str | None:
    """What is wrong with ``path`` against its manifest's ``record``: None where it is the file the run wrote;
    missing, short (fewer rows) or changed (other bytes) otherwise."""
    wrote = record.get("rows")
    if not path.exists():
        return f"missing: its run wrote it{f' with {wrote} rows' if wrote is not None else ''}"
    if path.stat().st_size == record.get("bytes") and sha256(path) == record["sha256"]:
        return None
    now = rows(path)
    if wrote is not None and now is not None and now < wrote:
        return f"short: {now} of the {wrote} rows its run wrote"
    return "changed since its run wrote it: its bytes differ from its manifest's sha256"
