"""The continuous-batching engine: same tokens as alone, static caches, per-request sampling, no recompiles."""

from __future__ import annotations

import pytest
import torch
from conftest import SMALL_POLICIES
from torch._dynamo.testing import CompileCounter
from transformers import LlamaConfig, LlamaForCausalLM

import evalkit.compression as ec
from evalkit.compression.engine.sampling import choose_tokens, gumbel_noise

VOCAB = 256


@pytest.fixture(scope="module")
def model():
    return small_llama()


def small_llama():
    """A random Llama: 2 layers, 4 heads, 2 KV heads of width 16, fp32, no EOS."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    model = LlamaForCausalLM(config).eval()
    model.config._attn_implementation = "sdpa"
    model.generation_config.eos_token_id = None
    return model


def stream(count: int = 10, seed: int = 1, **settings) -> list[ec.Request]:
    """Prompts of 20-150 tokens and lengths of 3-40 new tokens (a long tail over the slots)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(20, 150, (count,), generator=g).tolist()
    news = torch.randint(3, 40, (count,), generator=g).tolist()
    return [ec.Request(torch.randint(0, VOCAB, (n,), generator=g), max_new_tokens=m, seed=i, **settings)
            for i, (n, m) in enumerate(zip(lengths, news))]


POLICIES = [make() for make in SMALL_POLICIES.values()]  # every registered method


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_greedy_tokens_and_stats_equal_running_alone(model, policy):
    requests = stream()
    engine = ec.Engine(model, policy, slots=3, sync_every=3)
    completions = engine.run(requests)
    assert [c.index for c in completions] == list(range(len(requests)))
    for request, completion in zip(requests, completions):
        alone = ec.generate(model, request.input_ids[None], policy, max_new_tokens=request.max_new_tokens,
                            return_logits=False)
        assert completion.tokens == alone.sequences[0, request.input_ids.numel():].tolist()
        for key in ("prompt_tokens", "generated_tokens", "kept_prompt_tokens", "kept_prompt_tokens_per_head",
                    "peak_cache_tokens", "tokens_seen"):
            assert completion.stats[key] == alone.stats[0][key], key
        assert completion.stats["reserved_cache_tokens"] == engine.slot_tokens
    if policy.evicts_while_decoding and policy.cache_capacity() is not None:  # a static cache of the capacity
        assert engine.slot_tokens == policy.capacity
        assert max(c.stats["peak_cache_tokens"] for c in completions) <= policy.capacity


def test_fixed_capacity_cache_is_allocated_once_at_capacity(model):
    policy = ec.SnapStream(capacity=64, window=8, sink=4, recent=16)
    engine = ec.Engine(model, policy, slots=4)
    engine.run(stream(count=2))
    keys = engine.cache.layers[0].keys
    pointer, shape = keys.data_ptr(), tuple(keys.shape)
    assert shape == (4, 2, 64, 16)  # [slots, kv heads, capacity, head dim]: prompts of up to 150 tokens fit in 64
    completions = engine.run(stream(count=30, seed=2))  # 15x the requests: the same memory
    assert engine.cache.layers[0].keys.data_ptr() == pointer and tuple(engine.cache.layers[0].keys.shape) == shape
    long_prompts = [c for c, r in zip(completions, stream(count=30, seed=2)) if r.input_ids.numel() > 64]
    assert long_prompts and all(c.stats["peak_cache_tokens"] <= 64 for c in completions)
    assert all(c.stats["kept_prompt_tokens"] == [48, 48] for c in long_prompts)  # capacity - recent
    # the real per-slot state agrees: no slot ever holds more than the capacity
    assert int(engine.valid.sum(dim=1).max()) <= 64


