"""GEAR: quantization, a low-rank residual and sparse outliers (Kang et al., arXiv 2403.05527; official code
opengear-project/GEAR, ``GEARLM/Simulated/compress_function.py``, method ``GEAR``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from evalkit.core.method_settings import setting

from ..model_spec import cache_geometry
from ..views import PrefillView
from .base import refused_kv_format
from .rewriting import Rewriting

OUTLIER_INDEX_BYTES = 4  # each kept outlier's position, priced as an int32


def outlier_count(kv_heads: int, tokens: int, head_dim: int, ratio: float) -> int:
    """Outliers kept at each end of every row (each token of the values, each channel of the keys, alike): the
    reference's ``int(int(B * H * S * D * ratio) / B / S / 2)`` for one row (B = 1)."""
    return int(int(kv_heads * tokens * head_dim * ratio) / tokens / 2)


def quantize_groups(rows: torch.Tensor, levels: int) -> torch.Tensor:
    """Asymmetric fake quantization of each group (the last dim) to ``levels + 1`` codes: ``round(relu((x - min) /
    scale)) * scale + min`` with ``scale = (max - min) / levels``. A constant group (scale 0, NaN in the reference)
    keeps its value."""
    low, high = rows.amin(dim=-1, keepdim=True), rows.amax(dim=-1, keepdim=True)
    scale = (high - low) / levels
    codes = torch.relu((rows - low) / scale).round()
    return torch.where(scale > 0, codes * scale + low, rows)


