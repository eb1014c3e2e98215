"""HeadKV against a plain float64 reading of KVCache-Factory's (c97f9d7): the head budgets as ``run_longbench.py``
builds them from a score file in the publisher's format, reduced to KV heads and filled as ``HeadKVCluster.update_kv``
does at ``kv_head`` granularity; the tokens each layer and KV head holds (the cache's own tensors, matched by content),
its counts, and the tokens generated (a full-cache run hiding the dropped keys)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from baseline_reference import full_run, top
from conftest import random_prompt, tiny_model
from learned_files import headkv_scores
from masked_reference import _RECORD, module_scaling
from test_methods import held_positions, reference_keys
from transformers import DynamicCache

import evalkit.compression as ec
from evalkit.compression.learned_weights import LearnedFileError
from evalkit.compression.model_spec import cache_kwargs

WINDOW, KERNEL = 8, 7  # run_longbench.py's HeadKV settings (max pooling)


def reference_budgets(path: Path, max_capacity_prompts: int, beta: float, layers: int, heads: int) -> torch.Tensor:
    """run_longbench.py's ``head_capacity`` table, per query head, as it computes it."""
    with open(path) as file:
        head_list = json.loads(file.readline())
    head_score_list = [np.mean(item[1]) for item in head_list.items()]
    head_score_list = torch.tensor(head_score_list / sum(head_score_list))
    total_attention = head_score_list.reshape(layers, heads)
    total_pool_capacity = (max_capacity_prompts // beta) * layers * heads
    min_num = max_capacity_prompts - max_capacity_prompts // beta
    return torch.round(total_attention * total_pool_capacity + min_num).int()


def window_scores(r: dict, scaling: float) -> list[list[float]]:
    """Per KV head, ``calcul_attn_sore`` of the keys before the window: the window queries' attention (causal inside
    the window) averaged over them, then over the group's query heads, then max-pooled."""
    q_heads, n = r["query"].shape[:2]
    kv_heads = r["key"].shape[0]
    group, prefix, half = q_heads // kv_heads, n - WINDOW, KERNEL // 2
    out = []
    for h in range(kv_heads):
        means = []
        for g in range(group):
            logits = r["query"][h * group + g, prefix:] @ r["key"][h].T * scaling
            for i in range(WINDOW):
                logits[i, prefix + i + 1 :] = float("-inf")
            means.append(logits.softmax(dim=-1).mean(dim=0)[:prefix])
        mean = torch.stack(means).mean(dim=0).tolist()
        out.append([max(mean[max(0, j - half) : j + half + 1]) for j in range(prefix)])
    return out


def reference_kept(model, prompt, path: Path, capacity: int, beta: float) -> tuple[dict, dict]:
    """Per layer and KV head: the prompt positions kept, and each head's budget by score (the window aside)."""
    config = model.config
    layers, heads, kv_heads = config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads
    table = reference_budgets(path, capacity - WINDOW, beta, layers, heads)
    run, n = full_run(model, prompt), prompt.shape[1]
    kept, budgets = {}, {}
    for layer, r in run.items():
        budgets[layer] = table[layer].reshape(kv_heads, -1).float().mean(dim=-1).round().int().tolist()
        if n < capacity - WINDOW:  # base_capacity > n - window: nothing compressed
            kept[layer] = [set(range(n)) for _ in range(kv_heads)]
            continue
        kept[layer] = []
        for budget, scores in zip(budgets[layer], window_scores(r, module_scaling(model))):
            assert_no_near_tie(scores, budget)
            kept[layer].append(top(scores, budget) | set(range(n - WINDOW, n)))
    return kept, budgets


def assert_no_near_tie(scores: list[float], count: int) -> None:
    """The cut between a head's ``count`` best scores and the rest is an exact tie (pooling copies one score, broken
    by position on both sides) or wide: never a difference that float32 storage or the CPU's kernels could flip."""
    ranked = sorted(scores, reverse=True)
    if 0 < count < len(ranked):
        inside, outside = ranked[count - 1], ranked[count]
        assert inside == outside or inside - outside > 1e-6 * inside, (inside, outside)


@torch.no_grad()
def masked_logits(model, prompt, tokens: list[int], kept: dict) -> torch.Tensor:
    """Logits of a full-cache run of ``prompt`` then ``tokens`` (teacher forced), each layer and KV head seeing only
    the prompt keys in ``kept`` and every generated one."""
    original, n = model.config._attn_implementation, prompt.shape[1]
    model.config._attn_implementation = "reference_masked"
    _RECORD.clear()
    try:
        cache = DynamicCache(config=model.config)
        logits = [model(input_ids=prompt, **cache_kwargs(model, cache), use_cache=True).logits[0, -1].float()]
        for step, token in enumerate(tokens[:-1]):
            seen = range(n + step + 1)
            _RECORD["visible"] = {layer: torch.tensor([[j in heads or j >= n for j in seen] for heads in per_head])
                                  for layer, per_head in kept.items()}
            out = model(input_ids=torch.tensor([[token]]), **cache_kwargs(model, cache), use_cache=True)
            logits.append(out.logits[0, -1].float())
        return torch.stack(logits)
    finally:
        model.config._attn_implementation = original
        _RECORD.clear()


CASES = {  # family, capacity, beta, prompt length, score seed
    "llama": ("llama", 24, 1.01, 70, 0),
    "qwen3 beta 1.5": ("qwen3", 28, 1.5, 64, 1),
    "mistral beta 2": ("mistral", 20, 2.0, 60, 2),
    "llama between C and capacity": ("llama", 40, 1.01, 36, 0),  # 32 <= n < 40: the reference compresses
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_head_keeps_and_generates_what_the_reference_names(tmp_path, case):
    family, capacity, beta, n, seed = CASES[case]
    model, prompt = tiny_model(family), random_prompt(n, seed=seed + 3)
    path = headkv_scores(folder=tmp_path, seed=seed)
    policy = ec.HeadKV.from_config(capacity, scores=str(path), beta=beta)
    expected, budgets = reference_kept(model, prompt, path, capacity, beta)
    session = ec.CompressionSession(model, policy)
    session.prefill(prompt)
    assert held_positions(session, reference_keys(model, prompt)) == expected
    counts = {layer: [len(h) for h in heads] for layer, heads in expected.items()}
    assert counts == {layer: [min(b + WINDOW, n) for b in row] for layer, row in budgets.items()}
    sizes = [size for row in counts.values() for size in row]
    for index, layer in enumerate(session.cache.layers):  # what the cache really holds, padded to the largest head
        assert layer.heads.valid[0].sum(dim=-1).tolist() == counts[index]
        assert layer.keys.shape[-2] == max(sizes)
    assert min(sizes) < n and len(set(sizes)) > 1  # compressed, unevenly

    out = ec.generate(model, prompt, policy, max_new_tokens=12)
    assert out.stats[0]["kept_prompt_tokens_per_head"] == [counts[layer] for layer in sorted(counts)]
    tokens = out.sequences[0, n:].tolist()
    reference = masked_logits(model, prompt, tokens, expected)
    assert reference.argmax(dim=-1).tolist() == tokens
    torch.testing.assert_close(out.logits[0], reference, atol=2e-4, rtol=1e-4)


def test_a_prompt_shorter_than_the_reference_capacity_is_kept_whole(tmp_path, llama):
    policy = ec.HeadKV.from_config(24, scores=str(headkv_scores(folder=tmp_path)))  # C = 16
    out = ec.generate(llama, random_prompt(15, seed=4), policy, max_new_tokens=3)
    assert out.stats[0]["kept_prompt_tokens_per_head"] == [[15, 15], [15, 15]]


@pytest.mark.parametrize("damage, message", [
    (lambda path: path.unlink(), "no score file"),
    (lambda path: path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "1-2"})),
     r"names 7 heads, not each of 2 layers x 4 heads once \(no head 1-2\)"),
    (lambda path: path.write_text(json.dumps({"0-0": [0.5], "0-1": [-1]})), r"head 0-1 holds \[-1\]"),
], ids=["missing", "a head missing", "negative"])
def test_a_missing_or_misshapen_score_file_is_one_line(tmp_path, damage, message):
    path = headkv_scores(folder=tmp_path)
    damage(path)
    with pytest.raises(LearnedFileError, match=message) as caught:
        ec.HeadKV.from_config(24, scores=str(path))
    assert "\n" not in str(caught.value) and str(path) in str(caught.value)


def test_a_score_file_for_another_model_is_refused_at_its_layers_and_heads(tmp_path, llama):
    other = ec.HeadKV.from_config(24, scores=str(headkv_scores(folder=tmp_path, layers=3)))
    with pytest.raises(LearnedFileError, match="scores 3 layers, the model has 2"):
        ec.CompressionSession(llama, other)
    session = ec.CompressionSession(llama, ec.HeadKV.from_config(24, scores=str(headkv_scores(folder=tmp_path, heads=2))))
    with pytest.raises(LearnedFileError, match="scores 2 attention heads per layer, the model has 4"):
        session.prefill(random_prompt(40))
