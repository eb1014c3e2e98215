"""Nested wrappers, exactly: ``DecodingSnapKV(AdaKV(KNorm))`` (kvpress' ``DecodingPress(AdaKVPress(KnormPress()))``).

A plain reference, written here in torch and Python loops, replays the prompt and the fed tokens through the model
with an ordinary full cache, hiding from each layer and KV head the keys the definition has dropped:

* prefill: AdaKV shares ``capacity - interval`` tokens per head on average over each layer's heads, ranked by KNorm
  (``-||k||``, its ``sink``/``window`` forced): every head keeps its own top ``int(budget * alpha_safeguard)``, then
  the layer keeps its best ``kv_heads * budget`` across heads;
* decoding: every head takes each new token; after every ``interval``-th step each layer is ranked again as a prompt
  (each head's held tokens in text order, its forced sink/window its own first/last ones) and AdaKV-allocated back
  down to ``capacity - interval`` per head on average.

At every step the test checks that evalkit holds the same positions per layer and head (and the same key vectors in
those slots), that its logits are the reference's, that the layer total never exceeds ``kv_heads * capacity``, that
heads hold unequal counts (AdaKV allocated) and that the compression is real (fewer tokens than the sequence, logits
away from a full cache's).
"""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB
from masked_reference import _RECORD
from transformers import DynamicCache

import evalkit.compression as ec
from evalkit.compression.model_spec import cache_kwargs

INF = float("inf")
PROMPT, STEPS = 50, 20
# The gap a reference decision must clear between the last token kept and the first dropped: evalkit ranks float32
# norms of keys from its own attention, the reference float64 norms of the masked replay's keys (they differ by
# about 1e-7).
MARGIN = 1e-5


def _clear(last_kept: float, first_dropped: float) -> None:
    """A reference cut (kept above, dropped below) clears rounding, which could order a near-tie either way."""
    assert last_kept == INF or last_kept - first_dropped > MARGIN, "a near-tie: pick another seed"


def adakv_knorm(held: list[list[int]], keys: torch.Tensor, cap: int, alpha: float, sink: int, window: int):
    """One layer's AdaKV-over-KNorm selection among each head's ``held`` positions (text order), ``keys``
    ``[Hkv, positions, D]``: the kept positions per head."""
    budget = min(max(map(len, held)), cap)
    if max(map(len, held)) <= budget:
        return [set(h) for h in held]
    safe = int(budget * alpha)
    candidates = []
    for head, positions in enumerate(held):
        forced = set(positions[:sink]) | set(positions[len(positions) - window:])
        score = {j: INF if j in forced else -float(keys[head, j].double().norm()) for j in positions}
        ranked = sorted(positions, key=lambda j: (-score[j], j))
        protected = set(ranked[:safe])
        _clear(score[ranked[safe - 1]] if safe else INF, score[ranked[safe]] if safe < len(ranked) else -INF)
        candidates += [(INF if j in protected else score[j], head, j) for j in positions]
    candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
    chosen, dropped = candidates[: len(held) * budget], candidates[len(held) * budget:]
    _clear(chosen[-1][0], dropped[0][0] if dropped else -INF)
    kept = [set() for _ in held]
    for _, head, j in chosen:
        kept[head].add(j)
    return kept


@torch.no_grad()
def reference(model, policy, prompt: torch.Tensor, tokens: list[int]):
    """Replay ``prompt`` then ``tokens`` (teacher forced) with a full cache, masked to what the definition holds.
    Returns the logits of each step, the held positions per layer and head after each step (the prefill's first),
    and the keys ``[Hkv, positions, D]`` per layer of the whole replay."""
    adakv, knorm = policy.scorer, policy.scorer.scorer
    cap, n = policy.capacity - policy.interval, prompt.shape[1]

    def select(keys, held):
        return adakv_knorm([sorted(h) for h in held], keys, cap, adakv.alpha_safeguard, knorm.sink, knorm.window)

    original = model.config._attn_implementation
    model.config._attn_implementation = "reference_masked"  # plain attention that hides _RECORD["visible"]
    _RECORD.clear()
    try:
        cache = DynamicCache(config=model.config)
        model(input_ids=prompt, **cache_kwargs(model, cache), use_cache=True)
        keys = {layer: key[0] for layer, key in _RECORD["keys"].items()}
        held = {layer: select(key, [range(n)] * key.shape[0]) for layer, key in keys.items()}
        history, logits = [held], []
        for step, token in enumerate(tokens, start=1):
            position = n + step - 1
            held = {layer: [h | {position} for h in heads] for layer, heads in held.items()}
            _RECORD["visible"] = {layer: torch.tensor([[j in h for j in range(position + 1)] for h in heads])
                                  for layer, heads in held.items()}
            logits.append(model(input_ids=torch.tensor([[token]]), **cache_kwargs(model, cache)).logits[0, -1].float())
            keys = {layer: key[0] for layer, key in _RECORD["keys"].items()}
            if step % policy.interval == 0:
                held = {layer: select(keys[layer], heads) for layer, heads in held.items()}
            history.append(held)
        return torch.stack(logits), history, keys
    finally:
        model.config._attn_implementation = original
        _RECORD.clear()


