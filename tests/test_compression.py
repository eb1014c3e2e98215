"""The reference compression library: real eviction, positions, exactness, masking equivalence, batches, errors."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES, VOCAB, random_prompt, tiny_model
from masked_reference import masked_run

import evalkit.compression as ec

COMPRESSING = {
    "streaming_llm": lambda: ec.StreamingLLM(sink=4, window=12),
    "snapkv": lambda: ec.SnapKV(capacity=20, window=6, kernel_size=5, pooling="max"),
    "snapkv_avg_maxreduce": lambda: ec.SnapKV(capacity=20, window=6, kernel_size=3, pooling="avg", gqa_reduce="max"),
    "snapstream": lambda: ec.SnapStream(capacity=28, sink=3, window=6, kernel_size=5, recent=8),
}


def layer_slots(session) -> set[int]:
    return {layer.keys.shape[-2] for layer in session.cache.layers}


# -- 1. real eviction ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "policy, after_prefill, bound",
    [
        (ec.StreamingLLM(sink=4, window=12), 16, 16),
        (ec.SnapKV(capacity=20, window=6, kernel_size=5), 20, None),
        (ec.SnapStream(capacity=28, sink=3, window=6, kernel_size=5, recent=8), 20, 28),
    ],
    ids=["streaming_llm", "snapkv", "snapstream"],
)
def test_cache_tensors_hold_exactly_the_policy_tokens(llama, policy, after_prefill, bound):
    session = ec.CompressionSession(llama, policy)
    logits = session.prefill(random_prompt(50))
    assert layer_slots(session) == {after_prefill}
    assert session.state.valid.sum().item() == after_prefill
    token = logits.argmax(-1, keepdim=True)
    for step in range(1, 41):
        logits = session.step(token)[:, -1]
        token = logits.argmax(-1, keepdim=True)
        expected = after_prefill + step if bound is None else min(bound, after_prefill + step)
        assert layer_slots(session) == {expected}, f"step {step}"
        assert int(session.state.valid.sum()) == expected
        for layer in session.cache.layers:
            assert layer.keys.shape == layer.values.shape == (1, 2, expected, 16)


def test_snapstream_memory_is_constant_once_full(llama):
    policy = ec.SnapStream(capacity=28, sink=3, window=6, kernel_size=5, recent=8)
    out = ec.generate(llama, random_prompt(60), policy, max_new_tokens=90, return_logits=False)
    stats = out.stats[0]
    assert stats["peak_cache_tokens"] == 28
    assert stats["kept_prompt_tokens"] == [20, 20]
    assert stats["tokens_seen"] == 60 + 89
    assert stats["realized_ratio"] == pytest.approx(149 / 28)


def test_full_cache_grows_with_the_sequence(llama):
    out = ec.generate(llama, random_prompt(30), ec.Full(), max_new_tokens=10, return_logits=False)
    assert out.stats[0]["peak_cache_tokens"] == 39
    assert out.stats[0]["realized_ratio"] == 1.0


# -- 2. positions ----------------------------------------------------------------------------------------------------
def test_new_tokens_get_their_true_positions_not_the_cache_length(llama):
    seen = []
    handle = llama.model.rotary_emb.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["position_ids"].clone()), with_kwargs=True
    )
    try:
        session = ec.CompressionSession(llama, ec.StreamingLLM(sink=2, window=6))
        logits = session.prefill(random_prompt(40))
        for _ in range(5):
            logits = session.step(logits.argmax(-1, keepdim=True))[:, -1]
    finally:
        handle.remove()
    assert seen[0].tolist() == [list(range(40))]
    assert [int(p) for p in torch.cat(seen[1:]).flatten()] == [40, 41, 42, 43, 44]
    assert layer_slots(session) == {8}  # while the cache holds only 8 tokens


# -- 3. exactness ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_full_matches_model_generate(family):
    model = tiny_model(family)
    prompt = random_prompt(24, seed=3)
    expected = model.generate(prompt, max_new_tokens=16, do_sample=False)
    out = ec.generate(model, prompt, ec.Full(), max_new_tokens=16)
    assert torch.equal(out.sequences, expected)
    reference = model.generate(prompt, max_new_tokens=16, do_sample=False, output_logits=True, return_dict_in_generate=True)
    torch.testing.assert_close(out.logits, torch.stack(reference.logits, dim=1).float(), atol=1e-4, rtol=1e-4)


def test_full_matches_model_generate_with_the_same_eos(llama):
    prompt = random_prompt(24, seed=3)
    free = ec.generate(llama, prompt, ec.Full(), max_new_tokens=16).sequences[0, 24:]
    eos = int(free[5])  # a token the model emits: generation must stop there
    stop = int((free == eos).nonzero()[0]) + 1
    llama.generation_config.eos_token_id = eos
    expected = llama.generate(prompt, max_new_tokens=16, do_sample=False)
    out = ec.generate(llama, prompt, ec.Full(), max_new_tokens=16, eos_token_id=eos)
    assert out.stats[0]["generated_tokens"] == stop == expected.shape[1] - 24
    assert torch.equal(out.sequences[0, : 24 + stop], expected[0])


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize(
    "policy",
    [
        ec.StreamingLLM(sink=4, window=60),
        ec.SnapKV(capacity=64, window=8),
        ec.SnapStream(capacity=64, sink=4, window=8, recent=8),
    ],
    ids=["streaming_llm", "snapkv", "snapstream"],
)
def test_large_capacity_reproduces_full(family, policy):
    model = tiny_model(family)
    prompt = random_prompt(30, seed=4)
    full = ec.generate(model, prompt, ec.Full(), max_new_tokens=20)
    out = ec.generate(model, prompt, policy, max_new_tokens=20)
    assert torch.equal(out.sequences, full.sequences)
    torch.testing.assert_close(out.logits, full.logits, atol=1e-4, rtol=1e-4)
    assert out.stats[0]["kept_prompt_tokens"] == [30, 30]


def test_compress_prefix_compresses_only_the_document(llama):
    prompt = random_prompt(60, seed=6)
    full = ec.generate(llama, prompt, ec.Full(), max_new_tokens=6)
    roomy = ec.generate(llama, prompt, ec.SnapKV(capacity=64, window=8), max_new_tokens=6, compress_prefix=48)
    assert torch.equal(roomy.sequences, full.sequences)
    torch.testing.assert_close(roomy.logits, full.logits, atol=1e-4, rtol=1e-4)
    # Document (48 tokens) compressed to 16; the 12 question tokens and the new ones all stay.
    session = ec.CompressionSession(llama, ec.SnapKV(capacity=16, window=8))
    session.prefill(prompt[:, :48])
    session.step(prompt[:, 48:])
    assert {layer.keys.shape[-2] for layer in session.cache.layers} == {16 + 12}
    out = ec.generate(llama, prompt, ec.SnapKV(capacity=16, window=8), max_new_tokens=6, compress_prefix=48)
    assert out.stats[0]["kept_prompt_tokens"] == [16, 16] and out.stats[0]["peak_cache_tokens"] == 16 + 12 + 5
    assert not torch.equal(out.logits, full.logits)  # question-agnostic compression changed the outputs
    whole = ec.generate(llama, prompt, ec.SnapKV(capacity=16, window=8), max_new_tokens=6)
    assert whole.stats[0]["peak_cache_tokens"] == 16 + 5


def test_fidelity_is_perfect_with_room_and_measurable_without(llama):
    prompt = random_prompt(60, seed=3, batch=2)
    roomy = ec.fidelity(llama, prompt, ec.SnapKV(capacity=128, window=8), max_new_tokens=10)
    assert all(r["token_agreement"] == 1.0 and r["first_divergence"] == 10 and r["kl_mean"] < 1e-5 for r in roomy)
    tight = ec.fidelity(llama, prompt, ec.StreamingLLM(sink=2, window=8), max_new_tokens=10)
    assert min(r["token_agreement"] for r in tight) < 1.0 and min(r["kl_mean"] for r in tight) > 1e-4
    assert all(r["compared_tokens"] == 10 for r in tight)


# -- 4. equivalence to masking ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("name", sorted(COMPRESSING))
def test_compressed_run_equals_full_run_with_evicted_keys_masked(family, name):
    model = tiny_model(family)
    policy = COMPRESSING[name]()
    prompt = random_prompt(48, seed=5)
    out = ec.generate(model, prompt, policy, max_new_tokens=36)
    tokens = out.sequences[0, 48:].tolist()
    reference, kept = masked_run(model, policy, prompt, tokens)
    torch.testing.assert_close(out.logits[0], reference, atol=2e-4, rtol=1e-4)
    assert reference.argmax(-1).tolist() == tokens
    # The masks kept something less than everything, and differently per head for the SnapKV-style policies.
    sizes = {len(heads) for per_head in kept.values() for heads in per_head}
    assert sizes == {policy.prompt_capacity()}
    if name != "streaming_llm":
        assert any(len({frozenset(h) for h in per_head}) > 1 for per_head in kept.values())


def test_masking_reference_detects_a_wrong_selection(llama):
    """The equivalence check is able to fail: SnapKV with the wrong pooling does not match the max-pooling mask."""
    prompt = random_prompt(48, seed=5)
    out = ec.generate(llama, prompt, ec.SnapKV(capacity=20, window=6, kernel_size=5, pooling="avg"), max_new_tokens=12)
    reference, _ = masked_run(llama, ec.SnapKV(capacity=20, window=6, kernel_size=5, pooling="max"), prompt, out.sequences[0, 48:].tolist())
    assert not torch.allclose(out.logits[0], reference, atol=2e-4)


# -- 5. batches ------------------------------------------------------------------------------------------------------
def left_pad(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(p.shape[1] for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - prompt.shape[1] :] = prompt[0]
        mask[row, width - prompt.shape[1] :] = 1
    return ids, mask


def assert_batch_equals_alone(model, policy, new_tokens: int = 24) -> None:
    """Left-padded prompts of 50, 17 and 33 tokens give, row by row, what each gives alone."""
    prompts = [random_prompt(n, seed=n) for n in (50, 17, 33)]  # 17 fits every capacity: no eviction for it
    ids, mask = left_pad(prompts)
    batched = ec.generate(model, ids, policy, attention_mask=mask, max_new_tokens=new_tokens)
    for row, prompt in enumerate(prompts):
        alone = ec.generate(model, prompt, policy, max_new_tokens=new_tokens)
        assert batched.sequences[row, ids.shape[1] :].tolist() == alone.sequences[0, prompt.shape[1] :].tolist()
        torch.testing.assert_close(batched.logits[row], alone.logits[0], atol=2e-4, rtol=1e-4)
        for key in ("prompt_tokens", "generated_tokens", "kept_prompt_tokens", "kept_prompt_tokens_per_head",
                    "peak_cache_tokens", "tokens_seen"):
            assert batched.stats[row][key] == alone.stats[0][key], key


def assert_engine_equals_alone(model, policy, lengths=(30, 12, 45), new_tokens: int = 25) -> None:
    """Prompts of ``lengths`` tokens through a 2-slot engine give each the tokens and peak it gets alone."""
    prompts = [random_prompt(n, seed=n)[0] for n in lengths]
    completions = ec.Engine(model, policy, slots=2).run([ec.Request(p, max_new_tokens=new_tokens) for p in prompts])
    for prompt, completion in zip(prompts, completions):
        alone = ec.generate(model, prompt[None], policy, max_new_tokens=new_tokens, return_logits=False)
        assert completion.tokens == alone.sequences[0, len(prompt) :].tolist()
        assert completion.stats["peak_cache_tokens"] == alone.stats[0]["peak_cache_tokens"]


@pytest.mark.parametrize("name", ["full", *sorted(COMPRESSING)])
def test_batch_with_left_padding_equals_each_prompt_alone(family_model, name):
    assert_batch_equals_alone(family_model, ec.Full() if name == "full" else COMPRESSING[name]())


def test_phi3_compresses_exactly_like_the_other_plain_families():
    """Phi-3 (fused QKV projection) goes through the same hook: Full is model.generate, SnapStream shrinks the cache,
    batches equal single prompts, and the masked-attention reference agrees."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    config = Phi3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0, eos_token_id=None)
    config._attn_implementation = "sdpa"
    model = Phi3ForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    prompt = random_prompt(48, seed=5)
    full = ec.generate(model, prompt, ec.Full(), max_new_tokens=20)
    assert full.sequences.tolist() == model.generate(prompt, max_new_tokens=20, do_sample=False).tolist()
    policy = COMPRESSING["snapstream"]()
    out = ec.generate(model, prompt, policy, max_new_tokens=36)
    assert out.stats[0]["peak_cache_tokens"] == 28
    reference, _ = masked_run(model, policy, prompt, out.sequences[0, 48:].tolist())
    torch.testing.assert_close(out.logits[0], reference, atol=2e-4, rtol=1e-4)
    assert_batch_equals_alone(model, policy)


