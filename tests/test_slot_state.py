"""A method's state per row (``Policy.keeps_slot_state``): made at each row's prefill, carried by the session's
layer per row and by the engine's per slot, moved into its slot at admission, replaced when a new request takes the
slot and dropped when the request ends, copied with a forked session, and handed back to ``decode_visible``. ShadowKV
keeps its landmarks so: two prompts whose keys agree at both ends each read by their own."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from conftest import random_prompt

import evalkit.compression as ec
from evalkit.compression.methods.shadowkv import PromptShadow, chunk_scores

# 28 context chunks of 2 tokens, 22 of them exact outliers: a prompt's first chunk is one, so both ends of layer 0's
# keys are the exact keys of the first and last token.
SETTINGS = dict(capacity=8, rank=4, chunk_size=2, local_chunks=2, outlier_chunks=22)
NEW = 12


def twin_prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Two 60-token prompts with the same first and last token and different middles."""
    first, second = random_prompt(60, seed=9)[0], random_prompt(60, seed=109)[0]
    second[0], second[-1] = first[0], first[-1]
    return first, second


def prefilled(model, prompt: torch.Tensor) -> ec.CompressionSession:
    session = ec.CompressionSession(model, ec.ShadowKV(**SETTINGS))
    session.prefill(prompt[None])
    return session


def recorded(policy) -> list[tuple[int, torch.Tensor, list, torch.Tensor | None]]:
    """Every ``decode_visible`` call on ``policy``: its layer, query, the states it was handed (as they were) and
    the mask it returned."""
    calls, original = [], policy.decode_visible

    def spy(query, keys, visible, layer_idx, states=None):
        chosen = original(query, keys, visible, layer_idx, states)
        calls.append((layer_idx, query, list(states), chosen))
        return chosen

    policy.decode_visible = spy
    return calls


