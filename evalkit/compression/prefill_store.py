"""Prefills kept for reuse: a prompt's prefill pass does not depend on the method (every layer attends to the whole
prompt; the method only decides what the cache keeps of it), so a sweep of methods over the same prompts can run the
model over each prompt once. While a :class:`PrefillStore` is active (:func:`sharing_prefills`), a session's
one-pass prefill records what each layer's attention hands the cache (queries, keys, values, the attention's input)
and the last token's logits; a later session of the same model and prompt replays those calls into its own cache
instead of running the model, with the same arithmetic after them (kept tokens and outputs identical). A method
whose own passes after the prefill score the prompt whatever the budget (KVzip's reconstruction) records those
scores too, and a later budget of it keeps its share of them. Bounded in bytes, least recently used first out."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import weakref

import torch


@dataclasses.dataclass
class LayerCall:
    """One layer's prefill attention as the hook saw it."""

    layer_idx: int
    module: torch.nn.Module
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    scaling: float
    hidden: list[torch.Tensor] | None  # the attention's input, where it was recorded


@dataclasses.dataclass
class RecordedPrefill:
    model: weakref.ref
    calls: list[LayerCall]
    logits: torch.Tensor

    @property
    def nbytes(self) -> int:
        tensors = [self.logits, *(t for c in self.calls for t in (c.query, c.key, c.value, *(c.hidden or [])))]
        return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


@dataclasses.dataclass
class RecordedScores:
    """A method's pass scores over one prompt (``budget_free_passes``) and the prefill's peak bytes as they left it."""

    model: weakref.ref
    scores: torch.Tensor
    peak_bytes: int

    @property
    def nbytes(self) -> int:
        return self.scores.numel() * self.scores.element_size()


class PrefillStore:
    """Recorded prefills by model and prompt, at most ``max_bytes`` of them (the least recently used go first)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self.entries: collections.OrderedDict[tuple, RecordedPrefill] = collections.OrderedDict()
        self.sizes: dict[tuple, int] = {}  # each entry's bytes
        self.hits = self.misses = 0

    @staticmethod
    def key(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, positions: torch.Tensor) -> tuple:
        digest = hashlib.sha256()
        for tensor in (input_ids, attention_mask, positions):
            if tensor is not None:
                digest.update(str(tuple(tensor.shape)).encode())
                digest.update(tensor.detach().to("cpu", torch.long).numpy().tobytes())
        return id(model), model.config._attn_implementation, str(input_ids.device), digest.hexdigest()

    @staticmethod
    def passes_key(prefill_key: tuple, policy) -> tuple:
        """A method's pass scores over the prompt of ``prefill_key``: its class and every setting but the budget's."""
        settings = {k: v for k, v in policy.settings().items() if k not in policy.budget_fields}
        return (*prefill_key, "passes", type(policy).__qualname__, repr(sorted(settings.items())),
                repr(getattr(policy, "prompts", None)))

    def get(self, key: tuple, model) -> RecordedPrefill | RecordedScores | None:
        entry = self.entries.get(key)
        if entry is None or entry.model() is not model:
            self.misses += 1
            return None
        self.entries.move_to_end(key)
        self.hits += 1
        return entry

    def clear(self) -> None:
        self.entries.clear()
        self.sizes.clear()

    def put(self, key: tuple, entry: RecordedPrefill | RecordedScores) -> None:
        size = entry.nbytes
        if size > self.max_bytes:
            return
        self.entries[key] = entry
        self.sizes[key] = size
        while sum(self.sizes.values()) > self.max_bytes:
            oldest, _ = self.entries.popitem(last=False)
            del self.sizes[oldest]


_ACTIVE: list[PrefillStore] = []


def active() -> PrefillStore | None:
    """The store sessions record into and replay from now, or None."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextlib.contextmanager
def sharing_prefills(store: PrefillStore):
    """Sessions record and replay their prefills through ``store`` for the duration."""
    _ACTIVE.append(store)
    try:
        yield store
    finally:
        _ACTIVE.pop()