def test_eos_stops_a_row_and_is_counted(llama):
    prompt = random_prompt(20, seed=9)
    free = ec.generate(llama, prompt, ec.Full(), max_new_tokens=12)
    eos = int(free.sequences[0, 20 + 4])
    out = ec.generate(llama, prompt, ec.Full(), max_new_tokens=12, eos_token_id=eos)
    first = free.sequences[0, 20:].tolist().index(eos)
    assert out.stats[0]["generated_tokens"] == first + 1
    assert out.sequences.shape[1] == 20 + first + 1


def test_sampling_is_reproducible_with_a_seed(llama):
    prompt = random_prompt(20, seed=2)
    policy = ec.SnapStream(capacity=16, sink=2, window=4, kernel_size=3, recent=6)
    runs = [
        ec.generate(llama, prompt, policy, max_new_tokens=15, do_sample=True, temperature=0.8, top_p=0.95, seed=s)
        for s in (7, 7, 8)
    ]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    assert not torch.equal(runs[0].sequences, runs[2].sequences)


# -- 7. bad input ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "build, field",
    [
        (lambda: ec.SnapKV(capacity=32, window=32), "capacity"),
        (lambda: ec.SnapKV(capacity=64, kernel_size=4), "kernel_size"),
        (lambda: ec.SnapKV(capacity=64, pooling="median"), "pooling"),
        (lambda: ec.SnapKV(capacity=64, gqa_reduce="sum"), "gqa_reduce"),
        (lambda: ec.SnapStream(capacity=40, sink=4, window=32, recent=8), "capacity"),
        (lambda: ec.SnapStream(capacity=40, recent=0, window=8), "recent"),
        (lambda: ec.StreamingLLM(sink=-1, window=8), "sink"),
        (lambda: ec.StreamingLLM(sink=4, window=0), "window"),
        (lambda: ec.SnapKV(capacity="1024"), "capacity"),
    ],
)
def test_bad_policy_values_name_the_field(build, field):
    with pytest.raises(ValueError, match=field):
        build()


