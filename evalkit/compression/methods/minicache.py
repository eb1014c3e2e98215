"""MiniCache (Liu et al., NeurIPS 2024, arXiv 2405.14366): cross-layer merging, as KVCache-Factory defines it
(``pyramidkv/minicache.py`` at c97f9d7: ``minicache_slerp``, ``select_minicache_retention_indices``,
``compress_minicache_pair``, ``restore_minicache_pair``)."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import torch

from evalkit.core.method_settings import setting

from ..views import PrefillView
from .base import Policy

EPS = 1e-6  # KVCache-Factory's ``eps``


def slerp_directions(current: torch.Tensor, previous: torch.Tensor, interpolation: float, eps: float = EPS):
    """``minicache_slerp``: states ``[..., n, D]`` of layer ``l`` and ``l - 1`` as unit directions and magnitudes
    (clamped at ``eps``), the directions merged by SLERP at ``interpolation`` (linearly where the angle's sine is at
    most ``eps``) and renormalized. Returns (shared direction, current magnitude ``[..., n, 1]``, previous
    magnitude, angle ``[..., n]``), in the inputs' dtype."""
    current_magnitude = current.norm(dim=-1, keepdim=True).clamp_min(eps)
    previous_magnitude = previous.norm(dim=-1, keepdim=True).clamp_min(eps)
    current_unit, previous_unit = current / current_magnitude, previous / previous_magnitude
    cosine = (current_unit * previous_unit).sum(dim=-1, keepdim=True).clamp(min=-1.0 + eps, max=1.0 - eps)
    angle = torch.acos(cosine)
    sine = torch.sin(angle)
    along = torch.sin((1.0 - interpolation) * angle) / sine * previous_unit + \
        torch.sin(interpolation * angle) / sine * current_unit
    linear = (1.0 - interpolation) * previous_unit + interpolation * current_unit
    shared = torch.where(sine.abs() > eps, along, linear)
    shared = shared / shared.norm(dim=-1, keepdim=True).clamp_min(eps)
    return shared, current_magnitude, previous_magnitude, angle.squeeze(-1)


def retained_tokens(distance: torch.Tensor, retention_ratio: float) -> torch.Tensor:
    """``select_minicache_retention_indices``: per head, the ``ceil(n * retention_ratio)`` tokens of largest angular
    distance ``[..., n]`` (ties to the earlier token), in text order ``[..., r]``."""
    n = distance.shape[-1]
    keep = min(n, math.ceil(n * retention_ratio))
    return distance.sort(dim=-1, descending=True, stable=True).indices[..., :keep].sort(dim=-1).values


