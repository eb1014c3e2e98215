"""Triton kernels (CUDA) for the attention-sum methods' prefill: a prompt's causal attention with its log-sum-exp,
flash-style, then the attention each key receives summed over the queries, over the same tiles and that log-sum-exp:
bf16 (or fp16) products on tensor cores, fp32 accumulation, never the n x n matrix. The blockwise PyTorch functions
of :mod:`.kernels` are the reference and the CPU path; ``tests/test_gpu.py`` holds these to them."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _attention_lse(Q, K, V, O, LSE,
                   sq_b, sq_h, sq_n, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d, so_b, so_h, so_n, so_d,
                   n_queries, n_keys, offset, q_heads, groups, scale_log2,
                   HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WITH_OUTPUT: tl.constexpr,
                   PRECISION: tl.constexpr):
    """One block of queries of one head: online softmax over the keys it sees (query i at key position offset + i),
    its log-sum-exp in base 2 (of the logits times log2 e) and, WITH_OUTPUT, the attention output."""
    start_m = tl.program_id(0) * BLOCK_M
    row = tl.program_id(1)
    batch, head = row // q_heads, row % q_heads
    kv_head = head // groups
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + batch * sq_b + head * sq_h + offs_m[:, None] * sq_n + offs_d[None, :] * sq_d,
                mask=(offs_m[:, None] < n_queries) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    position = offs_m + offset
    end = tl.minimum(offset + start_m + BLOCK_M, n_keys)
    for start_n in range(0, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = tl.load(K + batch * sk_b + kv_head * sk_h + offs_n[None, :] * sk_n + offs_d[:, None] * sk_d,
                    mask=(offs_n[None, :] < n_keys) & (offs_d[:, None] < HEAD_DIM), other=0.0)
        s = tl.dot(q, k, input_precision=PRECISION) * scale_log2
        s = tl.where((offs_n[None, :] <= position[:, None]) & (offs_n[None, :] < n_keys), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # key 0 is seen by every row: finite from the first block on
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if WITH_OUTPUT:
            v = tl.load(V + batch * sv_b + kv_head * sv_h + offs_n[:, None] * sv_n + offs_dv[None, :] * sv_d,
                        mask=(offs_n[:, None] < n_keys) & (offs_dv[None, :] < VALUE_DIM), other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    tl.store(LSE + row * n_queries + offs_m, m_i + tl.math.log2(l_i), mask=offs_m < n_queries)
    if WITH_OUTPUT:
        out = acc / l_i[:, None]
        tl.store(O + batch * so_b + head * so_h + offs_m[:, None] * so_n + offs_dv[None, :] * so_d,
                 out.to(O.dtype.element_ty), mask=(offs_m[:, None] < n_queries) & (offs_dv[None, :] < VALUE_DIM))


@triton.jit
def _key_sums(Q, K, LSE, SUMS, sq_b, sq_h, sq_n, sq_d, sk_b, sk_h, sk_n, sk_d,
              n_queries, n_keys, offset, q_heads, groups, scale_log2,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              PRECISION: tl.constexpr):
    """One block of keys of one query head: the softmaxed attention each receives, summed over the queries that see
    it (the probabilities rebuilt from the logits and the queries' log-sum-exp), in fp32."""
    start_n = tl.program_id(0) * BLOCK_N
    row = tl.program_id(1)
    batch, head = row // q_heads, row % q_heads
    kv_head = head // groups
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k = tl.load(K + batch * sk_b + kv_head * sk_h + offs_n[None, :] * sk_n + offs_d[:, None] * sk_d,
                mask=(offs_n[None, :] < n_keys) & (offs_d[:, None] < HEAD_DIM), other=0.0)
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    first = (tl.maximum(start_n - offset, 0) // BLOCK_M) * BLOCK_M  # the first query block that sees these keys
    for start_m in range(first, n_queries, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = tl.load(Q + batch * sq_b + head * sq_h + offs_m[:, None] * sq_n + offs_d[None, :] * sq_d,
                    mask=(offs_m[:, None] < n_queries) & (offs_d[None, :] < HEAD_DIM), other=0.0)
        lse = tl.load(LSE + row * n_queries + offs_m, mask=offs_m < n_queries, other=0.0)
        s = tl.dot(q, k, input_precision=PRECISION) * scale_log2
        visible = (offs_n[None, :] <= offs_m[:, None] + offset) & (offs_m[:, None] < n_queries)
        total += tl.sum(tl.where(visible, tl.math.exp2(s - lse[:, None]), 0.0), 0)
    tl.store(SUMS + row * n_keys + offs_n, total, mask=offs_n < n_keys)


def supports(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor | None = None) -> bool:
    """Whether these kernels compute this attention: CUDA tensors of bf16 or fp16 with heads 64 to 128 wide (what
    was held to the reference on an H100); anything else takes the blockwise path."""
    tensors = [t for t in (query, keys, values) if t is not None]
    return (all(t.is_cuda and t.dtype == query.dtype for t in tensors)
            and query.dtype in (torch.float16, torch.bfloat16)
            and all(64 <= t.shape[-1] <= 128 for t in tensors) and query.shape[-1] == keys.shape[-1])


def _config(dim: int, dtype: torch.dtype) -> dict:
    """Tile sizes and warps: 128 x 64 tiles for 16-bit heads up to 128 wide; smaller where tiles would not fit in
    shared memory (fp32, wider heads)."""
    if dtype == torch.float32 or dim > 128:
        return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)
    return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)


def _strides(t: torch.Tensor) -> tuple:
    return tuple(t.stride())


def causal_attention_lse(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor | None, scaling: float,
                         offset: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``query`` ``[B, Hq, q, D]`` at key positions ``offset..offset+q-1`` over ``keys`` ``[B, Hkv, n, D]`` (causal,
    unpadded): the log-sum-exp of each query's logits in base 2 (fp32 ``[B, Hq, q]``) and, ``values`` given, the
    attention output ``[B, q, Hq, Dv]`` in the values' dtype (as transformers' attention functions return it)."""
    batch, q_heads, count, dim = query.shape
    kv_heads, n = keys.shape[1], keys.shape[2]
    lse = torch.empty(batch, q_heads, count, dtype=torch.float32, device=query.device)
    value_dim = dim if values is None else values.shape[-1]
    output = None if values is None else torch.empty(batch, count, q_heads, value_dim, dtype=values.dtype,
                                                     device=query.device)
    config = _config(max(dim, value_dim), query.dtype)
    grid = (triton.cdiv(count, config["BLOCK_M"]), batch * q_heads)
    v = keys if values is None else values
    o = lse if output is None else output
    o_strides = (0, 0, 0, 0) if output is None else (output.stride(0), output.stride(2), output.stride(1),
                                                      output.stride(3))
    _attention_lse[grid](query, keys, v, o, lse, *_strides(query), *_strides(keys), *_strides(v), *o_strides,
                         count, n, offset, q_heads, q_heads // kv_heads, scaling * LOG2E,
                         HEAD_DIM=dim, VALUE_DIM=value_dim, BLOCK_D=_pow2(dim), BLOCK_DV=_pow2(value_dim),
                         WITH_OUTPUT=values is not None, PRECISION=_precision(query.dtype), **config)
    return output, lse


def key_sums(query: torch.Tensor, keys: torch.Tensor, lse: torch.Tensor, scaling: float, offset: int) -> torch.Tensor:
    """fp32 ``[B, Hkv, G, n]``: the attention each key receives from ``query`` (at positions ``offset..``), summed
    over the queries, the probabilities rebuilt from ``lse`` (:func:`causal_attention_lse`)."""
    batch, q_heads, count, dim = query.shape
    kv_heads, n = keys.shape[1], keys.shape[2]
    sums = torch.empty(batch, q_heads, n, dtype=torch.float32, device=query.device)
    config = _config(dim, query.dtype)
    block_m, block_n = config["BLOCK_M"] // 2, config["BLOCK_N"] * 2  # a key block stays; query blocks stream by
    grid = (triton.cdiv(n, block_n), batch * q_heads)
    _key_sums[grid](query, keys, lse, sums, *_strides(query), *_strides(keys), count, n, offset, q_heads,
                    q_heads // kv_heads, scaling * LOG2E, HEAD_DIM=dim, BLOCK_D=_pow2(dim), BLOCK_M=block_m,
                    BLOCK_N=block_n, PRECISION=_precision(query.dtype), num_warps=config["num_warps"],
                    num_stages=config["num_stages"])
    return sums.view(batch, kv_heads, q_heads // kv_heads, n)


def attention_with_sums(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole unpadded prompt's causal attention ``[B, n, Hq, Dv]`` and what each key receives summed over every
    query, fp32 ``[B, Hkv, G, n]``: two passes over the same tiles (the flash-style pass writes the output and the
    log-sum-exp, the second the sums)."""
    output, lse = causal_attention_lse(query, keys, values, scaling, offset=0)
    return output, key_sums(query, keys, lse, scaling, offset=0)


def attention_sums(query: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """What each of ``keys`` ``[B, Hkv, n, D]`` receives from the prompt's last q queries (``query`` ``[B, Hq, q, D]``,
    causal, unpadded), summed over them: fp32 ``[B, Hkv, G, n]``."""
    offset = keys.shape[2] - query.shape[2]
    _, lse = causal_attention_lse(query, keys, None, scaling, offset)
    return key_sums(query, keys, lse, scaling, offset)


def _pow2(dim: int) -> int:
    return max(16, 1 << math.ceil(math.log2(dim)))


def _precision(dtype: torch.dtype) -> str:
    """fp32 inputs multiply in full fp32 (not TF32); 16-bit inputs on tensor cores, accumulated in fp32."""
    return "ieee" if dtype == torch.float32 else "tf32"
