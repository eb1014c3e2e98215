"""A packed layer's work in a decode step as loops in C (:class:`.PackedKV` on CPU, fp32): its dequantization in
one pass over its codes, a one-token step's token into the residual, and what the step's end quantizes.

The torch paths make many passes and small calls a layer (the dequantization eight: unpack, gather the keys' tables,
multiply, add, for keys and values, then the residual's rows; the bookkeeping a dozen calls on every slot's flags);
these are compiled once per machine with the system's C compiler into ``$EVALKIT_CACHE/kernels`` and called through
``ctypes``. The arithmetic is the torch paths': each element is ``code * scale`` rounded, then ``+ minimum`` rounded
(``-ffp-contract=off``: no fused multiply-add), a code ``(x - minimum) / scale`` rounded half to even, so the result
is bit for bit the same on any CPU. Where no compiler is found, for other dtypes and devices, for steps of several
tokens, or with ``EVALKIT_TORCH_PACKED=1``, the torch paths run.
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
#include <math.h>
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
    #pragma omp for collapse(2) schedule(static) nowait
    for (int64_t head = 0; head < heads; head++) {
        for (int64_t slot = 0; slot < slots; slot++) {
            const int64_t row = head * room + slot;
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

/* Keys and values in one call: each an array of `dequantize`'s 16 arguments. Their slots are shared among the
   threads of torch's own OpenMP runtime (the library links the same libgomp.so.1), as many as torch uses, where a
   layer has at least torch's grain of elements. */
#define GRAIN 32768
static void run(const int64_t *v) {
    dequantize((const uint8_t *)v[0], v[1], v[2], v[3], v[4], v[5], (const float *)v[6], (const float *)v[7],
               (const int32_t *)v[8], v[9], v[10], (const uint8_t *)v[11], (const int16_t *)v[12],
               (const float *)v[13], v[14], (float *)v[15]);
}

void dequantize_layer(const int64_t *keys, const int64_t *values) {
    #pragma omp parallel if (keys[1] * keys[2] * keys[4] >= GRAIN)
    {
        run(keys);
        run(values);
    }
}

/* One new token per row and head (head h of row b: slot `slot[b * slot_row + h * slot_head]`, text position
   `position[b * position_row]`, key and value rows of `key_states` and `value_states` [rows * heads, dim]) into the
   residual at row `position % residual_rows`: its slot then reads it there (residual_slot, key_fresh and value_fresh
   set, key_group 0). Returns -1, writing nothing, where another slot of the head still reads that row (the step
   overruns the residual). */
int hold_token(int64_t rows, int64_t heads, int64_t slots, int64_t room, int64_t dim, int64_t residual_rows,
               const int64_t *slot, int64_t slot_row, int64_t slot_head, const int64_t *position,
               int64_t position_row, const float *key_states, const float *value_states, float *residual_keys,
               float *residual_values, int16_t *residual_slot, uint8_t *key_fresh, uint8_t *value_fresh,
               int32_t *key_group) {
    for (int pass = 0; pass < 2; pass++) {
        for (int64_t b = 0; b < rows; b++) {
            const int64_t at = position[b * position_row] % residual_rows;
            for (int64_t k = 0; k < heads; k++) {
                const int64_t h = b * heads + k, base = h * room, own = slot[b * slot_row + k * slot_head];
                if (pass == 0) {
                    for (int64_t s = 0; s < slots; s++)
                        if (s != own && residual_slot[base + s] == at && (key_fresh[base + s] | value_fresh[base + s]))
                            return -1;
                    continue;
                }
                memcpy(residual_keys + (h * residual_rows + at) * dim, key_states + h * dim, dim * sizeof(float));
                memcpy(residual_values + (h * residual_rows + at) * dim, value_states + h * dim, dim * sizeof(float));
                residual_slot[base + own] = (int16_t)at;
                key_fresh[base + own] = value_fresh[base + own] = 1;
                key_group[base + own] = 0;
            }
        }
    }
    return 0;
}

/* One token's values [dim] quantized per group of `group` channels as the torch path does: per group the minimum
   and maximum, scale (max - min) / (2^bits - 1), codes round-half-even(clamp((x - min) / (scale or 1), 0,
   2^bits - 1)), packed planar into codes [dim * bits / 8]; scale and minimum [dim / group]. */
static void quantize_value(const float *x, int64_t dim, int64_t bits, int64_t group, uint8_t *codes, float *scale,
                           float *low) {
    const float top = (float)((1 << bits) - 1);
    const int64_t width = dim * bits / 8;
    memset(codes, 0, width);
    for (int64_t g = 0; g < dim / group; g++) {
        const float *v = x + g * group;
        float lo = v[0], hi = v[0];
        for (int64_t d = 1; d < group; d++) { lo = v[d] < lo ? v[d] : lo; hi = v[d] > hi ? v[d] : hi; }
        const float s = (hi - lo) / top, divisor = s > 0 ? s : 1.0f;
        scale[g] = s;
        low[g] = lo;
        for (int64_t d = 0; d < group; d++) {
            const int64_t channel = g * group + d;
            float q = (v[d] - lo) / divisor;
            q = nearbyintf(q < 0 ? 0 : (q > top ? top : q));
            codes[channel % width] |= (uint8_t)((uint8_t)q << ((channel / width) * bits));
        }
    }
}

/* After a step's attention: each slot keeps its residual flags only where `held`; a value `residual` tokens older
   than the step's token leaves the residual, quantized from the dequantized `values` [heads, slots, dim] into its
   slot's codes, scales and minima. Per row b of `rows` (heads / rows per row): `position[b * position_row]` the
   step's text position and `steps[b * steps_row]` the decode steps so far. `positions` and `held` [rows, heads or 1,
   slots] with the strides given.
   Returns 1 where the step also completes a block of generated keys (the caller quantizes it), else 0. */
int settle_values(int64_t heads, int64_t rows, int64_t slots, int64_t room, int64_t dim, int64_t bits, int64_t group,
                  int64_t residual, const int64_t *positions, int64_t positions_row, int64_t positions_head,
                  const uint8_t *held, int64_t held_row, int64_t held_head, const int64_t *position,
                  int64_t position_row, const int64_t *steps, int64_t steps_row, const float *values,
                  uint8_t *value_codes, float *value_scale, float *value_min, uint8_t *key_fresh,
                  uint8_t *value_fresh) {
    const int64_t per_row = heads / rows, width = dim * bits / 8, groups = dim / group;
    int blocks = 0;
    for (int64_t h = 0; h < heads; h++) {
        const int64_t b = h / per_row, k = h % per_row, here = position[b * position_row];
        const int64_t first = here - steps[b * steps_row] + 1;
        const int complete = (here - first + 1) % residual == 0;
        const int64_t *p = positions + b * positions_row + k * positions_head;
        const uint8_t *valid = held + b * held_row + k * held_head;
        for (int64_t s = 0, row = h * room; s < slots; s++, row++) {
            key_fresh[row] &= valid[s];
            value_fresh[row] &= valid[s];
            if (p[s] < first)
                continue;
            if (value_fresh[row] && p[s] <= here - residual) {
                quantize_value(values + (h * slots + s) * dim, dim, bits, group, value_codes + row * width,
                               value_scale + row * groups, value_min + row * groups);
                value_fresh[row] = 0;
            }
            blocks |= complete && key_fresh[row] && p[s] > here - residual;
        }
    }
    return blocks;
}
"""
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC")
LIBRARIES = ("-lm",)
OPENMP = ("-fopenmp",)  # where the compiler has no OpenMP, the loops run on one thread


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
    build = (SOURCE, *FLAGS, *OPENMP, *LIBRARIES, platform.machine(), _cpu_name())
    digest = hashlib.sha256("\0".join(build).encode()).hexdigest()[:16]
    path = cache_dir() / "kernels" / f"packed_kv_{digest}.so"
    try:
        if not path.exists() and not _build(compiler, path):
            return None
        kernel = ctypes.CDLL(str(path))
    except OSError:
        return None
    kernel.dequantize_layer.restype = None
    kernel.dequantize_layer.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    kernel.hold_token.restype = kernel.settle_values.restype = ctypes.c_int
    return kernel