def quantize_tokens(flat: torch.Tensor, levels: int, group_size: int) -> torch.Tensor:
    """``[S, H*D]``: groups of ``group_size`` consecutive channels of each token (values)."""
    tokens, width = flat.shape
    return quantize_groups(flat.reshape(tokens, width // group_size, group_size), levels).reshape(tokens, width)


def quantize_channels(flat: torch.Tensor, levels: int, group_size: int) -> torch.Tensor:
    """``[S, H*D]``: groups of ``group_size`` consecutive tokens of each channel (keys); the last ``S % group_size``
    tokens are left as they are (the reference's unquantized residual)."""
    tokens, width = flat.shape
    whole = tokens // group_size * group_size
    grouped = flat[:whole].reshape(tokens // group_size, group_size, width).transpose(1, 2)
    quantized = quantize_groups(grouped, levels).transpose(1, 2).reshape(whole, width)
    return torch.cat([quantized, flat[whole:]])


def sparse_quantize(rows: torch.Tensor, count: int, quantize) -> torch.Tensor:
    """The reference's ``gears_*Q`` on ``rows`` ``[R, L]`` (outliers along L): the ``count`` smallest and largest
    entries of each row set to its mean, ``quantize`` applied, then those entries restored (largest last)."""
    small_values, small_index = torch.topk(rows, count, dim=-1, largest=False)
    large_values, large_index = torch.topk(rows, count, dim=-1, largest=True)
    mean = rows.mean(dim=-1, keepdim=True).expand_as(rows)
    flattened = rows.clone()
    flattened.scatter_(-1, small_index, mean.gather(-1, small_index))
    flattened.scatter_(-1, large_index, mean.gather(-1, large_index))
    output = quantize(flattened)
    output.scatter_(-1, small_index, small_values)
    output.scatter_(-1, large_index, large_values)
    return output


def power_iteration(error: torch.Tensor, rank: int, loop: int, generator: torch.Generator) -> torch.Tensor:
    """The reference's ``fake_poweriteration_group`` on ``error`` ``[H, S, D]``: the rank-``rank`` approximation of
    each head's ``[S, D]`` matrix, from ``p ~ U[0, 1)`` ``[H, D, r]`` (then ``q`` ``[H, S, r]``, drawn and unused as
    the reference does), ``loop`` rounds of ``q = E p``, ``p = E^T q`` with QR of ``p`` and ``q`` in the last."""
    heads, tokens, width = error.shape
    p = torch.rand(1, heads, width, rank, generator=generator)[0].to(error)
    torch.rand(1, heads, tokens, rank, generator=generator)
    for step in range(loop):
        last = step == loop - 1
        if last:
            p = torch.linalg.qr(p).Q
        q = error @ p
        if last:
            q = torch.linalg.qr(q).Q
        p = error.transpose(1, 2) @ q
    return q @ p.transpose(1, 2)


def gear_one(x: torch.Tensor, keys: bool, bits: int, group_size: int, ratio: float, rank: int, loop: int,
             generator: torch.Generator, store: torch.dtype) -> torch.Tensor:
    """The reference's ``gearslkivi_channelQ_new`` (keys) or ``gearslkivi_tokenQ_new`` (values) on one row ``x``
    ``[H, S, D]`` in its own dtype (fp32 or fp64): sparse quantization rounded to ``store`` (the reference's
    ``.half()``), plus the low-rank approximation of what it missed; the result in ``store``."""
    heads, tokens, width = x.shape
    levels = bits ** 2 - 1  # the reference's cluster count; 2**bits - 1 at its 2 and 4 bits
    count = min(outlier_count(heads, tokens, width, ratio), tokens if keys else heads * width)
    flat = x.transpose(0, 1).reshape(tokens, heads * width)
    if keys:
        sparse = sparse_quantize(flat.T, count, lambda r: quantize_channels(r.T, levels, group_size).T.contiguous()).T
    else:
        sparse = sparse_quantize(flat, count, lambda r: quantize_tokens(r, levels, group_size))
    sparse = sparse.reshape(tokens, heads, width).transpose(0, 1).to(store).to(x.dtype)
    if rank == 0:
        return sparse.to(store)
    return (sparse + power_iteration(x - sparse, rank, loop, generator)).to(store)


@dataclasses.dataclass
class GEAR(Rewriting):
    """Keep the scorer's ``capacity`` tokens, then hold their keys and values as GEAR reconstructs them (its
    ``GEAR`` method with ``--streaming --stream_grouping``): per row, the first ``kept - kept % streaming_gap`` kept
    slots are compressed and the rest (the reference's full-precision streaming tail) kept exact. Keys: outliers per
    channel along the tokens, quantization per channel in groups of ``group_size`` tokens (a last partial group
    left as is); values: outliers per token across every head's channels, quantization in groups of ``group_size``
    channels (it must divide ``kv_heads * head_dim``). Then ``bits``-bit codes (the reference's ``bits**2 - 1``
    levels), the rank-``rank`` (keys) and ``rankv`` (values) power-iteration approximation of the residual per head
    (``loop`` rounds, drawn from ``seed + layer``: key ``p``, key ``q``, value ``p``, value ``q`` per row), computed
    in fp32 (fp64 for an fp64 model) with the sparse part rounded to the model's dtype as the reference rounds it to
    fp16. Tokens written while decoding stay exact (the reference compresses each ``streaming_gap`` of them).

    The cache stores the reconstruction dense, in the model's dtype: it frees nothing beyond the scorer's eviction.
    :meth:`priced_bytes` is what GEAR would hold for it (codes, scales and minimums, rank factors, outliers with
    their positions, the exact tail), a price, not memory freed. ``kv_bits`` < 16 is refused."""

    name: ClassVar[str] = "gear"
    bits: int = setting(2, low=2, high=4)
    group_size: int = setting(64, low=1)
    rank: int = setting(4, low=0)
    rankv: int = setting(4, low=0)
    loop: int = setting(3, low=1)
    outlier_ratio: float = setting(0.02, low=0, high=1)
    streaming_gap: int = setting(64, low=1)
    seed: int = setting(0, low=0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.bits == 3:
            raise ValueError("GEAR.bits must be 2 or 4 (the reference's bits**2 - 1 levels), got 3")

    def check_model(self, config) -> None:
        super().check_model(config)
        (heads, width, _), _ = cache_geometry(config)
        if (heads * width) % self.group_size:
            fits = max(size for size in range(1, min(64, heads * width) + 1) if heads * width % size == 0)
            raise ValueError(f"method.group_size={self.group_size} must divide this model's kv_heads * head_dim = "
                             f"{heads * width} ({heads} KV head{'s' * (heads > 1)} of {width} channels; GEAR quantizes the values in "
                             f"groups of that many channels): e.g. method.group_size={fits}")

    kv_format = refused_kv_format("GEAR quantizes the kept keys and values itself, a quantized format would quantize "
                                  "its reconstruction again")

    def rewrite(self, view: PrefillView, indices: torch.Tensor, counts: torch.Tensor, keys: torch.Tensor,
                values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        heads, width = keys.shape[1], keys.shape[-1]
        if (heads * width) % self.group_size:
            raise ValueError(f"GEAR.group_size {self.group_size} must divide kv_heads * head_dim = {heads * width}")
        keys, values = keys.clone(), values.clone()
        for row in range(keys.shape[0]):
            kept = int(counts[row].min())
            compressed = kept - kept % self.streaming_gap
            if compressed == 0:
                continue
            generator = torch.Generator().manual_seed(self.seed + view.layer_idx)
            for tensor, is_keys, rank in ((keys, True, self.rank), (values, False, self.rankv)):
                block = tensor[row, :, :compressed]
                work = block.to(torch.float64 if block.dtype == torch.float64 else torch.float32)
                tensor[row, :, :compressed] = gear_one(work, is_keys, self.bits, self.group_size, self.outlier_ratio,
                                                       rank, self.loop, generator, block.dtype)
        return keys, values

    def priced_bytes(self, tokens: int, kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> float:
        """GEAR's bytes for one layer's row of ``tokens`` kept tokens (keys and values), beside the dense
        ``2 * tokens * kv_heads * head_dim * dtype_bytes`` the cache holds for them."""
        width = kv_heads * head_dim
        compressed = tokens - tokens % self.streaming_gap
        quantized_keys = compressed // self.group_size * self.group_size
        count = outlier_count(kv_heads, compressed, head_dim, self.outlier_ratio) if compressed else 0
        outliers, outliers_v = 2 * min(count, compressed), 2 * min(count, width)
        codes = (quantized_keys + compressed) * width * self.bits / 8
        scales = 2 * (quantized_keys // self.group_size * width + compressed * width // self.group_size)
        loose = (compressed - quantized_keys) * width + 2 * (tokens - compressed) * width
        factors = kv_heads * (compressed + head_dim) * (self.rank + self.rankv) if compressed else 0
        sparse = (outliers * width + outliers_v * compressed) * (dtype_bytes + OUTLIER_INDEX_BYTES)
        return codes + sparse + (scales + loose + factors) * dtype_bytes