def _gather(states: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return states.gather(-2, index[..., None].expand(*index.shape, states.shape[-1]))


@dataclasses.dataclass
class MergedPair:
    """What MiniCache holds of one pair of layers' states (keys, or values) ``[H, n, D]``: one shared direction, each
    layer's magnitudes ``[H, n, 1]``, and per head the ``r`` retained tokens of each layer ``[H, r, D]`` at
    ``retained`` ``[H, r]``, in the cache's dtype."""

    direction: torch.Tensor
    current_magnitude: torch.Tensor
    previous_magnitude: torch.Tensor
    current_retained: torch.Tensor
    previous_retained: torch.Tensor
    retained: torch.Tensor

    @classmethod
    def merge(cls, current: torch.Tensor, previous: torch.Tensor, interpolation: float,
              retention_ratio: float) -> MergedPair:
        """``compress_minicache_pair`` in float64 (the retention ranks angles), held in the states' dtype."""
        shared, current_magnitude, previous_magnitude, angle = slerp_directions(
            current.double(), previous.double(), interpolation)
        retained = retained_tokens(angle / math.pi, retention_ratio)
        dtype = current.dtype
        return cls(shared.to(dtype), current_magnitude.to(dtype), previous_magnitude.to(dtype),
                   _gather(current, retained), _gather(previous, retained), retained)

    def restore(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``restore_minicache_pair`` in float64 from what is held: the shared direction renormalized times each
        layer's magnitude, its retained tokens scattered back; (current, previous) in the held dtype."""
        direction = self.direction.double()
        unit = direction / direction.norm(dim=-1, keepdim=True).clamp_min(EPS)
        index = self.retained[..., None].expand_as(self.current_retained)
        return tuple((unit * magnitude.double()).to(self.direction.dtype).scatter(-2, index, tokens)
                     for magnitude, tokens in ((self.current_magnitude, self.current_retained),
                                               (self.previous_magnitude, self.previous_retained)))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in dataclasses.astuple(self))


@dataclasses.dataclass
class MiniCache(Policy):
    """Every prompt token kept; from ``start_layer`` (default: the middle layer, ``num_layers // 2``) on, the
    adjacent layers ``(start_layer, start_layer + 1)``, ``(start_layer + 2, start_layer + 3)``, ... merged once the
    deeper one's prefill ends, keys and values each apart, each row and KV head over its own prompt tokens
    (KVCache-Factory ``compress_minicache_pair`` / ``restore_minicache_pair``, whose defaults these are):

    * each token's state in both layers split into a unit direction and its norm; the two directions merged by SLERP
      at ``interpolation`` (the deeper layer's weight) into one shared direction;
    * per head the ``ceil(n * retention_ratio)`` tokens whose two directions are furthest apart (angle / pi) kept
      unmerged in both layers (ties to the earlier token);
    * a layer's restored state: the shared direction times its own magnitude, its retained tokens put back.

    The pair is computed in float64, held in the cache's dtype (:class:`MergedPair`) and restored from that. Generated
    tokens are not merged. KVCache-Factory ships these functions without a runtime and applies them to nothing
    else, so MiniCache runs alone and takes no budget.

    Storage: the cache holds each layer's restored keys and values (one dense block per layer), so ``kv_bytes_peak``
    counts them whole; what MiniCache itself would hold, one shared direction per pair plus the magnitudes and
    retained tokens, is priced in :meth:`merged_bytes` (the last prefill's). The previous layer of a pair is rewritten
    in place when the deeper one is merged, so the layout is per head (a row layout's layer may already have been
    copied into an engine slot by then)."""

    name: ClassVar[str] = "minicache"
    per_head: ClassVar[bool] = True
    rewrites: ClassVar[bool] = True
    wrappable: ClassVar[bool] = False
    takes_budget: ClassVar[bool] = False
    budget_fields: ClassVar[tuple[str, ...]] = ()
    interpolation: float = setting(0.6, low=0, high=1)
    retention_ratio: float = setting(0.05, low=0, high=1)
    start_layer: int | None = setting(None, low=0)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._pending: dict[int, tuple] = {}  # the previous layer of the pair being merged: its kept tensors
        self.merged: dict[tuple[int, int], tuple[int, int]] = {}  # (previous, current): (bytes held, dense bytes)

    def first_layer(self, num_layers: int) -> int:
        return num_layers // 2 if self.start_layer is None else self.start_layer

    def pairs(self, num_layers: int) -> list[tuple[int, int]]:
        """The (previous, current) layers merged in a model of ``num_layers`` layers."""
        return [(layer, layer + 1) for layer in range(self.first_layer(num_layers), num_layers - 1, 2)]

    def check_layers(self, num_layers: int) -> None:
        if not self.pairs(num_layers):
            raise ValueError(f"MiniCache.start_layer={self.first_layer(num_layers)} leaves no pair of adjacent layers "
                             f"to merge in a {num_layers}-layer model")

    def merged_bytes(self) -> dict[str, int]:
        """The last prefill's merged layers, summed over its rows: the bytes MiniCache holds for them
        (``kv_bytes_merged``: shared directions, magnitudes, retained tokens and their indices, in the cache's dtype)
        and the bytes their dense keys and values take (``kv_bytes_dense``)."""
        return {"kv_bytes_merged": sum(held for held, _ in self.merged.values()),
                "kv_bytes_dense": sum(dense for _, dense in self.merged.values())}

    def rewrite(self, view: PrefillView, indices: torch.Tensor, counts: torch.Tensor, keys: torch.Tensor,
                values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        layer, pairs = view.layer_idx, self.pairs(view.num_layers)
        if layer in (previous for previous, _ in pairs):
            if layer == pairs[0][0]:
                self.merged = {}  # a new prefill
            self._pending = {layer: (indices, counts, keys, values)}
            return keys, values
        pending = self._pending.pop(layer - 1, None)
        if pending is None or (layer - 1, layer) not in pairs:  # not a pair's deeper layer, or its partner not ours
            return keys, values
        if not (torch.equal(pending[0], indices) and torch.equal(pending[1], counts)):
            raise RuntimeError(f"MiniCache cannot merge layers {layer - 1} and {layer}: they kept different tokens")
        keys, values = keys.clone(), values.clone()
        held = dense = 0
        for row in range(keys.shape[0]):
            n = int(counts[row].max())
            for current, previous in ((keys, pending[2]), (values, pending[3])):
                pair = MergedPair.merge(current[row, :, :n], previous[row, :, :n], self.interpolation,
                                        self.retention_ratio)
                current[row, :, :n], previous[row, :, :n] = pair.restore()  # previous: its layer's tensor, in place
                held += pair.nbytes()
                dense += 2 * current[row, :, :n].numel() * current.element_size()
        self.merged[(layer - 1, layer)] = (held, dense)
        return keys, values
