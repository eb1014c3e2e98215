"""Continuous batching over static-size caches: every slot stays busy until the request stream runs dry.

The engine owns ``slots`` per-sequence caches, allocated once: ``[slots, kv_heads, slot_tokens, head_dim]`` per layer.
A fixed-capacity policy (SnapStream, StreamingLLM) gets ``slot_tokens`` = its capacity; a growing one (Full, SnapKV)
gets its prompt capacity plus the most new tokens a request asks for, which is what a static-graph server must
reserve (``grow=True`` instead starts small and grows the slots when a row would run out).

One decode step feeds one token to every slot at once, with static shapes: the slot each token is written to, the
attention mask and the positions are computed on the device from per-slot state, so the step can be compiled once
(``compile=True``; CUDA graphs on GPU) and never recompiles. A request is prefilled and compressed alone, by the same
code as :func:`evalkit.compression.generate`, and its compressed cache is copied into a free slot while the other
slots keep their state. Finished rows are detected on the device (EOS, length); the host looks every ``sync_every``
steps, when it also checks stop strings, hands finished requests back and refills their slots.

Results do not depend on scheduling: a request's greedy tokens are those it gets alone, and sampling draws from a
per-request stream (a counter-based hash of the request's seed, its token index and the vocabulary entry, turned
into Gumbel noise), so a sampled request gets the same tokens whatever its neighbours and its slot.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence

import torch

from .attention import attention_implementation
from .generate import prefill
from .layout import DecodeStep, additive_mask, layout_of, ring_slot, tensor_fields
from .methods.base import Policy
from .methods.sliding_window import SlidingWindow, layer_policies
from .model_spec import cache_geometry, check_hookable, layer_devices, rotary_embedding
from .sampling import choose_tokens
from .slots import DECODE_ATTENTION, OUT_RING, Resident, SlotCache
from .stopping import eos_ids, stop_criteria, stop_token_ids


@dataclasses.dataclass
class Request:
    """One generation: prompt token ids and its own settings.

    ``compress_prefix`` and ``position_ids`` mean what they mean for :func:`evalkit.compression.generate`.
    """

    input_ids: Sequence[int] | torch.Tensor
    max_new_tokens: int = 64
    do_sample: bool = False
    temperature: float | None = None
    top_p: float | None = None
    stop_strings: Sequence[str] = ()
    seed: int = 0
    compress_prefix: int | None = None
    position_ids: Sequence[int] | torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.input_ids = torch.as_tensor(self.input_ids, dtype=torch.long).reshape(-1)
        if self.input_ids.numel() == 0:
            raise ValueError("a request needs at least one prompt token")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.temperature is not None and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if (self.temperature is not None or self.top_p is not None) and not self.do_sample:
            raise ValueError("temperature and top_p apply only with do_sample=True")
        self.stop_strings = (self.stop_strings,) if isinstance(self.stop_strings, str) else tuple(self.stop_strings)
        if self.position_ids is not None:
            self.position_ids = torch.as_tensor(self.position_ids, dtype=torch.long).reshape(-1)
            if self.position_ids.shape != self.input_ids.shape:
                raise ValueError("position_ids must have one position per prompt token")


@dataclasses.dataclass
class Completion:
    index: int  # the request's place in the stream
    tokens: list[int]  # generated tokens (EOS included when it ended the request; nothing after a stop string)
    stats: dict  # as generate()'s stats, plus reserved_cache_tokens (the slot's allocation)


def compile_backend(value) -> str | None:
    """The ``compile`` setting as a torch.compile backend: off (false) is None, true is inductor; a backend name
    (``eager``, ``aot_eager``: graph capture without code generation) is itself."""
    if value in (None, False, "false", "False", "0", 0):
        return None
    if value in (True, "true", "True", "1", 1):
        return "inductor"
    backends = sorted({"inductor", *torch._dynamo.list_backends(exclude_tags=())})
    if not isinstance(value, str) or value not in backends:
        raise ValueError(f"compile must be true, false or a torch.compile backend in {backends}, got {value!r}")
    return value


def _is_slot(held: torch.Tensor, cache: torch.Tensor, slot: int) -> bool:
    """Whether ``held`` is a view of slot ``slot`` of ``cache`` from its first token (where admission wrote it)."""
    return held.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr() and \
        held.storage_offset() == cache[slot].storage_offset() and held.stride() == cache[slot:slot + 1].stride()


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
        # Each layer's policy (a hybrid model's sliding-window layers keep their window); per-head layouts among them.
        self.layer_policies = layer_policies(model, policy)
        self.layer_devices = layer_devices(model)
        self.layouts = [layout_of(p, rotary_embedding(model)) for p in self.layer_policies]
        self.layout = layout_of(policy)  # the rows': per-head layouts mask by their own validity
        self.head_layouts = any(layout.per_head for layout in self.layouts)
        if grow and self.head_layouts:
            raise ValueError(f"{policy.name} on this model keeps layouts per layer and head; reserve slot_tokens "
                             "instead of grow")
        self.model, self.policy, self.slots = model, policy, slots
        self.tokenizer, self.grow, self.sync_every = tokenizer, grow, sync_every
        self.eos = eos_ids(stop_token_ids(model, tokenizer) if eos_token_id is None else eos_token_id)
        self.eos_device = self.eos.to(model.device) if self.eos is not None else None
        self.requested_slot_tokens = slot_tokens
        self.eager = model.config._attn_implementation == "eager"
        self.compile, self.compile_backend, self.compile_mode = compile, compile_backend, compile_mode
        self.prefill_chunk, self.prefill_chunk_mode = prefill_chunk, prefill_chunk_mode
        self._step_fn = None
        self._stops: dict[tuple[str, ...], object] = {}
        self.slot_tokens = 0
        # [slots, width] the newest generated tokens, on the device: token i of a slot at column i % width (the host
        # collects every sync_every steps, so fewer than width are ever uncollected); its shape never depends on a
        # request, so one compiled step serves every stream.
        self.out: torch.Tensor | None = None
        self.counters = {"decode_steps": 0, "busy_slot_steps": 0}

    # -- allocation -----------------------------------------------------------------------------------------------
    def _needed(self, request: Request) -> int:
        """Cache slots ``request`` needs under a growing policy (its largest head's, for per-head layouts)."""
        n = request.input_ids.numel()
        (kv_heads, _, _), _ = cache_geometry(self.model.config)
        if request.compress_prefix is not None and request.compress_prefix < n:
            head = request.compress_prefix
            return self.policy.prompt_slots(head, kv_heads) + (n - head) + request.max_new_tokens
        return self.policy.prompt_slots(n, kv_heads) + request.max_new_tokens

    def _allocate(self, size: int) -> None:
        config = self.model.config
        device, dtype = self.model.device, self.model.dtype
        (kv_heads, key_dim, value_dim), query_dim = cache_geometry(config)
        long = dict(dtype=torch.long, device=device)
        # Each layer's cache on that layer's device (one device, or several under a device map).
        layers = [(torch.zeros(self.slots, kv_heads, size, key_dim, dtype=dtype, device=at),
                   torch.zeros(self.slots, kv_heads, size, value_dim, dtype=dtype, device=at),
                   layout.allocate(self.slots, kv_heads, size, (config.num_attention_heads, query_dim), dtype, at))
                  for layout, at in zip(self.layouts, self.layer_devices)]
        self.valid = torch.zeros(self.slots, size, dtype=torch.bool, device=device)
        self.valid[:, 0] = True  # an empty slot attends to one zero key: finite outputs, no NaN in its cache
        self.seq_len = torch.zeros(self.slots, 1, **long)
        self.written = torch.zeros(self.slots, **long)
        self.fixed = torch.zeros(self.slots, **long)
        self.ring = torch.ones(self.slots, **long)
        self.write_slot = torch.zeros(self.slots, 1, **long)
        self.next_token = torch.zeros(self.slots, **long)
        self.generated = torch.zeros(self.slots, **long)
        self.max_new = torch.ones(self.slots, **long)
        self.finished = torch.ones(self.slots, dtype=torch.bool, device=device)
        self.seeds = torch.zeros(self.slots, **long)
        self.do_sample = torch.zeros(self.slots, dtype=torch.bool, device=device)
        self.temperature = torch.ones(self.slots, device=device)
        self.top_p = torch.ones(self.slots, device=device)
        self.active = torch.zeros(self.slots, dtype=torch.bool, device=device)
        self.cache = SlotCache(layers, self.layouts, DecodeStep(self.seq_len, self.generated, self.active,
                                                                self.write_slot))
        self.slot_tokens = size
        if self.compile:
            state = [t for keys, values, heads in layers
                     for t in (keys, values, *(tensor_fields(heads).values() if heads is not None else ()))]
            # state_tensors(): the step's positions, generated, active and write slots, and their mirrors.
            for tensor in [*state, *self.cache.state_tensors(), self.valid, self.written, self.fixed, self.ring,
                           self.next_token, self.max_new, self.finished, self.seeds, self.do_sample, self.temperature,
                           self.top_p]:
                torch._dynamo.mark_static_address(tensor)

    def _grow_to(self, size: int) -> None:
        size = 64 * math.ceil(size / 64)
        extra = size - self.slot_tokens
        for layer in self.cache.layers:
            layer.keys = torch.nn.functional.pad(layer.keys, (0, 0, 0, extra))
            layer.values = torch.nn.functional.pad(layer.values, (0, 0, 0, extra))
        self.valid = torch.nn.functional.pad(self.valid, (0, extra), value=False)
        self.slot_tokens = size

    # -- one decode step (static shapes) ---------------------------------------------------------------------------
    def _step(self, greedy_only: bool, use_top_p: bool) -> None:
        active = ~self.finished
        self.active.copy_(active)
        index = self.written
        slot = ring_slot(index, self.fixed, self.ring)
        self.write_slot.copy_(slot[:, None])
        self.valid.scatter_(1, slot[:, None], True)  # finished rows too: they must keep attending somewhere
        self.cache.sync()
        mask = self.valid[:, None, None, :]
        if self.eager and not self.head_layouts:
            mask = additive_mask(mask, self.model.dtype)
        logits = self.model(input_ids=self.next_token[:, None], attention_mask=mask,
                            position_ids=self.seq_len, past_key_values=self.cache, use_cache=True,
                            evalkit_cache=self.cache).logits
        logits = logits[:, -1].float().to(self.finished.device)  # a device-mapped model's last layer may be elsewhere
        chosen = choose_tokens(logits, greedy_only, self.seeds, self.generated, self.do_sample,
                               self.temperature, self.top_p, use_top_p)
        step = active.long()
        self.written.add_(step)
        self.seq_len.add_(step[:, None])
        # A finished row writes past its last token, over a column collected long ago: nothing it produced is lost.
        self.out.scatter_(1, (self.generated % self.out.shape[1])[:, None], chosen[:, None])
        self.generated.add_(step)
        done = self.generated >= self.max_new
        if self.eos is not None:
            done |= torch.isin(chosen, self.eos_device)
        self.finished.copy_(self.finished | (active & done))
        self.next_token.copy_(chosen)

    def _compiled_step(self):
        if self._step_fn is None:
            if not self.compile:
                self._step_fn = torch.no_grad()(self._step)
            else:
                mode = self.compile_mode
                if mode is None and self.compile_backend is None and self.model.device.type == "cuda":
                    mode = "reduce-overhead"  # CUDA graphs
                options = {"backend": self.compile_backend} if self.compile_backend is not None else {}
                self._step_fn = torch.no_grad()(torch.compile(self._step, dynamic=False, mode=mode, **options))
        return self._step_fn

    # -- admission -------------------------------------------------------------------------------------------------
    def _stop_checker(self, strings: tuple[str, ...]):
        if strings not in self._stops:
            if self.tokenizer is None:
                raise ValueError("stop_strings need the engine's tokenizer")
            self._stops[strings] = stop_criteria(self.tokenizer, list(strings), 0)
        return self._stops[strings]

    @torch.no_grad()
    def _admit(self, slot: int, index: int, request: Request) -> Resident:
        """Prefill and compress ``request`` alone, copy its cache into ``slot`` and choose its first token."""
        device = self.model.device
        ids = request.input_ids[None].to(device)
        positions = request.position_ids[None].to(device) if request.position_ids is not None else None
        slot_view = [(layer.keys[slot:slot + 1], layer.values[slot:slot + 1]) for layer in self.cache.layers]
        session, logits, seconds = prefill(self.model, self.policy, ids, None, request.compress_prefix, positions,
                                           self.prefill_chunk, self.prefill_chunk_mode, targets=slot_view)
        state = session.state
        # Per-head layouts may have grown past their last token (question chunks): copy what is used.
        used_by_layer = [layout.used(layer) for layout, layer in zip(self.layouts, session.cache.layers)]
        used = max(used_by_layer)
        if used > self.slot_tokens:
            if not self.grow:
                raise ValueError(f"request {index} needs {used} cache slots after prefill, more than the "
                                 f"{self.slot_tokens} reserved per slot (raise slot_tokens or use grow=True)")
            self._grow_to(used + request.max_new_tokens)
        for layer, source, used in zip(self.cache.layers, session.cache.layers, used_by_layer):
            if not _is_slot(source.keys, layer.keys, slot):  # written straight into the slot at compression, or not
                layer.keys[slot, :, :used] = source.keys[0, :, :used]
                layer.values[slot, :, :used] = source.values[0, :, :used]
            layer.layout.load(layer, slot, source, used)
        valid, fixed, ring = self.layout.slot_row(state, self.slot_tokens)
        self.valid[slot] = valid
        self.seq_len[slot] = int(state.seq_len[0])
        self.written[slot] = int(state.written[0])
        self.fixed[slot], self.ring[slot] = fixed, ring
        self.seeds[slot] = request.seed & ((1 << 63) - 1)
        self.do_sample[slot] = request.do_sample
        self.temperature[slot] = request.temperature or 1.0
        self.top_p[slot] = request.top_p or 1.0
        self.max_new[slot] = request.max_new_tokens
        self.generated[slot] = 0
        row = slice(slot, slot + 1)
        first = choose_tokens(logits.float().to(self.finished.device), not request.do_sample, self.seeds[row],
                              self.generated[row], self.do_sample[row], self.temperature[row], self.top_p[row],
                              request.top_p is not None)
        self.out[slot, 0] = first[0]
        self.next_token[slot] = first[0]
        self.generated[slot] = 1
        done = request.max_new_tokens == 1 or (self.eos is not None and int(first[0]) in self.eos.tolist())
        self.finished[slot] = done
        realized = session.realized(0)
        stats = {"prompt_tokens": request.input_ids.numel(), "kept_prompt_tokens": realized["kept_prompt_tokens"],
                 "kept_prompt_tokens_per_head": realized["kept_prompt_tokens_per_head"],
                 "compressed_layers": realized["compressed_layers"], "prefill_seconds": seconds}
        stop = self._stop_checker(request.stop_strings) if request.stop_strings else None
        held, limit = int(state.valid[0].sum()), int(state.fixed[0]) + int(state.ring[0])
        return Resident(index, request, stats, int(state.written[0]), held, limit, done, stop=stop)

    # -- the loop --------------------------------------------------------------------------------------------------
    def run(self, requests: Iterable[Request], on_finish: Callable[[Completion], None] | None = None) -> list[Completion]:
        """Generate every request; return the completions in request order. ``on_finish`` is called with each
        completion as soon as it is done (in finishing order), before the next requests are admitted."""
        stream = list(requests)
        for request in stream:
            if not isinstance(request, Request):
                raise TypeError(f"requests must be evalkit.compression.engine.Request, got {type(request).__name__}")
        self._prepare(stream)
        waiting = deque(enumerate(stream))
        started = time.perf_counter()
        residents: dict[int, Resident] = {}
        done: dict[int, Completion] = {}
        step_fn = self._compiled_step()
        while waiting or residents:
            ended_at_once = False
            for slot in range(self.slots):
                if slot not in residents and waiting:
                    index, request = waiting.popleft()
                    resident = residents[slot] = self._admit(slot, index, request)
                    # Timed on the host where admission already synchronised (its first token was read back).
                    resident.admitted_at = time.perf_counter()
                    resident.stats["time_to_first_token_s"] = resident.admitted_at - started
                    ended_at_once |= resident.ended_at_once
            if ended_at_once:  # done at their first token (EOS, or one new token asked for)
                self._collect(residents, done, on_finish)
            if not residents:
                continue
            if self.grow:
                self._grow_for(residents)
            greedy_only = not any(r.request.do_sample for r in residents.values())
            use_top_p = any(r.request.top_p is not None for r in residents.values())
            # Row layouts keep an eager model's own attention; per-head layouts need the engine's masks.
            implementation = None if self.eager and not self.head_layouts else DECODE_ATTENTION
            with attention_implementation(self.model, implementation):
                for _ in range(self.sync_every):
                    step_fn(greedy_only, use_top_p)
            self.counters["decode_steps"] += self.sync_every
            self.counters["busy_slot_steps"] += self.sync_every * len(residents)
            self._collect(residents, done, on_finish)
        return [done[i] for i in range(len(stream))]

    def _prepare(self, stream: list[Request]) -> None:
        capacity = self.policy.cache_capacity()
        if capacity is not None:
            size = capacity
        elif self.requested_slot_tokens is not None:
            size = self.requested_slot_tokens
        else:
            size = max((self._needed(r) for r in stream), default=1)
            if self.grow:
                size = min(size, 64)
        windows = [p.cache_capacity() for p in self.layer_policies if p is not self.policy]
        size = max([size, *windows])  # a hybrid model's sliding-window layers hold their window
        if self.slot_tokens != size:
            self._allocate(size)
        if self.out is None:
            self.out = torch.zeros(self.slots, max(OUT_RING, 2 * (self.sync_every + 1)), dtype=torch.long,
                                   device=self.model.device)
            if self.compile:
                torch._dynamo.mark_static_address(self.out)
        self.finished.fill_(True)

    def _grow_for(self, residents: dict[int, Resident]) -> None:
        generated = self.generated.tolist()
        needed = max(r.written_at_start + generated[slot] - 1 + self.sync_every for slot, r in residents.items())
        if needed > self.slot_tokens:
            self._grow_to(needed)

    def _collect(self, residents: dict[int, Resident], done: dict[int, Completion], on_finish) -> None:
        """The host's look at the slots: new tokens, stop strings, finished requests out."""
        if not residents:
            return
        width = self.sync_every + 1
        starts = torch.tensor([len(residents[s].tokens) if s in residents else 0 for s in range(self.slots)],
                              device=self.out.device)
        columns = (starts[:, None] + torch.arange(width, device=self.out.device)) % self.out.shape[1]
        # One transfer: per slot, its token count, whether it is finished, and its tokens since the last look.
        view = torch.cat([self.generated[:, None], self.finished[:, None].long(), self.out.gather(1, columns)], dim=1)
        rows = view.tolist()
        generated, finished, recent = [r[0] for r in rows], [bool(r[1]) for r in rows], [r[2:] for r in rows]
        for slot in list(residents):
            resident = residents[slot]
            start = len(resident.tokens)
            resident.tokens += recent[slot][: generated[slot] - start]
            cut = self._stop_at(resident, start) if resident.stop is not None else None
            if cut is not None:
                del resident.tokens[cut:]
                self.finished[slot] = True
            elif not finished[slot]:
                continue
            done[resident.index] = completion = self._complete(slot, resident)
            del residents[slot]
            if on_finish is not None:
                on_finish(completion)

    def _stop_at(self, resident: Resident, start: int) -> int | None:
        """Length of the generated tokens once the first stop string appears among those from ``start`` on."""
        tokens, stop = resident.tokens, resident.stop
        if len(tokens) == start:
            return None
        if self.tokenizer is not None:  # quick look at the new text first; most looks find nothing
            tail = self.tokenizer.decode(tokens[max(0, start - 64) :], skip_special_tokens=True)
            if not any(s in tail for s in resident.request.stop_strings):
                return None
        for length in range(start + 1, len(tokens) + 1):
            if bool(stop(torch.tensor([tokens[:length]]), None)[0]):
                return length
        return None

    def _complete(self, slot: int, resident: Resident) -> Completion:
        generated = len(resident.tokens)
        # Every token fed back takes a new slot until the ring is full; the count never drops, so the end is the peak.
        # (Read off the request's own tokens: the device may have run a few steps past a stop string.)
        peak = row_peak = min(resident.held_at_start + max(generated - 1, 0), resident.limit)
        if self.head_layouts:  # per-head layouts are tracked on the device: the mean over layers and heads
            peaks = [layer.layout.held(layer, slot, row_peak)[0] for layer in self.cache.layers]
            peak = round(sum(peaks) / len(peaks), 3)
        prompt = resident.stats["prompt_tokens"]
        seen = prompt + max(generated - 1, 0)
        # From its first token to the sync at which its end was seen (up to sync_every steps later).
        decode_seconds = time.perf_counter() - resident.admitted_at
        stats = {**resident.stats, "decode_seconds": decode_seconds, "generated_tokens": generated,
                 "peak_cache_tokens": peak, "tokens_seen": seen,
                 "realized_ratio": seen / peak, "reserved_cache_tokens": self.slot_tokens,
                 **self._bytes(slot, row_peak, seen)}
        return Completion(resident.index, list(resident.tokens), stats)

    def _bytes(self, slot: int, row_peak: int, seen: int) -> dict:
        """What the request's cache really took, in bytes, read off the tensors the engine allocated: ``kv_bytes_peak``
        the most it held (per layer: its peak tokens, or per head its own peak, times the bytes of a token's keys
        and values in that layer's dtype and widths: latent widths for MLA), ``kv_bytes_reserved`` what its slot
        reserves, ``kv_bytes_full`` what a full cache holds for the same ``seen`` tokens (a sliding-window layer at
        most its window), and ``memory_ratio`` = full / peak."""
        peak = reserved = full = 0
        for layer, policy in zip(self.cache.layers, self.layer_policies):
            per_head = (layer.keys.shape[-1] + layer.values.shape[-1]) * layer.keys.element_size()
            heads = layer.keys.shape[1]
            held = layer.layout.held(layer, slot, row_peak)[1]
            peak += held * per_head
            reserved += self.slot_tokens * heads * per_head
            window = policy.cache_capacity() if isinstance(policy, SlidingWindow) else None
            full += (min(seen, window) if window else seen) * heads * per_head
        return {"kv_bytes_peak": peak, "kv_bytes_reserved": reserved, "kv_bytes_full": full,
                "memory_ratio": full / peak if peak else None}

    def utilization(self) -> float:
        """Busy slot-steps over all slot-steps so far."""
        total = self.counters["decode_steps"] * self.slots
        return self.counters["busy_slot_steps"] / total if total else 0.0