def test_admission_writes_the_compressed_prompt_straight_into_its_slot(model, monkeypatch):
    """A compressed prompt (row layout) is written into its slot as each layer is compressed: the admission's session
    holds views of the engine's cache, not a second copy. A prompt under the budget (not compressed) and a question
    prefilled on top of a compressed context are copied as before; every request's tokens equal running alone."""
    import evalkit.compression.engine.slot_pool as engine_module

    admitted = []

    def spy(model, policy, ids, *args, **kwargs):
        session, logits, seconds = real(model, policy, ids, *args, **kwargs)
        admitted.append((ids.shape[1], args[1], session))  # args: attention_mask, compress_prefix, ...
        return session, logits, seconds

    real = engine_module.prefill
    monkeypatch.setattr(engine_module, "prefill", spy)
    policy = ec.SnapStream(capacity=64, window=8, sink=4, recent=16)
    requests = stream(count=6, seed=3)
    requests[1] = ec.Request(torch.randint(0, VOCAB, (130,), generator=torch.Generator().manual_seed(5)),
                             max_new_tokens=5, compress_prefix=110)  # a context of 110 tokens, then a question
    engine = ec.Engine(model, policy, slots=2)
    completions = engine.run(requests)
    slot_storage = {layer.keys.untyped_storage().data_ptr() for layer in engine.cache.layers}
    outcomes = set()
    for length, compress_prefix, session in admitted:
        in_slot = [layer.keys.untyped_storage().data_ptr() in slot_storage for layer in session.cache.layers]
        straight = length > policy.prompt_capacity() and compress_prefix is None
        assert in_slot == [straight] * len(in_slot), (length, compress_prefix)
        outcomes.add((straight, compress_prefix is not None))
    assert outcomes == {(True, False), (False, False), (False, True)}
    for request, completion in zip(requests, completions):
        alone = ec.generate(model, request.input_ids[None], policy, max_new_tokens=request.max_new_tokens,
                            compress_prefix=request.compress_prefix, return_logits=False)
        assert completion.tokens == alone.sequences[0, request.input_ids.numel():].tolist()


def test_growing_policy_reserves_prompt_capacity_plus_new_tokens(model):
    requests = stream()
    engine = ec.Engine(model, ec.SnapKV(capacity=48, window=8), slots=2)
    engine.run(requests)
    assert engine.slot_tokens == max(min(r.input_ids.numel(), 48) + r.max_new_tokens for r in requests)
    small = ec.Engine(model, ec.Full(), slots=2, slot_tokens=40)
    with pytest.raises(ValueError, match=r"request 0 needs \d+ cache slots .* more than the 40 reserved"):
        small.run(requests)


def test_grow_on_demand_gives_the_same_tokens(model):
    requests = stream()
    static = ec.Engine(model, ec.Full(), slots=3).run(requests)
    engine = ec.Engine(model, ec.Full(), slots=3, grow=True)
    grown = engine.run(requests)
    assert [c.tokens for c in grown] == [c.tokens for c in static]
    assert engine.slot_tokens >= max(r.input_ids.numel() for r in requests)
    with pytest.raises(ValueError, match="static"):
        ec.Engine(model, ec.Full(), grow=True, compile=True)
    with pytest.raises(ValueError, match="fixed capacity"):
        ec.Engine(model, ec.SnapStream(capacity=64, window=8, recent=16), grow=True)


def test_continuous_batching_takes_fewer_steps_than_static_batches(model):
    requests = stream(count=24, seed=3)
    engine = ec.Engine(model, ec.SnapStream(capacity=64, window=8, sink=4, recent=16), slots=4, sync_every=1)
    engine.run(requests)
    lengths = [r.max_new_tokens for r in requests]
    static_steps = sum(max(lengths[i : i + 4]) for i in range(0, len(lengths), 4))
    assert engine.counters["decode_steps"] < 0.8 * static_steps
    assert engine.utilization() > 0.8


