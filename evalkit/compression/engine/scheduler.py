"""A stream's way through the slots: waiting requests take free slots in arrival order; the host looks at the slots
every ``sync_every`` steps for new tokens, stop strings and finished requests, and hands those back. A finished
request may name the request that follows it (a chat's next turn, ``follow``): that one takes the same slot next."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import torch

from ..stopping import StopStrings
from .request import Completion, Request, Resident
from .slot_pool import SlotPool

Follow = Callable[[int, Resident, Completion], "Request | None"]  # a finished request's slot, record, completion


class Scheduler:
    """One run of ``stream``: who waits, who holds which slot, who is done."""

    def __init__(self, stream: list[Request], pool: SlotPool, stops: StopStrings, eos: torch.Tensor | None,
                 sync_every: int, follow: Follow | None = None):
        self.pool, self.stops, self.eos, self.sync_every, self.follow = pool, stops, eos, sync_every, follow
        self.waiting = deque(enumerate(stream))
        self.residents: dict[int, Resident] = {}
        self.done: dict[int, Completion] = {}
        self.started = time.perf_counter()
        self.admitted_tokens = 0
        # Follow-ups by the slot they take next: (index, request, when it was ready); indices go on after the stream's.
        self.following: dict[int, tuple[int, Request, float]] = {}
        self.count = len(stream)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.residents or self.following)

    @property
    def can_admit(self) -> bool:
        """Whether a request waits and a slot is free for it."""
        return bool(self.following) or bool(self.waiting) and len(self.residents) < self.pool.slots

    def admit(self) -> bool:
        """Fill the free slots, each with the request that follows its last one, else from the queue; return whether
        a request ended at its first token (EOS, one new token asked for, or for a follow-up a stop string).
        ``admitted_tokens``: the prompt tokens this call admitted."""
        ended_at_once, self.admitted_tokens = False, 0
        for slot in range(self.pool.slots):
            if slot in self.residents or not (self.waiting or slot in self.following):
                continue
            index, request, ready = (self.following.pop(slot) if slot in self.following
                                     else (*self.waiting.popleft(), self.started))
            resident = self.residents[slot] = self.pool.admit(slot, index, request, self.eos, self.follow is not None)
            resident.stop = self.stops.checker(request.stop_strings)
            # Timed on the host where admission already synchronised (its first token was read back).
            resident.admitted_at = time.perf_counter()
            resident.stats["time_to_first_token_s"] = resident.admitted_at - ready
            if self.follow is not None and resident.stop is not None and not resident.ended_at_once:
                self._stop_at_first(slot, resident)
            ended_at_once |= resident.ended_at_once
            self.admitted_tokens += request.input_ids.numel()
        return ended_at_once

    def _stop_at_first(self, slot: int, resident: Resident) -> None:
        """A chat's turn whose first token ends it with a stop string ends before any step feeds that token (as
        ``generate`` stops), so that its slot holds what the conversation holds."""
        first = int(self.pool.rows.out[slot, 0])
        if self.stops.cut([first], 0, resident.request.stop_strings, resident.stop) is not None:
            self.pool.rows.finished[slot] = True
            resident.ended_at_once = True

    def collect(self, complete: Callable[[int, Resident], Completion],
                on_finish: Callable[[Completion], None] | None) -> None:
        """The host's look at the slots: new tokens, stop strings, finished requests out (``complete`` makes a
        finished request's completion)."""
        if not self.residents:
            return
        generated, finished, recent = self._look()
        rows = self.pool.rows
        for slot in list(self.residents):
            resident = self.residents[slot]
            start = len(resident.tokens)
            resident.tokens += recent[slot][: generated[slot] - start]
            cut = (self.stops.cut(resident.tokens, start, resident.request.stop_strings, resident.stop)
                   if resident.stop is not None else None)
            if cut is not None:
                del resident.tokens[cut:]
                rows.finished[slot] = True
            elif not finished[slot]:
                continue
            self.done[resident.index] = completion = complete(slot, resident)
            following = self.follow(slot, resident, completion) if self.follow is not None else None
            if following is not None:  # before anything else runs in the slot
                self.following[slot] = (self.count, following, time.perf_counter())
                self.count += 1
            del self.residents[slot]
            self.pool.release(slot)
            if on_finish is not None:
                on_finish(completion)

    def _look(self) -> tuple[list[int], list[bool], list[list[int]]]:
        """In one transfer: per slot, its token count, whether it is finished, and its tokens since the last look
        (at most ``sync_every + 1``)."""
        rows = self.pool.rows
        width = self.sync_every + 1
        starts = torch.tensor([len(self.residents[s].tokens) if s in self.residents else 0
                               for s in range(self.pool.slots)], device=rows.out.device)
        columns = (starts[:, None] + torch.arange(width, device=rows.out.device)) % rows.out.shape[1]
        view = torch.cat([rows.generated[:, None], rows.finished[:, None].long(), rows.out.gather(1, columns)], dim=1)
        table = view.tolist()
        return [r[0] for r in table], [bool(r[1]) for r in table], [r[2:] for r in table]

    def completions(self) -> list[Completion]:
        """Every completion, in request order."""
        return [self.done[i] for i in range(len(self.done))]
