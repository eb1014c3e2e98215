"""A packed layer's dequantization in one pass over its codes (:meth:`.PackedKV.dequantize` on CPU, fp32).

The torch path makes eight passes over a layer (unpack, gather the keys' tables, multiply, add, for keys and values,
then the residual's rows); this is one loop in C, compiled once per machine with the system's C compiler into
``$EVALKIT_CACHE/kernels`` and called through ``ctypes``. The arithmetic is the torch path's: each element is
``code * scale`` rounded, then ``+ minimum`` rounded (``-ffp-contract=off``: no fused multiply-add), so the result is
bit for bit the same on any CPU. Where no compiler is found, or for other dtypes and devices, the torch path runs.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache

import torch

SOURCE = r"""
#include <stdint.h>
#include <string.h>

/* Channels [begin, end) of one slot: code times scale, rounded, plus minimum, rounded (per channel where `step` is
   1, one scale and minimum where it is 0). Byte w of the slot's codes holds channels w, w + width, ... at shifts 0,
   bits, ... (planar). */
static inline void channels(const uint8_t *restrict c, int64_t width, int64_t bits, uint8_t mask, int64_t begin,
                            int64_t end, const float *restrict s, const float *restrict m, int step,
                            float *restrict o) {
    for (int64_t j = 0, first = 0; first < end; j++, first += width) {
        const int64_t lo = begin > first ? begin : first, hi = end < first + width ? end : first + width;
        const uint8_t *restrict cj = c - first;
        const int shift = (int)(j * bits);
        if (step) {
            for (int64_t d = lo; d < hi; d++) { float t = (float)((uint8_t)(cj[d] >> shift) & mask) * s[d]; o[d] = t + m[d]; }
        } else {
            const float sv = *s, mv = *m;
            for (int64_t d = lo; d < hi; d++) { float t = (float)((uint8_t)(cj[d] >> shift) & mask) * sv; o[d] = t + mv; }
        }
    }
}

/* One layer's keys or values [B*H, S, D] from codes [B*H, room, D * bits / 8] (the per-slot inputs have room for
   `room` slots a head, the first S used). Keys (value_groups == 0): each slot's scale and minimum per channel are row
   `group` of its head's tables [B*H, entries, D]. Values: per slot, one scale and minimum per channel group
   [B*H, room, value_groups]. A slot with `fresh` takes row `residual_slot` of its head's residual
   [B*H, residual_rows, D] instead. */
void dequantize(const uint8_t *codes, int64_t heads, int64_t slots, int64_t room, int64_t dim, int64_t bits,
                const float *scale, const float *low, const int32_t *group, int64_t entries, int64_t value_groups,
                const uint8_t *fresh, const int16_t *residual_slot, const float *residual, int64_t residual_rows,
                float *out) {
    const int64_t width = dim * bits / 8, size = value_groups ? dim / value_groups : dim;
    const uint8_t mask = (uint8_t)((1 << bits) - 1);
    for (int64_t head = 0; head < heads; head++) {
        for (int64_t slot = 0, row = head * room; slot < slots; slot++, row++) {
            float *o = out + (head * slots + slot) * dim;
            const uint8_t *c = codes + row * width;
            if (fresh[row]) {
                memcpy(o, residual + (head * residual_rows + residual_slot[row]) * dim, dim * sizeof(float));
            } else if (value_groups == 0) {
                const int64_t at = (head * entries + group[row]) * dim;
                channels(c, width, bits, mask, 0, dim, scale + at, low + at, 1, o);
            } else {
                for (int64_t g = 0; g < value_groups; g++)
                    channels(c, width, bits, mask, g * size, (g + 1) * size, scale + row * value_groups + g,
                             low + row * value_groups + g, 0, o);
            }
        }
    }
}

/* Keys and values in one call: each an array of `dequantize`'s 16 arguments. (A second thread for the values
   costs more than it saves: torch's own threads spin on the other core between their parallel regions.) */
static void run(const int64_t *v) {
    dequantize((const uint8_t *)v[0], v[1], v[2], v[3], v[4], v[5], (const float *)v[6], (const float *)v[7],
               (const int32_t *)v[8], v[9], v[10], (const uint8_t *)v[11], (const int16_t *)v[12],
               (const float *)v[13], v[14], (float *)v[15]);
}

