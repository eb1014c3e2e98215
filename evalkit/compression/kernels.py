"""The attention arithmetic methods score with: fp32 softmax attention over a cache or a prompt, the blockwise causal
attention sums (never the n x n matrix; on CUDA the fused Triton kernels of :mod:`.triton_sums`, these blockwise
functions their reference), SnapKV's pooled window score, and the group reductions."""

from __future__ import annotations

import math

import torch

from .model_spec import attention_sinks
from .views import PrefillView


def attention_probabilities(queries: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, scaling: float,
                            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention in fp32 of ``queries`` ``[B, Hq, q, D]`` over ``keys`` ``[B, Hkv, S, D]`` where ``visible``
    (``[B, Hkv or 1, q, S]`` bool) allows: ``[B, Hkv, G, q, S]``, the query heads grouped by their KV head.
    ``sinks`` (``[Hq]``, gpt-oss): each head's learned sink logit joins the softmax and takes its share of the mass,
    as in the model's own attention, and is dropped from the result."""
    batch, q_heads, count, dim = queries.shape
    kv_heads = keys.shape[1]
    grouped = queries.float().reshape(batch, kv_heads, q_heads // kv_heads, count, dim)
    logits = torch.matmul(grouped, keys.float().unsqueeze(2).transpose(-1, -2)) * scaling
    logits = logits.masked_fill(~visible[:, :, None], float("-inf"))
    if sinks is None:
        return logits.softmax(dim=-1)
    sink = sinks.float().reshape(1, kv_heads, q_heads // kv_heads, 1, 1).expand(batch, -1, -1, count, 1)
    return torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]


def pre_rope(states: torch.Tensor, positions: torch.Tensor, rotary) -> torch.Tensor:
    """Post-RoPE ``states`` ``[B, H, q, D]`` at text ``positions`` ``[B, q]`` rotated back to before RoPE, in fp32
    (exact: RoPE is a rotation; a model that normalises before RoPE, as Qwen3, gives the normalised states)."""
    from transformers.models.llama.modeling_llama import rotate_half

    if rotary is None:
        raise ValueError("this method reads pre-RoPE queries or keys: it needs a model with rotary embeddings")
    states = states.float()
    cos, sin = (t.float()[:, None] for t in rotary(states, positions))  # [B, 1, q, D]
    return (states * cos - rotate_half(states) * sin) / (cos * cos + sin * sin)


def causal_visible(key_valid: torch.Tensor, begin: int, end: int) -> torch.Tensor:
    """``[B, 1 or Hkv, end - begin, n]`` bool: the prompt's queries ``begin..end-1`` see the keys at or before them,
    padding (``key_valid`` ``[B, n]``, or per head ``[B, Hkv, n]``, False) excluded."""
    valid = key_valid if key_valid.dim() == 3 else key_valid[:, None]
    key_index = torch.arange(valid.shape[-1], device=key_valid.device)
    causal = key_index[None, :] <= torch.arange(begin, end, device=key_valid.device)[:, None]  # [q, n]
    return causal[None, None] & valid[:, :, None, :]


def slots_visible(valid: torch.Tensor, positions: torch.Tensor, query_positions: torch.Tensor) -> torch.Tensor:
    """``[B, Hkv, q, S]`` bool: which cache slots (``valid`` and text ``positions``, ``[B, Hkv, S]``) each query at
    ``query_positions`` (``[B, q]``) may attend to, head by head: held tokens at or before it."""
    return valid[:, :, None, :] & (positions[:, :, None, :] <= query_positions[:, None, :, None])


def free_lowest(rank: torch.Tensor, eligible: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """Slots a one-per-step eviction frees, ``[..., S]`` bool: where ``full`` (``[...]``), the ``eligible`` slot of
    lowest ``rank`` (ties: the first slot); nothing elsewhere."""
    highest = float("inf") if rank.is_floating_point() else torch.iinfo(rank.dtype).max
    victim = rank.masked_fill(~eligible, highest).argmin(dim=-1)
    return torch.nn.functional.one_hot(victim, rank.shape[-1]).bool() & full[..., None]


def pool_scores(scores: torch.Tensor, kernel_size: int, pooling: str) -> torch.Tensor:
    """SnapKV's smoothing along the last axis: stride 1, padding kernel_size // 2, max or average (zeros padded)."""
    flat = scores.reshape(-1, 1, scores.shape[-1])
    pool = torch.nn.functional.max_pool1d if pooling == "max" else torch.nn.functional.avg_pool1d
    return pool(flat, kernel_size=kernel_size, stride=1, padding=kernel_size // 2).reshape(scores.shape)


def reduce_groups(scores: torch.Tensor, how: str) -> torch.Tensor:
    """``[B, Hkv, G, ...]`` -> ``[B, Hkv, ...]``: the query heads of each KV group by mean or max."""
    return scores.amax(dim=2) if how == "max" else scores.mean(dim=2)


def snapkv_scores(
    window_queries: torch.Tensor,
    keys: torch.Tensor,
    key_valid: torch.Tensor,
    scaling: float,
    kernel_size: int,
    pooling: str,
    gqa_reduce: str,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """SnapKV importance of the keys before the observation window (Li et al., NeurIPS 2024, arXiv 2404.14469).

    window_queries ``[B, Hq, w, D]`` (post-RoPE), keys ``[B, Hkv, n, D]``, key_valid ``[B, n]`` (False on padding).
    Softmax in fp32 of the window queries over all keys (causal inside the window), summed over the window queries,
    cut to the keys before the window, pooled along keys (stride 1, padding kernel_size // 2), then reduced over the
    query heads of each KV group. Returns ``[B, Hkv, n - w]``.
    """
    window, n = window_queries.shape[2], keys.shape[2]
    visible = causal_visible(key_valid, n - window, n)
    attention = attention_probabilities(window_queries, keys, visible, scaling, sinks).sum(dim=-2)[..., : n - window]
    return reduce_groups(pool_scores(attention, kernel_size, pooling), gqa_reduce)


def causal_attention_sums(view: PrefillView, last: int | None = None, budget: int | None = None,
                          fused: bool = True) -> torch.Tensor:
    """Attention each prompt key receives, summed over the prompt's queries (or its ``last`` queries), in fp32:
    ``[B, Hkv, G, n]``. Causal, padding excluded on both sides.

    ``view.query`` may hold only the prompt's last q queries (chunked prefill): they sit at key positions
    ``n - q .. n - 1``, and ``view.prior_sums`` (the earlier queries' sums, exact chunked prefill) is added when all
    queries are asked for; without it the sums are over the queries the view holds (a chunk compressed as it goes).

    Computed a block of queries at a time, each block's probabilities at most ``budget`` floats (default 64 MiB on
    a CPU, 256 MiB on a GPU, where fewer, larger blocks keep the kernels busy): never the n x n matrix. A block of
    queries ``begin..end`` sees only keys ``..end``, so only those are scored (half the work of scoring every key),
    and without padding only the block's own diagonal needs the causal mask."""
    batch, q_heads, count, _ = view.query.shape
    n = view.keys.shape[2]
    offset = n - count  # key position of the first query held
    budget = _default_budget(view.query.device) if budget is None else budget
    start = offset if last is None else n - last
    if start < offset:
        raise ValueError(f"attention sums over the last {last} queries, but the view holds only {count}")
    sinks = attention_sinks(view.module)
    padded = not bool(view.key_valid.all())
    triton = _triton(fused and not padded and sinks is None, view.query, view.keys)
    if triton is not None:
        total = triton.attention_sums(view.query[:, :, start - offset :], view.keys, view.scaling)
        if last is None and view.prior_sums is not None:
            total[..., : view.prior_sums.shape[-1]] += view.prior_sums
        return total
    kv_heads = view.keys.shape[1]
    groups = q_heads // kv_heads
    total = torch.zeros(batch, kv_heads, groups, n, dtype=torch.float32, device=view.query.device)
    if last is None and view.prior_sums is not None:
        total[..., : view.prior_sums.shape[-1]] += view.prior_sums
    keys = view.keys.float()  # [B, Hkv, n, D]: a block's keys are its first rows, no copy
    unpadded = not padded and sinks is None
    buffer = _block_buffer(batch * q_heads, n - start, n, budget, view.query.device) if unpadded else None
    begin = start
    while begin < n:
        end = _block_end(begin, n, budget, batch * q_heads)
        queries = view.query[:, :, begin - offset : end - offset]
        if buffer is not None:  # the common case: one product, the diagonal masked, a softmax
            total[..., :end] += _unpadded_block(queries, keys, begin, end, view.scaling, buffer).sum(dim=-2)
            begin = end
            continue
        if padded:
            visible = causal_visible(view.key_valid[:, :end], begin, end)
        else:  # keys before the block are all visible; the block's own square is lower-triangular
            visible = _block_visible(begin, end, view.query.device)
        probabilities = attention_probabilities(queries, view.keys[:, :, :end], visible, view.scaling, sinks)
        if padded:  # a padding query sees nothing (a row of NaN) and adds nothing
            real_queries = view.key_valid[:, begin:end][:, None, None, :, None]
            probabilities = torch.nan_to_num(probabilities, nan=0.0).mul_(real_queries)
        total[..., :end] += probabilities.sum(dim=-2)
        begin = end
    return total


def attention_with_sums(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
                        budget: int | None = None, fused: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole prompt's causal attention and the attention sums its score needs, in one pass: the output
    ``[B, n, Hq, Dv]`` (as transformers' attention functions return it) and, fp32, what each key receives summed over
    every query, ``[B, Hkv, G, n]``. The blocks and the fp32 arithmetic of the sums are
    :func:`causal_attention_sums`' own (so the kept tokens are the same); each block's probabilities are then used
    once more, cast to the values' dtype, for the output. For an unpadded prompt without learned sinks: the prefill of
    an attention-sum method (H2O, ObservedAttention) then costs one attention, not two. On CUDA the Triton kernels
    compute both (``fused=False``: this blockwise path, their reference)."""
    triton = _triton(fused, query, keys, values)
    if triton is not None:
        return triton.attention_with_sums(query, keys, values, scaling)
    batch, q_heads, n, _ = query.shape
    kv_heads = keys.shape[1]
    groups = q_heads // kv_heads
    budget = _default_budget(query.device) if budget is None else budget
    total = torch.zeros(batch, kv_heads, groups, n, dtype=torch.float32, device=query.device)
    output = torch.empty(batch, kv_heads, groups, n, values.shape[-1], dtype=values.dtype, device=query.device)
    keys32 = keys.float()
    buffer = _block_buffer(batch * q_heads, n, n, budget, query.device)
    begin = 0
    while begin < n:
        end = _block_end(begin, n, budget, batch * q_heads)
        probabilities = _unpadded_block(query[:, :, begin:end], keys32, begin, end, scaling, buffer)
        total[..., :end] += probabilities.sum(dim=-2)
        weights = probabilities.view(batch, kv_heads, groups * (end - begin), end).to(values.dtype)
        output[:, :, :, begin:end] = torch.matmul(weights, values[:, :, :end]).view(batch, kv_heads, groups,
                                                                                     end - begin, -1)
        begin = end
    return output.view(batch, q_heads, n, -1).transpose(1, 2).contiguous(), total


def _triton(wanted: bool, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor | None = None):
    """:mod:`.triton_sums` where ``wanted`` and its kernels compute this attention (CUDA, Triton installed), else
    None."""
    if not (wanted and query.is_cuda):
        return None
    try:
        from . import triton_sums
    except ImportError:  # a CUDA torch without Triton: the blockwise path
        return None
    return triton_sums if triton_sums.supports(query, keys, values) else None


def _default_budget(device: torch.device) -> int:
    """Floats of probabilities per block: 64 MiB on a CPU, 256 MiB on a GPU. Late in a long prompt a block's queries
    see many keys, so a budget buys few of them: 16 MiB at 32k keys was 16 queries a block, and products that thin
    ran at two thirds of the speed of 64-query ones."""
    return 1 << (26 if device.type == "cuda" else 24)


def _block_end(begin: int, n: int, budget: int, rows_per_query: int) -> int:
    """The end of the block of queries from ``begin``: the most rows r whose probabilities (r queries x begin + r keys,
    ``rows_per_query`` = batch x query heads of them) stay within ``budget`` floats: r^2 + begin r <= cells."""
    cells = max(1, budget // rows_per_query)
    return min(n, begin + max(1, (math.isqrt(begin * begin + 4 * cells) - begin) // 2))


def _block_buffer(rows_per_query: int, count: int, n: int, budget: int, device: torch.device) -> torch.Tensor:
    """One fp32 buffer that every block of :func:`_block_end` over the last ``count`` of ``n`` queries fits in (a
    one-query block may pass the budget; a few queries need less), reused block after block: a fresh n-sized tensor
    per block costs more in allocation (page faults on a CPU) than the arithmetic it holds."""
    return torch.empty(min(max(budget, rows_per_query * n), rows_per_query * count * n), dtype=torch.float32,
                       device=device)


def _unpadded_block(queries: torch.Tensor, keys32: torch.Tensor, begin: int, end: int, scaling: float,
                    buffer: torch.Tensor) -> torch.Tensor:
    """fp32 causal attention probabilities ``[B, Hkv, G, end - begin, end]`` of an unpadded prompt's queries
    ``begin..end-1`` (``queries`` ``[B, Hq, r, D]``) over its first ``end`` keys (``keys32``, fp32, ``[B, Hkv, n, D]``):
    the query heads of a KV group stacked as rows of one product (the keys are never expanded per head), the mask on
    the block's own square only; product, scaling and mask in ``buffer`` (:func:`_block_buffer`), and on a CPU the
    softmax too, in place: the result is then a view of it (valid until the next block)."""
    batch, q_heads, rows, _ = queries.shape
    kv_heads = keys32.shape[1]
    block = queries.float().reshape(batch, kv_heads, q_heads // kv_heads * rows, -1)
    logits = buffer[: batch * q_heads * rows * end].view(batch, kv_heads, q_heads // kv_heads * rows, end)
    if math.frexp(scaling)[0] == 0.5:  # a power of two (head size 64, 256): scaling the queries first is exact
        torch.matmul(block * scaling, keys32[:, :, :end].transpose(-1, -2), out=logits)
    else:  # one pass more over the block, the rounding of every other scaling kept
        torch.matmul(block, keys32[:, :, :end].transpose(-1, -2), out=logits).mul_(scaling)
    logits = logits.view(batch, kv_heads, q_heads // kv_heads, rows, end)
    logits[..., begin:end].masked_fill_(_block_hidden(begin, end, queries.device), float("-inf"))
    if logits.device.type != "cpu":  # a caching allocator makes a new tensor cheap; in place is checked on CPU only
        return logits.softmax(dim=-1)
    return torch.softmax(logits, dim=-1, out=logits)


def _block_hidden(begin: int, end: int, device: torch.device) -> torch.Tensor:
    """``[end - begin, end - begin]``: within the block's own square, the keys after each query (hidden from it)."""
    index = torch.arange(end - begin, device=device)
    return index[None, :] > index[:, None]


def _block_visible(begin: int, end: int, device: torch.device) -> torch.Tensor:
    """``[1, 1, end - begin, end]``: queries ``begin..end-1`` of an unpadded prompt see every key up to their own."""
    return (torch.arange(end, device=device)[None, :] <= torch.arange(begin, end, device=device)[:, None])[None, None]