def _build(compiler: str, path) -> bool:
    """Compile the kernel into ``path``; whether it compiled."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as build:
        source = os.path.join(build, "packed_kv.c")
        with open(source, "w") as file:
            file.write(SOURCE)
        target = os.path.join(build, "packed_kv.so")
        if not any(subprocess.run([compiler, *FLAGS, *threads, source, "-o", target, *LIBRARIES],
                                  capture_output=True).returncode == 0 for threads in (OPENMP, ())):
            return False
        os.replace(target, path)  # atomic: concurrent builders each finish a whole file
    return True


def applies(packed, *dense: torch.Tensor) -> bool:
    """Whether the compiled kernels work on ``packed`` and its ``dense`` tensors (fp32 on CPU, contiguous): its
    per-slot fields ``[B, H, S, ...]`` views of the first slots of their storage of ``room`` as its codes are
    (:meth:`.PackedKV.pad` makes them alike), where the kernels could be built."""
    return (all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in dense)
            and _first_slots(packed.key_codes, packed.room)
            and os.environ.get("EVALKIT_TORCH_PACKED") != "1" and library() is not None)


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


def hold_token(packed, slots: torch.Tensor, positions: torch.Tensor, key_states: torch.Tensor,
               value_states: torch.Tensor) -> bool:
    """One new token per row and head (``slots`` ``[B, H or 1, 1]`` and text ``positions`` ``[B, 1, 1]``, int64;
    ``key_states``, ``value_states`` ``[B, H, 1, D]``) into ``packed``'s residual; False, writing nothing, where that
    overruns it."""
    batch, heads, _, dim = key_states.shape
    sizes = (batch, heads, packed.slots, packed.room, dim, packed.residual_keys.shape[2])
    head_stride = slots.stride(1) if slots.shape[1] > 1 else 0
    return library().hold_token(
        *map(ctypes.c_int64, sizes), ctypes.c_void_p(slots.data_ptr()), ctypes.c_int64(slots.stride(0)),
        ctypes.c_int64(head_stride), ctypes.c_void_p(positions.data_ptr()), ctypes.c_int64(positions.stride(0)),
        *(ctypes.c_void_p(t.data_ptr()) for t in (key_states, value_states, packed.residual_keys,
                                                   packed.residual_values, packed.residual_slot, packed.key_fresh,
                                                   packed.value_fresh, packed.key_group))) == 0


def settle_values(packed, values: torch.Tensor, positions: torch.Tensor, position: torch.Tensor,
                  steps: torch.Tensor, held: torch.Tensor) -> bool:
    """:meth:`.PackedKV.settle`'s flags and values (its arguments: ``position``, ``steps`` ``[B]`` and ``positions``
    ``[B, H or 1, S]`` int64, ``held`` bool ``[B, H or 1, S]``, the last two contiguous along the slots); whether a
    block of keys completes (the caller quantizes it)."""
    batch, heads, slots, dim = values.shape
    fmt = packed.fmt
    sizes = (batch * heads, batch, slots, packed.room, dim, fmt.bits, fmt.group_size, fmt.residual)
    strided = [(ctypes.c_void_p(t.data_ptr()), ctypes.c_int64(t.stride(0)),
                ctypes.c_int64(t.stride(1) if t.shape[1] > 1 else 0)) for t in (positions, held)]
    return bool(library().settle_values(
        *map(ctypes.c_int64, sizes), *strided[0], *strided[1], ctypes.c_void_p(position.data_ptr()),
        ctypes.c_int64(position.stride(0)), ctypes.c_void_p(steps.data_ptr()), ctypes.c_int64(steps.stride(0)),
        *(ctypes.c_void_p(t.data_ptr()) for t in (values, packed.value_codes, packed.value_scale, packed.value_min,
                                                   packed.key_fresh, packed.value_fresh))))
