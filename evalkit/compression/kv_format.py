"""Quantized KV storage any method sits on: KIVI's 2/4/8-bit format (Liu et al., arXiv 2402.02750; reference code
jy-yuan/KIVI, ``quant/new_pack.py`` ``quant_and_pack_kcache``/``quant_and_pack_vcache`` and the residual rules of
``models/llama_kivi.py``).

* Keys are quantized per channel over groups of ``group_size`` tokens, values per token over groups of
  ``group_size`` channels; asymmetric min/max: ``scale = (max - min) / (2**bits - 1)``, ``code = clamp((x - min) /
  scale, 0, 2**bits - 1).round()``, held as ``code * scale + min`` (a group whose values are all equal is held exactly:
  KIVI's division by a zero scale gives NaN there).
* The prompt is quantized whole at the end of prefill (what the method kept of it; groups of kept tokens in text
  order); generated tokens keep KIVI's full-precision residual: the values of the last ``residual`` tokens, and the
  keys of the current block of ``residual`` generated tokens, quantized (per channel, groups by their place in the
  block) when the block is complete. A token the method evicts before then is simply not in its group.

The cache tensors hold the quantized values in the model's dtype (the format's numerics exactly); the rows price
what the format stores (:meth:`KVFormat.held_bytes`: packed codes, a scale and a minimum per group, the residual at
full precision), and so does the simulator. ``bits=16`` is no format at all: the unquantized cache, bit for bit.
"""

from __future__ import annotations

import dataclasses
import math

import torch


