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

    def unit(self) -> torch.Tensor:
        """The shared direction renormalized, in float64 (what both layers' restored states scale)."""
        direction = self.direction.double()
        return direction / direction.norm(dim=-1, keepdim=True).clamp_min(EPS)

    def restore_layer(self, deeper: bool, out: torch.Tensor | None = None,
                      unit: torch.Tensor | None = None) -> torch.Tensor:
        """``restore_minicache_pair`` for one layer (``deeper``: the pair's current one) from what is held, in float64:
        the shared direction renormalized (``unit``, if computed already) times its magnitude, in the held dtype (into
        ``out`` ``[H, n, D]`` if given), its retained tokens put back."""
        magnitude, tokens = ((self.current_magnitude, self.current_retained) if deeper
                             else (self.previous_magnitude, self.previous_retained))
        restored = (self.unit() if unit is None else unit) * magnitude.double()
        out = restored.to(self.direction.dtype) if out is None else out.copy_(restored)
        return out.scatter_(-2, self.retained[..., None].expand_as(tokens), tokens)

    def restore(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Both layers' restored states: (current, previous) in the held dtype."""
        unit = self.unit()
        return self.restore_layer(True, unit=unit), self.restore_layer(False, unit=unit)

    def layer_bytes(self, deeper: bool) -> int:
        """The bytes one layer of the pair holds: the deeper one its magnitudes and retained tokens, the shared
        direction and the retained positions (held once per pair); the other its magnitudes and retained tokens."""
        own = (self.current_magnitude, self.current_retained) if deeper else (self.previous_magnitude,
                                                                              self.previous_retained)
        return sum(t.numel() * t.element_size() for t in (*own, *((self.direction, self.retained) if deeper else ())))

    def nbytes(self) -> int:
        return self.layer_bytes(True) + self.layer_bytes(False)


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

    Storage (:mod:`..merged_storage`): a session's merged layers hold what MiniCache holds, the pair's shared
    direction and retained positions once, each layer its magnitudes and retained tokens, and after the prompt its
    generated tokens dense; a decode step restores the layer into a workspace its cache lends, so ``kv_bytes_peak``
    falls by the merged share. The engine's slots hold keys and values dense (as under ``kv_bits``): there the
    merged layers are held restored and priced as MiniCache holds them (:meth:`layer_bytes`); so are they under a
    quantized KV format, which packs the restored layers. :meth:`merged_bytes` reports the last prefill's pairs. The
    previous layer of a pair is rewritten in place when the deeper one is merged, so the layout is per head (a row
    layout's layer may already have been copied into an engine slot by then)."""

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
        self._held: dict[int, tuple[int, list]] = {}  # a pair just merged, by its deeper layer: (previous, per row)

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

    def take_merged(self, layer: int) -> tuple[int, list[tuple[MergedPair, MergedPair]]] | None:
        """The pair whose deeper layer ``layer`` was just merged, for its cache to hold: the previous layer and per row
        the keys' and the values' :class:`MergedPair` (None: ``layer`` merged nothing)."""
        return self._held.pop(layer, None)

    def layer_bytes(self, layer: int, num_layers: int, tokens: int, heads: int, widths: tuple[int, int],
                    element: int) -> int | None:
        """The bytes layer ``layer`` of ``num_layers`` holds of ``tokens`` merged tokens per head over ``heads`` heads
        (key and value ``widths``, ``element`` bytes an entry; retained positions int64), as :meth:`MergedPair.
        layer_bytes` counts them; None where the layer is in no pair."""
        deeper = {current: True for _, current in self.pairs(num_layers)}
        deeper.update({previous: False for previous, _ in self.pairs(num_layers)})
        if layer not in deeper:
            return None
        retained = min(tokens, math.ceil(tokens * self.retention_ratio))
        held = 0
        for width in widths:
            held += heads * (tokens + retained * width) * element  # its magnitudes and retained tokens
            held += heads * (tokens * width * element + retained * 8) if deeper[layer] else 0
        return held

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
        rows = []
        for row in range(keys.shape[0]):
            n = int(counts[row].max())
            rows.append([])
            for current, previous in ((keys, pending[2]), (values, pending[3])):
                pair = MergedPair.merge(current[row, :, :n], previous[row, :, :n], self.interpolation,
                                        self.retention_ratio)
                current[row, :, :n], previous[row, :, :n] = pair.restore()  # previous: its layer's tensor, in place
                rows[-1].append(pair)
                held += pair.nbytes()
                dense += 2 * current[row, :, :n].numel() * current.element_size()
        self.merged[(layer - 1, layer)] = (held, dense)
        self._held = {layer: (layer - 1, [tuple(pairs) for pairs in rows])}
        return keys, values
