"""``ec.kept_positions``: the text positions each layer and KV head holds, after prefill and after decode steps, equal
what each method's definition keeps (and what the cache's own selection picked), for row and per-head layouts, a
hybrid model's sliding-window layers and a latent (MLA) cache."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from baseline_reference import kept_prompt, simulate_decoding
from conftest import random_prompt
from test_hybrid import WINDOW, tiny_gemma3

import evalkit.compression as ec
from evalkit.compression.cache import CompressedCache

DOCS = Path(__file__).resolve().parents[1] / "docs" / "methods.md"


def as_lists(kept) -> list[list[list[int]]]:
    return [[head.tolist() for head in layer] for layer in kept]


def record_keep(monkeypatch) -> dict:
    """Patch ``CompressedCache.keep`` to record, per (layer, row), each head's picked prompt positions (the old way)."""
    picks = {}
    original = CompressedCache.keep

    def keep(cache, layer_idx, view, query, indices, counts, raw):
        positions = view.positions[:, None, :].expand(-1, indices.shape[1], -1).gather(2, indices)
        for row in range(indices.shape[0]):
            picks[layer_idx, row] = [sorted(positions[row, h, : int(counts[row, h])].tolist())
                                     for h in range(indices.shape[1])]
        original(cache, layer_idx, view, query, indices, counts, raw)

    monkeypatch.setattr(CompressedCache, "keep", keep)
    return picks


def test_snapkv_holds_what_its_selection_picked_in_every_row_of_a_padded_batch(llama, monkeypatch):
    picks = record_keep(monkeypatch)
    prompts = random_prompt(60, seed=4, batch=2)
    mask = torch.ones_like(prompts)
    mask[0, :15] = 0  # row 0: a 45-token prompt, left-padded
    out = ec.generate(llama, prompts, ec.SnapKV(capacity=20, window=4, kernel_size=5), attention_mask=mask,
                      max_new_tokens=1, keep_session=True)  # one token: no step ran, the cache as prefill left it
    for row in range(2):
        kept = as_lists(ec.kept_positions(out, row=row))
        assert kept == [picks[layer, row] for layer in range(len(kept))]
        assert [len(h) for layer in kept for h in layer] == [20] * 4
        assert [len(layer[0]) for layer in kept] == out.stats[row]["kept_prompt_tokens"]
        assert max(max(h) for layer in kept for h in layer) == (44 if row == 0 else 59)
    assert as_lists(ec.kept_positions(out, row=1)) != as_lists(ec.kept_positions(out, row=0))


def test_streaming_llm_holds_its_sink_and_last_window_and_its_ring_moves_while_decoding(llama):
    session = ec.CompressionSession(llama, ec.StreamingLLM(sink=4, window=16))
    logits = session.prefill(random_prompt(50, seed=2))
    sink, window = list(range(4)), list(range(34, 50))
    assert as_lists(ec.kept_positions(session)) == [[sink + window] * 2] * 2
    assert session.realized(0)["kept_prompt_tokens"] == [20, 20]
    for _ in range(5):  # positions 50..54 overwrite the ring's oldest slots
        logits = session.step(logits.argmax(dim=-1).reshape(1, 1))[:, -1]
    assert as_lists(ec.kept_positions(session)) == [[sink + list(range(39, 55))] * 2] * 2
    assert as_lists(ec.kept_positions(session, prompt_only=True)) == [[sink + list(range(39, 50))] * 2] * 2


def test_snapstream_keeps_its_prompt_region_and_rings_its_generated_tokens(llama, monkeypatch):
    picks = record_keep(monkeypatch)
    policy = ec.SnapStream(capacity=64, window=8, sink=4, recent=16, kernel_size=5)
    out = ec.generate(llama, random_prompt(100, seed=5), policy, max_new_tokens=21, keep_session=True)
    prompt = [[picks[layer, 0][h] for h in range(2)] for layer in range(2)]
    assert all(len(h) == 48 for layer in prompt for h in layer)  # capacity - recent
    # 20 steps wrote positions 100..119; the ring of 64 - 48 slots holds the newest 16
    assert as_lists(ec.kept_positions(out)) == [[h + list(range(104, 120)) for h in layer] for layer in prompt]
    assert as_lists(ec.kept_positions(out, prompt_only=True)) == prompt