@dataclasses.dataclass(frozen=True)
class KVFormat:
    bits: int = 4
    group_size: int = 32
    residual: int = 128

    def __post_init__(self) -> None:
        if self.bits not in (2, 4, 8):
            raise ValueError(f"kv_bits must be 2, 4, 8 or 16 (unquantized), got {self.bits!r}")
        if not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"kv_group_size must be a positive integer, got {self.group_size!r}")
        if not isinstance(self.residual, int) or self.residual < self.group_size or self.residual % self.group_size:
            raise ValueError(f"kv_residual must be a positive multiple of kv_group_size ({self.group_size}), got "
                             f"{self.residual!r}")

    def check_model(self, config) -> None:
        """A one-line ValueError where the model's cache cannot take the format."""
        from .model_spec import cache_geometry

        (_, key_dim, value_dim), _ = cache_geometry(config)
        if key_dim != value_dim:
            raise ValueError("kv_bits < 16 is not available on a latent (MLA) cache")
        if value_dim % self.group_size:
            raise ValueError(f"kv_group_size {self.group_size} must divide the head dimension {value_dim} (values "
                             "are quantized per token in groups of channels)")

    # -- what it stores ----------------------------------------------------------------------------------------------
    def token_bytes(self, key_dim: int, value_dim: int, element: int) -> float:
        """Bytes one quantized token of one KV head takes: its codes, its values' scale and minimum per channel group,
        and its share of its keys' per-channel scale and minimum (one pair per ``group_size`` tokens)."""
        codes = (key_dim + value_dim) * self.bits / 8
        return codes + 2 * element * (value_dim / self.group_size + key_dim / self.group_size)

    def residual_tokens(self, tokens: float, heads: int, generated: float | None = None) -> float:
        """Of ``tokens`` held tokens of one layer (summed over its ``heads``), those at full precision: per head the
        last ``residual`` generated ones (the kept prompt is quantized whole at the end of prefill), so at most the
        ``generated`` tokens fed back; where ``generated`` is not known (a steady state), ``residual`` per head."""
        per_head = tokens / max(heads, 1)
        return heads * min(per_head, self.residual, per_head if generated is None else generated)

    def quantized_tokens(self, tokens: float, heads: int, generated: float | None = None) -> float:
        """Of ``tokens`` held tokens of one layer (summed over its ``heads``), those :meth:`held_bytes` prices at
        ``bits``: all but the full-precision residual (:meth:`residual_tokens`)."""
        return max(0.0, tokens - self.residual_tokens(tokens, heads, generated))

    def held_bytes(self, tokens: float, heads: int, key_dim: int, value_dim: int, element: int,
                   generated: float | None = None) -> float:
        """Bytes ``tokens`` held tokens of one layer take (summed over its ``heads``): quantized, but for the
        full-precision residual (:meth:`residual_tokens`)."""
        full = (key_dim + value_dim) * element
        quantized = self.token_bytes(key_dim, value_dim, element)
        return tokens * quantized + self.residual_tokens(tokens, heads, generated) * (full - quantized)

    # -- the numerics --------------------------------------------------------------------------------------------------
    def encode(self, x: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``'s codes (whole numbers in ``x``'s dtype) and its groups' scale, for the group minimum ``low`` and
        maximum ``high`` (broadcast), computed in ``x``'s dtype as KIVI computes (its half-precision rounding
        included). A group of equal values has scale 0 and codes 0."""
        top = 2 ** self.bits - 1
        scale = (high - low) / top
        return ((x - low) / torch.where(scale > 0, scale, 1.0)).clamp(0, top).round(), scale

    def quantized(self, x: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
        """``x`` as its codes give it back: ``codes * scale + low`` (see :meth:`encode`)."""
        codes, scale = self.encode(x, low, high)
        return torch.where(scale > 0, codes * scale + low, low)

    def values_per_token(self, values: torch.Tensor) -> torch.Tensor:
        """``[..., D]`` quantized per token over groups of ``group_size`` channels (KIVI's value cache)."""
        grouped = values.unflatten(-1, (-1, self.group_size))
        low, high = grouped.amin(dim=-1, keepdim=True), grouped.amax(dim=-1, keepdim=True)
        return self.quantized(grouped, low, high).flatten(-2)

    def keys_per_channel(self, keys: torch.Tensor, members: torch.Tensor, group: torch.Tensor,
                         groups: int) -> torch.Tensor:
        """``keys`` ``[B, H, S, D]`` with the ``members`` ``[B, H, S]`` quantized per channel over their ``group``
        (``[B, H, S]`` in ``[0, groups)``); the others as they are (KIVI's key cache)."""
        index = group.masked_fill(~members, groups).clamp(0, groups)[..., None].expand_as(keys)
        shape = (*keys.shape[:2], groups + 1, keys.shape[-1])
        low = keys.new_full(shape, math.inf).scatter_reduce(2, index, keys, "amin")
        high = keys.new_full(shape, -math.inf).scatter_reduce(2, index, keys, "amax")
        held = self.quantized(keys, low.gather(2, index), high.gather(2, index))
        return torch.where(members[..., None], held, keys)

    # -- when ----------------------------------------------------------------------------------------------------------
    def quantize_prompt(self, keys: torch.Tensor, values: torch.Tensor,
                        held: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt a layer kept (``held`` ``[B, H or 1, S]``, text order along the slots) quantized whole: keys in
        groups of ``group_size`` held tokens."""
        held = held.expand(keys.shape[:3])
        rank = held.long().cumsum(dim=-1) - 1
        groups = math.ceil(keys.shape[2] / self.group_size)
        keys = self.keys_per_channel(keys, held, rank.clamp(min=0) // self.group_size, groups)
        values = torch.where(held[..., None], self.values_per_token(values), values)
        return keys, values

    def settle(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, position: torch.Tensor,
               steps: torch.Tensor) -> None:
        """After a decode step's attention, in place: the value that leaves the residual (``residual`` tokens back)
        and, where the step completes a block of ``residual`` generated tokens, the block's keys. ``positions``
        ``[B, H or 1, S]`` of the held tokens (-1: none, or a prompt slot whose position the layout does not keep),
        ``position`` ``[B]`` this step's, ``steps`` ``[B]`` the decode steps so far (this one included)."""
        first = (position - steps + 1)[:, None, None]  # the first generated token's position
        generated = positions >= first
        here = position[:, None, None]
        leaving = generated & (positions == here - self.residual)
        complete = ((position - first[:, 0, 0] + 1) % self.residual == 0)[:, None, None]
        block = generated & (positions > here - self.residual) & complete
        if not torch.compiler.is_compiling() and not bool(leaving.any() | block.any()):
            return
        values.copy_(torch.where(leaving.expand(values.shape[:3])[..., None], self.values_per_token(values), values))
        group = (positions - (here - self.residual + 1)).clamp(min=0) // self.group_size
        keys.copy_(self.keys_per_channel(keys, block.expand(keys.shape[:3]), group.expand(keys.shape[:3]),
                                         self.residual // self.group_size))


def kv_format(bits: int, group_size: int = 32, residual: int = 128) -> KVFormat | None:
    """The format of ``kv_bits``: None at 16 (the cache as the model computes it)."""
    if bits == 16:
        return None
    return KVFormat(bits, group_size, residual)