def test_sampling_is_per_request_whatever_the_slot_and_neighbours(model):
    requests = stream(do_sample=True, temperature=0.9, top_p=0.95)
    policy = ec.SnapStream(capacity=64, window=8, sink=4, recent=16)
    first = ec.Engine(model, policy, slots=3).run(requests)
    reordered = ec.Engine(model, policy, slots=5, sync_every=2).run(requests[::-1])[::-1]
    assert [c.tokens for c in first] == [c.tokens for c in reordered]
    reseeded = [ec.Request(r.input_ids, max_new_tokens=r.max_new_tokens, do_sample=True, temperature=0.9, top_p=0.95,
                           seed=r.seed + 100) for r in requests]
    other = ec.Engine(model, policy, slots=3).run(reseeded)
    assert sum(a.tokens != b.tokens for a, b in zip(first, other)) >= len(requests) - 1  # the seed matters
    greedy = ec.Engine(model, policy, slots=3).run(stream())
    assert sum(a.tokens != b.tokens for a, b in zip(first, greedy)) >= len(requests) - 1  # sampling is not argmax


def test_gumbel_draws_follow_the_distribution():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5])
    probabilities = logits.softmax(dim=-1)
    draws = 20000
    seeds = torch.arange(draws)
    noise = gumbel_noise(seeds, torch.full((draws,), 7), len(logits))
    counts = torch.bincount((logits + noise).argmax(dim=-1), minlength=len(logits)).float()
    expected = probabilities * draws
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 18.5  # 4 degrees of freedom, p = 0.001
    # per-row settings: top-p removes the tail, temperature sharpens
    rows = 4000
    chosen = choose_tokens(logits.expand(rows, -1), False, torch.arange(rows), torch.zeros(rows, dtype=torch.long),
                           torch.ones(rows, dtype=torch.bool), torch.full((rows,), 0.5), torch.full((rows,), 0.8), True)
    assert set(chosen.tolist()) <= {0, 1}  # at T=0.5 the first two tokens hold more than 0.8 of the mass
    greedy = choose_tokens(logits.expand(3, -1), False, torch.arange(3), torch.zeros(3, dtype=torch.long),
                           torch.zeros(3, dtype=torch.bool), torch.ones(3), torch.ones(3), False)
    assert greedy.tolist() == [0, 0, 0]


def test_eos_ends_a_request_as_it_does_alone(model):
    policy = ec.SnapStream(capacity=64, window=8, sink=4, recent=16)
    requests = stream(count=6)
    plain = ec.Engine(model, policy, slots=2).run(requests)
    eos = plain[0].tokens[2]  # a token the model does produce
    completions = ec.Engine(model, policy, slots=2, eos_token_id=eos).run(requests)
    ended = 0
    for request, completion in zip(requests, completions):
        alone = ec.generate(model, request.input_ids[None], policy, max_new_tokens=request.max_new_tokens,
                            eos_token_id=eos, return_logits=False)
        assert completion.tokens == alone.sequences[0, request.input_ids.numel():][: alone.stats[0]["generated_tokens"]].tolist()
        ended += completion.tokens[-1] == eos and len(completion.tokens) < request.max_new_tokens
    assert ended >= 1


def test_stop_strings_end_a_request_at_the_same_token(model):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB)}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw)
    policy = ec.SnapStream(capacity=64, window=8, sink=4, recent=16)
    requests = stream(count=6)
    plain = ec.Engine(model, policy, slots=2).run(requests)
    stop = tokenizer.decode(plain[1].tokens[4:6])  # two words from the middle of one generation
    stopped = [ec.Request(r.input_ids, max_new_tokens=r.max_new_tokens, stop_strings=[stop]) for r in requests]
    completions = ec.Engine(model, policy, slots=2, tokenizer=tokenizer, sync_every=5).run(stopped)
    assert len(completions[1].tokens) <= 6 and stop in tokenizer.decode(completions[1].tokens)
    for request, completion in zip(requests, completions):
        alone = ec.generate(model, request.input_ids[None], policy, max_new_tokens=request.max_new_tokens,
                            stop_strings=[stop], tokenizer=tokenizer, return_logits=False)
        assert completion.tokens == alone.sequences[0, request.input_ids.numel():][: alone.stats[0]["generated_tokens"]].tolist()
        assert completion.stats["generated_tokens"] == alone.stats[0]["generated_tokens"]


