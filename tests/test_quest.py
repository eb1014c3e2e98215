"""Quest: every token held, each decode step reading the pages its query bounds highest, against a plain definition
(zoo_reference.quest_generate), in ``generate`` and in the engine."""

from __future__ import annotations

import pytest
import torch
import zoo_reference as ref
from conftest import random_prompt, tiny_model

import evalkit.compression as ec

NEW = 12


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", num_hidden_layers=3)


@pytest.mark.parametrize("capacity,dense_layers", [(24, 2), (24, 0), (40, 1)])
def test_each_step_reads_the_pages_its_query_bounds_highest(model, capacity, dense_layers):
    prompt = random_prompt(90)
    policy = ec.Quest(capacity=capacity, page_size=8, dense_layers=dense_layers)
    out = ec.generate(model, prompt, policy, max_new_tokens=NEW)
    tokens, logits = ref.quest_generate(model, prompt, NEW, 8, capacity, dense_layers)
    assert out.sequences[0, -NEW:].tolist() == tokens
    torch.testing.assert_close(out.logits[0], logits, rtol=1e-4, atol=1e-4)
    held = out.stats[0]
    assert held["kept_prompt_tokens"] == [90] * 3 and held["peak_cache_tokens"] == 90 + NEW - 1  # nothing evicted


def test_reading_fewer_pages_changes_the_output_and_reading_all_is_the_full_cache(model):
    prompt = random_prompt(90, seed=5)
    full = ec.generate(model, prompt, ec.Full(), max_new_tokens=NEW)
    everything = ec.generate(model, prompt, ec.Quest(capacity=4096, page_size=8, dense_layers=0), max_new_tokens=NEW)
    assert torch.equal(everything.sequences, full.sequences)
    torch.testing.assert_close(everything.logits, full.logits, rtol=1e-5, atol=1e-5)
    narrow = ec.generate(model, prompt, ec.Quest(capacity=24, page_size=8, dense_layers=0), max_new_tokens=NEW)
    assert (narrow.logits - full.logits).abs().max() > 1e-3  # reading 3 of 13 pages is not the full cache


def test_the_engine_reads_as_generate_and_prices_the_whole_cache(model):
    prompts = [random_prompt(90, seed=s)[0] for s in (1, 2, 3)] + [random_prompt(57, seed=4)[0]]
    policy = ec.Quest(capacity=24, page_size=8, dense_layers=1)
    engine = ec.Engine(model, policy, slots=2, slot_tokens=128)
    done = {c.index: c for c in engine.run([ec.Request(p, max_new_tokens=NEW) for p in prompts])}
    for index, prompt in enumerate(prompts):
        alone = ec.generate(model, prompt[None], policy, max_new_tokens=NEW)
        assert done[index].tokens == alone.sequences[0, -NEW:].tolist()
        stats = done[index].stats
        assert stats["kv_bytes_peak"] == stats["kv_bytes_full"] and stats["memory_ratio"] == 1.0