def read_candidates(chosen: torch.Tensor, shadow: PromptShadow, groups: int, size: int) -> list[set[int]]:
    """Per KV head, the candidate chunks of ``shadow`` that a slot's mask ``[Hq, S]`` reads."""
    read = []
    for head, candidates in enumerate(shadow.chunks.tolist()):
        slots = torch.nonzero(chosen[head * groups]).flatten().tolist()
        read.append({slot // size for slot in slots if slot < shadow.tokens} & set(candidates))
    return read


def selected(query: torch.Tensor, shadow: PromptShadow, count: int) -> list[set[int]]:
    """Per KV head, the candidate chunks ``shadow``'s landmarks select for a slot's query ``[Hq, 1, D]``."""
    picked = chunk_scores(query, shadow.landmarks).topk(count, dim=-1).indices
    return [set(row) for row in shadow.chunks.gather(1, picked).tolist()]


def test_two_slots_whose_keys_agree_at_both_ends_read_by_their_own_landmarks(llama):
    first, second = twin_prompts()
    alone = [prefilled(llama, prompt).cache.layers for prompt in (first, second)]
    for end in (0, -1):  # layer 0 holds the same keys at both ends for both prompts
        assert torch.equal(alone[0][0].keys[0, :, end], alone[1][0].keys[0, :, end])
    assert not torch.equal(alone[0][0].slot_states[0].landmarks, alone[1][0].slot_states[0].landmarks)

    policy = ec.ShadowKV(**SETTINGS)
    calls = recorded(policy)
    completions = ec.Engine(llama, policy, slots=2).run([ec.Request(p, max_new_tokens=NEW) for p in (first, second)])
    for prompt, completion in zip((first, second), completions):
        reference = ec.generate(llama, prompt[None], ec.ShadowKV(**SETTINGS), max_new_tokens=NEW, return_logits=False)
        assert completion.tokens == reference.sequences[0, 60:].tolist()

    groups = llama.config.num_attention_heads // llama.config.num_key_value_heads
    count, both, differs = policy.selected_chunks(), 0, 0
    for layer, query, states, chosen in calls:
        if None in states:  # a slot whose request has ended
            continue
        both += 1
        assert states[0] is not states[1] and not torch.equal(states[0].landmarks, states[1].landmarks)
        for slot in (0, 1):
            own, other = states[slot], states[1 - slot]
            assert torch.equal(own.landmarks, alone[slot][layer].slot_states[0].landmarks)  # its prompt's, made alone
            own_choice = selected(query[slot], own, count)
            assert read_candidates(chosen[slot], own, groups, policy.chunk_size) == own_choice
            differs += own_choice != selected(query[slot], other, count)
    assert both >= 2 * (NEW - 1) and differs  # every step of both layers; the other slot's landmarks choose otherwise


def test_a_forked_session_copies_the_state_and_each_keeps_its_own():
    from conftest import tiny_model

    model = tiny_model("llama")
    session = prefilled(model, twin_prompts()[0])
    fork = session.fork()
    for parent, child in zip(session.cache.layers, fork.cache.layers):
        assert child.slot_states[0] is not parent.slot_states[0]
        assert torch.equal(child.slot_states[0].landmarks, parent.slot_states[0].landmarks)
        assert torch.equal(child.slot_states[0].chunks, parent.slot_states[0].chunks)
    held = session.cache.layers[0].slot_states[0]
    landmarks, chunks = held.landmarks.clone(), held.chunks.clone()
    fork.cache.layers[0].slot_states[0].landmarks.add_(1.0)
    fork.cache.layers[0].slot_states[0].chunks.zero_()
    fork.cache.layers[1].slot_states[0] = None
    assert torch.equal(held.landmarks, landmarks) and torch.equal(held.chunks, chunks)
    assert session.cache.layers[1].slot_states[0] is not None


def test_a_slot_taken_by_the_next_request_holds_that_request_state_and_a_freed_one_none(llama):
    first, second = twin_prompts()
    alone = [prefilled(llama, prompt).cache.layers for prompt in (first, second)]
    policy = ec.ShadowKV(**SETTINGS)
    calls = recorded(policy)
    engine = ec.Engine(llama, policy, slots=1)
    engine.run([ec.Request(p, max_new_tokens=NEW) for p in (first, second)])
    for layer in range(llama.config.num_hidden_layers):
        held = []
        for index, _, states, _ in calls:
            if index == layer and (not held or states[0] is not held[-1]):
                held.append(states[0])
        assert len(held) == 2  # the first request's state, then the second's in its place
        for state, made in zip(held, alone):
            assert torch.equal(state.landmarks, made[layer].slot_states[0].landmarks)
            assert torch.equal(state.chunks, made[layer].slot_states[0].chunks)
    assert [layer.slot_states for layer in engine.cache.layers] == [[None]] * llama.config.num_hidden_layers


@dataclasses.dataclass
class PromptLength(ec.Policy):
    """Keeps every token and, per row, its prompt's length: what each decode step is handed is recorded."""

    selects_while_decoding: ClassVar[bool] = True
    keeps_slot_state: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        self.seen: list[tuple] = []

    def prefill_state(self, view) -> list:
        return view.key_valid.sum(dim=1).tolist()

    def decode_visible(self, query, keys, visible, layer_idx, states=None):
        if layer_idx == 0:
            self.seen.append(tuple(states))
        return None


def test_any_method_gets_its_own_state_per_row_and_per_slot(llama):
    policy = PromptLength()
    prompts = [random_prompt(n, seed=n)[0] for n in (30, 12, 45)]
    width = 45
    padded = torch.stack([torch.nn.functional.pad(p, (width - len(p), 0)) for p in prompts])
    mask = torch.stack([torch.arange(width) >= width - len(p) for p in prompts]).long()
    ec.generate(llama, padded, policy, attention_mask=mask, max_new_tokens=3)
    assert policy.seen == [(30, 12, 45)] * 2  # each row its own, left padding aside

    policy.seen.clear()
    requests = [ec.Request(p, max_new_tokens=n) for p, n in zip(prompts, (4, 12, 12))]
    engine = ec.Engine(llama, policy, slots=2, sync_every=4)
    engine.run(requests)
    # the first request ends at the first look and the third takes its slot; the second's slot is freed at its end
    assert list(dict.fromkeys(policy.seen)) == [(30, 12), (45, 12), (45, None)]
    assert engine.cache.layers[0].slot_states == [None, None]