void dequantize_layer(const int64_t *keys, const int64_t *values) {
    run(keys);
    run(values);
}
"""
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith(("model name", "flags"))), platform.processor())
    except OSError:
        return platform.processor()


@cache
def library() -> ctypes.CDLL | None:
    """The compiled kernel (built on first use, kept per source, flags and CPU), or None where it cannot be built or
    loaded (no compiler, a cache folder that cannot be written, a damaged library file): the torch path then runs."""
    from ..core.identity import cache_dir

    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None or platform.system() != "Linux":
        return None
    digest = hashlib.sha256("\0".join((SOURCE, *FLAGS, platform.machine(), _cpu_name())).encode()).hexdigest()[:16]
    path = cache_dir() / "kernels" / f"packed_dequant_{digest}.so"
    try:
        if not path.exists() and not _build(compiler, path):
            return None
        kernel = ctypes.CDLL(str(path))
    except OSError:
        return None
    kernel.dequantize_layer.restype = None
    kernel.dequantize_layer.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    return kernel


def _build(compiler: str, path) -> bool:
    """Compile the kernel into ``path``; whether it compiled."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as build:
        source = os.path.join(build, "packed_dequant.c")
        with open(source, "w") as file:
            file.write(SOURCE)
        target = os.path.join(build, "packed_dequant.so")
        if subprocess.run([compiler, *FLAGS, source, "-o", target], capture_output=True).returncode:
            return False
        os.replace(target, path)  # atomic: concurrent builders each finish a whole file
    return True


def applies(codes: torch.Tensor, room: int, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether the compiled kernel dequantizes into ``keys`` and ``values``: fp32 on CPU, the per-slot fields
    ``[B, H, S, ...]`` views of the first slots of their storage of ``room`` as ``codes`` is (:meth:`.PackedKV.pad`
    makes them alike), where the kernel could be built."""
    return (all(out.device.type == "cpu" and out.dtype == torch.float32 and out.is_contiguous()
                for out in (keys, values))
            and _first_slots(codes, room)
            and os.environ.get("EVALKIT_TORCH_DEQUANTIZE") != "1" and library() is not None)


def _first_slots(tensor: torch.Tensor, room: int) -> bool:
    """Whether ``tensor`` ``[B, H, S, ...]`` is the first ``S`` slots of a contiguous ``[B, H, room, ...]``."""
    stride = 1
    for dim in range(tensor.dim() - 1, -1, -1):
        if tensor.stride(dim) != stride and tensor.shape[dim] > 1:
            return False
        stride *= room if dim == 2 else tensor.shape[dim]
    return tensor.storage_offset() == 0


def dequantize(packed, keys: torch.Tensor, values: torch.Tensor) -> None:
    """``packed`` (a :class:`.PackedKV` whose fields :func:`applies` holds) into ``keys`` and ``values``
    ``[B, H, S, D]``: codes times scale plus minimum, the residual's rows where a slot's token is still there."""
    batch, heads, slots, dim = keys.shape
    tables = [t.contiguous() for t in (packed.key_scale, packed.key_min, packed.residual_keys, packed.residual_values)]
    common = (batch * heads, slots, packed.room, dim, packed.fmt.bits)
    rows = packed.residual_keys.shape[2]
    key_args = (packed.key_codes.data_ptr(), *common, tables[0].data_ptr(), tables[1].data_ptr(),
                packed.key_group.data_ptr(), tables[0].shape[2], 0, packed.key_fresh.data_ptr(),
                packed.residual_slot.data_ptr(), tables[2].data_ptr(), rows, keys.data_ptr())
    value_args = (packed.value_codes.data_ptr(), *common, packed.value_scale.data_ptr(),
                  packed.value_min.data_ptr(), 0, 0, packed.value_scale.shape[-1], packed.value_fresh.data_ptr(),
                  packed.residual_slot.data_ptr(), tables[3].data_ptr(), rows, values.data_ptr())
    library().dequantize_layer((ctypes.c_int64 * 16)(*key_args), (ctypes.c_int64 * 16)(*value_args))