@pytest.mark.parametrize("make", [lambda: ec.AdaKV.from_config(20, window=2, kernel_size=5, alpha_safeguard=0.5),
                                  lambda: ec.H2O(capacity=21, recent=6)], ids=["adakv", "h2o"])
def test_per_head_methods_hold_what_their_definition_keeps(llama, make):
    policy, prompt = make(), random_prompt(50, seed=11)
    session = ec.CompressionSession(llama, policy)
    session.prefill(prompt)
    kept = as_lists(ec.kept_positions(session))
    expected = kept_prompt(llama, policy, prompt)
    assert kept == [[sorted(h) for h in expected[layer]] for layer in range(2)]
    assert [[len(h) for h in layer] for layer in kept] == session.realized(0)["kept_prompt_tokens_per_head"]
    if policy.name == "adakv":  # per-head counts differ
        assert len({len(h) for layer in kept for h in layer}) > 1


def test_h2o_holds_after_each_decode_step_what_its_definition_holds(llama):
    policy, prompt = ec.H2O(capacity=21, recent=6), random_prompt(30, seed=7)
    tokens = ec.generate(llama, prompt, policy, max_new_tokens=12).sequences[0, 30:].tolist()
    _, history = simulate_decoding(llama, policy, prompt, tokens[:-1], kept_prompt(llama, policy, prompt))
    session = ec.CompressionSession(llama, policy)
    session.prefill(prompt)
    for step, token in enumerate(tokens[:-1]):
        session.step(torch.tensor([[token]]))
        assert as_lists(ec.kept_positions(session)) == [[sorted(h) for h in history[step][layer]] for layer in range(2)]
    assert len(set(ec.kept_positions(session)[0][0].tolist()) & set(range(30))) < 20  # prompt tokens were evicted


def test_full_holds_every_position_prompt_and_generated(llama):
    prompts = random_prompt(30, seed=3, batch=2)
    mask = torch.ones_like(prompts)
    mask[1, :10] = 0
    out = ec.generate(llama, prompts, ec.Full(), attention_mask=mask, max_new_tokens=6, keep_session=True)
    assert as_lists(ec.kept_positions(out, row=0)) == [[list(range(35))] * 2] * 2
    assert as_lists(ec.kept_positions(out, row=1)) == [[list(range(25))] * 2] * 2
    assert as_lists(ec.kept_positions(out, row=1, prompt_only=True)) == [[list(range(20))] * 2] * 2


def test_chunked_prefill_and_given_positions_are_followed(llama):
    prompt = random_prompt(181, seed=4)
    streaming = ec.CompressionSession(llama, ec.StreamingLLM(sink=4, window=36))
    streaming.prefill(prompt, chunk=30, chunk_mode="compress")  # compressed back to 40 after every chunk
    assert as_lists(ec.kept_positions(streaming)) == [[[0, 1, 2, 3, *range(145, 181)]] * 2] * 2
    whole, chunked = (ec.CompressionSession(llama, ec.SnapKV(capacity=40, window=8, kernel_size=5)) for _ in range(2))
    whole.prefill(prompt)
    chunked.prefill(prompt, chunk=50, chunk_mode="exact")
    assert as_lists(ec.kept_positions(chunked)) == as_lists(ec.kept_positions(whole))
    given = torch.sort(torch.randperm(300, generator=torch.Generator().manual_seed(0))[:20]).values
    full = ec.CompressionSession(llama, ec.Full())
    full.prefill(prompt[:, :20], position_ids=given[None])
    full.step(torch.tensor([[5]]))
    assert as_lists(ec.kept_positions(full)) == [[[*given.tolist(), int(given[-1]) + 1]] * 2] * 2
    assert as_lists(ec.kept_positions(full, prompt_only=True)) == [[given.tolist()] * 2] * 2


