"""Crash-safe progress of a run: every finished generation is appended to a JSONL file as soon as its batch ends.

A run started again with the same config reads the file back and generates only what is missing, so an interrupted
run (kill -9 included) loses at most the batch in flight and never produces a sample twice. A line cut short by a
crash fails to parse and is ignored. The file lives in ``<results_dir>/.progress/<config digest>.jsonl`` and is
removed once the run's tables are written.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from pathlib import Path

from evalkit.core.paths import naming


def request_keys(requests: list[tuple[str, dict]]) -> list[str]:
    """A key per request: its text, generation arguments and which repeat of identical requests it is."""
    seen: Counter = Counter()
    keys = []
    for text, gen_kwargs in requests:
        ident = json.dumps([text, gen_kwargs], sort_keys=True, default=str)
        keys.append(hashlib.sha1(f"{ident}\x00{seen[ident]}".encode()).hexdigest())
        seen[ident] += 1
    return keys


def stats_keys(requests) -> list[tuple]:
    """``(task, doc_id, repeat)`` of each request: the key its statistics are stored under, so that a sample's row
    gets its own request's numbers whatever order the requests finish in. lm-eval hands a prompt sampled n times as
    the same request n times, in the order it stores their responses; ``repeat`` counts a document's requests in that
    order (for log-likelihood, its choices). A request without lm-eval's metadata is its own document, named by its
    place in the call."""
    seen: Counter = Counter()
    keys = []
    for position, request in enumerate(requests):
        doc_id = getattr(request, "doc_id", None)
        owner = (getattr(request, "task_name", None), position if doc_id is None else doc_id)
        keys.append((*owner, seen[owner]))
        seen[owner] += 1
    return keys


class Progress:
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.done: dict[str, dict] = {}
        if self.path.is_file():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    record = json.loads(line)
                    self.done[record["key"]] = record
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue  # the line a crash cut short
        self.resumed = len(self.done)

    def get(self, key: str) -> dict | None:
        return self.done.get(key)

    def add(self, records: list[dict]) -> None:
        """Append ``records`` (each with a ``key``) and make them durable before returning. A line an earlier crash
        or full disk cut short is ended first, so that it costs only itself."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with naming(self.path), open(self.path, "a+b") as handle:
            size = handle.seek(0, os.SEEK_END)
            cut_short = size > 0 and handle.seek(size - 1) >= 0 and handle.read(1) != b"\n"
            text = "\n" * cut_short + "".join(json.dumps(record, default=str) + "\n" for record in records)
            handle.write(text.encode("utf-8"))
            handle.flush()
            os.fsync(handle.fileno())
        self.done.update((record["key"], record) for record in records)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
