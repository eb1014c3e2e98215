"""The engine's slots: a static cache and per-slot state allocated once (grown only under ``grow=True``), and
admission, which prefills and compresses a request alone (the code :func:`evalkit.compression.generate` runs) and
moves its cache and state into a free slot while the other slots keep theirs."""

from __future__ import annotations

import dataclasses
import math
import time

import torch

from ..generate import prefill
from ..layout import DecodeStep, layout_of, tensor_fields
from ..methods.base import Policy
from ..model_spec import cache_geometry, rotary_embedding
from .packed_slots import empty_slots, packs_slots
from .packed_slots import load_slot as load_packed
from .reduced_keys import ReducedKeys, reduced_channels, shift_row
from .reduced_keys import load_slot as load_reduced
from .request import Request, Resident
from .sampling import choose_tokens
from .slot_cache import PackedSlotLayer, ReducedSlotLayer, SlotCache

OUT_RING = 256  # columns of the generated-token ring (at least 2 x (sync_every + 1))
SEED_BITS = (1 << 63) - 1  # a request's seed as the non-negative int64 its random stream hashes


@dataclasses.dataclass
class SlotRows:
    """Per-slot state on the device, one row per slot: what the decode step reads and advances in place, and what
    admission writes, a request's row as one unit (:meth:`load`)."""

    valid: torch.Tensor  # [slots, slot_tokens] bool: row layouts' slots that hold a token
    slot_pos: torch.Tensor  # [slots, slot_tokens] long: row layouts' text position of a token written after prefill
    positions: torch.Tensor  # [slots, 1] long: text position of the slot's next token
    written: torch.Tensor  # [slots] cache writes so far, wrapped ones included
    fixed: torch.Tensor  # [slots] slots never overwritten
    ring: torch.Tensor  # [slots] size of the ring after them
    next_token: torch.Tensor  # [slots] the token the next step feeds
    generated: torch.Tensor  # [slots] tokens generated so far
    steps: torch.Tensor  # [slots] decode steps taken, the tokens fed one by one after a compressed prefix included
    max_new: torch.Tensor  # [slots] the request's max_new_tokens
    finished: torch.Tensor  # [slots] bool: ended (EOS, length); a free slot is finished
    seeds: torch.Tensor  # [slots] the request's random stream
    do_sample: torch.Tensor  # [slots] bool
    temperature: torch.Tensor  # [slots] float
    top_p: torch.Tensor  # [slots] float
    write_slot: torch.Tensor  # [slots, 1] long: the slot this step's token takes (row layouts)
    active: torch.Tensor  # [slots] bool: not finished when this step began
    # [slots, width] the newest generated tokens: token i of a slot at column i % width (the host collects every
    # sync_every steps, so fewer than width are ever uncollected); its shape never depends on a request, so one
    # compiled step serves every stream.
    out: torch.Tensor

    @classmethod
    def empty(cls, slots: int, slot_tokens: int, out_width: int, device) -> SlotRows:
        long = dict(dtype=torch.long, device=device)
        valid = torch.zeros(slots, slot_tokens, dtype=torch.bool, device=device)
        valid[:, 0] = True  # an empty slot attends to one zero key: finite outputs, no NaN in its cache
        return cls(valid=valid, slot_pos=torch.full((slots, slot_tokens), -1, **long),
                   positions=torch.zeros(slots, 1, **long), written=torch.zeros(slots, **long),
                   fixed=torch.zeros(slots, **long), ring=torch.ones(slots, **long),
                   next_token=torch.zeros(slots, **long), generated=torch.zeros(slots, **long), steps=torch.zeros(slots, **long),
                   max_new=torch.ones(slots, **long), finished=torch.ones(slots, dtype=torch.bool, device=device),
                   seeds=torch.zeros(slots, **long), do_sample=torch.zeros(slots, dtype=torch.bool, device=device),
                   temperature=torch.ones(slots, device=device), top_p=torch.ones(slots, device=device),
                   write_slot=torch.zeros(slots, 1, **long), active=torch.zeros(slots, dtype=torch.bool, device=device),
                   out=torch.zeros(slots, out_width, **long))

    def load(self, slot: int, row: SlotRows) -> None:
        """Row ``slot`` becomes ``row``'s only row."""
        for name, tensor in tensor_fields(self).items():
            tensor[slot] = getattr(row, name)[0]

    def step_inputs(self) -> DecodeStep:
        """What each layer's layout reads during a step: views of these rows, so the step's updates show through."""
        return DecodeStep(self.positions, self.steps, self.active, self.write_slot, slot_positions=self.slot_pos)


