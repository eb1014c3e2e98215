"""An independent, deliberately plain model of what each policy keeps, for equivalence tests.

The reference runs the model with an ordinary full cache and hides, per layer and per KV head, the keys the policy
evicted. Scores are recomputed here with explicit loops, from the queries and keys the model itself produced.
"""

from __future__ import annotations

import math

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    AttentionMaskInterface,
)

import evalkit.compression as ec
from evalkit.compression.model_spec import cache_kwargs

_RECORD: dict = {}


def _masked_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    layer = module.layer_idx
    _RECORD.setdefault("queries", {})[layer] = query
    _RECORD.setdefault("keys", {})[layer] = key
    _RECORD.setdefault("values", {})[layer] = value
    group = query.shape[1] // key.shape[1]
    keys = key.repeat_interleave(group, dim=1)
    values = value.repeat_interleave(group, dim=1)
    logits = torch.matmul(query.float(), keys.float().transpose(-1, -2)) * scaling
    q_len, k_len = query.shape[2], key.shape[2]
    causal = torch.ones(q_len, k_len, dtype=torch.bool).tril(diagonal=k_len - q_len)
    logits = logits.masked_fill(~causal, float("-inf"))
    visible = _RECORD.get("visible", {}).get(layer)  # [Hkv, k_len] bool, decode steps only (q_len 1)
    if visible is not None:
        logits = logits.masked_fill(~visible.repeat_interleave(group, dim=0)[None, :, None, :], float("-inf"))
    output = torch.matmul(logits.softmax(dim=-1), values.float()).to(query.dtype)
    return output.transpose(1, 2).contiguous(), None


AttentionInterface.register("reference_masked", _masked_attention)
AttentionMaskInterface.register("reference_masked", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def plain_snapkv_scores(query, key, window, kernel_size, pooling, gqa_reduce, scaling):
    """SnapKV scores of one sequence, head by head: query [Hq, n, D], key [Hkv, n, D] -> [Hkv, n - window]."""
    q_heads, n, _ = query.shape
    kv_heads = key.shape[0]
    group = q_heads // kv_heads
    prefix = n - window
    result = torch.zeros(kv_heads, prefix)
    for kv_head in range(kv_heads):
        per_query_head = []
        for g in range(group):
            q = query[kv_head * group + g, prefix:].double()
            logits = q @ key[kv_head].double().T * scaling
            for i in range(window):
                logits[i, prefix + i + 1 :] = float("-inf")
            summed = logits.softmax(dim=-1).sum(dim=0)[:prefix]
            pooled = torch.zeros(prefix, dtype=torch.double)
            half = kernel_size // 2
            for j in range(prefix):
                neighbours = summed[max(0, j - half) : min(prefix, j + half + 1)]
                pooled[j] = neighbours.max() if pooling == "max" else neighbours.sum() / kernel_size
            per_query_head.append(pooled)
        stacked = torch.stack(per_query_head)
        result[kv_head] = (stacked.max(dim=0).values if gqa_reduce == "max" else stacked.mean(dim=0)).float()
    return result


def kept_prompt_positions(policy, query, key, scaling) -> list[set[int]]:
    """Per KV head, the prompt positions ``policy`` keeps after prefill (one sequence)."""
    kv_heads, n = key.shape[0], key.shape[1]
    everything = [set(range(n)) for _ in range(kv_heads)]
    if isinstance(policy, ec.Full) or n <= policy.prompt_capacity():
        return everything
    if isinstance(policy, ec.StreamingLLM):
        return [set(range(policy.sink)) | set(range(n - policy.window, n)) for _ in range(kv_heads)]
    scores = plain_snapkv_scores(
        query, key, policy.window, policy.kernel_size, policy.pooling, policy.gqa_reduce, scaling
    )
    sink = policy.sink if isinstance(policy, ec.SnapStream) else 0
    budget = policy.prompt_capacity() - policy.window - sink
    kept = []
    for kv_head in range(kv_heads):
        middle = scores[kv_head, sink:].tolist()
        # Ties (max pooling copies scores) go to the earlier token.
        best = {sink + i for i in sorted(range(len(middle)), key=lambda i: (-middle[i], i))[:budget]}
        kept.append(best | set(range(sink)) | set(range(n - policy.window, n)))
    return kept


def visible_keys(policy, kept_prompt: set[int], prompt_len: int, position: int) -> torch.Tensor:
    """Bool [position + 1]: keys the token at ``position`` may attend to under ``policy``."""
    visible = torch.zeros(position + 1, dtype=torch.bool)
    if isinstance(policy, ec.StreamingLLM):
        visible[: policy.sink] = True
        visible[max(0, position - policy.window + 1) :] = True
        return visible
    visible[sorted(kept_prompt)] = True
    if isinstance(policy, ec.SnapStream):
        ring = policy.capacity - len(kept_prompt)
        visible[max(prompt_len, position - ring + 1) :] = True
    else:
        visible[prompt_len:] = True
    return visible


@torch.no_grad()
def masked_run(model, policy, prompt: torch.Tensor, tokens: list[int]):
    """Logits of a full-cache run of ``prompt`` then ``tokens`` (teacher forced) with evicted keys hidden."""
    original = model.config._attn_implementation
    model.config._attn_implementation = "reference_masked"
    _RECORD.clear()
    try:
        cache = DynamicCache(config=model.config)
        n = prompt.shape[1]
        out = model(input_ids=prompt, **cache_kwargs(model, cache), use_cache=True)
        logits = [out.logits[0, -1].float()]
        kept = {
            layer: kept_prompt_positions(policy, _RECORD["queries"][layer][0], _RECORD["keys"][layer][0], module_scaling(model))
            for layer in _RECORD["queries"]
        }
        for step, token in enumerate(tokens[:-1]):
            position = n + step
            _RECORD["visible"] = {
                layer: torch.stack([visible_keys(policy, heads, n, position) for heads in per_head])
                for layer, per_head in kept.items()
            }
            out = model(input_ids=torch.tensor([[token]]), **cache_kwargs(model, cache), use_cache=True)
            logits.append(out.logits[0, -1].float())
        return torch.stack(logits), kept
    finally:
        model.config._attn_implementation = original
        _RECORD.clear()


def module_scaling(model) -> float:
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 1 / math.sqrt(head_dim)
