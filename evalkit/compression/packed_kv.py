"""A layer's keys and values stored as a quantized KV format stores them (:mod:`.kv_format`): what ``kv_bits`` frees.

Per layer, ``[B, H, S]`` slots of width ``D``, ``G`` the format's group, ``R`` its residual:

* codes ``key_codes`` / ``value_codes`` ``[B, H, S, D * bits / 8]`` uint8, planar: byte ``j`` holds channels ``j``,
  ``j + D / per``, ... of its token (``per = 8 / bits`` codes a byte), so unpacking is one shift and mask a field;
* the keys' groups: ``key_scale`` and ``key_min`` ``[B, H, E, D]`` (a group's per channel; entry 0 all zero) and
  each slot's entry ``key_group`` ``[B, H, S]`` (0: not quantized); entries no held slot uses are reused;
* the values' groups: ``value_scale`` and ``value_min`` ``[B, H, S, D / G]`` (per token and channel group);
* the full-precision residual: ``residual_keys`` / ``residual_values`` ``[B, H, R + 1, D]`` at ``position % (R +
  1)`` (a value leaves after the step that sees it ``R`` tokens old, so ``R + 1`` are held at once), each slot's
  index there ``residual_slot`` (-1: none), and whether its key, its value, is still there (``key_fresh``,
  ``value_fresh``).

A decode step dequantizes the layer into a workspace its cache lends (one layer at a time), writes the step's tokens
there and in the residual, attends, and quantizes what the format's rules release (:meth:`.KVFormat.settle`'s: the
value ``R`` tokens old, the keys of a complete block of ``R`` generated tokens). The workspace holds exactly the
dense format's ``codes * scale + minimum``: the outputs are the dense format's, bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from . import packed_kernels
from .kv_format import KVFormat

# The per-slot fields ``[B, H, S, ...]`` and what an empty slot holds.
SLOT_FIELDS = (("key_codes", 0), ("value_codes", 0), ("value_scale", 0.0), ("value_min", 0.0), ("key_group", 0),
               ("residual_slot", -1), ("key_fresh", False), ("value_fresh", False))


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Whole-number codes ``[..., D]`` (any dtype) as planar bytes ``[..., D * bits / 8]``."""
    codes = codes.to(torch.uint8)
    per = 8 // bits
    fields = codes.unflatten(-1, (per, -1))
    packed = fields[..., 0, :].clone()
    for j in range(1, per):
        packed |= fields[..., j, :] << (j * bits)
    return packed


