"""A merged layer's keys and values stored as MiniCache holds them (:mod:`.methods.minicache`): what its merge frees.

A pair of adjacent layers merged after prefill holds, per row, its keys' and its values' :class:`.MergedPair`: the
shared direction and the retained positions once for both layers (counted in the deeper one's bytes), each layer's
magnitudes and retained tokens. Each layer's storage (:class:`MergedKV`) refers to its row's pairs and holds dense
only what was not merged, a block of slots from ``start`` (the shortest row's merged tokens) on: a padded row's empty
prompt slots and every generated token.

The layer reads and steps as a packed quantized layer does (:class:`.packed_kv.PackedStorage`, whose ``packed`` it
is): ``keys`` and ``values`` restore it (into the workspace its cache lends while a decode step runs in the layer, else
into fresh tensors), a step's tokens are written there and into the dense block. The workspace holds exactly the
states MiniCache restores (the same float64 operations on the same tensors): the outputs are the dense layers', bit
for bit.
"""

from __future__ import annotations

import torch

from .methods.minicache import MergedPair


class MergedKV:
    """One layer of a merged pair: per row its keys' and values' pairs (shared with the partner layer), ``deeper``
    whether it is the pair's current layer, and the dense block ``later_keys``, ``later_values`` ``[B, H, S - start,
    D]`` of slots ``start`` on."""

    def __init__(self, rows: list[tuple[MergedPair, MergedPair]], deeper: bool, keys: torch.Tensor,
                 values: torch.Tensor):
        self.rows, self.deeper = rows, deeper
        self.start = min(pair.direction.shape[-2] for pair, _ in rows)
        self.later_keys, self.later_values = keys[:, :, self.start:].clone(), values[:, :, self.start:].clone()

    @property
    def slots(self) -> int:
        return self.start + self.later_keys.shape[-2]

    @property
    def dense_shape(self) -> tuple[int, int, int, int]:
        return (*self.later_keys.shape[:2], self.slots, self.later_keys.shape[-1])

    @property
    def like(self) -> torch.Tensor:
        """What the restored layer is made like (dtype, device)."""
        return self.later_keys

    def nbytes(self) -> int:
        """This layer's share of its pairs (:meth:`.MergedPair.layer_bytes`) and its dense block's storage."""
        pairs = sum(pair.layer_bytes(self.deeper) for row in self.rows for pair in row)
        return pairs + sum(t.untyped_storage().nbytes() for t in (self.later_keys, self.later_values))

    def merged_bytes(self, row: int) -> tuple[int, int]:
        """Row ``row``'s merged tokens: the bytes this layer holds of them, and the bytes they take dense."""
        held = sum(pair.layer_bytes(self.deeper) for pair in self.rows[row])
        return held, sum(pair.direction.numel() * pair.direction.element_size() for pair in self.rows[row])

    def pad(self, slots: int) -> None:
        """Room for ``slots`` slots, new ones empty (zero, as a dense layer's)."""
        extra = slots - self.slots
        if extra > 0:
            self.later_keys = torch.nn.functional.pad(self.later_keys, (0, 0, 0, extra))
            self.later_values = torch.nn.functional.pad(self.later_values, (0, 0, 0, extra))

    def dequantize(self, keys: torch.Tensor, values: torch.Tensor, lend=None) -> None:
        """The layer restored into ``keys``, ``values`` ``[B, H, S, D]``: the dense block at its slots, then each row's
        merged tokens (:meth:`.MergedPair.restore_layer`); it needs no buffers of its cache's (``lend``)."""
        keys[:, :, self.start:] = self.later_keys
        values[:, :, self.start:] = self.later_values
        for row, (key_pair, value_pair) in enumerate(self.rows):
            count = key_pair.direction.shape[-2]
            key_pair.restore_layer(self.deeper, out=keys[row, :, :count])
            value_pair.restore_layer(self.deeper, out=values[row, :, :count])

    def hold(self, index: tuple[torch.Tensor, ...], positions: torch.Tensor, key_states: torch.Tensor,
             value_states: torch.Tensor) -> None:
        """New tokens written at ``index`` (``(rows, heads, slots)``, slots at ``start`` or later: every earlier one
        holds a merged token) into the dense block."""
        rows, heads, slots = index
        self.later_keys.index_put_((rows, heads, slots - self.start), key_states)
        self.later_values.index_put_((rows, heads, slots - self.start), value_states)

    def settle(self, *step) -> None:
        """Nothing is quantized after a step."""


def hold_merged(cache, layer_idx: int) -> None:
    """After layer ``layer_idx``'s prompt is kept: where its policy just merged a pair ending there, both layers hold
    it as :class:`MergedKV`; not under engine admission (the engine's slots hold keys and values dense, into which
    admission copies) nor a quantized KV format (which packs the restored layers)."""
    policy = cache.layer_policies[layer_idx]
    take = getattr(policy, "take_merged", None)
    merged = take(layer_idx) if take is not None else None
    if merged is None or cache.targets is not None or policy.kv_format is not None:
        return
    previous, rows = merged
    for index, deeper in ((previous, False), (layer_idx, True)):
        layer = cache.layers[index]
        storage = MergedKV(rows, deeper, layer.keys, layer.values)
        layer.packed = storage
        layer._keys = layer._values = None


def merged_saving(layers, index: int, row: int, prefilled: int) -> int:
    """Bytes layer ``index`` of ``layers`` does not hold, of row ``row``, for the tokens MiniCache merged: a session's
    :class:`MergedKV` layer by its tensors; an engine slot's (held dense) priced as MiniCache holds the ``prefilled``
    tokens it took by its prefill (:meth:`.MiniCache.layer_bytes`); 0 for a layer in no merged pair."""
    layer = layers[index]
    if hasattr(layer, "packed"):  # a session's layer: what its storage holds
        if not isinstance(layer.packed, MergedKV):
            return 0
        held, dense = layer.packed.merged_bytes(row)
        return dense - held
    policy = layer.layout.policy
    priced = getattr(policy, "layer_bytes", None)
    if priced is None or policy.kv_format is not None:
        return 0
    pair = [pair for pair in policy.pairs(len(layers)) if index in pair]
    if not pair or any(layers[other].layout.policy is not policy for other in pair[0]):  # a partner not merged
        return 0
    heads, element = layer.keys.shape[1], layer.keys.element_size()
    widths = (layer.keys.shape[-1], layer.values.shape[-1])
    held = priced(index, len(layers), prefilled, heads, widths, element)
    return heads * prefilled * sum(widths) * element - held
