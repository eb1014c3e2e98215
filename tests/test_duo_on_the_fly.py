"""DuoAttention's pattern estimated from the model (``patterns: on_the_fly``, kvpress' ``on_the_fly_scoring``) against a
plain float64 definition on a tiny random Llama: the texts drawn, each KV head's score, the heads that stream, the
prompt positions each layer and head keeps (the cache really holding only them) and the logits after."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
import torch
from baseline_reference import full_run, replay_decoding
from conftest import VOCAB, random_prompt, tiny_model
from test_methods import held_positions, reference_keys

import evalkit.compression as ec
from evalkit.compression.methods import duo_attention as duo
from evalkit.core.errors import ConfigError

SINK, RECENT = 128, 256
N = 420  # longer than sink + recent: the streaming heads drop the middle


def word_tokenizer():
    """Whitespace words ``w3``..``w96`` of the tiny vocabulary, ``<s>`` first (as a Llama tokenizer adds it)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def chapters(rows: int = 64, seed: int = 5) -> list[str]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(10, 60, (rows,), generator=generator).tolist()
    return [" ".join(f"w{int(t)}" for t in torch.randint(3, VOCAB, (length,), generator=generator)) for length in lengths]


def biased_model():
    """The tiny Llama with large query and key biases: its heads' mean queries and keys differ, and so their scores
    (without them every score is ~0.5)."""
    model = tiny_model("llama", attention_bias=True)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in model.model.layers:
            for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                projection.bias.copy_(torch.randn(projection.bias.shape, generator=generator) * 2)
    return model


@pytest.fixture
def calibration(tmp_path):
    path = tmp_path / "booksum.jsonl"
    path.write_text("".join(json.dumps({"chapter": text, "summary": "-"}) + "\n" for text in chapters()))
    return path


# -- the definition, float64, explicit loops -------------------------------------------------------------------------
def rope(vector: torch.Tensor, positions: int, theta: float) -> torch.Tensor:
    """``vector`` ``[D]`` (float64) rotated to each position ``0 .. positions - 1``: ``[positions, D]``, the halves
    rotated pairwise by ``position * theta ** (-2 i / D)``."""
    dim = vector.shape[0]
    half = dim // 2
    angle = torch.arange(positions, dtype=torch.float64)[:, None] * torch.tensor(
        [theta ** (-2 * i / dim) for i in range(half)], dtype=torch.float64)
    low, high = vector[:half], vector[half:]
    return torch.cat([low * angle.cos() - high * angle.sin(), high * angle.cos() + low * angle.sin()], dim=-1)


