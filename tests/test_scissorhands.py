"""Scissorhands: the tokens each layer and KV head holds after prefill and after every decode step, and the logits,
against a plain float64 definition written from KVCache-Factory's ``pyramidkv/scissorhands.py``: importance = the
attention of the prompt's last ``history_window`` queries summed (``reduce_scissorhands_scores``), then
``decay * importance + attention`` at every step (``update_scissorhands_importance``); the budget keeps the first
``sink`` and last ``recent`` tokens and the most important others (``select_scissorhands_tokens``, top-k)."""

from __future__ import annotations

import pytest
import torch
from baseline_reference import _probabilities, causal_probabilities, full_run, replay_decoding
from conftest import random_prompt, tiny_model
from masked_reference import module_scaling

import evalkit.compression as ec

# fp32 attention sums agree with fp64 to about 1e-6: a cut between two importances closer than this would hang on
# the CPU kernels' rounding, and the reference says so instead.
TOLERANCE = 1e-5
SETTINGS = {
    "sink_window_decay": dict(capacity=21, sink=2, recent=4, history_window=8, decay=0.8),
    "all_queries_max": dict(capacity=21, recent=3, gqa_reduce="max"),
}


def peaked_model():
    """The tiny llama with larger weights: uneven attention, so that decode steps evict prompt tokens too (with the
    default init's near-uniform attention every step evicts the token leaving the recent window)."""
    return tiny_model("llama", initializer_range=0.2)


def group_reduce(per_query_head: list[torch.Tensor], how: str) -> torch.Tensor:
    stacked = torch.stack(per_query_head)
    return stacked.amax(dim=0) if how == "max" else stacked.mean(dim=0)


def prefill_importance(r, policy, scaling) -> list[list[float]]:
    """Per KV head, the attention the last ``history_window`` prompt queries gave each prompt token, summed."""
    kv_heads, n = r["key"].shape[:2]
    group = r["query"].shape[0] // kv_heads
    first = 0 if policy.history_window is None else max(0, n - policy.history_window)
    return [group_reduce([causal_probabilities(r["query"][h * group + g], r["key"][h], scaling)[first:].sum(dim=0)
                          for g in range(group)], policy.gqa_reduce).tolist() for h in range(kv_heads)]


def budget_selection(order: list[int], importance: dict[int, float], budget: int, sink: int, recent: int) -> set[int]:
    """``select_scissorhands_tokens`` over the held tokens ``order`` (text order): the first ``sink`` and last
    ``recent`` protected, the most important others (ties to the earlier token) up to ``budget``."""
    if budget >= len(order):
        return set(order)
    protected = set(order[:sink]) | set(order[len(order) - recent:])
    ranked = sorted((j for j in order if j not in protected), key=lambda j: (-importance[j], j))
    count = budget - len(protected)
    inside, outside = importance[ranked[count - 1]], importance[ranked[count]]
    assert abs(inside - outside) > TOLERANCE, f"tokens {ranked[count - 1]}, {ranked[count]} tie at the cut"
    return protected | set(ranked[:count])


def kept_after_prefill(run, policy, scaling):
    """Per layer and KV head: the prompt positions kept, and their importance."""
    held, importance = {}, {}
    for layer, r in run.items():
        n = r["key"].shape[1]
        held[layer], importance[layer] = [], []
        for scores in prefill_importance(r, policy, scaling):
            scores = dict(enumerate(scores))
            kept = budget_selection(list(range(n)), scores, policy.capacity - 1, policy.sink, policy.recent)
            held[layer].append(kept)
            importance[layer].append({j: scores[j] for j in kept})
    return held, importance


def decode_step(policy, heads: set[int], importance: dict[int, float], probabilities: list[float]) -> None:
    """After a step's attention: every held token's importance decayed and raised by it; once the cache holds
    ``capacity`` tokens, the budget of ``capacity - 1`` selected among them (one token leaves)."""
    order = sorted(heads)
    for j, p in zip(order, probabilities):
        importance[j] = policy.decay * importance.get(j, 0.0) + p
    if len(order) >= policy.capacity:
        kept = budget_selection(order, importance, policy.capacity - 1, policy.sink, policy.recent)
        for j in heads - kept:
            heads.discard(j)
            del importance[j]


@torch.no_grad()
def simulate(model, policy, prompt: torch.Tensor, tokens: list[int]):
    """Feed ``tokens`` after ``prompt`` with a full cache, each layer and head seeing only what the definition still
    holds. Returns the prefill's kept positions, each step's logits and the positions held after each step."""
    scaling = module_scaling(model)
    held, importance = kept_after_prefill(full_run(model, prompt), policy, scaling)
    prefill = {layer: [set(h) for h in per_head] for layer, per_head in held.items()}

    def evict(layer, per_head, query, keys, position, steps):
        group = query.shape[0] // keys.shape[0]
        for h, heads in enumerate(per_head):
            order = sorted(heads)
            probabilities = group_reduce([torch.tensor(_probabilities(query[h * group + g], keys[h], order, scaling))
                                          for g in range(group)], policy.gqa_reduce).tolist()
            decode_step(policy, heads, importance[layer][h], probabilities)

    return prefill, *replay_decoding(model, prompt, tokens, held, evict)