def _is_slot(held: torch.Tensor, cache: torch.Tensor, slot: int) -> bool:
    """Whether ``held`` is a view of slot ``slot`` of ``cache`` from its first token (where admission wrote it)."""
    return held.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr() and \
        held.storage_offset() == cache[slot].storage_offset() and held.stride() == cache[slot:slot + 1].stride()


class SlotPool:
    """``slots`` per-sequence caches of ``slot_tokens`` each (every layer on its own device) and their rows."""

    def __init__(self, model, policy: Policy, slots: int, layer_policies: list[Policy], layer_devices: list,
                 *, grow: bool, static: bool, out_width: int, prefill_chunk: int | None, prefill_chunk_mode: str):
        self.model, self.policy, self.slots, self.layer_devices = model, policy, slots, layer_devices
        self.grow, self.static, self.out_width = grow, static, out_width
        self.prefill_chunk, self.prefill_chunk_mode = prefill_chunk, prefill_chunk_mode
        self.layouts = [layout_of(p, rotary_embedding(model)) for p in layer_policies]
        self.layout = layout_of(policy)  # the rows': per-head layouts mask by their own validity
        self.head_layouts = any(layout.per_head for layout in self.layouts)
        # ThinK: the key channels a slot keeps of its prompt's keys (None: full width), in a block of the prompt's
        # capacity (:mod:`.reduced_keys`).
        self.reduced = reduced_channels(model, policy, layer_policies)
        self.prompt_block = policy.prompt_capacity() if self.reduced is not None else None
        self.cache: SlotCache | None = None
        self.rows: SlotRows | None = None
        self.slot_tokens = 0

    def prepare(self, stream: list[Request], requested: int | None) -> None:
        """Size the slots for ``stream`` (``requested``: the engine's ``slot_tokens``), reallocating only when the
        size changes, and free them all."""
        (kv_heads, _, _), _ = cache_geometry(self.model.config)
        capacity = self.policy.slot_capacity(kv_heads)
        if capacity is not None:
            size = capacity
        elif requested is not None:
            size = requested
        else:
            size = max((self._needed(r) for r in stream), default=1)
            if self.grow:
                size = min(size, 64)
        windows = [layout.policy.cache_capacity() for layout in self.layouts if layout.policy is not self.policy]
        size = max([size, *windows])  # a hybrid model's sliding-window layers hold their window
        if self.slot_tokens != size:
            self.allocate(size)
        self.rows.finished.fill_(True)

    def _needed(self, request: Request) -> int:
        if self.reduced is None:
            return slots_needed(self.model.config, self.policy, request)
        # the whole prompt block, then every token after it: a prefix's request's own, a question after its context
        n = request.input_ids.numel()
        head = n if request.compress_prefix is None or request.compress_prefix >= n else request.compress_prefix
        return self.prompt_block + n - (0 if request.prefix is not None else head) + request.max_new_tokens

    def allocate(self, size: int) -> None:
        config = self.model.config
        (kv_heads, _, _), query_dim = cache_geometry(config)
        query_shape = (config.num_attention_heads, query_dim)
        layers = [(*self._storage(layout.policy.kv_format, size, at),
                   layout.allocate(self.slots, kv_heads, size, query_shape, self.model.dtype, at))
                  for layout, at in zip(self.layouts, self.layer_devices)]
        self.rows = SlotRows.empty(self.slots, size, self.out_width, self.model.device)
        self.cache = SlotCache(layers, self.layouts, self.rows.step_inputs(), self.rows.valid)
        self.slot_tokens = size
        if self.static:  # compiled: the step's tensors keep their addresses (CUDA graphs read them in place)
            heads = [tensor for *_, state in layers if state is not None for tensor in tensor_fields(state).values()]
            # a packed layer's tensors are read by its kernels only, outside the compiled graphs
            slot_tensors = [tensor for layer in self.cache.layers if not isinstance(layer, PackedSlotLayer)
                            for tensor in layer.tensors()]
            for tensor in [*slot_tensors, *heads, *self.cache.state_tensors(), *tensor_fields(self.rows).values()]:
                torch._dynamo.mark_static_address(tensor)

    def _storage(self, fmt, size: int, at) -> tuple:
        """A layer's slots: a :class:`.PackedKV` of every slot under a format that packs (values None), ThinK's
        :class:`.ReducedKeys` and the values, or dense keys and values."""
        (kv_heads, key_dim, value_dim), _ = cache_geometry(self.model.config)
        shape, dtype = (self.slots, kv_heads, size), self.model.dtype
        if packs_slots(fmt, key_dim, value_dim):
            return empty_slots(fmt, *shape, key_dim, dtype, at), None
        values = torch.zeros(*shape, value_dim, dtype=dtype, device=at)
        if self.reduced is not None:
            return ReducedKeys.empty(*shape, min(self.prompt_block, size), self.reduced, key_dim, dtype, at), values
        return torch.zeros(*shape, key_dim, dtype=dtype, device=at), values

    def grow_to(self, size: int) -> None:
        size = 64 * math.ceil(size / 64)
        extra = size - self.slot_tokens
        for layer in self.cache.layers:
            layer.grow_to(size)
        self.rows.valid = torch.nn.functional.pad(self.rows.valid, (0, extra), value=False)
        self.rows.slot_pos = torch.nn.functional.pad(self.rows.slot_pos, (0, extra), value=-1)
        self.cache.step.slot_positions, self.cache.valid = self.rows.slot_pos, self.rows.valid
        self.slot_tokens = size

    def make_room(self, residents: dict[int, Resident], steps: int) -> None:
        """Under ``grow``: enough slot tokens for the residents' next ``steps`` tokens."""
        generated = self.rows.generated.tolist()
        needed = max(r.written_at_start + generated[slot] - 1 + steps for slot, r in residents.items())
        if needed > self.slot_tokens:
            self.grow_to(needed)

    @torch.no_grad()
    def admit(self, slot: int, index: int, request: Request, eos: torch.Tensor | None,
              keep_session: bool = False) -> Resident:
        """Prefill and compress ``request`` alone, move its cache into ``slot`` and choose its first token.
        ``keep_session``: the resident keeps the session admission moved (a chat's turn), its own tensors."""
        device = self.model.device
        ids = request.input_ids[None].to(device)
        positions = request.position_ids[None].to(device) if request.position_ids is not None else None
        if request.prefix is not None:  # a shared context's session: copied, then the request's tokens on top
            session, logits, seconds = continue_prefix(request.prefix, ids)
        else:
            session, logits, seconds = prefill(self.model, self.policy, ids, None, request.compress_prefix, positions,
                                               self.prefill_chunk, self.prefill_chunk_mode,
                                               targets=None if keep_session else self._targets(slot))
        shifted = self._move_cache(slot, index, request, session.cache.layers)
        state = session.state
        row = SlotRows.empty(1, self.slot_tokens, self.out_width, self.rows.finished.device)
        row.valid[0], row.fixed[0], row.ring[0] = self.layout.slot_row(state, self.slot_tokens)
        row.slot_pos[0, : min(state.slots, self.slot_tokens)] = state.slot_pos[0, : self.slot_tokens]
        row.positions[0], row.written[0] = int(state.seq_len[0]), int(state.written[0])
        if shifted is not None:  # ThinK's reduced slots: the tokens after the prompt start after its block
            shift_row(row, *shifted, self.prompt_block)
        row.seeds[0], row.do_sample[0], row.max_new[0] = request.seed & SEED_BITS, request.do_sample, request.max_new_tokens
        row.temperature[0], row.top_p[0] = request.temperature or 1.0, request.top_p or 1.0
        first = choose_tokens(logits.float().to(row.finished.device), not request.do_sample, row.seeds, row.generated,
                              row.do_sample, row.temperature, row.top_p, request.top_p is not None)
        done = request.max_new_tokens == 1 or (eos is not None and int(first[0]) in eos.tolist())
        row.out[0, 0], row.next_token[0], row.generated[0], row.finished[0] = first[0], first[0], 1, done
        row.steps[0] = 1 + session.cache.decode_steps  # the steps its session took (a query after the context) go on
        self.rows.load(slot, row)
        realized = session.realized(0)
        prefix = request.prefix  # the context's own tokens; not a method's tokens after it (RestoreKV's)
        shared = int(prefix.state.seq_len[0] - prefix.appended[0]) if prefix is not None else 0
        stats = {"prompt_tokens": shared + request.input_ids.numel(), "kept_prompt_tokens": realized["kept_prompt_tokens"],
                 "kept_prompt_tokens_per_head": realized["kept_prompt_tokens_per_head"],
                 "compressed_layers": realized["compressed_layers"], "prefill_seconds": seconds,
                 "kv_bytes_prefill_peak": realized["kv_bytes_prefill_peak"],
                 **({"prefill_tokens_computed": request.input_ids.numel(), "prefill_tokens_shared": shared}
                    if request.prefix is not None else {})}
        held, limit = int(state.valid[0].sum()), int(state.fixed[0]) + int(state.ring[0])
        return Resident(index, request, stats, int(row.written[0]), held, limit, done,
                        session=session if keep_session else None)

    def release(self, slot: int) -> None:
        """A finished request's slot keeps none of its policy's state."""
        for layer in self.cache.layers:
            if layer.slot_states is not None:
                layer.slot_states[slot] = None

    def _targets(self, slot: int) -> list | None:
        """Per layer, the dense slot admission compresses a prompt straight into (None where the slots are packed or
        hold reduced keys: the session's own layer, packed or reduced, is copied); None where no layer's is dense."""
        targets = [None if isinstance(layer, (PackedSlotLayer, ReducedSlotLayer)) else
                   (layer.keys[slot:slot + 1], layer.values[slot:slot + 1]) for layer in self.cache.layers]
        return targets if any(target is not None for target in targets) else None

    def _move_cache(self, slot: int, index: int, request: Request, layers: list) -> tuple[int, int] | None:
        """Copy a session's layers (row 0) into ``slot``, what each uses (growing the slots under ``grow``). Returns,
        where the slots hold ThinK's reduced keys, the prompt tokens the row kept and the tokens after them."""
        if self.reduced is None:
            used_by_layer = [layout.used(layer) for layout, layer in zip(self.layouts, layers)]
        else:  # the prompt block, then what came after it
            used_by_layer = [self.prompt_block + layer.get_seq_length() - layer.keys.shape[-2] for layer in layers]
        used = max(used_by_layer)
        if used > self.slot_tokens:
            if not self.grow:
                raise ValueError(f"request {index} needs {used} cache slots after prefill, more than the "
                                 f"{self.slot_tokens} reserved per slot (raise slot_tokens or use grow=True)")
            self.grow_to(used + request.max_new_tokens)
        shifted = None
        for layer, source, used in zip(self.cache.layers, layers, used_by_layer):
            if isinstance(layer, ReducedSlotLayer):
                shifted = load_reduced(layer, slot, source)
            elif isinstance(layer, PackedSlotLayer):
                load_packed(layer.packed, slot, source.packed, used)
            elif not _is_slot(source.keys, layer.keys, slot):  # written straight into the slot at compression, or not
                layer.keys[slot, :, :used] = source.keys[0, :, :used]
                layer.values[slot, :, :used] = source.values[0, :, :used]
            layer.layout.load(layer, slot, source, used)
            if layer.slot_states is not None:  # the request's state replaces the slot's last one
                layer.slot_states[slot] = source.slot_states[0] if source.slot_states else None
        return shifted


def continue_prefix(prefix, ids: torch.Tensor):
    """A copy of the prefilled session ``prefix`` with ``ids`` ``[1, n]`` prefilled on top: the copy, the next-token
    logits and the seconds it took (the request's time to first token: the prefix is not recomputed)."""
    started = time.perf_counter()
    session = prefix.fork()
    logits = session.step(ids)[:, -1]
    if logits.is_cuda:
        torch.cuda.synchronize(logits.device)
    return session, logits, time.perf_counter() - started


def slots_needed(config, policy: Policy, request: Request) -> int:
    """Cache slots ``request`` needs under a growing ``policy`` (its largest head's, for per-head layouts)."""
    n = request.input_ids.numel()
    if request.prefix is not None:  # what the prefix's session holds, then the request's own tokens
        return max(layer.get_seq_length() for layer in request.prefix.cache.layers) + n + request.max_new_tokens
    (kv_heads, _, _), _ = cache_geometry(config)
    if request.compress_prefix is not None and request.compress_prefix < n:
        head = request.compress_prefix
        return policy.prompt_slots(head, kv_heads) + (n - head) + request.max_new_tokens
    return policy.prompt_slots(n, kv_heads) + request.max_new_tokens
