"""LU-KV head budgets (arXiv 2602.08585; baidu-baige/LU-KV; kvpress ``LUKVPress``)."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import ClassVar

import torch

from evalkit.core.method_settings import setting

from ..learned_weights import LearnedFileError, bad_file
from .wrapper import Wrapper

CURVE_POINTS = 99  # the published curves: one row per compression ratio 0.01 .. 0.99


@dataclasses.dataclass
class LUKV(Wrapper):
    """A scorer's ranking (ExpectedAttention with epsilon 0.02 by default, kvpress' pairing) with each KV head's
    count from LU-KV's precomputed budget curve (kvpress ``LUKVPress.compress``): for a row compressed at ratio
    ``r = 1 - capacity / n``, the curve's row ``round(100 r) - 1`` gives each head of the layer its prune ratio; the
    keep counts ``(1 - p_h) n`` are floored, the rounding remainder of their sum goes to the largest fractions, and
    each head keeps at least one token. The first ``sink`` and last ``window`` tokens rank first. kvpress masks the
    pruned tokens; here they leave the cache (heads hold different counts, on a slot axis padded to the largest).

    ``curve``: the ``.npy`` file LU-KV publishes per model and scorer (``[99, layers, kv_heads]``, e.g.
    ``evaluation/curve_data/llama-3.1-8b/ea_0.02_sink4_win1_llama_avg_ratio.npy``) or one its scripts made.
    """

    name: ClassVar[str] = "lukv"
    per_head: ClassVar[bool] = True
    allocates: ClassVar[bool] = True
    inline: ClassVar[tuple[str, dict]] = ("expected_attention", {"epsilon": 0.02})
    curve: str | None = None
    sink: int = setting(4, low=0)
    window: int = setting(1, low=0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.curve:  # what the file says alone is checked as the method is built, before any model loads
            _curve(self.curve)

    def prompt_capacity(self) -> int:
        return self.capacity

    def prompt_slots(self, n: int, kv_heads: int) -> int:
        return n  # a head's curve may keep every token

    def kept_sink(self) -> int:
        return max(self.sink, self.scorer.kept_sink())

    def kept_window(self) -> int:
        return max(self.window, self.scorer.kept_window())

    def check_layers(self, num_layers: int) -> None:
        curve = _curve(self._source())
        if curve.shape[1] != num_layers:
            raise bad_file("lukv", self.curve, f"has shape {list(curve.shape)}; the model needs "
                                               f"[{CURVE_POINTS}, {num_layers}, kv_heads]")
        super().check_layers(num_layers)

    def _source(self) -> str:
        if not self.curve:
            raise ValueError("lukv needs its budget curve: set method.curve to LU-KV's .npy file for the model and "
                             "scorer ([99, layers, kv_heads]; baidu-baige/LU-KV evaluation/curve_data/)")
        return self.curve

    def allocate(self, scores: torch.Tensor, budget: torch.Tensor, layer_idx: int = 0) -> torch.Tensor:
        curve = _curve(self._source())[:, layer_idx]  # [99, kv_heads]
        batch, kv_heads, _ = scores.shape
        if curve.shape[1] != kv_heads:
            raise bad_file("lukv", self.curve, f"has {curve.shape[1]} KV heads per layer, the model has {kv_heads}")
        real = (scores > float("-inf")).sum(dim=-1).amax(dim=1).tolist()  # [B] each row's tokens
        counts = []
        for row, n in enumerate(real):
            ratio = 1 - int(budget[row]) / n
            if ratio <= 0:
                counts.append([n] * kv_heads)
                continue
            keep = (1 - curve[min(CURVE_POINTS - 1, max(0, round(ratio * 100) - 1))]).clamp(0, 1) * n
            total = max(kv_heads, min(kv_heads * n, int(torch.round(keep.sum()))))
            floor = keep.floor().long()
            remainder = total - int(floor.sum())
            if remainder > 0:
                floor[(keep - floor).topk(min(remainder, kv_heads)).indices] += 1
            counts.append(floor.clamp(1, n).tolist())
        return torch.tensor(counts, device=scores.device)


@functools.lru_cache(maxsize=4)
def _curve(source: str) -> torch.Tensor:
    """The curve of ``source``, checked: a ``.npy`` array of real numbers ``[99, layers, kv_heads]``, every prune
    ratio in [0, 1]."""
    import numpy as np

    path = Path(source).expanduser()
    if not path.is_file():
        raise LearnedFileError(f"lukv: no curve file {source} (LU-KV's .npy, [99, layers, kv_heads])")
    with open(path, "rb") as handle:
        magic = handle.read(6)
    if magic != b"\x93NUMPY":
        what = "a .npz archive" if magic.startswith(b"PK") else "no .npy file (its first bytes are not numpy's)"
        raise bad_file("lukv", source, f"is {what}; an LU-KV curve is a .npy array")
    try:
        curve = np.load(path, allow_pickle=False)
    except (ValueError, EOFError, OSError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else "cut short"
        raise bad_file("lukv", source, f"does not read as a .npy array ({first})") from None
    if curve.dtype.kind not in "iuf":
        raise bad_file("lukv", source, f"holds {curve.dtype}, not real numbers")
    if curve.ndim != 3 or curve.shape[0] != CURVE_POINTS or 0 in curve.shape:
        raise bad_file("lukv", source, f"has shape {list(curve.shape)}; an LU-KV curve is [{CURVE_POINTS}, layers, "
                                       "kv_heads]")
    wrong = ~np.isfinite(curve) | (curve < 0) | (curve > 1)
    if wrong.any():
        where = [int(i) for i in np.argwhere(wrong)[0]]
        raise bad_file("lukv", source, f"holds {curve[tuple(where)].item()} at {where} (ratio "
                                       f"{(where[0] + 1) / 100:.2f}, layer {where[1]}, head {where[2]}); prune "
                                       "ratios are in [0, 1]")
    return torch.from_numpy(curve).float()
