"""Chunked prefill: exact mode is the unchunked prefill (outputs and kept tokens), compress-as-you-go keeps the cache
within capacity + chunk and selects, after every chunk, what the method's definition selects from what it held."""

from __future__ import annotations

import pytest
import torch
from baseline_reference import kept_knorm
from conftest import SMALL_POLICIES, random_prompt, tiny_model
from masked_reference import kept_prompt_positions

import evalkit.compression as ec
from evalkit.compression.cache import CompressedCache
from evalkit.compression.generate import prefill
from evalkit.results import read_table

POLICIES = SMALL_POLICIES


def chunk_lengths(model) -> list[int]:
    """Record the number of tokens of every forward call of ``model``."""
    seen: list[int] = []
    model.model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(
        (kwargs["input_ids"] if kwargs.get("input_ids") is not None else kwargs["inputs_embeds"]).shape[1]),
        with_kwargs=True)
    return seen


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("chunk", [32, 45])
def test_exact_chunked_prefill_is_the_unchunked_prefill(name, chunk):
    """A 173-token prompt (not a multiple of the chunk) in chunks: the same kept tokens in every layer and head (the
    cache's keys and values after prefill) and the same generated tokens as at once."""
    model = tiny_model("llama", seed=2)
    seen = chunk_lengths(model)
    prompt = random_prompt(173, seed=4)
    whole, _, _ = prefill(model, POLICIES[name](), prompt)
    seen.clear()
    chunked, _, _ = prefill(model, POLICIES[name](), prompt, prefill_chunk=chunk)
    chunks = [chunk] * (173 // chunk) + [173 % chunk]
    passes = seen[len(chunks):]  # a method's own passes after the prompt (KVzip's)
    assert seen[: len(chunks)] == chunks, "the prompt did not go through the model in chunks"
    assert not passes or chunked.policy.extra_passes
    for index, (a, b) in enumerate(zip(whole.cache.layers, chunked.cache.layers)):
        assert a.keys.shape == b.keys.shape, f"layer {index}"
        torch.testing.assert_close(b.keys, a.keys, rtol=1e-5, atol=1e-5, msg=f"layer {index}: other tokens kept")
        torch.testing.assert_close(b.values, a.values, rtol=1e-5, atol=1e-5)
        if a.heads is not None:
            assert torch.equal(a.heads.positions, b.heads.positions) and torch.equal(a.heads.valid, b.heads.valid)
    once = ec.generate(model, prompt, POLICIES[name](), max_new_tokens=24)
    again = ec.generate(model, prompt, POLICIES[name](), max_new_tokens=24, prefill_chunk=chunk)
    assert torch.equal(once.sequences, again.sequences)
    assert once.stats[0]["kept_prompt_tokens_per_head"] == again.stats[0]["kept_prompt_tokens_per_head"]


def test_exact_chunked_prefill_through_the_engine_and_a_batch():
    """The engine admits requests through the same chunked path; a batch of equal-length prompts chunks too."""
    model = tiny_model("llama", seed=2)
    prompts = [random_prompt(150 + 11 * i, seed=i)[0] for i in range(3)]
    policy = POLICIES["snapstream"]()
    alone = ec.Engine(model, policy, slots=2).run([ec.Request(p, max_new_tokens=20) for p in prompts])
    chunked = ec.Engine(model, policy, slots=2, prefill_chunk=40).run([ec.Request(p, max_new_tokens=20) for p in prompts])
    assert [c.tokens for c in chunked] == [c.tokens for c in alone]
    batch = random_prompt(120, seed=9, batch=2)
    assert torch.equal(ec.generate(model, batch, policy, max_new_tokens=8).sequences,
                       ec.generate(model, batch, policy, max_new_tokens=8, prefill_chunk=50).sequences)


class Recorder:
    """Every compression of a chunked prefill: the layer's keys before (held + chunk) and after, and the queries."""

    def __init__(self, monkeypatch):
        self.calls: list[dict] = []
        original = CompressedCache.compress_layer

        def record(cache, layer_idx, module, query, keys, values, scaling, prior_sums=None):
            before = keys.clone()
            original(cache, layer_idx, module, query, keys, values, scaling, prior_sums)
            self.calls.append({"layer": layer_idx, "query": query[0], "before": before[0], "scaling": scaling,
                               "after": cache.layers[layer_idx].keys[0].clone()})

        monkeypatch.setattr(CompressedCache, "compress_layer", record)


def kept_positions(call: dict) -> list[set[int]]:
    """Which of the held + chunk keys each KV head kept (keys are distinct rows: find each kept row)."""
    kept = []
    for head in range(call["before"].shape[0]):
        rows = call["before"][head]
        kept.append({int((rows == row).all(dim=-1).nonzero()[0]) for row in call["after"][head]})
    return kept


@pytest.mark.parametrize("name", ["snapkv", "snapstream", "streaming_llm", "knorm"])
def test_compress_as_you_go_holds_at_most_capacity_plus_chunk_and_selects_by_the_definition(name, monkeypatch):
    chunk, length = 30, 181
    model = tiny_model("llama", seed=2)
    policy = POLICIES[name]()
    capacity = policy.prompt_capacity()
    recorder = Recorder(monkeypatch)
    out = ec.generate(model, random_prompt(length, seed=4), policy, max_new_tokens=10, prefill_chunk=chunk,
                      prefill_chunk_mode="compress")
    layers = model.config.num_hidden_layers
    assert len(recorder.calls) == layers * -(-length // chunk)
    compressed = 0
    for call in recorder.calls:
        held = call["before"].shape[1]
        assert held <= capacity + chunk
        assert call["after"].shape[1] == min(held, capacity)
        if held <= capacity:
            continue
        compressed += 1
        if name == "knorm":
            expected = kept_knorm({0: {"key": call["before"]}}, capacity)[0]
        else:
            # The definition on what the cache held: its keys, scored by the last queries it saw.
            query = torch.zeros(call["query"].shape[0], held, call["query"].shape[-1])
            query[:, held - call["query"].shape[1]:] = call["query"]
            expected = kept_prompt_positions(policy, query, call["before"], call["scaling"])
        assert kept_positions(call) == expected
    assert compressed >= layers * 4  # the cache was compressed after most chunks, not only at the end
    assert out.stats[0]["kept_prompt_tokens"] == [capacity] * layers


def test_compress_as_you_go_is_a_different_method_and_refuses_per_head_budgets():
    model = tiny_model("llama", seed=2)
    prompt = random_prompt(181, seed=4)
    policy = POLICIES["snapkv"]()
    once, _, _ = prefill(model, policy, prompt)
    streamed, _, _ = prefill(model, policy, prompt, prefill_chunk=30, prefill_chunk_mode="compress")
    assert not torch.equal(once.cache.layers[-1].keys, streamed.cache.layers[-1].keys)
    for name in ("h2o", "pyramidkv", "adakv", "tova"):
        with pytest.raises(ValueError, match="one budget for every layer and head"):
            prefill(model, POLICIES[name](), prompt, prefill_chunk=30, prefill_chunk_mode="compress")
    with pytest.raises(ValueError, match="prefill_chunk_mode must be one of"):
        prefill(model, policy, prompt, prefill_chunk=30, prefill_chunk_mode="stream")
    with pytest.raises(ValueError, match="positive integer"):
        prefill(model, policy, prompt, prefill_chunk=0)
    padded = torch.ones(2, 181, dtype=torch.long)
    padded[0, :5] = 0
    with pytest.raises(ValueError, match="without padding"):
        prefill(model, policy, random_prompt(181, seed=4, batch=2), padded, prefill_chunk=30)


def test_a_chunked_run_records_its_mode_and_exact_mode_scores_as_the_unchunked_run(tmp_path, random_model_dir):
    from test_harness import composed

    import evalkit.run.runner as runner
    from evalkit.run import validate

    def run(*extra):
        spec = validate(composed(f"model.pretrained={random_model_dir}", "limit=4", "batch_size=2", "+budget=4x",
                                        "+task.generation.max_gen_toks=8", f"results_dir={tmp_path / 'r'}", *extra))
        return runner.run(spec)

    whole, exact = run(), run("prefill_chunk=16")
    compress = run("prefill_chunk=16", "prefill_chunk_mode=compress")
    samples = read_table(tmp_path / "r", "samples").set_index("run_id")  # every run's rows, as pandas reads them
    assert samples.loc[whole.run_id, "prefill_chunk"].isna().all()
    assert (samples.loc[exact.run_id, "prefill_chunk"] == 16).all()
    assert (samples.loc[exact.run_id, "prompt_tokens"] > 2 * 16).all()  # every prompt went in several chunks
    assert (samples.loc[exact.run_id, "prefill_chunk_mode"] == "exact").all()
    assert (samples.loc[compress.run_id, "prefill_chunk_mode"] == "compress").all()
    assert len({whole.run_id, exact.run_id, compress.run_id}) == 3  # three configs, three runs
    assert list(exact.samples["prediction"]) == list(whole.samples["prediction"])
    assert list(exact.samples["kept_prompt_tokens"]) == list(whole.samples["kept_prompt_tokens"])


def test_a_later_chunks_attention_in_row_blocks_is_the_masked_attention(monkeypatch):
    """A chunk's queries over all the keys, computed a few query rows at a time (small masks), equal one masked sdpa."""
    from evalkit.compression import attention as cache

    g = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, heads, length, 16, generator=g) for heads, length in ((4, 50), (2, 170), (2, 170)))
    monkeypatch.setattr(cache, "MASK_CELLS", 170 * 7)  # blocks of 7 rows
    visible = torch.arange(170)[None, :] <= torch.arange(120, 170)[:, None]
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(2, dim=1), value.repeat_interleave(2, dim=1), attn_mask=visible, scale=0.25)
    torch.testing.assert_close(cache.chunk_attention(query, key, value, 0.25), expected.transpose(1, 2))