@pytest.mark.parametrize("policy", [ec.SnapStream(capacity=64, window=8, sink=4, recent=16),
                                    ec.AdaKV.from_config(48, window=4), ec.H2O(capacity=40, recent=10),
                                    ec.ExpectedAttention(capacity=40, n_future_positions=32)], ids=lambda p: p.name)
def test_context_scope_and_kept_positions_match_generate(model, policy):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (120,), generator=g)
    prefix = ec.Request(ids, max_new_tokens=12, compress_prefix=100)
    positions = torch.sort(torch.randperm(300, generator=g)[:120]).values
    kept = ec.Request(ids, max_new_tokens=12, position_ids=positions)
    completions = ec.Engine(model, policy, slots=2).run([prefix, kept])
    alone_prefix = ec.generate(model, ids[None], policy, max_new_tokens=12, compress_prefix=100, return_logits=False)
    alone_kept = ec.generate(model, ids[None], policy, max_new_tokens=12, position_ids=positions[None], return_logits=False)
    assert completions[0].tokens == alone_prefix.sequences[0, 120:].tolist()
    assert completions[1].tokens == alone_kept.sequences[0, 120:].tolist()
    assert completions[0].tokens != completions[1].tokens


def test_compiled_step_compiles_once_and_matches_eager(model):
    policy = ec.SnapStream(capacity=64, window=8, sink=4, recent=16)
    requests = stream(count=8)
    eager = ec.Engine(model, policy, slots=3).run(requests)
    counter = CompileCounter()
    engine = ec.Engine(model, policy, slots=3, compile=True, compile_backend=counter)
    compiled = engine.run(requests)
    assert [c.tokens for c in compiled] == [c.tokens for c in eager]
    steps = engine.counters["decode_steps"]
    assert steps > 50 and counter.frame_count == 1  # one graph for every step: no recompiles, no graph breaks
    engine.run(stream(count=8, seed=9))  # new requests, new prompts and lengths: still the same graph
    assert engine.counters["decode_steps"] > steps and counter.frame_count == 1


def test_a_later_stream_of_longer_requests_reuses_the_compiled_step(model):
    """The generated-token buffer is a ring of fixed width: a request longer than any before needs no new graph."""
    policy = ec.SnapStream(capacity=64, window=8, sink=4, recent=16)
    counter = CompileCounter()
    engine = ec.Engine(model, policy, slots=2, compile=True, compile_backend=counter)
    engine.run(stream(count=3))
    longer = [ec.Request(torch.arange(30) % VOCAB, max_new_tokens=600), *stream(count=2, seed=4)]
    completions = engine.run(longer)
    assert counter.frame_count == 1
    assert [c.tokens for c in completions] == [c.tokens for c in ec.Engine(model, policy, slots=2).run(longer)]
    alone = ec.generate(model, longer[0].input_ids[None], policy, max_new_tokens=600, return_logits=False)
    assert completions[0].tokens == alone.sequences[0, 30:].tolist() and len(completions[0].tokens) == 600


@pytest.mark.parametrize("policy", [ec.H2O(capacity=40, recent=10), ec.AdaKV.from_config(48, window=4),
                                    ec.DecodingSnapKV.from_config(64, window=4, kernel_size=3, interval=8)],
                         ids=lambda p: p.name)
def test_per_head_layouts_compile_to_one_graph(model, policy):
    torch._dynamo.reset()
    counter = CompileCounter()
    requests = stream(6, seed=3)
    engine = ec.Engine(model, policy, slots=3, compile=True, compile_backend=counter)
    compiled = engine.run(requests)
    eager = ec.Engine(model, policy, slots=3).run(requests)
    assert counter.frame_count == 1
    assert [c.tokens for c in compiled] == [c.tokens for c in eager]