def held_now(session) -> dict[int, list[set[int]]]:
    """Per layer and KV head, the positions the cache's valid slots hold."""
    return {index: [set(layer.heads.positions[0, h][layer.heads.valid[0, h]].tolist())
                    for h in range(layer.heads.valid.shape[1])] for index, layer in enumerate(session.cache.layers)}


@pytest.mark.parametrize("settings", sorted(SETTINGS))
def test_scissorhands_holds_what_its_definition_holds_after_prefill_and_every_step(settings):
    llama = peaked_model()
    policy, prompt, steps = ec.Scissorhands(**SETTINGS[settings]), random_prompt(40, seed=4), 24
    tokens = ec.generate(llama, prompt, policy, max_new_tokens=steps).sequences[0, 40:].tolist()
    prefill, reference_logits, history = simulate(llama, policy, prompt, tokens[:-1])

    session = ec.CompressionSession(llama, policy)
    first = session.prefill(prompt)
    assert held_now(session) == prefill
    assert [[len(h) for h in heads] for heads in held_now(session).values()] == [[20, 20], [20, 20]]
    assert session.realized(0)["kept_prompt_tokens_per_head"] == [[20, 20], [20, 20]]
    logits = []
    for step, token in enumerate(tokens[:-1]):
        logits.append(session.step(torch.tensor([[token]]))[0, -1])
        for layer in session.cache.layers:  # the real tensors: capacity slots, capacity - 1 held after each step
            assert layer.keys.shape[-2] == policy.capacity
            assert layer.heads.valid[0].sum(dim=-1).tolist() == [policy.capacity - 1] * 2
        assert held_now(session) == history[step], f"step {step}"
        assert [sorted(h) for h in history[step][0]] == [p.tolist() for p in ec.kept_positions(session)[0]]
    assert first.argmax(-1).item() == tokens[0]
    torch.testing.assert_close(torch.stack(logits), reference_logits, atol=2e-4, rtol=1e-4)
    assert reference_logits.argmax(dim=-1).tolist() == tokens[1:]  # the generated tokens are the definition's
    # Evictions happened, differently per head, and the protected tokens stayed.
    last = history[-1]
    assert len(last[0][0] & set(range(40))) < 20
    assert any(heads[0] != heads[1] for snapshot in history for heads in snapshot.values())
    protected = set(range(policy.sink)) | set(range(40 + steps - 1 - policy.recent, 40 + steps - 1))
    assert all(protected <= heads for per_head in last.values() for heads in per_head)


def test_scissorhands_definition_detects_another_history_window():
    """The reference can fail: another history window names other prompt tokens."""
    llama = peaked_model()
    policy, prompt = ec.Scissorhands(capacity=21, recent=4, history_window=8), random_prompt(40, seed=4)
    session = ec.CompressionSession(llama, policy)
    session.prefill(prompt)
    other = ec.Scissorhands(capacity=21, recent=4, history_window=None)
    run = full_run(llama, prompt)
    assert held_now(session) == kept_after_prefill(run, policy, module_scaling(llama))[0]
    assert held_now(session) != kept_after_prefill(run, other, module_scaling(llama))[0]


def test_scissorhands_left_padded_batch_and_chunked_prefill_equal_the_prompt_alone(llama):
    from test_compression import assert_batch_equals_alone

    policy = ec.Scissorhands(capacity=21, sink=2, recent=4, history_window=8, decay=0.9)
    assert_batch_equals_alone(llama, policy, new_tokens=20)
    prompt = random_prompt(90, seed=6)
    whole, chunked = (ec.CompressionSession(llama, policy) for _ in range(2))
    whole.prefill(prompt)
    chunked.prefill(prompt, chunk=32, chunk_mode="exact")
    assert held_now(chunked) == held_now(whole)


@pytest.mark.parametrize("settings, message", [
    (dict(capacity=10, sink=4, recent=5), r"sink \+ recent must be <= capacity - 2 \(8\)"),
    (dict(capacity=21, history_window=0), "history_window must be an integer >= 1"),
    (dict(capacity=21, decay=-0.5), "decay must be a number >= 0"),
    (dict(capacity=21, gqa_reduce="sum"), "gqa_reduce must be one of"),
])
def test_scissorhands_refuses_settings_it_cannot_run(settings, message):
    with pytest.raises(ValueError, match=message):
        ec.Scissorhands(**settings)