def test_unhookable_model_fails_before_any_compute():
    class Opaque(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = tiny_model("llama").config
            self.attn = type("OpaqueAttention", (torch.nn.Module,), {})()

        def forward(self, *args, **kwargs):  # pragma: no cover - must never be reached
            raise AssertionError("compute ran")

    with pytest.raises(ValueError, match="layer_idx"):
        ec.generate(Opaque(), random_prompt(8), ec.Full(), max_new_tokens=2)


def test_unsupported_attention_implementation_is_refused(llama):
    llama.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="attention implementation"):
        ec.generate(llama, random_prompt(8), ec.Full(), max_new_tokens=2)


def test_eager_attention_gives_the_same_tokens_as_sdpa():
    prompt = random_prompt(40, seed=6)
    policy = COMPRESSING["snapstream"]()
    sdpa = ec.generate(tiny_model("llama"), prompt, policy, max_new_tokens=20)
    eager = ec.generate(tiny_model("llama", attn_implementation="eager"), prompt, policy, max_new_tokens=20)
    assert torch.equal(sdpa.sequences, eager.sequences)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": 0.5}, "do_sample"),
        ({"do_sample": True, "top_p": 1.5}, "top_p"),
        ({"stop_strings": ["\n"]}, "tokenizer"),
    ],
)
def test_bad_generation_arguments(llama, kwargs, message):
    with pytest.raises(ValueError, match=message):
        ec.generate(llama, random_prompt(8), ec.Full(), **kwargs)