def test_a_fork_reads_its_own_cache(llama):
    session = ec.CompressionSession(llama, ec.StreamingLLM(sink=2, window=8))
    session.prefill(random_prompt(30, seed=6))
    before = as_lists(ec.kept_positions(session))
    fork = session.fork()
    fork.step(torch.tensor([[5]]))
    assert as_lists(ec.kept_positions(session)) == before
    assert as_lists(ec.kept_positions(fork)) == [[[0, 1, *range(23, 31)]] * 2] * 2


def test_hybrid_sliding_window_layers_hold_their_window(monkeypatch):
    model, picks = tiny_gemma3(), record_keep(monkeypatch)
    session = ec.CompressionSession(model, ec.SnapStream(capacity=20, sink=2, window=4, kernel_size=3, recent=6))
    logits = session.prefill(random_prompt(40, seed=2))
    kinds = model.config.layer_types
    for index, heads in enumerate(as_lists(ec.kept_positions(session))):
        if kinds[index] == "sliding_attention":
            assert heads == [list(range(40 - WINDOW + 1, 40))] * 2
        else:
            assert heads == picks[index, 0] and all(len(h) == 14 for h in heads)
    for _ in range(3):
        logits = session.step(logits.argmax(dim=-1).reshape(1, 1))[:, -1]
    for index, heads in enumerate(as_lists(ec.kept_positions(session))):
        if kinds[index] == "sliding_attention":  # the newest window - 1 after each step's eviction
            assert heads == [list(range(43 - WINDOW + 1, 43))] * 2
        else:
            assert heads == [h + [40, 41, 42] for h in picks[index, 0]]


def test_a_latent_cache_holds_one_head_per_layer(monkeypatch):
    from test_mla import tiny_deepseek  # here: test_mla builds every registered method as it is imported

    model, picks = tiny_deepseek(), record_keep(monkeypatch)
    session = ec.CompressionSession(model, ec.SnapKV(capacity=20, window=6, kernel_size=5))
    session.prefill(random_prompt(50, seed=3))
    kept = as_lists(ec.kept_positions(session))
    assert kept == [picks[layer, 0] for layer in range(2)] and all(len(layer) == 1 for layer in kept)
    assert all(len(layer[0]) == 20 and layer[0][-6:] == list(range(44, 50)) for layer in kept)


def test_bad_inputs_are_refused_in_one_line(llama):
    session = ec.CompressionSession(llama, ec.Full())
    with pytest.raises(ValueError, match="call prefill first"):
        ec.kept_positions(session)
    session.prefill(random_prompt(10))
    with pytest.raises(ValueError, match=r"row must be an integer in \[0, 1\), got 1"):
        ec.kept_positions(session, row=1)
    out = ec.generate(llama, random_prompt(10), ec.Full(), max_new_tokens=2)
    with pytest.raises(ValueError, match="keep_session=True"):
        ec.kept_positions(out)
    with pytest.raises(TypeError, match="got dict"):
        ec.kept_positions({})


def test_the_documented_example_runs_as_shown(llama):
    """docs/methods.md's "What a method kept" example, run on the tiny model with a 50-token prompt."""
    section = DOCS.read_text().split("## What a method kept", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    scope = {"ec": ec, "model": llama, "input_ids": random_prompt(50, seed=2)}
    exec(code, scope)
    sink_and_window = [0, 1, 2, 3, *range(34, 50)]
    assert scope["after_prefill"][0][0].tolist() == sink_and_window
    assert scope["after_step"][0][0].tolist() == [0, 1, 2, 3, *range(35, 51)]
    assert scope["prompt_left"][0][0].tolist() == [0, 1, 2, 3, *range(35, 50)]
    assert as_lists(scope["at_the_end"]) == [[[0, 1, 2, 3, *range(41, 57)]] * 2] * 2
