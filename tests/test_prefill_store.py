"""A prefill recorded under one method and replayed under another gives what running the model gives: the same kept
tokens, logits and generated tokens for every method, through generate and through the engine, without a forward
pass over the prompt."""

from __future__ import annotations

import pytest
import torch
from conftest import SMALL_POLICIES, TINY_RECONSTRUCTION, random_prompt, tiny_model
from test_chunked_prefill import chunk_lengths

import evalkit.compression as ec
from evalkit.compression.prefill_store import PrefillStore, sharing_prefills


@pytest.mark.parametrize("name", sorted(SMALL_POLICIES))
def test_a_replayed_prefill_is_the_prefill(name):
    model = tiny_model("llama", seed=2)
    prompt = random_prompt(120, seed=5, batch=2)
    mask = torch.ones_like(prompt)
    mask[1, :17] = 0  # a left-padded row
    plain = ec.generate(model, prompt, SMALL_POLICIES[name](), attention_mask=mask, max_new_tokens=12)
    store = PrefillStore(max_bytes=1 << 30)
    passes = chunk_lengths(model)  # the token count of each forward call
    with sharing_prefills(store):
        ec.generate(model, prompt, ec.KNorm(capacity=40), attention_mask=mask, max_new_tokens=2)  # records it
        replayed = ec.generate(model, prompt, SMALL_POLICIES[name](), attention_mask=mask, max_new_tokens=12)
    policy = SMALL_POLICIES[name]()  # a method's own passes over the prompt (KVCompose reads it again) run as ever
    own = sum(ids.shape[0] == 120 for _, _, ids in policy.passes(prompt[0])) if policy.extra_passes else 0
    misses = 1 + (policy.budget_free_passes and not getattr(policy, "appends", False))  # + its pass scores
    assert (store.hits, store.misses) == (1, misses) and passes.count(120) == 1 + own  # the prefill ran once
    assert replayed.sequences.tolist() == plain.sequences.tolist()
    assert torch.equal(replayed.logits, plain.logits)
    assert [s["kept_prompt_tokens_per_head"] for s in replayed.stats] == [
        s["kept_prompt_tokens_per_head"] for s in plain.stats]


def test_the_engine_replays_each_prompt_and_a_full_store_forgets_the_oldest():
    model = tiny_model("llama", seed=2)
    prompts = [random_prompt(90 + 7 * i, seed=i)[0] for i in range(3)]
    requests = [ec.Request(p, max_new_tokens=10) for p in prompts]
    policy = ec.SnapKV(capacity=48, window=8, kernel_size=5)
    plain = ec.Engine(model, policy, slots=2).run(requests)
    store = PrefillStore(max_bytes=1 << 30)
    with sharing_prefills(store):
        ec.Engine(model, ec.H2O(capacity=40, recent=10), slots=2).run(requests)
        replayed = ec.Engine(model, policy, slots=2).run(requests)
    assert store.hits == 3 and [c.tokens for c in replayed] == [c.tokens for c in plain]
    one = max(entry.nbytes for entry in store.entries.values())
    small = PrefillStore(max_bytes=one + 1)
    with sharing_prefills(small):
        ec.Engine(model, policy, slots=1).run(requests)
    assert len(small.entries) == 1  # only the last prompt's prefill fits


def test_chunked_prefills_and_other_models_are_not_replayed():
    model, other = tiny_model("llama", seed=2), tiny_model("llama", seed=3)
    prompt = random_prompt(100, seed=1)
    store = PrefillStore(max_bytes=1 << 30)
    with sharing_prefills(store):
        ec.generate(model, prompt, ec.Full(), max_new_tokens=2)
        ours = ec.generate(other, prompt, ec.Full(), max_new_tokens=5)
        ec.generate(model, prompt, ec.Full(), max_new_tokens=2, prefill_chunk=32)
    assert store.hits == 0
    assert ours.sequences.tolist() == ec.generate(other, prompt, ec.Full(), max_new_tokens=5).sequences.tolist()


@pytest.mark.parametrize("name", ["kvzip", "kvzip_plus"])
def test_kvzips_passes_run_once_for_every_budget(name):
    """KVzip's reconstruction scores do not depend on the budget: a second budget over the same prompt reads them
    from the store (no pass runs) and keeps what it keeps alone, with the same prefill peak."""
    model = tiny_model("llama", seed=2)
    prompt = random_prompt(150, seed=4)
    method = {"kvzip": ec.KVzip, "kvzip_plus": ec.KVzipPlus}[name]
    sized = [method(capacity=c, chunk_size=64).with_prompts(TINY_RECONSTRUCTION) for c in (30, 70)]
    plain = ec.generate(model, prompt, sized[1], max_new_tokens=10)
    store = PrefillStore(max_bytes=1 << 30)
    calls = chunk_lengths(model)
    with sharing_prefills(store):
        ec.generate(model, prompt, sized[0], max_new_tokens=2)
        before = len(calls)
        shared = ec.generate(model, prompt, sized[1], max_new_tokens=10)
    assert store.hits == 2  # the prefill and the passes' scores
    assert all(n == 1 for n in calls[before:])  # the second budget ran no pass (and no prefill): decode steps only
    assert shared.sequences.tolist() == plain.sequences.tolist()
    assert [s["kept_prompt_tokens_per_head"] for s in shared.stats] == [
        s["kept_prompt_tokens_per_head"] for s in plain.stats]
    assert [s["kv_bytes_prefill_peak"] for s in shared.stats] == [s["kv_bytes_prefill_peak"] for s in plain.stats]
    assert torch.tensor(shared.stats[0]["kept_prompt_tokens_per_head"]).float().mean() < 100  # it compressed
