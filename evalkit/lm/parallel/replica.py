"""One engine replica: the run's model and engine in a Ray actor's process, generating the requests (or answering
the whole sessions) it is handed.

The replica loads the model exactly as a single-process run does (the run's ``load_lm``, handed over) and measures its
own throughput; the run's process turns its completions into text, statistics and table rows.
"""

from __future__ import annotations

import os
import queue
import threading

_END = object()


class Replica:
    """The actor's body (``ray.remote`` is applied by :mod:`evalkit.lm.parallel.pool`, so this file needs no Ray)."""

    def __init__(self, load_lm, spec, threads: int | None):
        import torch

        from evalkit.memory.measure import Throughput

        if threads:
            torch.set_num_threads(threads)
        self.lm = load_lm(spec)
        self.meter = Throughput()

    def pid(self) -> int:
        return os.getpid()

    def generate(self, items: list, slot_tokens: int | None = None):
        """``items``: (index, request) pairs; ``slot_tokens``: the slot size of the run's whole stream. Yields (index,
        tokens, stats) as each request finishes (a streaming generator: the run records each one as it arrives, so a
        replica that dies loses only its unfinished ones)."""
        indices = [index for index, _ in items]

        def work(put) -> None:
            engine = self.lm.engine
            self.meter.start(self.lm.device)
            try:
                engine.run([request for _, request in items], slot_tokens=slot_tokens,
                           on_finish=lambda c: put((indices[c.index], c.tokens, c.stats)))
            finally:
                self.meter.stop(engine, self.lm.model)

        for item in _streamed(work):
            self.meter.add(item[2])
            yield item

    def sessions(self, items: list, mode: str, history: str, chat_slot_tokens: int | None = None):
        """``items``: (index, a session's lm-eval requests) pairs. Yields (index, [(position, text, stats)...]) as each
        session is answered whole (:func:`evalkit.lm.sessions.generate_sessions`, which records a session once all
        its turns are done: here that record is what streams back). ``chat_slot_tokens``: the whole run's chat slot
        size."""
        from evalkit.lm.sessions import generate_sessions
        from evalkit.results.progress import request_keys

        flat = [request for _, session in items for request in session]
        owner = {}  # this replica's key of each request: (session index, position in it)
        keys = iter(request_keys([(r.args[0], r.args[1]) for r in flat]))
        for index, session in items:
            owner.update({next(keys): (index, position) for position in range(len(session))})

        def work(put) -> None:
            self.lm.progress, self.lm.throughput = _Streamed(put, owner), self.meter  # it measures into ours
            generate_sessions(self.lm, flat, mode, history, disable_tqdm=True, slot_tokens=chat_slot_tokens)

        yield from _streamed(work)

    def throughput(self):
        """What this replica measured of its own generations (since it last started)."""
        return self.meter


def _streamed(work):
    """What ``work(put)`` puts, yielded as it comes, ``work`` running in a thread (its error raised here)."""
    finished: queue.Queue = queue.Queue()

    def run() -> None:
        try:
            work(finished.put)
            finished.put(_END)
        except BaseException as error:  # handed to the caller, raised there
            finished.put(error)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    while (item := finished.get()) is not _END:
        if isinstance(item, BaseException):
            raise item
        yield item
    worker.join()


class _Streamed:
    """A replica's progress file as :func:`evalkit.lm.sessions.generate_sessions` sees it: nothing done before, and
    each finished session's records handed to ``put`` as (session index, [(position, text, stats)...])."""

    def __init__(self, put, owner: dict):
        self.put, self.owner = put, owner

    def get(self, key: str) -> None:
        return None

    def add(self, records: list[dict]) -> None:
        placed = [(*self.owner[r["key"]], r["text"], r["stats"]) for r in records]
        self.put((placed[0][0], [(position, text, stats) for _, position, text, stats in placed]))