def evalkit_held(session, keys: dict[int, torch.Tensor]) -> dict[int, list[set[int]]]:
    """Per layer and KV head, the positions the session's cache holds; checks each valid slot holds the key the
    reference has at that position."""
    held = {}
    for index, layer in enumerate(session.cache.layers):
        heads = layer.heads
        held[index] = []
        for head in range(heads.valid.shape[1]):
            valid = heads.valid[0, head]
            positions = heads.positions[0, head][valid]
            torch.testing.assert_close(layer.keys[0, head][valid].double(), keys[index][head, positions].double(),
                                       atol=1e-4, rtol=1e-4)
            held[index].append(set(positions.tolist()))
    return held


@pytest.mark.parametrize("scorer", [
    {"name": "adakv", "scorer": "knorm"},
    # A safeguard of int(24 * 0.9) = 21 tokens per head binds here: without it layer 0's heads would keep 29 and 19.
    {"name": "adakv", "scorer": {"name": "knorm", "sink": 2, "window": 3}, "alpha_safeguard": 0.9},
], ids=["knorm", "knorm_sink_window_safeguard"])
def test_decoding_over_adakv_over_knorm_holds_what_the_definition_names_at_every_step(llama, scorer):
    policy = ec.DecodingSnapKV(capacity=30, window=2, interval=6, scorer=scorer)
    assert (type(policy.scorer), type(policy.scorer.scorer)) == (ec.AdaKV, ec.KNorm)
    assert policy.scorer.capacity == policy.scorer.scorer.capacity == 24  # both sized capacity - interval
    # Distinct tokens throughout: RoPE keeps a key's norm, so a repeated token would tie with itself (layer 0) and
    # KNorm's ranking would hang on the last bit.
    distinct = (3 + torch.randperm(VOCAB - 3, generator=torch.Generator().manual_seed(0))[: PROMPT + STEPS]).tolist()
    prompt, tokens = torch.tensor([distinct[:PROMPT]]), distinct[PROMPT:]
    expected_logits, history, keys = reference(llama, policy, prompt, tokens)

    session, full = ec.CompressionSession(llama, policy), ec.CompressionSession(llama, ec.Full())
    session.prefill(prompt)
    full.prefill(prompt)
    kv_heads, target = llama.config.num_key_value_heads, policy.capacity - policy.interval
    safe = int(target * policy.scorer.alpha_safeguard)
    assert evalkit_held(session, keys) == history[0], "prefill"
    logits, full_logits, counts = [], [], set()
    for step, token in enumerate(tokens, start=1):
        logits.append(session.step(torch.tensor([[token]]))[0, -1])
        full_logits.append(full.step(torch.tensor([[token]]))[0, -1])
        held = evalkit_held(session, keys)
        assert held == history[step], f"step {step}"
        for index, heads in held.items():
            sizes = [len(h) for h in heads]
            counts.add(tuple(sizes))
            assert sum(sizes) <= kv_heads * policy.capacity, (step, index, sizes)
            assert max(sizes) < PROMPT + step  # the cache is really smaller than the sequence
            if step % policy.interval == 0:  # re-applied: back to capacity - interval per head on average
                assert sum(sizes) == kv_heads * target and min(sizes) >= safe, (step, index, sizes)
            assert session.cache.layers[index].keys.shape[-2] <= policy.slot_capacity(kv_heads)
    torch.testing.assert_close(torch.stack(logits), expected_logits, atol=2e-4, rtol=1e-4)
    assert any(len(set(sizes)) > 1 for sizes in counts), "AdaKV gave every head the same count"
    assert (torch.stack(logits) - torch.stack(full_logits)).abs().max() > 1e-2, "the logits are a full cache's"
