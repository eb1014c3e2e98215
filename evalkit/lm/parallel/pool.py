"""A run's requests sharded over engine replicas on Ray, with the interface of one engine (``run``); a session task's
sessions, each whole on one replica (``run_sessions``).

Every finished request streams back to the run's process as it finishes and is handed to ``on_finish`` there: the
run's one writer (its crash-safe progress file, then its tables) works as with one engine, so resume and the run's
identity are unchanged. A replica that dies (killed, out of memory) is restarted by Ray and given its unfinished
requests again; a request is recorded once, when its completion arrives, so none is lost or written twice. Past
``max_restarts`` deaths of one replica the run stops with one line, its finished generations kept for resume.
Results do not depend on the sharding: a request's greedy tokens are those it gets alone, and a sampled request
draws from its own seeded stream (:class:`evalkit.compression.engine.Engine`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import queue
import threading
import time
from collections.abc import Callable

from evalkit.compression.engine.request import Completion, Request
from evalkit.compression.engine.slot_pool import slots_needed
from evalkit.core.console import say
from evalkit.core.errors import RunError
from evalkit.memory.measure import Throughput

from . import RAY_MISSING, ParallelSettings
from .replica import Replica


class ReplicaPool:
    """``settings.replicas`` Ray actors, each holding the model of ``spec`` (loaded by ``load_lm(spec)``, the run's own
    loader) and an engine."""

    def __init__(self, spec, settings: ParallelSettings, model_config, load_lm):
        try:
            import ray
        except ImportError:
            raise RunError(RAY_MISSING) from None
        self.ray, self.settings, self.model_config, self.policy = ray, settings, model_config, spec.policy
        self.started_ray = not ray.is_initialized()
        if self.started_ray:
            ray.init(address=settings.address, include_dashboard=False, log_to_driver=False,
                     logging_level=logging.ERROR, configure_logging=True)
        cpus, gpus = self._resources(spec)
        actor = ray.remote(num_cpus=cpus, num_gpus=gpus, max_restarts=settings.max_restarts, max_task_retries=0)(Replica)
        threads = spec.threads or (max(1, int(cpus)) if gpus == 0 else None)
        alone = dataclasses.replace(spec, parallel=None)  # a replica runs its share as one process
        self.actors = [actor.remote(load_lm, alone, threads) for _ in range(settings.replicas)]
        self.deaths = [0] * settings.replicas
        try:
            self.pids = ray.get([a.pid.remote() for a in self.actors])  # a replica's load error surfaces here
        except ray.exceptions.RayTaskError as error:
            self.close()
            raise error.as_instanceof_cause() from None

    def _resources(self, spec) -> tuple[float, float]:
        """CPUs and GPUs each replica asks Ray for: by default a GPU each where the cluster has GPUs, else an equal
        share of the cluster's CPUs (a fraction where replicas outnumber cores: they all start)."""
        cluster = self.ray.cluster_resources()
        gpus = self.settings.gpus_per_replica
        if gpus is None:
            gpus = 1 if cluster.get("GPU", 0) >= 1 and spec.device != "cpu" else 0
        cpus = self.settings.cpus_per_replica
        if cpus is None:
            cpus = cluster.get("CPU", os.cpu_count() or 1) / self.settings.replicas if not gpus else 1
        return cpus, gpus

    def run(self, requests: list[Request], on_finish: Callable[[Completion], None] | None = None,
            on_step: Callable[[str, int, float], None] | None = None) -> list[Completion]:
        """Generate every request on the replicas (request ``i`` on replica ``i % replicas`` first); ``on_finish``
        is called here with each completion as it arrives, once per request; ``on_step`` hears the one phase seen
        from here (``replicas``), as an engine's phases."""
        if on_step is not None:
            on_step(f"{len(self.actors)} replicas", 0, 0.0)
        # A growing policy's slots are sized for the whole stream, as one engine sizes them (same reserved bytes).
        slot_tokens = max(slots_needed(self.model_config, self.policy, r) for r in requests) if requests else None
        done: dict[int, Completion] = {}

        def arrived(index: int, tokens, stats) -> None:
            done[index] = Completion(index, tokens, stats)
            if on_finish is not None:
                on_finish(done[index])

        self._distribute(requests, lambda actor, items: actor.generate.options(num_returns="streaming").remote(
            items, slot_tokens), arrived, "requests")
        return [done[i] for i in range(len(requests))]

    def run_sessions(self, sessions: list[list], mode: str, history: str,
                     on_session: Callable[[int, list[tuple[int, str, dict]]], None],
                     chat_slot_tokens: int | None = None) -> None:
        """Answer whole sessions on the replicas (``sessions``: each one's lm-eval requests in turn order; session
        ``i`` on replica ``i % replicas`` first). ``on_session(i, answers)`` is called here once per session, as it
        arrives whole: ``answers`` (position in the session, text, statistics) per turn. A replica that dies takes
        its unfinished sessions again, whole. ``chat_slot_tokens``: the slot size of the whole run's chats, which
        each replica's engine reserves (as one engine running them all would)."""
        self._distribute(sessions, lambda actor, items: actor.sessions.options(num_returns="streaming").remote(
            items, mode, history, chat_slot_tokens), on_session, "sessions")

    def _distribute(self, units: list, call: Callable, arrived: Callable, noun: str) -> None:
        """Hand ``units`` out over the replicas (``call(actor, [(index, unit)...])``: a streaming call yielding
        ``(index, *result)`` per finished unit) and ``arrived(index, *result)`` each one once, as it arrives."""
        unfinished = [set(range(r, len(units), len(self.actors))) for r in range(len(self.actors))]
        finished: set[int] = set()
        events: queue.Queue = queue.Queue()

        def stream(replica: int, indices: list[int], restarted: bool = False) -> None:
            items = [(i, units[i]) for i in indices]
            threading.Thread(target=self._stream, args=(replica, items, call, events, restarted), daemon=True).start()

        streaming = len(self.actors)
        for replica, indices in enumerate(unfinished):
            stream(replica, sorted(indices))
        while streaming:
            kind, replica, payload = events.get()
            if kind == "finished":
                if payload[0] in finished:  # defensive: a unit is recorded once
                    continue
                unfinished[replica].discard(payload[0])
                finished.add(payload[0])
                arrived(*payload)
            elif kind == "error":
                self.close()
                raise payload
            elif kind == "died":
                self.deaths[replica] += 1
                if self.deaths[replica] > self.settings.max_restarts:
                    self.close()
                    raise RunError(f"replica {replica} died {self.deaths[replica]} times (last: {_first_line(payload)})"
                                   f"; {len(finished)} of {len(units)} {noun} are kept: run the same command again "
                                   "to resume")
                if unfinished[replica]:  # Ray restarts the actor; the call waits for it
                    say(f"evalkit: replica {replica} died ({_first_line(payload)}); restarted, it takes its "
                        f"{len(unfinished[replica])} unfinished {noun} again (death {self.deaths[replica]} of "
                        f"{self.settings.max_restarts} allowed)", err=True)
                    stream(replica, sorted(unfinished[replica]), restarted=True)
                    continue
                streaming -= 1
            else:
                if unfinished[replica]:  # the stream ended without them: never expected, never silent
                    self.close()
                    raise RunError(f"replica {replica} ended without {len(unfinished[replica])} of its {noun}")
                streaming -= 1

    def _stream(self, replica: int, items: list, call: Callable, events: queue.Queue, restarted: bool) -> None:
        """Run ``items`` on one replica (in a thread of this process), putting what happens on ``events``: each
        finished unit as it arrives, the stream's end, a real error of the replica's code, or the replica's death."""
        ray = self.ray
        try:
            if restarted:
                self._wait_for(replica)
            for ref in call(self.actors[replica], items):
                events.put(("finished", replica, ray.get(ref)))
            events.put(("ended", replica, None))
        except ray.exceptions.RayTaskError as error:  # raised by the replica's own code: a real error
            events.put(("error", replica, error.as_instanceof_cause()))
        except ray.exceptions.RayError as error:  # the replica's process died (killed, out of memory)
            events.put(("died", replica, error))

    def _wait_for(self, replica: int) -> None:
        """Until Ray has restarted the replica (its model loaded again); a replica Ray gave up on raises."""
        while True:
            try:
                self.pids[replica] = self.ray.get(self.actors[replica].pid.remote())
                return
            except self.ray.exceptions.ActorUnavailableError:  # restarting
                time.sleep(0.2)

    def throughputs(self) -> list[Throughput]:
        """Each replica's own measurement (a restarted replica's since its restart); none once the pool is
        closed."""
        return self.ray.get([a.throughput.remote() for a in self.actors]) if self.actors else []

    def close(self) -> None:
        """Stop the replicas (and the local Ray cluster this pool started)."""
        for actor in getattr(self, "actors", ()):
            with contextlib.suppress(self.ray.exceptions.RayError):  # one that died for good is gone already
                self.ray.kill(actor, no_restart=True)
        self.actors = []
        if self.started_ray:
            self.ray.shutdown()
            self.started_ray = False


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__
