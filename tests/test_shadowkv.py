"""ShadowKV against a plain float64 definition written from ByteDance-Seed/ShadowKV ``models/kv_cache.py``
(``ShadowKVCache``) as ``models/base.py`` runs it, over a Llama computed by hand: the chunks each decode step reads
per layer and KV head, and its logits; then what shows it compresses (rebuilt keys, fewer slots read, other logits
than Full's, fewer bytes on the device) and what shows it does nothing where it must not."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import random_prompt, tiny_model

import evalkit.compression as ec
from evalkit.core.errors import ConfigError

SETTINGS = dict(capacity=16, rank=6, chunk_size=4, local_chunks=2, outlier_chunks=3)


# -- the definition ------------------------------------------------------------------------------------------------
def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE as the model defines it (angles in fp32), applied in float64: ``x`` ``[..., n, D]``."""
    dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    angles = positions[:, None].float() * inv_freq[None]
    emb = torch.cat([angles, angles], dim=-1)
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * emb.cos().double() + rotated * emb.sin().double()


def rms(norm, x: torch.Tensor) -> torch.Tensor:
    return norm.weight.double() * x / torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + norm.variance_epsilon)


class Definition:
    """ShadowKV on a float64 Llama, one prompt: an exact prefill, then step by step each layer's query reads the
    exact local window, outlier chunks and generated tokens, and the chunks its landmarks select, their keys
    rebuilt from the SVD factors of the prompt's pre-RoPE keys and rotated."""

    def __init__(self, model, settings: dict):
        self.model, self.s = model, settings
        config = model.config
        self.heads, self.kv_heads, self.dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.theta = config.rope_parameters["rope_theta"]
        self.layers: list[dict] = []

    def attention(self, layer, hidden, positions, keys_for):
        attn = layer.self_attn
        h = rms(layer.input_layernorm, hidden)
        n = h.shape[0]
        q = (h @ attn.q_proj.weight.double().T).view(n, self.heads, self.dim).transpose(0, 1)
        k = (h @ attn.k_proj.weight.double().T).view(n, self.kv_heads, self.dim).transpose(0, 1)
        v = (h @ attn.v_proj.weight.double().T).view(n, self.kv_heads, self.dim).transpose(0, 1)
        q = rope(q, positions, self.theta)
        out = keys_for(q, k, rope(k, positions, self.theta), v)  # [Hq, n, D]
        hidden = hidden + out.transpose(0, 1).reshape(n, -1) @ attn.o_proj.weight.double().T
        m = layer.mlp
        x = rms(layer.post_attention_layernorm, hidden)
        act = torch.nn.functional.silu(x @ m.gate_proj.weight.double().T) * (x @ m.up_proj.weight.double().T)
        return hidden + act @ m.down_proj.weight.double().T

    def logits(self, hidden):
        return rms(self.model.model.norm, hidden[-1]) @ self.model.lm_head.weight.double().T

    def prefill(self, prompt: list[int]) -> torch.Tensor:
        hidden = self.model.model.embed_tokens.weight.double()[prompt]
        positions = torch.arange(len(prompt))
        for layer in self.model.model.layers:
            def full(q, pre, k, v):
                self.layers.append(self.shadow(pre, k, v))
                group = self.heads // self.kv_heads
                logits = q @ k.repeat_interleave(group, 0).transpose(1, 2) / math.sqrt(self.dim)
                logits = logits.masked_fill(torch.ones(len(prompt), len(prompt)).triu(1).bool(), float("-inf"))
                return logits.softmax(dim=-1) @ v.repeat_interleave(group, 0)

            hidden = self.attention(layer, hidden, positions, full)
        self.position = len(prompt)
        return self.logits(hidden)

    def shadow(self, pre, k, v) -> dict:
        """``prefill_kv_cache`` and ``get_svd`` on one layer: U, SV, landmarks, outliers, the local window."""
        s, (heads, n, dim) = self.s, k.shape
        chunks = n // s["chunk_size"] - s["local_chunks"]
        u, sig, vh = torch.linalg.svd(pre.transpose(0, 1).reshape(n, heads * dim), full_matrices=False)
        rank = s["rank"]
        sv = (torch.diag(sig[:rank]) @ vh[:rank]).view(rank, heads, dim).transpose(0, 1)
        ctx = k[:, : chunks * s["chunk_size"]].reshape(heads, chunks, s["chunk_size"], dim)
        means = ctx.mean(dim=2)
        cosine = torch.nn.functional.cosine_similarity(means[:, :, None].expand_as(ctx), ctx, dim=-1)
        outliers = [set(row.tolist()) for row in cosine.min(dim=-1).values.topk(s["outlier_chunks"], largest=False).indices]
        rest = [[c for c in range(chunks) if c not in outliers[h]] for h in range(heads)]
        return dict(u=u[:, :rank], sv=sv, k=k, v=v, chunks=chunks, outliers=outliers, rest=rest,
                    landmarks=[means[h, rest[h]] for h in range(heads)], new_k=[], new_v=[])

    def read(self, state, q) -> list[list[int]]:
        """``get_retrieval_position_ids``: per KV head, the chunks of ``rest`` its group's queries select."""
        group, size = self.heads // self.kv_heads, self.s["capacity"] // self.s["chunk_size"]
        chosen = []
        for h in range(self.kv_heads):
            logits = q[h * group:(h + 1) * group, 0] @ state["landmarks"][h].T / math.sqrt(128)
            score = logits.softmax(dim=-1).max(dim=0).values
            chosen.append(sorted(state["rest"][h][c] for c in score.topk(size).indices.tolist()))
        return chosen

    def step(self, token: int) -> tuple[torch.Tensor, list[list[set[int]]]]:
        hidden = self.model.model.embed_tokens.weight.double()[[token]]
        positions = torch.tensor([self.position])
        reads = []
        size = self.s["chunk_size"]
        for layer, state in zip(self.model.model.layers, self.layers):
            def sparse(q, pre, k, v, state=state):
                state["new_k"].append(k[:, 0])
                state["new_v"].append(v[:, 0])
                chosen, per_head, outs = self.read(state, q), [], []
                n, group = state["k"].shape[1], self.heads // self.kv_heads
                for h in range(self.kv_heads):
                    exact = [j for c in state["outliers"][h] for j in range(c * size, (c + 1) * size)]
                    exact += list(range(state["chunks"] * size, n))
                    rebuilt = [j for c in chosen[h] for j in range(c * size, (c + 1) * size)]
                    low = rope(state["u"][rebuilt] @ state["sv"][h], torch.tensor(rebuilt), self.theta)
                    keys = torch.cat([state["k"][h, exact], low, torch.stack([x[h] for x in state["new_k"]])])
                    values = torch.cat([state["v"][h, exact + rebuilt], torch.stack([x[h] for x in state["new_v"]])])
                    weights = (q[h * group:(h + 1) * group, 0] @ keys.T / math.sqrt(self.dim)).softmax(dim=-1)
                    outs.append(weights @ values)
                    per_head.append(set(exact + rebuilt) | set(range(n, n + len(state["new_k"]))))
                reads.append(per_head)
                return torch.cat(outs)[:, None]

            hidden = self.attention(layer, hidden, positions, sparse)
        self.position += 1
        return self.logits(hidden), reads


