"""One engine replica: the run's model and engine in a Ray actor's process, generating the requests it is handed.

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
        """``items``: (index, request) pairs; ``slot_tokens``: the slot size of the run's whole stream. Yields (index, tokens, stats) as each request finishes (a streaming
        generator: the run records each one as it arrives, so a replica that dies loses only its unfinished ones)."""
        finished: queue.Queue = queue.Queue()
        indices = [index for index, _ in items]

        def work() -> None:
            engine = self.lm.engine
            self.meter.start(self.lm.device)
            try:
                engine.run([request for _, request in items], slot_tokens=slot_tokens,
                           on_finish=lambda c: finished.put((indices[c.index], c.tokens, c.stats)))
                finished.put(_END)
            except BaseException as error:  # handed to the caller, raised there
                finished.put(error)
            finally:
                self.meter.stop(engine, self.lm.model)

        worker = threading.Thread(target=work, daemon=True)
        worker.start()
        while (item := finished.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            self.meter.add(item[2])
            yield item
        worker.join()

    def throughput(self):
        """What this replica measured of its own generations (since it last started)."""
        return self.meter
