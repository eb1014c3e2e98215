"""LaCache, a ladder-shaped KV cache (Shi et al., ICML 2025, arXiv 2507.14204; reference code GATECH-EIC/LaCache at
commit 0f27c33bc1974c1f8a93656bca2dbb9641ef0937, ``LongBench/lacache/kv_cache.py`` (class ``LaCache``) as
``LongBench/pred.py`` calls it: once on the prompt's cache, then after every decode step)."""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar, NamedTuple

import torch

from evalkit.core.method_settings import setting

from ..views import DecodeView, PrefillView
from .base import Policy


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class Ladder(NamedTuple):
    """One model's ladder: every ``before`` consecutive cache entries of a rung, each layer keeps ``after`` of them,
    layer ``i`` from offset ``i % (before - after + 1)`` (deeper layers shifted along the sequence)."""

    layers: int
    before: int
    after: int

    @property
    def reduce(self) -> int:
        return self.before - self.after


class State(NamedTuple):
    """The reference's running values between two calls: its cache size (raised once by ``(before - after) // 2``
    on the first call that finds the cache over it, to match the average size), its cursor (cache entries before it
    are compacted) and whether the raise happened."""

    size: int
    cursor: int
    raised: bool


def ladder_of(layers: int, span: int, overlap: int) -> Ladder:
    step = span - overlap
    before = 1 + _ceil_div(layers - span, step)
    return Ladder(layers, before, min(_ceil_div(span, step), before))


def _rungs(start: int, count: int, before: int, after: int, shift: int, stride: int) -> list[int]:
    return [start + shift + before * j + stride * k for j in range(count) for k in range(after)]