def test_bad_requests_are_refused_clearly(model):
    with pytest.raises(ValueError, match="max_new_tokens"):
        ec.Request([1, 2], max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature and top_p apply only with do_sample"):
        ec.Request([1, 2], temperature=0.5)
    with pytest.raises(ValueError, match="at least one prompt token"):
        ec.Request([])
    with pytest.raises(ValueError, match="slots"):
        ec.Engine(model, ec.Full(), slots=0)
    with pytest.raises(TypeError, match="Request"):
        ec.Engine(model, ec.Full()).run([[1, 2, 3]])
    with pytest.raises(ValueError, match="tokenizer"):
        ec.Engine(model, ec.Full()).run([ec.Request([1, 2], stop_strings=["x"])])
    assert ec.compile_backend(False) is None and ec.compile_backend(True) == "inductor"
    with pytest.raises(ValueError, match="torch.compile backend"):
        ec.compile_backend("fastest")


# -- through the CLI: the adapter hands the task to the engine ---------------------------------------------------------
@pytest.mark.slow
def test_cli_compiled_engine_gives_the_same_samples_and_rows_record_it(tmp_path, random_model_dir):
    from helpers import evalkit

    from evalkit.results import read_table

    common = ["task=kv_retrieval", f"model.pretrained={random_model_dir}", "limit=12", "batch_size=3", "+budget=4x",
              "+task.generation.max_gen_toks=24"]
    plain = evalkit(*common, f"results_dir={tmp_path / 'plain'}", cwd=tmp_path)
    compiled = evalkit(*common, "compile=eager", f"results_dir={tmp_path / 'compiled'}", cwd=tmp_path)
    assert plain.returncode == 0 and compiled.returncode == 0, (plain.stderr + compiled.stderr)[-3000:]
    assert "tok/s" in plain.stderr  # the progress bar reports the engine's throughput
    first, second = read_table(tmp_path / "plain", "samples"), read_table(tmp_path / "compiled", "samples")
    assert first["prediction"].tolist() == second["prediction"].tolist()
    assert (first["batch_size"] == 3).all() and first["compile"].isna().all() and (second["compile"] == "eager").all()
    assert (first["peak_cache_tokens"] <= first["capacity"]).all() and (first["reserved_cache_tokens"] == first["capacity"]).all()
    bad = evalkit(*common, "compile=fastest", f"results_dir={tmp_path / 'bad'}", cwd=tmp_path)
    assert bad.returncode == 2 and "compile must be true, false or a torch.compile backend" in bad.stderr


def test_adapter_repeats_sample_differently_and_reproducibly(random_model_dir):
    """lm-eval's repeats of one prompt (AIME's 64 samples) are identical requests: each gets its own random stream,
    and the same request gets the same text in another run, whatever the order."""
    from lm_eval.api.instance import Instance

    from evalkit.lm import EvalkitLM
    from evalkit.models import load_model

    tiny, tokenizer = load_model(str(random_model_dir), device="cpu")
    tiny.generation_config.eos_token_id = tokenizer.eos_token_id = None  # random weights: no early EOS
    lm = EvalkitLM(model=tiny, tokenizer=tokenizer, max_context=256, batch_size=3)
    settings = {"until": [], "max_gen_toks": 12, "do_sample": True, "temperature": 1.5}
    prompts = ["u1 v2 k3 u4 v5 k6 ?", "u7 v8 k9 ?"]
    requests = [Instance("generate_until", {}, (text, dict(settings)), idx) for idx, text in
                enumerate([prompts[0]] * 4 + [prompts[1]] * 2)]
    first = lm.generate_until(requests, disable_tqdm=True)
    assert len(set(first[:4])) >= 3  # repeats are independent samples
    again = EvalkitLM(model=tiny, tokenizer=tokenizer, max_context=256, batch_size=2)
    second = again.generate_until(requests[4:] + requests[:4], disable_tqdm=True)  # other order, other slots
    assert second[2:] + second[:2] == first
    stats = list(lm.request_stats.values())
    assert len(stats) == 6 and all(s["generated_tokens"] >= 1 and s["reserved_cache_tokens"] > 0 for s in stats)


def test_the_engine_reports_each_phase_as_it_begins_and_ends(model):
    """``on_step``: every admission (prefill) and decode round announced as it begins, then its tokens and seconds;
    the first round is the warm-up; the prompt tokens read add up to the stream's."""
    requests = stream(count=6, seed=3)
    heard = []
    completions = ec.Engine(model, ec.SnapStream(capacity=48), slots=2, sync_every=4).run(
        requests, on_step=lambda phase, tokens, seconds: heard.append((phase, tokens, seconds)))
    begins, ends = heard[0::2], heard[1::2]
    assert all(tokens == 0 and seconds == 0.0 for _, tokens, seconds in begins)
    assert [phase for phase, _, _ in begins] == [phase for phase, _, _ in ends]
    assert all(tokens > 0 and seconds > 0 for _, tokens, seconds in ends)
    phases = [phase for phase, _, _ in ends]
    assert phases[0] == "prefill" and phases.count("warm-up") == 1
    assert phases.index("warm-up") < phases.index("decode")
    read = sum(tokens for phase, tokens, _ in ends if phase == "prefill")
    assert read == sum(r.input_ids.numel() for r in requests)
    decoded = sum(tokens for phase, tokens, _ in ends if phase in ("warm-up", "decode"))
    assert decoded >= sum(len(c.tokens) for c in completions) - len(requests)  # each first token is the prefill's


@pytest.mark.parametrize("scorer", [None, "snapkv"])
def test_a_query_buffer_longer_than_the_prompt_enters_its_slot_as_it_runs_alone(model, scorer):
    """A method that keeps recent queries for its decode-time scorer, with prompts shorter than its buffer: the
    slot's buffer takes the prompt's queries at its end (found by the schema fuzz: the engine failed at admission)."""
    settings = {} if scorer is None else {"scorer": ec.SnapKV(capacity=40, window=4)}
    policy = ec.CompressionRatioDecoding(capacity=40, interval=8, buffer=200, **settings)
    requests = stream(count=4)
    completions = ec.Engine(model, policy, slots=2, sync_every=3).run(requests)
    for request, completion in zip(requests, completions):
        alone = ec.generate(model, request.input_ids[None], policy, max_new_tokens=request.max_new_tokens,
                            return_logits=False)
        assert completion.tokens == alone.sequences[0, request.input_ids.numel():].tolist()
        assert completion.stats["peak_cache_tokens"] == alone.stats[0]["peak_cache_tokens"]


def test_a_layer_that_keeps_nothing_enters_its_slot_as_it_runs_alone():
    """A global budget spent on one layer's sinks leaves another layer nothing (KVzip+ with its sinks beyond the
    budget): the engine admits it and decodes as the request does alone (found by the schema fuzz)."""
    from evalkit.models import load_model

    model, tokenizer = load_model("builtin:kv_retrieval_tiny")
    policy = ec.policy_from_budget("kvzip_plus", "4x", 256, sink=128)
    policy.bind_tokenizer(tokenizer)
    ids = torch.randint(5, 100, (1, 160), generator=torch.Generator().manual_seed(0))
    alone = ec.generate(model, ids, policy, max_new_tokens=12, tokenizer=tokenizer)
    (completion,) = ec.Engine(model, policy, slots=2, tokenizer=tokenizer).run([ec.Request(ids[0], max_new_tokens=12)])
    assert alone.stats[0]["kept_prompt_tokens"] == completion.stats["kept_prompt_tokens"] == [128, 0]
    assert completion.tokens == alone.sequences[0, 160:].tolist()