def test_right_padding_is_refused(llama):
    ids, mask = random_prompt(6, batch=2), torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    with pytest.raises(ValueError, match="left"):
        ec.generate(llama, ids, ec.Full(), attention_mask=mask)


# -- budgets ---------------------------------------------------------------------------------------------------------
def test_policy_from_budget():
    assert ec.policy_from_budget("snapstream", "4x", 131072, window=32).capacity == 32768
    assert ec.policy_from_budget("snapkv", "tokens_4096", 131072).capacity == 4096
    streaming = ec.policy_from_budget("streaming_llm", "8x", 1024, sink=4)
    assert (streaming.sink, streaming.window, streaming.cache_capacity()) == (4, 124, 128)
    assert isinstance(ec.policy_from_budget("full", None, 1024), ec.Full)
    with pytest.raises(ValueError, match="takes no budget"):
        ec.policy_from_budget("full", "4x", 1024)
    with pytest.raises(ValueError, match="needs a budget"):
        ec.policy_from_budget("snapkv", None, 1024)
    with pytest.raises(ValueError, match="budget must look like"):
        ec.policy_from_budget("snapkv", "four", 1024)
    with pytest.raises(ValueError, match="unknown method"):
        ec.policy_from_budget("h3o", "4x", 1024)


@pytest.mark.parametrize("name", ["full", "snapstream", "h2o"])
def test_a_finished_requests_cache_is_freed_without_the_cycle_collector(llama, monkeypatch, name):
    """No reference cycle holds a finished request's cache: its KV tensors go when the request ends, not when Python's
    cycle collector next runs (which never sees GPU memory as pressure)."""
    import gc
    import weakref

    from evalkit.compression.cache import CompressedCache

    caches = []
    original = CompressedCache.__init__

    def recording(self, *args, **kwargs):
        original(self, *args, **kwargs)
        caches.append(weakref.ref(self))

    monkeypatch.setattr(CompressedCache, "__init__", recording)
    policy = {"full": ec.Full(), "snapstream": ec.SnapStream(capacity=28, sink=3, window=6, recent=8),
              "h2o": ec.H2O(capacity=21, recent=6)}[name]
    gc.collect()
    gc.disable()
    try:
        out = ec.generate(llama, random_prompt(60), policy, max_new_tokens=6)
        assert out.sequences.shape[1] == 66 and caches
        ec.Engine(llama, policy, slots=2).run([ec.Request(random_prompt(40)[0], max_new_tokens=4)])
        assert all(ref() is None for ref in caches), f"{sum(ref() is not None for ref in caches)} caches still alive"
    finally:
        gc.enable()
