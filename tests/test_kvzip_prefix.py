"""KVzip's reconstruction passes as the model receives them: a chat template's leading text is skipped only where the
prompt starts with it, and a later chunk's request repeats the previous chunk's last 8 tokens, never more than that
chunk (as the paper's code and kvpress' ``KVzipPress.prepare``)."""

from __future__ import annotations

import dataclasses

import torch
from conftest import TINY_RECONSTRUCTION, random_prompt, tiny_model

import evalkit.compression as ec


def pass_inputs(policy, prompt: torch.Tensor, model=None) -> list[list[int]]:
    """The input ids of every model call KVzip's prefill makes after the prompt's own (on a tiny random Llama)."""
    model, seen = model or tiny_model(), []
    hook = model.get_input_embeddings().register_forward_pre_hook(lambda _, args: seen.append(args[0][0].tolist()))
    try:
        ec.CompressionSession(model, policy).prefill(prompt)
    finally:
        hook.remove()
    assert seen[0] == prompt[0].tolist()
    return seen[1:]


def kept_early(policy, prompt: torch.Tensor, count: int) -> set[int]:
    """Which of the prompt's first ``count`` positions any layer and KV head keeps."""
    session = ec.CompressionSession(tiny_model(), policy)
    session.prefill(prompt)
    return {int(p) for layer in session.cache.layers for positions, valid in zip(layer.heads.positions[0],
                                                                                layer.heads.valid[0])
            for p in positions[valid] if p < count}


def expected(tokens: list[int], start: int, chunk: int) -> list[list[int]]:
    """The official construction written out: the chunks of ``tokens[start:]``, the first asked with ``first``, each
    later one with ``next`` and the previous chunk's last 8 tokens."""
    p = TINY_RECONSTRUCTION
    chunks = [tokens[begin : begin + chunk] for begin in range(start, len(tokens), chunk)]
    return [[*(p.first if i == 0 else (*p.next, *chunks[i - 1][-8:])), *p.suffix, *c] for i, c in enumerate(chunks)]


def test_a_later_chunks_request_repeats_no_more_than_the_previous_chunk():
    prompt, model = random_prompt(20), tiny_model()
    tokens = prompt[0].tolist()
    prefixed = dataclasses.replace(TINY_RECONSTRUCTION, prefix=tuple(tokens[:3]))
    for chunk in (4, 12):  # shorter and longer than the 8 tokens repeated
        plain = ec.KVzip(capacity=10, chunk_size=chunk).with_prompts(TINY_RECONSTRUCTION)
        assert pass_inputs(plain, prompt, model) == expected(tokens, 0, chunk), chunk
        chat = ec.KVzip(capacity=10, chunk_size=chunk).with_prompts(prefixed)
        assert pass_inputs(chat, prompt, model) == expected(tokens, 3, chunk), chunk


def test_a_prompt_without_the_chat_prefix_is_reconstructed_from_its_first_token():
    """Unlike kvpress 0.5.5, which always skips len(prefix) tokens: a prompt that does not start with the chat
    template's leading text is reconstructed from its first token, so those tokens are scored and some kept."""
    prompt = random_prompt(40)
    other = dataclasses.replace(TINY_RECONSTRUCTION, prefix=tuple(random_prompt(6, seed=2)[0].tolist()))
    own = dataclasses.replace(TINY_RECONSTRUCTION, prefix=tuple(prompt[0, :6].tolist()))
    assert other.prefix != own.prefix
    policy = ec.KVzip(capacity=20, chunk_size=16, sink=0).with_prompts(other)
    assert pass_inputs(policy, prompt) == expected(prompt[0].tolist(), 0, 16)
    assert kept_early(policy, prompt, 6)
    skipped = ec.KVzip(capacity=20, chunk_size=16, sink=0).with_prompts(own)  # a prefix scores 0: never kept
    assert pass_inputs(skipped, prompt) == expected(prompt[0].tolist(), 6, 16)
    assert not kept_early(skipped, prompt, 6)
