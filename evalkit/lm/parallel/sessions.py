"""A session task under ``parallel=ray``: its sessions spread over the replicas, each whole on one of them (a chat's
turns, or the queries sharing a context's cache, never split), and recorded in the run's progress file as each one
arrives, as one process records them. The rows are then read back exactly as a resumed run reads them
(:func:`evalkit.lm.sessions.generate_sessions`), so they are the rows one process writes."""

from __future__ import annotations

from evalkit.core.console import PhaseBar
from evalkit.core.errors import RunError
from evalkit.lm.sessions import run_chat_slot_tokens, sessions_of
from evalkit.results.progress import request_keys


def answer_on_replicas(lm, requests, mode: str, history: str, disable_tqdm: bool = False) -> None:
    """Answer the sessions of ``requests`` not yet in ``lm.progress`` on ``lm``'s replica pool; each finished session
    is recorded there (and measured) as it arrives. A replica that dies takes its unfinished sessions again, whole."""
    if lm.progress is None:
        raise RunError("parallel=ray records each session as it arrives: it needs the run's progress file (the "
                       "evalkit command keeps one)")
    keys = request_keys([(r.args[0], r.args[1]) for r in requests])
    pending = [members for members in sessions_of(requests).values()
               if not all(lm.progress.get(keys[i]) for i in members)]
    # every replica's engine reserves what one engine running all the chats would (the same reserved bytes)
    slot_tokens = run_chat_slot_tokens(lm, [[requests[i] for i in members] for members in pending], mode, history)
    meter = lm.throughput
    meter.start(lm.device)
    with PhaseBar(len(requests), len(requests) - sum(map(len, pending)), disable=disable_tqdm) as bar:

        def arrived(index: int, answers: list) -> None:
            members = pending[index]
            records = [{"key": keys[members[position]], "text": text, "stats": stats}
                       for position, text, stats in answers]
            if len(records) != len(members):
                raise RunError(f"a replica answered {len(records)} of the {len(members)} turns of a session")
            lm.progress.add(records)
            for record in records:
                meter.add({**record["stats"], "prompt_tokens": record["stats"]["prefill_tokens_computed"]})
            bar.update(len(records))

        try:
            lm._engine.run_sessions([[requests[i] for i in members] for members in pending], mode, history, arrived,
                                    slot_tokens)
        finally:
            meter.stop(lm._engine, lm.model)
