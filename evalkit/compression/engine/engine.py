"""Continuous batching over static-size caches: every slot stays busy until the request stream runs dry.

The engine owns ``slots`` per-sequence caches, allocated once: ``[slots, kv_heads, slot_tokens, head_dim]`` per layer.
A fixed-capacity policy (SnapStream, StreamingLLM) gets ``slot_tokens`` = its capacity; a growing one (Full, SnapKV)
gets its prompt capacity plus the most new tokens a request asks for, which is what a static-graph server must
reserve (``grow=True`` instead starts small and grows the slots when a row would run out). The slots hold what the
method stores: under ``kv_bits`` every layer's slots packed (:mod:`.packed_slots`), under ThinK each slot's prompt
keys at the reduced width (:mod:`.reduced_keys`).

One decode step feeds one token to every slot at once, with static shapes: the slot each token is written to, the
attention mask and the positions are computed on the device from per-slot state, so the step can be compiled once
(``compile=True``; CUDA graphs on GPU) and never recompiles. A request is prefilled and compressed alone, by the same
code as :func:`evalkit.compression.generate`, and its compressed cache is copied into a free slot while the other
slots keep their state. Finished rows are detected on the device (EOS, length); the host looks every ``sync_every``
steps, when it also checks stop strings, hands finished requests back and refills their slots.

Chats (:meth:`Engine.run_chats`, :mod:`.chats`): a conversation's turns follow one another in one slot, the next
turn's tokens prefilled on top of what the last one left there, while other chats decode in the other slots.

Results do not depend on scheduling: a request's greedy tokens are those it gets alone, and sampling draws from a
per-request stream (a counter-based hash of the request's seed, its token index and the vocabulary entry, turned
into Gumbel noise), so a sampled request gets the same tokens whatever its neighbours and its slot.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable

from ..methods.base import Policy
from ..methods.sliding_window import layer_policies
from ..model_spec import check_hookable, layer_devices
from ..stopping import StopStrings, eos_ids, stop_token_ids
from .accounting import Accounting
from .chats import ChatRun
from .model_runner import ModelRunner
from .request import Chat, Completion, Request
from .scheduler import Scheduler
from .slot_pool import OUT_RING, SlotPool
from .slot_snapshot import snapshot_refusal


class Engine:
    """Continuous batching of :class:`Request` s under ``policy`` with ``slots`` sequences decoded together.

    ``slot_tokens``: the cache size reserved per slot for a growing policy (default: enough for the largest request
    of the stream, which must then be a list). ``grow=True``: start small and grow (not with ``compile``).
    ``compile``: compile the decode step with ``torch.compile`` (``compile_backend`` picks the backend; on CUDA the
    default mode uses CUDA graphs). ``sync_every``: decode steps between two looks of the host at the slots.
    ``eos_token_id``: the ids that end a request (default :func:`stop_token_ids` of the model and ``tokenizer``).
    """

    def __init__(self, model, policy: Policy, slots: int = 8, *, eos_token_id=None, tokenizer=None,
                 slot_tokens: int | None = None, grow: bool = False, compile: bool = False, compile_backend=None,
                 compile_mode: str | None = None, sync_every: int = 4, prefill_chunk: int | None = None,
                 prefill_chunk_mode: str = "exact"):
        if not isinstance(policy, Policy):
            raise TypeError(f"policy must be an evalkit.compression policy, got {type(policy).__name__}")
        for name, value in (("slots", slots), ("sync_every", sync_every)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if grow and compile:
            raise ValueError("grow=True changes the cache's shape; a compiled step needs a static one (grow=False)")
        if grow and policy.cache_capacity() is not None:
            raise ValueError(f"{policy.name} has a fixed capacity; grow applies to growing policies only")
        check_hookable(model)
        if tokenizer is not None:
            policy.bind_tokenizer(tokenizer)
        policy.bind_model(model)
        # Each layer's policy: a hybrid model's sliding-window layers keep their window.
        self.pool = SlotPool(model, policy, slots, layer_policies(model, policy), layer_devices(model), grow=grow,
                             static=compile, out_width=max(OUT_RING, 2 * (sync_every + 1)),
                             prefill_chunk=prefill_chunk, prefill_chunk_mode=prefill_chunk_mode)
        if grow and self.pool.head_layouts:
            raise ValueError(f"{policy.name} on this model keeps layouts per layer and head; reserve slot_tokens "
                             "instead of grow")
        self.grow, self.sync_every, self.requested_slot_tokens = grow, sync_every, slot_tokens
        self.eos = eos_ids(stop_token_ids(model, tokenizer) if eos_token_id is None else eos_token_id)
        self.stops = StopStrings(tokenizer)
        self.runner = ModelRunner(model, self.pool, self.eos, compile=compile, backend=compile_backend,
                                  mode=compile_mode)
        self.accounting = Accounting(self.pool)
        self.counters = self.accounting.counters

    # What the engine allocated, as its callers read it.
    @property
    def cache(self):
        return self.pool.cache

    @property
    def slot_tokens(self) -> int:
        return self.pool.slot_tokens

    @property
    def valid(self):
        return self.pool.rows.valid

    def utilization(self) -> float:
        """Busy slot-steps over all slot-steps so far."""
        return self.accounting.utilization()

    def run(self, requests: Iterable[Request], on_finish: Callable[[Completion], None] | None = None,
            slot_tokens: int | None = None, on_step: Callable[[str, int, float], None] | None = None) -> list[Completion]:
        """Generate every request; return the completions in request order. ``on_finish`` is called with each
        completion as soon as it is done (in finishing order), before the next requests are admitted.
        ``slot_tokens``: the slot size of a growing policy for this stream (default: the engine's ``slot_tokens``,
        else what its largest request needs; a replica given part of a run's stream reserves what the whole needs).
        ``on_step(phase, tokens, seconds)``: called as each phase begins (``tokens`` 0) and ends: ``prefill`` (an
        admission: the prompt tokens it read), ``warm-up`` (the first decode round: compilation, first kernels) and
        ``decode`` (a round: the tokens it generated), for a progress display."""
        stream = list(requests)
        for request in stream:
            if not isinstance(request, Request):
                raise TypeError(f"requests must be evalkit.compression.engine.Request, got {type(request).__name__}")
        self.pool.prepare(stream, slot_tokens or self.requested_slot_tokens)
        return self._serve(Scheduler(stream, self.pool, self.stops, self.eos, self.sync_every), on_finish, on_step)

    def chat_refusal(self) -> str | None:
        """Why this engine cannot run chats (:meth:`run_chats`; None: it can)."""
        return snapshot_refusal(self.pool)

    def run_chats(self, chats: Iterable[Chat], on_chat: Callable[[int, list[Completion]], None] | None = None,
                  slot_tokens: int | None = None, on_step: Callable[[str, int, float], None] | None = None
                  ) -> list[list[Completion]]:
        """Answer every turn of every chat (:class:`Chat`), greedy answers equal to
        :func:`evalkit.compression.generate_shared`'s ``mode="multi_turn"`` on each alone; return each chat's
        completions in turn order. The chats decode together in the slots; a chat's turns follow one another in its
        slot (:mod:`.chats`), the host looking after every step so that a turn's slot is parked where it ended.
        ``on_chat(index, completions)`` is called as each chat's last turn is done. A turn's
        ``time_to_first_token_s`` counts from when it could start (the run's start, or its last turn's end)."""
        chats = list(chats)
        for chat in chats:
            if not isinstance(chat, Chat):
                raise TypeError(f"chats must be evalkit.compression.engine.Chat, got {type(chat).__name__}")
        refusal = self.chat_refusal()
        if refusal:
            raise ValueError(refusal)
        run = ChatRun(chats, self.pool, self.eos, on_chat)
        stream = run.first_turns()
        self.pool.prepare(stream, slot_tokens or self.requested_slot_tokens or (run.slot_tokens() if chats else None))
        self._serve(Scheduler(stream, self.pool, self.stops, self.eos, 1, follow=run.follow), None, on_step)
        return run.answers

    def _serve(self, scheduler: Scheduler, on_finish, on_step) -> list[Completion]:
        """Admit, decode ``scheduler.sync_every`` steps, collect, until the scheduler's stream is done."""
        step = _timed(on_step)
        rounds, every = 0, scheduler.sync_every
        while scheduler.busy:
            with step("prefill", scheduler.can_admit) as read:
                ended_at_once = scheduler.admit()
                read(scheduler.admitted_tokens)
            if ended_at_once:  # done at their first token (EOS, or one new token asked for)
                scheduler.collect(self.accounting.complete, on_finish)
            residents = scheduler.residents
            if not residents:
                continue
            if self.grow:
                self.pool.make_room(residents, every)
            greedy_only = not any(r.request.do_sample for r in residents.values())
            use_top_p = any(r.request.top_p is not None for r in residents.values())
            with step("decode" if rounds else "warm-up") as generated:
                self.runner.run(every, greedy_only, use_top_p)
                generated(every * len(residents))
            rounds += 1
            self.accounting.count(every, len(residents))
            scheduler.collect(self.accounting.complete, on_finish)
        return scheduler.completions()


def _timed(on_step: Callable[[str, int, float], None] | None):
    """``step(phase, begins)``: a context that, where ``begins``, calls ``on_step(phase, 0, 0.0)`` as it begins and
    ``on_step(phase, tokens, seconds)`` as it ends, ``tokens`` as counted within it (by the callable it yields)."""

    @contextlib.contextmanager
    def step(phase: str, begins: bool = True):
        counted = [0]
        if on_step is None or not begins:
            yield counted.append
            return
        on_step(phase, 0, 0.0)
        started = time.perf_counter()
        yield counted.append
        on_step(phase, counted[-1], time.perf_counter() - started)

    return step
