"""Rows of a benchmark from a hub id or a local JSON/JSONL/Parquet file, checked row by row.

A file that does not parse, or a row that lacks a field or holds the wrong type, is a :class:`DataError` whose one line
names the file, the row (line number for JSON Lines, position otherwise, and the row's id) and the field. With
``bad_rows="skip"`` bad rows are left out instead, one line each to the list :func:`collecting_skipped_rows` yields
(the run reports the count).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import datasets

BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}

_SKIPPED: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("evalkit_skipped_rows", default=None)


@contextlib.contextmanager
def collecting_skipped_rows() -> Iterator[list[str]]:
    """For the duration, the rows :func:`checked_rows` leaves out (``bad_rows="skip"``) are added to the list this
    yields, one line each: a task's loaders run inside lm-eval, which has no way to hand them back."""
    rows: list[str] = []
    token = _SKIPPED.set(rows)
    try:
        yield rows
    finally:
        _SKIPPED.reset(token)


class DataError(ValueError):
    """Unusable input data; the message is one line."""


class RowError(ValueError):
    """What is wrong with one row: ``field`` and the problem."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"field {field!r}: {problem}")
        self.field = field


def load_rows(source: str | list[str], split: str = "train", hub_config: str | None = None) -> list[dict]:
    """``source``: a hub dataset id, ``hf://`` file paths, a local file (or list of files: .json/.jsonl/.parquet) or
    a folder of them. Local JSON is parsed here, not by ``datasets``, so a bad line is reported by its number and
    rows of mixed types reach the row checks instead of failing a table cast."""
    sources = [source] if isinstance(source, str) else list(source)
    if all(s.startswith("hf://") for s in sources):  # raw files of a hub repo (LiveCodeBench's releases)
        return _hub(lambda: datasets.load_dataset("json", data_files=sources, split="train"), ", ".join(sources))
    local = [Path(s).expanduser() for s in sources]
    if all(path.exists() for path in local):
        files = [f for path in local for f in (sorted(path.iterdir()) if path.is_dir() else [path]) if f.suffix in BUILDERS]
        kinds = {BUILDERS[f.suffix] for f in files}
        if not files or len(kinds) != 1:
            raise DataError(f"{', '.join(sources)}: need .json/.jsonl or .parquet files of one kind, found "
                            f"{[str(f) for f in files] or 'none'}")
        if kinds == {"parquet"}:
            try:
                return list(datasets.load_dataset("parquet", data_files=[str(f) for f in files], split="train"))
            except Exception as error:  # noqa: BLE001
                raise DataError(f"{', '.join(map(str, files))}: not a readable Parquet table: {_first_line(error)}") from None
        return [row for f in files for row in _json_rows(f)]
    if len(sources) != 1 or any(s.startswith(("/", ".", "~")) for s in sources):
        missing = [s for s, path in zip(sources, local) if not path.exists()]
        raise DataError(f"dataset file(s) not found: {', '.join(missing)}")
    return _hub(lambda: datasets.load_dataset(sources[0], hub_config, split=split), f"{sources[0]!r} (split {split!r})")


def _hub(load, what: str) -> list[dict]:
    try:
        return list(load())
    except Exception as error:  # noqa: BLE001 (offline, unknown id, gated...: say what was tried)
        raise DataError(f"could not load dataset {what} from the hub: {_first_line(error)}. Without network, pass a "
                        "local file: task.dataset.path=/path/to/file.jsonl") from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else type(error).__name__


def _json_rows(path: Path) -> list[dict]:
    """Rows of a JSON file (a list of objects, or one object of lists) or of a JSON Lines file."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise DataError(f"{path}: not UTF-8 text (byte {error.start})") from None
    try:
        whole = json.loads(text)
    except json.JSONDecodeError as error:
        first = next((line for line in text.splitlines() if line.strip()), "")
        if path.suffix == ".json" and not _is_json(first):  # one document, broken somewhere
            raise DataError(f"{path}: line {error.lineno}: not valid JSON ({error.msg})") from None
        rows = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as bad:
                raise DataError(f"{path}: line {number}: not valid JSON ({bad.msg})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}: line {number}: a row must be a JSON object, got {type(row).__name__}") from None
            rows.append(row)
        return rows
    if isinstance(whole, dict) and whole and all(isinstance(v, list) for v in whole.values()):  # columns
        lengths = {key: len(values) for key, values in whole.items()}
        if len(set(lengths.values())) > 1:
            raise DataError(f"{path}: columns of unequal length ({', '.join(f'{k}: {n}' for k, n in lengths.items())})")
        return [dict(zip(whole, values)) for values in zip(*whole.values())]
    whole = [whole] if isinstance(whole, dict) else whole
    if not isinstance(whole, list) or any(not isinstance(row, dict) for row in whole):
        raise DataError(f"{path}: expected a list of JSON objects (or JSON Lines)")
    return whole


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except json.JSONDecodeError:
        return False


def checked_rows(rows, source: str | list[str], check: Callable[[dict], dict], bad_rows: str = "error",
                 id_field: str = "id") -> list[dict]:
    """``check(row)`` for every row (it returns the row to keep, or raises :class:`RowError`)."""
    name = source if isinstance(source, str) else ", ".join(source)
    kept, seen, skipped = [], {}, []
    for position, row in enumerate(rows, 1):
        try:
            checked = check(row)
            key = None if checked.get(id_field) is None else str(checked.get(id_field))
            if key is not None:  # one document per id: results, reasoning passes and resumes are keyed by it
                if key in seen:
                    raise RowError(id_field, f"duplicate id {key[:60]!r} (first at row {seen[key]})")
                seen[key] = position
            kept.append(checked)
        except RowError as error:
            message = f"{name}: row {position} ({id_field}={row.get(id_field, '?')}): {error}"
            if bad_rows != "skip":
                raise DataError(message) from None
            skipped.append(message)
    collector = _SKIPPED.get()
    if collector is not None:
        collector.extend(skipped)
    if not kept:
        raise DataError(f"{name}: no usable rows" + (f" ({len(skipped)} skipped)" if skipped else ""))
    return kept


def require_text(row: dict, fields: tuple[str, ...]) -> None:
    """Each of ``fields`` is present and a string."""
    for field in fields:
        if field not in row or row[field] is None:
            raise RowError(field, "missing")
        if not isinstance(row[field], str):
            raise RowError(field, f"must be a string, got {type(row[field]).__name__} {str(row[field])[:40]!r}")