def text_scores(model, ids: torch.Tensor, queries: int = 500) -> list[list[float]]:
    """Per layer and KV head: the mean pre-RoPE query and key over the text, rotated to every position 0..499; the
    softmax of the last position's query over the 500 keys (scaled by head_dim ** -0.5); the mean of its running sum;
    averaged over the KV head's query heads."""
    theta = model.config.rope_parameters["rope_theta"]
    out = []
    for r in full_run(model, ids).values():
        query, key = r["pre_rope"].mean(dim=1), r["pre_rope_key"].mean(dim=1)  # [H, D]
        groups, dim = query.shape[0] // key.shape[0], query.shape[1]
        keys = [rope(key[h].double(), queries, theta) for h in range(key.shape[0])]  # [queries, D] each
        heads = []
        for h in range(query.shape[0]):
            last = rope(query[h].double(), queries, theta)[-1]
            logits = [float(value) / math.sqrt(dim) for value in keys[h // groups] @ last]
            top = max(logits)
            weights = [math.exp(x - top) for x in logits]
            total, running, area = sum(weights), 0.0, 0.0
            for w in weights:
                running += w / total
                area += running / queries
            heads.append(area)
        out.append([sum(heads[g * groups : (g + 1) * groups]) / groups for g in range(key.shape[0])])
    return out


def reference_pattern(model, tokenizer, texts: list[str]) -> torch.Tensor:
    drawn = pd.DataFrame({"chapter": texts}).sample(50, random_state=42)["chapter"].tolist()  # kvpress' draw
    total = torch.zeros(model.config.num_hidden_layers, model.config.num_key_value_heads, dtype=torch.float64)
    for text in drawn:
        total += torch.tensor(text_scores(model, tokenizer(text, return_tensors="pt")["input_ids"])) / len(drawn)
    return total


def lowest(scores: torch.Tensor, count: int) -> set[tuple[int, int]]:
    flat = sorted(range(scores.numel()), key=lambda i: float(scores.flatten()[i]))
    return {divmod(i, scores.shape[1]) for i in flat[:count]}


# -- the tests -------------------------------------------------------------------------------------------------------
def test_the_texts_are_those_kvpress_draws(calibration):
    assert duo.calibration_texts(str(calibration), 50) == pd.DataFrame({"chapter": chapters()}).sample(
        50, random_state=42)["chapter"].tolist()


@torch.no_grad()
def test_the_estimated_pattern_keeps_and_outputs_what_the_definition_says(calibration):
    model, tokenizer = biased_model(), word_tokenizer()
    policy = ec.DuoAttention(patterns="on_the_fly", calibration=str(calibration))
    policy.bind_tokenizer(tokenizer)
    policy.bind_model(model)
    expected = reference_pattern(model, tokenizer, chapters())
    torch.testing.assert_close(torch.from_numpy(policy._estimated), expected, atol=1e-5, rtol=0)
    ordered = expected.flatten().sort().values
    assert float(ordered[2] - ordered[1]) > 0.05  # no near-tie decides which 2 of the 4 heads stream
    streaming = lowest(expected, 2)
    assert len({layer for layer, _ in streaming}) == 2  # one head of each layer streams
    prompt = random_prompt(N, seed=3)
    session = ec.CompressionSession(model, policy)
    logits = session.prefill(prompt)
    short = set(range(SINK)) | set(range(N - RECENT, N))
    kept = {layer: [short if (layer, head) in streaming else set(range(N)) for head in range(2)] for layer in range(2)}
    assert held_positions(session, reference_keys(model, prompt)) == kept
    held = [int(layer.heads.valid[0, head].sum()) for layer in session.cache.layers for head in range(2)]
    assert sorted(held) == [SINK + RECENT] * 2 + [N] * 2  # the cache holds only them
    tokens, ours = [], []
    for _ in range(4):
        tokens.append(int(logits.argmax()))
        ours.append(session.step(torch.tensor([[tokens[-1]]]))[0, -1])
        logits = ours[-1][None]
    reference, _ = replay_decoding(model, prompt, tokens, kept, lambda *args: None)
    torch.testing.assert_close(torch.stack(ours), reference, atol=2e-4, rtol=1e-4)


def test_the_estimate_is_made_once_per_model(calibration, monkeypatch):
    model, calls = tiny_model("llama"), []
    real = duo.estimate_pattern
    monkeypatch.setattr(duo, "estimate_pattern", lambda *args: calls.append(1) or real(*args))
    for _ in range(2):
        policy = ec.DuoAttention(patterns="on_the_fly", calibration=str(calibration), samples=3)
        policy.bind_tokenizer(word_tokenizer())
        policy.bind_model(model)
    assert len(calls) == 1


@pytest.mark.parametrize("rows, samples, message", [
    ([{"chapter": "w3 w4"}] * 2, 3, "has 2 rows, fewer than samples=3"),
    ([{"text": "w3 w4"}] * 4, 3, "has no chapter column"),
])
def test_bad_calibration_texts_are_one_line(tmp_path, rows, samples, message):
    path = tmp_path / "texts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    policy = ec.DuoAttention(patterns="on_the_fly", calibration=str(path), samples=samples)
    policy.bind_tokenizer(word_tokenizer())
    with pytest.raises(ConfigError, match=message):
        policy.bind_model(tiny_model("llama"))


def test_an_estimate_without_a_tokenizer_is_one_line(llama):
    """A session binds the model: a model saved without its tokenizer, and none bound, is one line."""
    with pytest.raises(ValueError, match="patterns=on_the_fly needs the model's tokenizer: none is saved with"):
        ec.CompressionSession(llama, ec.DuoAttention(patterns="on_the_fly"))