def unpack_codes(packed: torch.Tensor, bits: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Planar bytes ``[..., W]`` back to codes ``[..., W * 8 / bits]`` (uint8), into ``out`` if given."""
    per = 8 // bits
    if per == 1:
        return packed
    out = packed.new_empty(*packed.shape[:-1], per * packed.shape[-1]) if out is None else out
    fields, mask = out.unflatten(-1, (per, -1)), (1 << bits) - 1
    for j in range(per):
        torch.bitwise_and(packed >> (j * bits) if j else packed, mask, out=fields[..., j, :])
    return out


@dataclasses.dataclass
class PackedKV:
    fmt: KVFormat
    key_codes: torch.Tensor
    value_codes: torch.Tensor
    key_scale: torch.Tensor
    key_min: torch.Tensor
    key_group: torch.Tensor
    value_scale: torch.Tensor
    value_min: torch.Tensor
    residual_keys: torch.Tensor
    residual_values: torch.Tensor
    residual_slot: torch.Tensor
    key_fresh: torch.Tensor
    value_fresh: torch.Tensor
    rooms: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict, repr=False)  # each slot field's storage

    @classmethod
    def from_prompt(cls, fmt: KVFormat, keys: torch.Tensor, values: torch.Tensor, held: torch.Tensor) -> PackedKV:
        """The kept prompt ``[B, H, S, D]`` packed whole (:meth:`.KVFormat.quantize_prompt`'s groups: keys in groups
        of ``G`` held tokens in slot order); ``held`` ``[B, H or 1, S]``."""
        batch, heads, slots, dim = keys.shape
        held = held.expand(batch, heads, slots)
        groups = math.ceil(slots / fmt.group_size)
        group = ((held.long().cumsum(dim=-1) - 1).clamp(min=0) // fmt.group_size).masked_fill(~held, groups)
        low, high = _group_bounds(keys, group, groups)
        index = group[..., None].expand_as(keys)
        codes, _ = fmt.encode(keys, low.gather(2, index), high.gather(2, index))
        tables = [torch.cat([t.new_zeros(batch, heads, 1, dim), t[:, :, :groups].nan_to_num(0.0, 0.0, 0.0)], dim=2)
                  for t in ((high - low) / (2 ** fmt.bits - 1), low)]
        value_codes, value_scale, value_min = _values_encoded(fmt, values)
        residual = keys.new_zeros(batch, heads, fmt.residual + 1, dim)
        return cls(fmt, pack_codes(torch.where(held[..., None], codes, 0), fmt.bits), pack_codes(value_codes, fmt.bits),
                   *tables, torch.where(held, group + 1, 0).int(), torch.where(held[..., None], value_scale, 0.0),
                   torch.where(held[..., None], value_min, 0.0), residual,
                   residual.clone(), torch.full_like(group, -1, dtype=torch.int16), torch.zeros_like(held),
                   torch.zeros_like(held))

    @property
    def slots(self) -> int:
        return self.key_codes.shape[2]

    @property
    def device(self) -> torch.device:
        return self.key_codes.device

    @property
    def dense_shape(self) -> tuple[int, int, int, int]:
        """``[B, H, S, D]``: the keys' (and values') shape dequantized."""
        return (*self.key_codes.shape[:3], self.residual_keys.shape[-1])

    def tensors(self) -> list[torch.Tensor]:
        return [value for value in vars(self).values() if isinstance(value, torch.Tensor)]

    def nbytes(self) -> int:
        """The bytes of the tensors' storage, the room kept for later slots included."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self.tensors()}
        return sum(storages.values())

    @property
    def room(self) -> int:
        """The slots the storage has room for (the tensors are views of their first :attr:`slots`)."""
        return self.key_codes.stride(1) // self.key_codes.stride(2)

    def pad(self, slots: int) -> None:
        """Room for ``slots`` slots; new ones empty. The storage grows by a sixteenth at a time (a growing cache
        allocates once every so many steps, not every step) and the fields are views of its first ``slots``."""
        if slots <= self.slots:
            return
        grown = slots > self.room
        room = slots + max(16, slots // 16) if grown else self.room
        for name, fill in SLOT_FIELDS:
            tensor, whole = getattr(self, name), self.rooms.get(name)
            if grown:
                whole = tensor.new_full((*tensor.shape[:2], room, *tensor.shape[3:]), fill)
                whole[:, :, : tensor.shape[2]] = tensor
            elif whole is None:
                whole = tensor.as_strided((*tensor.shape[:2], room, *tensor.shape[3:]), tensor.stride())
            self.rooms[name] = whole
            setattr(self, name, whole.narrow(2, 0, slots))

    # -- a decode step -----------------------------------------------------------------------------------------------
    @property
    def like(self) -> torch.Tensor:
        """What the layer's dequantized form is made like (dtype, device)."""
        return self.residual_keys

    def dequantize(self, keys: torch.Tensor, values: torch.Tensor, lend=None) -> None:
        """Every slot's key and value into ``keys``, ``values`` ``[B, H, S, D]``: codes times scale plus minimum, the
        residual's where it holds them. ``lend(name, shape, like)``: where the torch path takes its buffers for the
        codes ``[B, H, S, D]`` (uint8) and each slot's key scale and minimum ``[2, B * H * S, D]`` (reused step after
        step: no fresh tensors, no page faults); none, fresh ones."""
        bits, group = self.fmt.bits, self.fmt.group_size
        if packed_kernels.applies(self, keys, values):
            return packed_kernels.dequantize(self, keys, values)
        batch, heads, slots, dim = keys.shape
        lend = lend or (lambda name, shape, like: like.new_empty(shape))
        codes, params = lend("codes", keys.shape, self.key_codes), lend("params", (2, batch * heads * slots, dim), keys)
        rows = (torch.arange(batch * heads, device=keys.device)[:, None] * self.key_scale.shape[2]
                + self.key_group.reshape(batch * heads, slots)).view(-1)
        for table, out in zip((self.key_scale, self.key_min), params):
            torch.index_select(table.view(-1, dim), 0, rows, out=out)
        # codes * scale, then + minimum: two roundings, as the dense format (a fused multiply-add differs by CPU)
        torch.mul(unpack_codes(self.key_codes, bits, codes), params[0].view(keys.shape), out=keys)
        keys.add_(params[1].view(keys.shape))
        grouped = values.view(batch, heads, slots, dim // group, group)
        torch.mul(unpack_codes(self.value_codes, bits, codes).view(grouped.shape), self.value_scale[..., None],
                  out=grouped)
        grouped.add_(self.value_min[..., None])
        for fresh, residual, target in ((self.key_fresh, self.residual_keys, keys),
                                        (self.value_fresh, self.residual_values, values)):
            rows, head, slot = fresh.nonzero(as_tuple=True)
            target[rows, head, slot] = residual[rows, head, self.residual_slot[rows, head, slot].long()]

    def hold(self, index: tuple[torch.Tensor, ...], positions: torch.Tensor, key_states: torch.Tensor,
             value_states: torch.Tensor) -> None:
        """New tokens written at ``index`` (``(rows, heads, slots)``, as :func:`.layout.put_tokens` writes) at text
        ``positions`` (broadcast like the slots): into the residual, their slots no longer quantized."""
        slots = index[2]
        if (key_states.shape[2] == 1 and slots.dtype == positions.dtype == torch.int64
                and slots.shape[0] == positions.shape[0] == key_states.shape[0] and positions.shape[1] == 1
                and packed_kernels.applies(self, key_states, value_states)):
            if not packed_kernels.hold_token(self, slots, positions, key_states, value_states):
                raise self._overrun(1)
            return
        rows, heads = index[:2]
        at = (positions % self.residual_keys.shape[2]).expand_as(slots)
        busy = self.residual_slot == at[..., :1]
        for j in range(1, at.shape[-1]):
            busy |= self.residual_slot == at[..., j:j + 1]
        busy &= self.key_fresh | self.value_fresh
        busy[index] = False  # the slots written now give theirs up
        if at.shape[-1] > self.residual_keys.shape[2] or bool(busy.any()):
            raise self._overrun(at.shape[-1])
        self.residual_keys.index_put_((rows, heads, at), key_states)
        self.residual_values.index_put_((rows, heads, at), value_states)
        self.residual_slot.index_put_(index, at.to(self.residual_slot.dtype))
        self.key_fresh[index] = self.value_fresh[index] = True
        self.key_group[index] = 0

    def _overrun(self, tokens: int) -> ValueError:
        return ValueError(f"a step of {tokens} tokens overruns kv_bits' full-precision residual (kv_residual="
                          f"{self.fmt.residual}: the tokens of its last steps are still held there); feed fewer tokens "
                          "a step")

    def settle(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, position: torch.Tensor,
               steps: torch.Tensor, held: torch.Tensor) -> None:
        """After a step's attention over ``keys``, ``values`` (the dequantized workspace), quantize what leaves the
        residual: :meth:`.KVFormat.settle`'s tokens, with its arguments; ``held`` ``[B, H or 1, S]`` the valid
        slots (the key groups they use stay allocated; an evicted token gives its residual entry up)."""
        if (positions.dtype == position.dtype == steps.dtype == torch.int64 and positions.stride(-1) == 1
                and held.stride(-1) == 1 and packed_kernels.applies(self, values)):
            if packed_kernels.settle_values(self, values, positions, position, steps, held):
                self._quantize_block(keys, self._completed(positions, position - steps + 1, position), positions,
                                     position, held)
            return
        self.key_fresh &= held
        self.value_fresh &= held
        first, here = position - steps + 1, position
        generated = positions >= first[:, None, None]
        leaving = (generated & (positions <= here[:, None, None] - self.fmt.residual)).expand_as(self.value_fresh)
        leaving = leaving & self.value_fresh
        if bool(leaving.any()):
            self._quantize_values(values, leaving)
        block = self._completed(positions, first, here)
        if bool(block.any()):
            self._quantize_block(keys, block, positions, here, held)

    def _completed(self, positions: torch.Tensor, first: torch.Tensor, here: torch.Tensor) -> torch.Tensor:
        """``[B, H, S]``: the slots of generated tokens whose keys a step at ``here`` (``[B]``, the first generated
        token at ``first``) completes a block of, still in the residual."""
        residual = self.fmt.residual
        complete = ((here - first + 1) % residual == 0)[:, None, None]
        block = (positions >= first[:, None, None]) & (positions > here[:, None, None] - residual) & complete
        return block.expand_as(self.key_fresh) & self.key_fresh

    def _quantize_values(self, values: torch.Tensor, leaving: torch.Tensor) -> None:
        rows, heads, slots = leaving.nonzero(as_tuple=True)
        codes, scale, low = _values_encoded(self.fmt, values[rows, heads, slots])
        self.value_codes[rows, heads, slots] = pack_codes(codes, self.fmt.bits)
        self.value_scale[rows, heads, slots], self.value_min[rows, heads, slots] = scale, low
        self.value_fresh[rows, heads, slots] = False

    def _quantize_block(self, keys: torch.Tensor, block: torch.Tensor, positions: torch.Tensor, here: torch.Tensor,
                        held: torch.Tensor) -> None:
        """The keys of a complete ``block`` (``[B, H, S]``; the step at ``here`` ``[B]`` its last), per channel over
        their groups (by place in the block), into newly allocated table entries."""
        fmt, count = self.fmt, self.fmt.residual // self.fmt.group_size
        group = ((positions - (here[:, None, None] - fmt.residual + 1)).clamp(min=0) // fmt.group_size)
        group, held = group.expand_as(block), held.expand_as(block)
        low, high = _group_bounds(keys, group.masked_fill(~block, count), count)
        index = group.clamp(max=count - 1)[..., None].expand_as(keys)
        codes, _ = fmt.encode(keys, low.gather(2, index), high.gather(2, index))
        entries = self._allocate(count, held & ~self.key_fresh)
        completes = block.any(dim=-1)  # [B, H]: the (row, head) pairs whose block is complete
        rows, heads = completes.nonzero(as_tuple=True)
        for table, new in ((self.key_scale, (high - low) / (2 ** fmt.bits - 1)), (self.key_min, low)):
            table[rows[:, None], heads[:, None], entries[rows, heads]] = new[:, :, :count].nan_to_num(
                0.0, 0.0, 0.0)[rows, heads]
        rows, heads, slots = block.nonzero(as_tuple=True)
        self.key_codes[rows, heads, slots] = pack_codes(codes[rows, heads, slots], fmt.bits)
        self.key_group[rows, heads, slots] = entries[rows, heads, group[rows, heads, slots]].to(self.key_group.dtype)
        self.key_fresh[rows, heads, slots] = False

    def _allocate(self, count: int, quantized: torch.Tensor) -> torch.Tensor:
        """``count`` table entries per row and head ``[B, H, count]`` that no ``quantized`` slot uses (entry 0 never);
        the table grows where too few are free."""
        used = torch.zeros(self.key_scale.shape[:3], dtype=torch.bool, device=self.key_scale.device)
        used.scatter_(2, self.key_group.long() * quantized, True)  # unquantized slots mark entry 0, always used
        used[:, :, 0] = True
        short = count - int((~used).sum(dim=-1).min())
        if short > 0:
            for name in ("key_scale", "key_min"):
                table = getattr(self, name)
                setattr(self, name, torch.cat([table, table.new_zeros(*table.shape[:2], short, table.shape[3])], dim=2))
            used = torch.nn.functional.pad(used, (0, short), value=False)
        return used.to(torch.uint8).argsort(dim=-1, stable=True)[..., :count]


def _group_bounds(keys: torch.Tensor, group: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per channel, the minimum and maximum of ``keys`` ``[B, H, S, D]`` over each of ``groups`` groups (``group``
    ``[B, H, S]``; ``groups`` itself: in none) ``[B, H, groups + 1, D]``."""
    index = group[..., None].expand_as(keys)
    shape = (*keys.shape[:2], groups + 1, keys.shape[-1])
    low = keys.new_full(shape, math.inf).scatter_reduce(2, index, keys, "amin")
    high = keys.new_full(shape, -math.inf).scatter_reduce(2, index, keys, "amax")
    return low, high


def _values_encoded(fmt: KVFormat, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Values ``[..., D]`` per token over groups of channels: their codes ``[..., D]``, scales and minima ``[..., D /
    G]``, as :meth:`.KVFormat.values_per_token` quantizes them."""
    grouped = values.unflatten(-1, (-1, fmt.group_size))
    low, high = grouped.amin(dim=-1, keepdim=True), grouped.amax(dim=-1, keepdim=True)
    codes, scale = fmt.encode(grouped, low, high)
    return codes.flatten(-2), scale[..., 0], low[..., 0]



class PackedStorage:
    """What a session's cache layer needs to hold its keys and values packed: ``keys`` and ``values`` read the
    dense tensors, or a packed layer's dequantized form (the step's workspace while a decode step runs in the layer;
    else a fresh copy)."""

    packed: PackedKV | None = None
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None  # the dequantized layer of the step running now

    @property
    def keys(self) -> torch.Tensor:
        return self.__dict__.get("_keys") if self.packed is None else self._dense()[0]

    @keys.setter
    def keys(self, tensor: torch.Tensor) -> None:
        self._dense_only()
        self._keys = tensor

    @property
    def values(self) -> torch.Tensor:
        return self.__dict__.get("_values") if self.packed is None else self._dense()[1]

    @values.setter
    def values(self, tensor: torch.Tensor) -> None:
        self._dense_only()
        self._values = tensor

    @property
    def slot_count(self) -> int:
        return self.packed.slots if self.packed is not None else self.keys.shape[-2]

    @property
    def kv_heads(self) -> int:
        return self.packed.dense_shape[1] if self.packed is not None else self.keys.shape[1]

    def pack(self, fmt: KVFormat, held: torch.Tensor) -> None:
        """Hold the kept prompt packed from now on (``held`` ``[B, H or 1, S]``: the slots holding tokens)."""
        self.packed = PackedKV.from_prompt(fmt, self._keys, self._values, held)
        self._keys = self._values = None

    def open_step(self) -> None:
        """Dequantize the layer into its cache's workspace for the decode step about to run in it."""
        packed, lend = self.packed, functools.partial(_lent, self.cache)
        shape = packed.dense_shape
        keys, values = lend("keys", shape, packed.like), lend("values", shape, packed.like)
        packed.dequantize(keys, values, lend)
        self.workspace = keys, values

    def close_step(self, positions: torch.Tensor, step) -> None:
        """After the step's attention: quantize what leaves the residual (``positions`` ``[B, H or 1, S]`` of the
        held tokens, as :meth:`.KVFormat.settle` takes them), and give the workspace back."""
        self.packed.settle(*self.workspace, positions, step.positions[:, -1], step.steps, self.held_slots())
        self.workspace = None

    def held_slots(self) -> torch.Tensor:
        """``[B, H or 1, S]``: the slots holding tokens (a per-head layout's own, else the rows')."""
        return self.heads.valid if self.heads is not None else self.cache.state.valid[:, None, : self.packed.slots]

    def _dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.workspace is not None:
            return self.workspace
        packed = self.packed
        keys, values = (packed.like.new_empty(packed.dense_shape) for _ in range(2))
        packed.dequantize(keys, values)
        return keys, values

    def _dense_only(self) -> None:
        if self.packed is not None:
            raise RuntimeError("a packed layer's keys and values change only through its decode steps")


def _lent(cache, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A contiguous ``shape`` tensor of ``like``'s dtype and device from the cache's workspace ``name``: one buffer,
    lent to each layer in turn and kept from step to step (grown by a quarter when too small), so that a decode step
    makes no fresh tensors (their page faults cost more than the arithmetic) and a growing cache no new ones."""
    spaces = cache.__dict__.setdefault("workspaces", {})
    key, count = (name, like.dtype, like.device), math.prod(shape)
    if key not in spaces or spaces[key].numel() < count:
        spaces[key] = like.new_empty(count + count // 4)
    return spaces[key][:count].view(shape)


def packs(layer, cache) -> bool:
    """Whether a session's ``layer`` holds its quantized cache packed: where the head width splits into whole bytes,
    and not where the engine admits the request into a dense slot of this layer (which admission writes into; the
    engine's packed slots take the packed layer, :mod:`.engine.packed_slots`)."""
    fmt = layer.layout.policy.kv_format
    dense_slot = cache.targets is not None and cache.targets[layer.index] is not None
    return not dense_slot and layer.keys.shape[-1] % (8 // fmt.bits) == 0