# -- evalkit beside it ---------------------------------------------------------------------------------------------
def spied(policy: ec.ShadowKV) -> list[tuple[int, torch.Tensor]]:
    """Record every mask ``decode_visible`` returns, with its layer."""
    calls, original = [], policy.decode_visible

    def spy(query, keys, visible, layer_idx, states=None):
        chosen = original(query, keys, visible, layer_idx, states)
        calls.append((layer_idx, chosen))
        return chosen

    policy.decode_visible = spy
    return calls


def read_sets(chosen: torch.Tensor, kv_heads: int) -> list[set[int]]:
    """Row 0's read slots per KV head (the mask's query heads of a group agree)."""
    per_query = chosen[0].reshape(kv_heads, -1, chosen.shape[-1])
    assert bool((per_query == per_query[:, :1]).all())
    return [set(torch.nonzero(per_query[h, 0]).flatten().tolist()) for h in range(kv_heads)]


@pytest.mark.parametrize("length,steps", [(120, 8), (97, 6)])
def test_shadowkv_reads_and_computes_what_its_definition_does(length, steps):
    model = tiny_model("llama", initializer_range=0.2).double()
    prompt = random_prompt(length, seed=3)
    policy = ec.ShadowKV(**SETTINGS)
    calls = spied(policy)
    out = ec.generate(model, prompt, policy, max_new_tokens=steps, eos_token_id=[])
    tokens = out.sequences[0, length:].tolist()

    definition = Definition(model, SETTINGS)
    logits = [definition.prefill(prompt[0].tolist())]
    layers = model.config.num_hidden_layers
    for step, token in enumerate(tokens[:-1]):
        step_logits, reads = definition.step(token)
        logits.append(step_logits)
        ours = calls[step * layers:(step + 1) * layers]
        assert [layer for layer, _ in ours] == list(range(layers))
        for layer, (_, chosen) in enumerate(ours):
            assert read_sets(chosen, model.config.num_key_value_heads) == reads[layer], f"step {step} layer {layer}"
    torch.testing.assert_close(out.logits[0], torch.stack(logits).float(), atol=1e-5, rtol=1e-6)  # fp32 logits
    assert torch.stack(logits).argmax(dim=-1).tolist() == tokens


