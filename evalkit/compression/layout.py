"""The slot arithmetic that the session's cache (:mod:`.cache`) and the engine's per-slot cache (:mod:`.slots`) share,
so that a token lands in the same slot either way (the engine-equals-alone tests hold them to it):

* row layouts: the first ``fixed`` slots are never overwritten, then a ring of ``ring`` slots is written oldest first;
* per-head layouts: each KV head's new token takes that head's first free slot;
* the peak: the most tokens a row (or head) held at once, counted for active rows only.

Every function is shape-static (no host sync), so a compiled decode step can call it.
"""

from __future__ import annotations

import torch


def ring_slot(index: torch.Tensor, fixed: torch.Tensor, ring: torch.Tensor) -> torch.Tensor:
    """The slot of the ``index``-th write (counting from 0, wrapped writes included) of a row with ``fixed`` slots
    kept and a ring of ``ring`` after them; the arguments broadcast."""
    return torch.where(index < fixed, index, fixed + (index - fixed) % ring)


def first_free(valid: torch.Tensor, count: int | None = None) -> torch.Tensor:
    """Each head's first free slot ``[..., heads]`` of ``valid [..., heads, slots]`` (``count=None``), or its first
    ``count`` free slots in slot order ``[..., heads, count]`` (slot 0 where a head has none: callers check)."""
    if count is None:
        return (~valid).to(torch.uint8).argmax(dim=-1)
    return valid.to(torch.uint8).argsort(dim=-1, stable=True)[..., :count]


def occupy(heads, index: tuple[torch.Tensor, ...], positions: torch.Tensor) -> None:
    """Mark the slots ``index`` (``(rows, heads, slots)``, broadcasting) of a per-head layout as holding new tokens
    at text ``positions`` (broadcast like the slots): valid, their positions set, their running score (if any) zero.
    ``heads`` has ``valid``, ``positions`` and ``scores`` (a :class:`.cache.HeadState` or an engine slot layer);
    written in place (``index_put_``: a compiled graph keeps it in place)."""
    slots = index[-1]
    heads.valid.index_put_(index, torch.ones_like(slots, dtype=torch.bool))
    heads.positions.index_put_(index, positions.expand_as(slots))
    if heads.scores is not None:
        heads.scores.index_put_(index, torch.zeros_like(slots, dtype=heads.scores.dtype))


def raised_peak(peak: torch.Tensor, held: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """``peak`` raised to ``held`` where the row is ``active`` (``active [B]`` broadcast over trailing head axes)."""
    active = active.reshape(active.shape + (1,) * (peak.dim() - active.dim()))
    return torch.where(active, torch.maximum(peak, held), peak)
