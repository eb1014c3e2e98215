"""KVzip's passes: their reconstruction prompt from the tokenizer, the bytes they hold, and their refusals (the kept
tokens against the plain definition are in test_zoo_methods.py; against kvpress in benchmarks/parity_kvzip.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_RECONSTRUCTION, random_prompt, tiny_model
from transformers import AutoTokenizer

import evalkit.compression as ec
from evalkit.compression.methods.kvzip import FIRST_PROMPT, NEXT_PROMPT, ReconstructionPrompts

TEMPLATE = "{% for m in messages %}<|user|>{{ m['content'] }}<|end|>{% endfor %}<|assistant|>"


def test_the_reconstruction_prompt_is_the_chat_template_split_around_a_user_message(random_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(random_model_dir)
    plain = ReconstructionPrompts.from_tokenizer(tokenizer)
    assert plain.prefix == () and plain.suffix == tuple(tokenizer.encode("\n", add_special_tokens=False))
    assert plain.first == tuple(tokenizer.encode(FIRST_PROMPT, add_special_tokens=False))
    tokenizer.chat_template = TEMPLATE
    chat = ReconstructionPrompts.from_tokenizer(tokenizer)
    assert chat.prefix == tuple(tokenizer.encode("<|user|>", add_special_tokens=False))
    assert chat.suffix == tuple(tokenizer.encode("<|end|><|assistant|>", add_special_tokens=False))
    assert chat.next == tuple(tokenizer.encode(NEXT_PROMPT, add_special_tokens=False))


def test_the_passes_cover_the_prompt_after_its_chat_prefix_chunk_by_chunk():
    prompts = ReconstructionPrompts(prefix=(3, 4), suffix=(1, 2), first=(5, 6, 7), next=(5, 6, 8))
    ids = torch.tensor([3, 4, *range(10, 60)])  # the prefix, then 50 tokens
    passes = ec.KVzip(capacity=8, chunk_size=20).with_prompts(prompts).passes(ids)
    assert [(start, end) for start, end, _ in passes] == [(2, 22), (22, 42), (42, 52)]
    assert passes[0][2].tolist() == [5, 6, 7, 1, 2, *range(10, 30)]
    assert passes[1][2].tolist() == [5, 6, 8, *range(22, 30), 1, 2, *range(30, 50)]  # from the last 8 tokens
    no_prefix = ec.KVzip(capacity=8, chunk_size=40).with_prompts(prompts).passes(ids[2:])
    assert [(start, end) for start, end, _ in no_prefix] == [(0, 40), (40, 50)]


def layer_bytes(model, tokens: int) -> int:
    config = model.config
    dim = config.hidden_size // config.num_attention_heads
    return 2 * config.num_key_value_heads * tokens * dim * 4  # keys and values, fp32


def test_the_passes_hold_every_layer_whole_and_count_in_the_prefill_peak(llama):
    """Every layer holds its whole prompt until the passes end, plus one layer's copy with the longest pass; a method
    that compresses during the prompt's pass holds the layers before the last compressed and the last one whole."""
    n, capacity, chunk = 150, 40, 64
    prompt = random_prompt(n)
    session = ec.CompressionSession(llama, ec.KVzip(capacity=capacity, chunk_size=chunk).with_prompts(TINY_RECONSTRUCTION))
    session.prefill(prompt)
    longest = len(TINY_RECONSTRUCTION.next) + 8 + len(TINY_RECONSTRUCTION.suffix) + chunk
    layers = llama.config.num_hidden_layers
    assert session.realized(0)["kv_bytes_prefill_peak"] == layers * layer_bytes(llama, n) + layer_bytes(llama, n + longest)
    held = sum(layer.keys.shape[1] * layer.keys.shape[2] for layer in session.cache.layers)
    assert held < layers * llama.config.num_key_value_heads * n  # and then it compressed
    snapkv = ec.CompressionSession(llama, ec.SnapKV(capacity=capacity, window=8))
    snapkv.prefill(prompt)
    assert snapkv.realized(0)["kv_bytes_prefill_peak"] == layer_bytes(llama, capacity) + layer_bytes(llama, n)


def test_a_batch_keeps_what_each_prompt_keeps_alone(llama):
    policy = ec.KVzip(capacity=30, chunk_size=32).with_prompts(TINY_RECONSTRUCTION)
    short, long = random_prompt(70, seed=2), random_prompt(90, seed=3)
    batch = torch.cat([torch.nn.functional.pad(short, (20, 0)), long])
    mask = torch.cat([torch.nn.functional.pad(torch.ones_like(short), (20, 0)), torch.ones_like(long)])
    together = ec.generate(llama, batch, policy, attention_mask=mask, max_new_tokens=6)
    for row, prompt in enumerate((short, long)):
        alone = ec.generate(llama, prompt, policy, max_new_tokens=6)
        assert together.sequences[row, -6:].tolist() == alone.sequences[0, -6:].tolist()
        assert together.stats[row]["kept_prompt_tokens_per_head"] == alone.stats[0]["kept_prompt_tokens_per_head"]


def test_kvzip_without_its_prompt_or_on_what_it_cannot_score_says_so_in_one_line(llama):
    with pytest.raises(ValueError, match="kvzip needs the model's tokenizer for its reconstruction prompt"):
        ec.CompressionSession(llama, ec.KVzip(capacity=20)).prefill(random_prompt(60))
    policy = ec.KVzip(capacity=20).with_prompts(TINY_RECONSTRUCTION)
    with pytest.raises(ValueError, match="prefill_chunk_mode=compress would drop tokens before kvzip's passes"):
        ec.CompressionSession(llama, policy).prefill(random_prompt(60), chunk=16, chunk_mode="compress")
    with pytest.raises(ValueError, match="cannot be kvzip: it does not score tokens"):
        ec.AdaKV(capacity=20, scorer="kvzip")
    hybrid = tiny_model("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1)
    with pytest.raises(ValueError, match="sliding-window layers keep only their window"):
        ec.CompressionSession(hybrid, policy)