def full_keys(model, prompt) -> list[torch.Tensor]:
    session = ec.CompressionSession(model, ec.Full())
    session.prefill(prompt)
    return [layer.keys[0] for layer in session.cache.layers]


def test_shadowkv_compresses_keys_reads_and_bytes():
    """It did something: candidate chunks' keys are rebuilt (exact elsewhere), a step reads fewer slots than the
    cache holds, the logits leave Full's, the device holds fewer bytes than a full cache."""
    model, prompt = tiny_model("llama", initializer_range=0.2).double(), random_prompt(120, seed=3)
    policy = ec.ShadowKV(**SETTINGS)
    session = ec.CompressionSession(model, policy)
    session.prefill(prompt)
    size, local = SETTINGS["chunk_size"], 120 - (120 // 4 - SETTINGS["local_chunks"]) * 4
    for ours, exact in zip(session.cache.layers, full_keys(model, prompt)):
        changed = (ours.keys[0] - exact).abs().amax(dim=-1) > 1e-9  # [Hkv, n]
        assert not bool(changed[:, -local:].any())
        per_chunk = changed[:, : 120 - local].reshape(2, -1, size)
        assert per_chunk.all(dim=-1).sum(dim=-1).tolist() == [28 - 3] * 2  # every candidate chunk, no outlier
        assert not bool((per_chunk.any(dim=-1) & ~per_chunk.all(dim=-1)).any())
    calls = spied(policy)
    steps = 6
    out = ec.generate(model, prompt, policy, max_new_tokens=steps, eos_token_id=[])
    full = ec.generate(model, prompt, ec.Full(), max_new_tokens=steps, eos_token_id=[])
    for call, (_, chosen) in enumerate(calls):  # local window, outliers, 16 selected, the tokens generated so far
        generated = call // model.config.num_hidden_layers + 1
        read = chosen[0].sum(dim=-1)  # per query head, of 120 + generated held
        assert read.tolist() == [local + 3 * size + 16 + generated] * 4 and int(read.max()) < 120 + generated
    assert float((out.logits[0, 1:] - full.logits[0, 1:]).abs().max()) > 1e-3
    torch.testing.assert_close(out.logits[0, 0], full.logits[0, 0])  # the prefill reads everything

    completions = ec.Engine(model, policy, slots=2).run([ec.Request(prompt[0], max_new_tokens=steps)])
    stats = completions[0].stats
    assert completions[0].tokens == out.sequences[0, 120:].tolist()
    element, heads, dim = 8, 2, 16
    token = heads * dim * element
    exact = local + 3 * size + steps - 1  # the tokens fed back
    # per layer: U [120, 6] and SV [2, 6, 16]; 25 landmarks per head with their int64 indices; exact keys and values
    # of the local window, outliers and fed-back tokens, and of the 16 tokens read
    device = (120 * 6 + heads * 6 * dim) * element + 25 * (token + heads * 8) + 2 * (exact + 16) * token
    assert stats["kv_bytes_device"] == 2 * device
    assert stats["kv_bytes_device"] < stats["kv_bytes_full"] == stats["kv_bytes_peak"]
    assert stats["kv_bytes_fetched_step"] == 2 * 16 * token


def test_shadowkv_at_full_rank_reading_every_chunk_is_full():
    """Nothing approximated where nothing must be: full rank, every candidate read, the logits are Full's."""
    model, prompt = tiny_model("llama").double(), random_prompt(120, seed=3)
    policy = ec.ShadowKV(capacity=25 * 4, rank=32, chunk_size=4, local_chunks=2, outlier_chunks=3)
    out = ec.generate(model, prompt, policy, max_new_tokens=6, eos_token_id=[])
    full = ec.generate(model, prompt, ec.Full(), max_new_tokens=6, eos_token_id=[])
    torch.testing.assert_close(out.logits, full.logits, atol=1e-5, rtol=1e-6)
    short = ec.generate(model, prompt[:, :30], ec.ShadowKV(**SETTINGS), max_new_tokens=6, eos_token_id=[])
    alone = ec.generate(model, prompt[:, :30], ec.Full(), max_new_tokens=6, eos_token_id=[])
    torch.testing.assert_close(short.logits, alone.logits, atol=1e-5, rtol=1e-6)  # too short: read whole


def test_shadowkv_left_padded_batch_and_engine_equal_each_prompt_alone(llama):
    from test_compression import assert_batch_equals_alone, assert_engine_equals_alone

    policy = ec.ShadowKV(capacity=8, rank=4, chunk_size=2, local_chunks=2, outlier_chunks=1)
    assert_batch_equals_alone(llama, policy, new_tokens=12)
    assert_engine_equals_alone(llama, policy, new_tokens=12)

    # A slot taken over by a prompt of the same length, first and last token, whose first chunk is an exact outlier:
    # layer 0 holds the same keys at both ends for both, and the slot is decoded with the second one's landmarks.
    policy = ec.ShadowKV(capacity=8, rank=4, chunk_size=2, local_chunks=2, outlier_chunks=22)
    first, second = random_prompt(60, seed=9)[0], random_prompt(60, seed=109)[0]
    second[0], second[-1] = first[0], first[-1]
    completions = ec.Engine(llama, policy, slots=1).run([ec.Request(p, max_new_tokens=12) for p in (first, second)])
    for prompt, completion in zip((first, second), completions):
        alone = ec.generate(llama, prompt[None], policy, max_new_tokens=12, return_logits=False)
        assert completion.tokens == alone.sequences[0, 60:].tolist()


def test_shadowkv_refuses_bad_settings_in_one_line():
    with pytest.raises(ValueError, match="capacity must be >= chunk_size"):
        ec.ShadowKV(capacity=4, chunk_size=8)
    with pytest.raises(ValueError, match="rank must be an integer >= 1"):
        ec.ShadowKV(capacity=16, rank=0)
    with pytest.raises(ConfigError, match="kv_bits < 16 does not combine with method=shadowkv"):
        ec.ShadowKV(capacity=16).kv_format = object()


def test_shadowkv_refuses_a_hybrid_model_in_one_line():
    from test_hybrid import tiny_gpt_oss

    with pytest.raises(ValueError, match="shadowkv does not run on a hybrid model"):
        ec.generate(tiny_gpt_oss(), random_prompt(40), ec.ShadowKV(**SETTINGS), max_new_tokens=2)


def test_the_offloaded_bytes_reach_the_samples_table():
    from evalkit.results.tables import samples_table

    table = samples_table([{"kv_bytes_device": 75_319_920, "kv_bytes_fetched_step": 11_796_480}, {}], {})
    assert table.column("kv_bytes_device").to_pylist() == [75_319_920, None]
    assert table.column("kv_bytes_fetched_step").to_pylist() == [11_796_480, None]
