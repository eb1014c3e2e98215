"""SCBench: the docs of evalkit's generated sessions (kv, prefix_suffix, vt, mf), each session generated when one of
its docs is read, and only the last few kept. lm-eval reads a task's docs in order and stops at the run's ``limit``:
``task.dataset.n_sessions=200000 limit=4`` generates the one session it asks, and a pass over every doc holds one
session at a time instead of all of them.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from evalkit.tasks.scbench import generators, scbench

KEPT_SESSIONS = 64  # the sessions made last, kept for the docs read again soon (a session's other turns)


class GeneratedDocs(Sequence):
    """The ``test`` split lm-eval reads (its length, a doc by index, in order, and ``features``, the field names): the
    docs :func:`scbench.rows_to_docs` makes of :func:`generators.generate`'s rows, in their order, one per turn.
    A length's sessions come from one random stream: a session is made after the earlier ones of its length (the
    stream starts again for a session before the last one made); a doc read is a copy."""

    def __init__(self, task: str, lengths, n_sessions: int, turns: int, seed: int):
        generators.check(task, lengths, n_sessions, turns)
        self.task, self.lengths, self.n_sessions, self.turns, self.seed = task, list(lengths), int(n_sessions), \
            int(turns), int(seed)
        self._streams: dict[int, tuple] = {}  # length index -> (its rows, how many it has made)
        self._kept: collections.OrderedDict = collections.OrderedDict()  # (length index, session) -> its docs
        self.sessions_made = 0

    def __len__(self) -> int:
        return len(self.lengths) * self.n_sessions * self.turns  # every generated session has ``turns`` turns

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        stream, rest = divmod(range(len(self))[index], self.n_sessions * self.turns)
        session, turn = divmod(rest, self.turns)
        return dict(self._session(stream, session)[turn])

    @property
    def features(self) -> dict:
        return dict.fromkeys(self[0])

    def select(self, indices) -> list[dict]:
        """The docs at ``indices`` (as ``datasets.Dataset.select``: a run leaving bad rows out)."""
        return [self[i] for i in indices]

    def _session(self, stream: int, session: int) -> list[dict]:
        key = (stream, session)
        if key in self._kept:
            self._kept.move_to_end(key)
            return self._kept[key]
        rows, made = self._streams.get(stream, (None, 0))
        if rows is None or made > session:
            rows, made = generators.sessions(self.task, self.lengths[stream], self.n_sessions, self.turns, self.seed,
                                             first_id=stream * self.n_sessions), 0
        while made <= session:
            row, made = next(rows), made + 1
            self.sessions_made += 1
        self._streams[stream] = (rows, made)
        self._kept[key] = scbench.rows_to_docs([row], self.task, self.turns, "generated")
        if len(self._kept) > KEPT_SESSIONS:
            self._kept.popitem(last=False)
        return self._kept[key]
