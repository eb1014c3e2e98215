"""LaCache: the tokens each layer and KV head holds after prefill and after every decode step, and the logits, against
a plain float64 definition written from GATECH-EIC/LaCache ``LongBench/lacache/kv_cache.py`` (``LaCache.__call__``)
as ``LongBench/pred.py`` calls it: once on the prompt's cache, then after every decode step's attention."""

from __future__ import annotations

import math

import pytest
import torch
from baseline_reference import replay_decoding
from conftest import random_prompt, tiny_model

import evalkit.compression as ec

# name: (layers, method settings, prompt tokens, decode steps)
CASES = {
    "two_layers_start_over": (2, dict(capacity=40, start_size=4, span=1), 100, 30),
    "six_layers_raised_size": (6, dict(capacity=30, span=2, start_size=4), 70, 40),
    "four_layers_clamped_start": (4, dict(capacity=36, span=2), 45, 40),
    "eight_layers_overlap": (8, dict(capacity=40, span=4, overlap=2, start_size=6), 60, 30),
}


class Definition:
    """The reference's rule over lists of text positions, one list per layer (the cache entries in order)."""

    def __init__(self, settings: dict, layers: int, prompt: int):
        span, overlap = settings.get("span", 16), settings.get("overlap", 0)
        self.layers = layers
        self.before = 1 + math.ceil((layers - span) / (span - overlap))
        self.after = min(math.ceil(span / (span - overlap)), self.before)
        self.shrink = self.before - self.after
        self.size = settings["capacity"] - 1 - self.shrink // 2  # the reference's cache_size
        self.start = min(settings.get("start_size", 128), max(1, prompt - layers - 1), self.size - layers - 1)
        self.cursor, self.raised = self.start, False

    def rung(self, begin: int, count: int, width: int, layer: int, spacing: int) -> list[int]:
        shift = layer % (width - self.after + 1)
        return [begin + shift + width * j + spacing * k for j in range(count) for k in range(self.after)]

    def __call__(self, held: list[list[int]]) -> list[list[int]]:
        length = len(held[0])
        if length <= self.size:
            return held
        if not self.raised:
            self.size, self.raised = self.size + self.shrink // 2, True
        excess, room = length - self.size, self.size - self.cursor - self.layers
        possible = room // self.after * self.shrink
        count = math.ceil(excess / self.shrink) if excess <= possible else room // self.after
        picks = [list(range(self.cursor)) + self.rung(self.cursor, count, self.before, layer, 1)
                 + list(range(self.cursor + self.before * count, length)) for layer in range(self.layers)]
        if excess <= possible:
            self.cursor += count * self.after
        else:
            left = excess - possible
            rounds = math.ceil(left / ((self.size - self.start - self.layers) // self.after * self.shrink))
            width = self.before + (rounds - 1) * (self.before - 1)
            count = math.ceil(left / (width - self.after))
            picks = [[pick[i] for i in list(range(self.start)) + self.rung(self.start, count, width, layer, rounds)
                      + list(range(self.start + width * count, len(pick)))] for layer, pick in enumerate(picks)]
            self.cursor = self.start + count * self.after
        return [[order[i] for i in pick] for order, pick in zip(held, picks)]


@torch.no_grad()
def simulate(model, settings: dict, prompt: torch.Tensor, tokens: list[int]):
    """The definition's held positions after prefill, each step's logits (float64 attention over what it holds) and
    the positions held after each step, per layer and KV head."""
    layers, kv_heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    definition = Definition(settings, layers, prompt.shape[1])
    kept = definition([list(range(prompt.shape[1]))] * layers)
    held = {layer: [set(kept[layer]) for _ in range(kv_heads)] for layer in range(layers)}
    prefill = {layer: [set(h) for h in per_head] for layer, per_head in held.items()}

    def evict(layer, per_head, query, keys, position, steps):
        if layer == layers - 1:  # every layer has attended: one call of the reference over all of them
            after = definition([sorted(held[i][0]) for i in range(layers)])
            for i in range(layers):
                for heads in held[i]:
                    heads.intersection_update(after[i])

    return prefill, *replay_decoding(model, prompt, tokens, held, evict)


def held_now(session) -> dict[int, list[set[int]]]:
    return {index: [set(layer.heads.positions[0, h][layer.heads.valid[0, h]].tolist())
                    for h in range(layer.heads.valid.shape[1])] for index, layer in enumerate(session.cache.layers)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_lacache_holds_what_its_definition_holds_after_prefill_and_every_step(case):
    layers, settings, length, steps = CASES[case]
    model = tiny_model("llama", num_hidden_layers=layers, initializer_range=0.2)
    policy, prompt = ec.LaCache(**settings), random_prompt(length, seed=4)
    tokens = ec.generate(model, prompt, policy, max_new_tokens=steps).sequences[0, length:].tolist()
    prefill, reference_logits, history = simulate(model, settings, prompt, tokens[:-1])

    session = ec.CompressionSession(model, policy)
    session.prefill(prompt)
    assert held_now(session) == prefill
    logits = []
    for step, token in enumerate(tokens[:-1]):
        logits.append(session.step(torch.tensor([[token]]))[0, -1])
        assert held_now(session) == history[step], f"step {step}"
        for layer in session.cache.layers:  # the real tensors: at most capacity slots, fewer tokens than seen
            assert layer.keys.shape[-2] <= policy.capacity
            held = layer.heads.valid[0].sum(dim=-1)
            assert int(held.max()) <= policy.capacity - 1 < length + step + 1
    torch.testing.assert_close(torch.stack(logits), reference_logits, atol=2e-4, rtol=1e-4)
    assert reference_logits.argmax(dim=-1).tolist() == tokens[1:]
    # The ladder: layers hold different tokens of the same count, the first start tokens and the latest in all.
    last = history[-1]
    assert len({frozenset(per_head[0]) for per_head in last.values()}) > 1
    assert len({len(per_head[0]) for per_head in last.values()}) == 1
    start = Definition(settings, layers, length).start
    common = set.intersection(*(per_head[0] for per_head in last.values()))
    assert set(range(start)) | {length + steps - 2} <= common


def test_lacache_definition_detects_another_span():
    """The reference can fail: another span keeps other positions per layer."""
    model = tiny_model("llama", num_hidden_layers=6)
    prompt = random_prompt(70, seed=4)
    session = ec.CompressionSession(model, ec.LaCache(capacity=30, span=2, start_size=4))
    session.prefill(prompt)
    layers = {layer: per_head[0] for layer, per_head in held_now(session).items()}
    for span, equal in ((2, True), (3, False)):
        kept = Definition(dict(capacity=30, span=span, start_size=4), 6, 70)([list(range(70))] * 6)
        assert (layers == {layer: set(k) for layer, k in enumerate(kept)}) is equal


def test_lacache_left_padded_batch_and_chunked_prefill_equal_the_prompt_alone(llama):
    from test_compression import assert_batch_equals_alone, assert_engine_equals_alone

    policy = ec.LaCache(capacity=24, start_size=4, span=1)
    assert_batch_equals_alone(llama, policy, new_tokens=30)
    assert_engine_equals_alone(llama, policy)
    prompt = random_prompt(90, seed=6)
    whole, chunked = (ec.CompressionSession(llama, policy) for _ in range(2))
    whole.prefill(prompt)
    chunked.prefill(prompt, chunk=32, chunk_mode="exact")
    assert held_now(chunked) == held_now(whole)


@pytest.mark.parametrize("settings, layers, message", [
    (dict(capacity=40), 2, r"lacache with span=16, overlap=0 keeps every token on a 2-layer model"),
    (dict(capacity=4, span=1), 2, r"lacache's capacity 4 leaves no room for a ladder on a 2-layer model"),
    (dict(capacity=48, start_size=4, span=3, overlap=1), 6, r"start-over keeps a token twice"),
])
def test_lacache_refuses_what_the_reference_cannot_run(settings, layers, message):
    model = tiny_model("llama", num_hidden_layers=layers)
    policy = ec.LaCache(**settings)
    with pytest.raises(ValueError, match=message):
        policy.check_layers(layers)
        ec.generate(model, random_prompt(120, seed=4), policy, max_new_tokens=80)


def test_lacache_refuses_an_overlap_not_below_its_span():
    with pytest.raises(ValueError, match=r"LaCache.overlap must be < span \(4\), got 4"):
        ec.LaCache(capacity=40, span=4, overlap=4)