def compact(ladder: Ladder, start: int, state: State, length: int, layer: int) -> tuple[list[int] | None, State]:
    """One call of the reference on a cache of ``length`` entries (text order): the entries layer ``layer`` keeps
    (None: all of them) and the state after the call."""
    size, cursor, raised = state
    if length <= size:
        return None, state
    if not raised:
        size += ladder.reduce // 2
    excess, room = length - size, size - cursor - ladder.layers
    possible = (room // ladder.after) * ladder.reduce
    count = _ceil_div(excess, ladder.reduce) if excess <= possible else room // ladder.after
    shift = layer % (ladder.reduce + 1)
    kept = [*range(cursor), *_rungs(cursor, count, ladder.before, ladder.after, shift, 1),
            *range(cursor + ladder.before * count, length)]
    if excess <= possible:
        return kept, State(size, cursor + count * ladder.after, True)
    # Start over: the compacted span from ``start`` is compacted again, ``rounds`` rungs at once.
    left = excess - possible
    rounds = _ceil_div(left, ((size - start - ladder.layers) // ladder.after) * ladder.reduce)
    before = ladder.before + (rounds - 1) * (ladder.before - 1)
    count = _ceil_div(left, before - ladder.after)
    again = [*range(start), *_rungs(start, count, before, ladder.after, layer % (before - ladder.after + 1), rounds),
             *range(start + before * count, len(kept))]
    return _distinct([kept[j] for j in again]), State(size, start + count * ladder.after, True)


def _distinct(kept: list[int]) -> list[int]:
    if any(a >= b for a, b in zip(kept, kept[1:])):
        raise ValueError("lacache's start-over keeps a token twice with these span and overlap (the reference's "
                         "does too): lower overlap")
    return kept


def _call(ladder: Ladder, start: int, state: State, length: int) -> tuple[State, int]:
    """The state after a call on ``length`` entries, and the entries each layer then holds."""
    kept, after = compact(ladder, start, state, length, 0)
    return after, (length if kept is None else len(kept))


@functools.lru_cache(maxsize=64)
def _trajectory(ladder: Ladder, start: int, size: int, prompt: int) -> list[tuple[State, int]]:
    """The state and the entries held after the prompt's call, then after each decode step's so far (a list the
    decode steps extend)."""
    return [_call(ladder, start, State(size, start, False), prompt)]


@dataclasses.dataclass
class LaCache(Policy):
    """Every layer keeps the first ``start_size`` tokens and the latest ones in full, and between them a ladder: of
    every ``before = 1 + ceil((layers - span) / (span - overlap))`` consecutive tokens, layer ``i`` keeps ``after =
    min(ceil(span / (span - overlap)), before)`` from offset ``i % (before - after + 1)``, deeper layers (in each cycle
    of ``before - after + 1`` layers) holding later tokens of the rung. The prompt's cache is compacted once after
    prefill, then once after each decode step's attention where the cache is over its size: a cursor walks from
    ``start_size`` to the end of the cache, compacting just enough rungs of the tokens past it; once it reaches the
    end it starts over at ``start_size`` and compacts the already compacted span again, several rungs into one.

    Sizes: the reference's ``cache_size`` is raised by ``(before - after) // 2`` on its first compaction; evalkit's
    ``capacity`` is the most tokens a layer holds (a step's token included), the raised size plus one, so the
    reference's ``cache_size`` is ``capacity - 1 - (before - after) // 2``. ``start_size`` is clamped per prompt as
    ``LongBench/pred.py`` does, to ``min(start_size, max(1, n - layers - 1), cache_size - layers - 1)`` (its default
    128 is the LongBench one; ``ppl/run.py`` uses a fixed 4). Differences from the reference: keys keep the RoPE of
    their true text positions and queries their own (the reference stores keys before RoPE and rotates each by its
    index in the cache, its queries by the cache's length: StreamingLLM's position shift); settings where the
    reference would divide by zero (``span - overlap`` so large that ``before == after``, or no room for a rung
    after ``start_size``) are refused, as are those where its start-over would keep a token twice.
    """

    name: ClassVar[str] = "lacache"
    per_head: ClassVar[bool] = True
    evicts_while_decoding: ClassVar[bool] = True
    wrappable: ClassVar[bool] = False
    capacity: int = setting(low=3)
    start_size: int = setting(128, low=1)
    span: int = setting(16, low=1)
    overlap: int = setting(0, low=0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.overlap >= self.span:
            raise ValueError(f"LaCache.overlap must be < span ({self.span}), got {self.overlap}")

    def prompt_capacity(self) -> int:
        return self.capacity - 1

    def cache_capacity(self) -> int:
        return self.capacity

    def check_layers(self, num_layers: int) -> None:
        self._plan(num_layers)

    def _plan(self, layers: int) -> tuple[Ladder, int]:
        """The model's ladder and the reference's ``cache_size``; a ValueError where the reference cannot run."""
        ladder = ladder_of(layers, self.span, self.overlap)
        if ladder.reduce < 1:
            raise ValueError(f"lacache with span={self.span}, overlap={self.overlap} keeps every token on a "
                             f"{layers}-layer model (its ladder needs span - overlap < layers): lower span")
        size = self.capacity - 1 - ladder.reduce // 2
        start = min(self.start_size, size - layers - 1)
        if start < 1 or (size + ladder.reduce // 2 - start - layers) // ladder.after < 1:
            raise ValueError(f"lacache's capacity {self.capacity} leaves no room for a ladder on a {layers}-layer "
                             f"model (start_size={self.start_size}, span={self.span}): raise the budget")
        return ladder, size

    def _start(self, ladder: Ladder, size: int, prompt: int) -> int:
        return min(self.start_size, max(1, prompt - ladder.layers - 1), size - ladder.layers - 1)

    def state_before(self, layers: int, prompt: int, steps: int) -> tuple[Ladder, int, State]:
        """The ladder, the start size and the reference's state before decode step ``steps`` (1: the first) of a
        ``prompt``-token prompt."""
        ladder, size = self._plan(layers)
        start = self._start(ladder, size, prompt)
        calls = _trajectory(ladder, start, size, prompt)
        while len(calls) < steps:
            state, held = calls[-1]
            calls.append(_call(ladder, start, state, held + 1))
        return ladder, start, calls[steps - 1][0]

    def select(self, view: PrefillView, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, n = view.key_valid.shape
        ladder, size = self._plan(view.num_layers)
        picks = []
        for row in range(batch):
            prompt = int(view.key_valid[row].sum())
            start = self._start(ladder, size, prompt)
            kept, _ = compact(ladder, start, State(size, start, False), prompt, view.layer_idx)
            picks.append([n - prompt + j for j in (range(prompt) if kept is None else kept)])
        width = max(len(p) for p in picks)
        indices = torch.tensor([p + [0] * (width - len(p)) for p in picks], device=view.keys.device)
        counts = torch.tensor([len(p) for p in picks], device=view.keys.device)
        return (indices[:, None].expand(-1, kv_heads, -1).contiguous(), counts[:, None].expand(-1, kv_heads).clone(),
                torch.zeros(batch, kv_heads, n, device=view.keys.device))

    def decode_evict(self, view: DecodeView) -> torch.Tensor | None:
        config, layer = view.module.config, view.module.layer_idx
        valid, positions = view.valid, view.positions
        freed = torch.zeros_like(valid)
        for row in range(valid.shape[0]):
            steps = int(view.steps[row])
            held = int(valid[row, 0].sum())
            if steps < 1 or bool((positions[row, 0][valid[row, 0]] < 0).any()):
                continue  # an idle slot of the engine
            prompt = int(view.position[row]) - steps + 1
            ladder, start, state = self.state_before(config.num_hidden_layers, prompt, steps)
            kept, _ = compact(ladder, start, state, held, layer)
            if kept is None:
                continue
            order = positions[row].masked_fill(~valid[row], torch.iinfo(positions.dtype).max).argsort(dim=-1)
            keep = torch.zeros(valid.shape[1], valid.shape[2], dtype=torch.bool, device=valid.device)
            keep[:, torch.tensor(kept, device=valid.device)] = True
            freed[row] = valid[row] & ~torch.zeros_like(keep).scatter_(-1, order, keep)
        return freed

