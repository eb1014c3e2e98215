"""One context, many calls (evalkit/compression/shared_context.py): every query over a shared compressed context gets
what it gets alone; a chat over a full cache is transformers' own turn by turn; what the shared prefix saved is
counted."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import SMALL_POLICIES, random_prompt, tiny_model
from transformers import DynamicCache

import evalkit.compression as ec

CONTEXT, NEW = 240, 6


def _queries(count: int = 3) -> list[torch.Tensor]:
    return [random_prompt(8 + 3 * i, seed=100 + i)[0] for i in range(count)]


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.mark.parametrize("name", sorted(SMALL_POLICIES))
def test_every_query_of_a_shared_context_gets_its_answer_alone(llama, name):
    """multi_request: each answer is generate's over the context and that query with the context compressed alone
    (compress_prefix), greedy, in any order: no query sees another's tokens."""
    context, queries = random_prompt(CONTEXT, seed=7), _queries()
    alone = []
    for query in queries:
        try:
            out = ec.generate(llama, torch.cat([context, query[None]], dim=1), SMALL_POLICIES[name](),
                              max_new_tokens=NEW, eos_token_id=[], return_logits=False, compress_prefix=CONTEXT)
        except ValueError as error:  # a method that cannot compress the context alone refuses both ways
            with pytest.raises(ValueError, match=str(error)[:40]):
                ec.generate_shared(llama, context, queries, SMALL_POLICIES[name](), max_new_tokens=NEW,
                                   eos_token_id=[])
            return
        alone.append((out.sequences[0, CONTEXT + len(query):], out.stats[0]["peak_cache_tokens"]))
    shared = ec.generate_shared(llama, context, queries, SMALL_POLICIES[name](), max_new_tokens=NEW, eos_token_id=[])
    backwards = ec.generate_shared(llama, context, queries[::-1], SMALL_POLICIES[name](), max_new_tokens=NEW,
                                   eos_token_id=[])
    for i, (tokens, peak) in enumerate(alone):
        assert torch.equal(shared.answers[i], tokens) and torch.equal(backwards.answers[-1 - i], tokens)
        assert shared.stats[i]["peak_cache_tokens"] == pytest.approx(peak)


@pytest.mark.parametrize("name", sorted(SMALL_POLICIES))
def test_the_engine_copies_a_shared_context_into_each_querys_slot(llama, name):
    """Request(prefix=session): the engine serves every query over one prefilled context, batched in its slots,
    with what the query gets as a request of its own (the context and the query, compress_prefix), greedy; the
    shared session is left as it was."""
    context, queries = random_prompt(CONTEXT, seed=7), _queries()
    try:
        prefix, _ = ec.prefill_context(llama, SMALL_POLICIES[name](), context)
    except ValueError:  # a method that cannot compress a context alone (the test above holds it to generate)
        return
    held = [layer.keys.clone() for layer in prefix.cache.layers]
    done = {}
    engine = ec.Engine(llama, SMALL_POLICIES[name](), slots=2, eos_token_id=[])
    engine.run([ec.Request(query, max_new_tokens=NEW, prefix=prefix) for query in queries],
               on_finish=lambda completion: done.__setitem__(completion.index, completion))
    alone = engine.run([ec.Request(torch.cat([context[0], query]), max_new_tokens=NEW, compress_prefix=CONTEXT)
                        for query in queries])
    for i, query in enumerate(queries):
        assert done[i].tokens == alone[i].tokens
        stats = done[i].stats
        assert (stats["prefill_tokens_computed"], stats["prefill_tokens_shared"]) == (len(query), CONTEXT)
        assert stats["prompt_tokens"] == CONTEXT + len(query)
        for key in ("peak_cache_tokens", "kept_prompt_tokens", "kv_bytes_peak", "memory_ratio"):
            assert stats[key] == pytest.approx(alone[i].stats[key])
    assert all(torch.equal(layer.keys, before) for layer, before in zip(prefix.cache.layers, held))


@pytest.mark.parametrize("name", sorted(n for n, make in SMALL_POLICIES.items() if make().evicts_while_decoding))
def test_the_engine_counts_a_querys_steps_after_a_compressed_context_as_generate_does(llama, name):
    """A request whose context is compressed alone (compress_prefix) then takes its query token by token: the
    decode steps a method counts (its re-compression interval, its first generated position) go on from them in the
    engine's slot as in generate, over several intervals."""
    context, query = random_prompt(CONTEXT, seed=1)[0], random_prompt(11, seed=101)[0]
    ids = torch.cat([context, query])
    policy = SMALL_POLICIES[name]()
    alone = ec.generate(llama, ids[None], policy, max_new_tokens=40, eos_token_id=[], return_logits=False,
                        compress_prefix=CONTEXT)
    served = ec.Engine(llama, policy, slots=2, eos_token_id=[]).run(
        [ec.Request(ids, max_new_tokens=40, compress_prefix=CONTEXT)])
    assert served[0].tokens == alone.sequences[0, len(ids):].tolist()
    assert served[0].stats["peak_cache_tokens"] == alone.stats[0]["peak_cache_tokens"]


def test_the_compiled_step_serves_shared_contexts_without_a_new_graph(llama):
    """SnapStream's static cache, compiled: queries over a shared context and plain requests in one stream, one graph,
    the eager engine's tokens."""
    from torch._dynamo.testing import CompileCounter

    policy = lambda: ec.SnapStream(capacity=64, window=8, sink=4, recent=16)  # noqa: E731
    context, queries = random_prompt(CONTEXT, seed=7), _queries(4)
    prefix, _ = ec.prefill_context(llama, policy(), context)
    requests = [ec.Request(query, max_new_tokens=NEW, prefix=prefix) for query in queries]
    requests.insert(2, ec.Request(random_prompt(50, seed=3)[0], max_new_tokens=NEW))
    eager = ec.Engine(llama, policy(), slots=2, eos_token_id=[]).run(requests)
    counter = CompileCounter()
    compiled = ec.Engine(llama, policy(), slots=2, eos_token_id=[], compile=True, compile_backend=counter).run(requests)
    assert [c.tokens for c in compiled] == [c.tokens for c in eager] and counter.frame_count == 1


def test_a_request_over_a_prefix_takes_no_other_prompt_split(llama):
    prefix, _ = ec.prefill_context(llama, ec.Full(), random_prompt(16, seed=7))
    with pytest.raises(ValueError, match="takes neither compress_prefix nor position_ids"):
        ec.Request([1, 2], prefix=prefix, compress_prefix=1)


def test_a_compressing_method_holds_less_and_answers_otherwise_than_the_full_cache(llama):
    context, queries = random_prompt(CONTEXT, seed=7), _queries()
    full = ec.generate_shared(llama, context, queries, ec.Full(), max_new_tokens=NEW, eos_token_id=[])
    snapkv = ec.generate_shared(llama, context, queries, ec.SnapKV(capacity=48, window=8, kernel_size=5),
                                max_new_tokens=NEW, eos_token_id=[])
    assert all(s["peak_cache_tokens"] <= 48 + len(q) + NEW < CONTEXT for s, q in zip(snapkv.stats, queries))
    assert all(f["peak_cache_tokens"] == CONTEXT + len(q) + NEW - 1 for f, q in zip(full.stats, queries))
    assert any(not torch.equal(a, b) for a, b in zip(full.answers, snapkv.answers))


def test_the_context_is_computed_once_and_served_to_every_later_query(llama):
    context, queries = random_prompt(CONTEXT, seed=7), _queries(8)
    out = ec.generate_shared(llama, context, queries, ec.Full(), max_new_tokens=2, eos_token_id=[])
    computed = sum(s["prefill_tokens_computed"] for s in out.stats)
    assert computed == CONTEXT + sum(len(q) for q in queries)
    assert [s["prefill_tokens_shared"] for s in out.stats] == [0] + [CONTEXT] * 7
    one_by_one = sum(CONTEXT + len(q) for q in queries)
    assert computed <= one_by_one / 4


@pytest.mark.parametrize("name", ["snapstream", "streaming_llm", "h2o"])
def test_a_fixed_size_cache_keeps_its_one_size_across_the_turns_of_a_chat(llama, name):
    """SnapStream, StreamingLLM and H2O evict while decoding: a chat's turns never take the cache past its
    capacity, however much the turns add."""
    policy = SMALL_POLICIES[name]()
    out = ec.generate_shared(llama, random_prompt(CONTEXT, seed=7), _queries(4), policy, mode="multi_turn",
                             max_new_tokens=24, eos_token_id=[])
    peaks = [s["peak_cache_tokens"] for s in out.stats]
    assert max(peaks) <= policy.cache_capacity() and peaks[-1] == policy.cache_capacity()
    assert out.stats[-1]["tokens_seen"] > CONTEXT + 4 * 24 > policy.cache_capacity()


@pytest.mark.parametrize("name", ["adakv", "pyramidkv", "snapkv"])
def test_allocated_budgets_stay_as_they_were_while_a_chat_grows_the_cache(llama, name):
    """A method that compresses only the context (per-head AdaKV, per-layer PyramidKV, SnapKV) fixes what each head
    kept once; the turns add their tokens on top, to every head alike."""
    out = ec.generate_shared(llama, random_prompt(CONTEXT, seed=7), _queries(3), SMALL_POLICIES[name](),
                             mode="multi_turn", max_new_tokens=NEW, eos_token_id=[])
    kept = [s["kept_prompt_tokens_per_head"] for s in out.stats]
    assert kept[0] == kept[1] == kept[2]
    added = [s["tokens_seen"] - out.stats[0]["tokens_seen"] for s in out.stats]
    assert [s["peak_cache_tokens"] - out.stats[0]["peak_cache_tokens"] for s in out.stats] == pytest.approx(added)


def test_a_chat_over_the_full_cache_is_transformers_own_turn_by_turn(llama):
    """multi_turn with Full: each turn appends its query to the conversation so far (the model's own answers
    included), as transformers' generate continuing its own cache does."""
    context, queries = random_prompt(CONTEXT, seed=7), _queries()
    ours = ec.generate_shared(llama, context, queries, ec.Full(), mode="multi_turn", max_new_tokens=NEW,
                              eos_token_id=[])
    cache, conversation = DynamicCache(config=llama.config), context
    for turn, query in enumerate(queries):
        conversation = torch.cat([conversation, query[None]], dim=1)
        with warnings.catch_warnings():  # newer transformers deprecate past_key_values (now cache); it still works
            warnings.simplefilter("ignore", FutureWarning)
            out = llama.generate(conversation, attention_mask=torch.ones_like(conversation), past_key_values=cache,
                                 max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, return_dict_in_generate=True,
                                 pad_token_id=0)
        answer = out.sequences[0, conversation.shape[1]:]
        assert torch.equal(ours.answers[turn], answer), turn
        conversation, cache = out.sequences, out.past_key_values
    shared = [s["prefill_tokens_shared"] for s in ours.stats]
    assert shared == [0, CONTEXT + len(queries[0]) + NEW - 1, CONTEXT + len(queries[0]) + len(queries[1]) + 2 * NEW - 1]


def test_a_chat_keeps_the_gold_answers_in_place_of_its_own_when_asked(llama):
    context, queries = random_prompt(CONTEXT, seed=7), _queries()
    golds = [random_prompt(5, seed=200 + i)[0] for i in range(len(queries))]
    own = ec.generate_shared(llama, context, queries, ec.Full(), mode="multi_turn", max_new_tokens=NEW, eos_token_id=[])
    gold = ec.generate_shared(llama, context, queries, ec.Full(), mode="multi_turn", history="gold",
                              gold_answers=golds, max_new_tokens=NEW, eos_token_id=[])
    assert torch.equal(own.answers[0], gold.answers[0])  # the first turn has no history yet
    assert gold.stats[1]["prefill_tokens_shared"] == CONTEXT + len(queries[0])  # the model's answer was dropped
    assert gold.stats[1]["prefill_tokens_computed"] == len(golds[0]) + len(queries[1])
    assert gold.stats[2]["prefill_tokens_shared"] == CONTEXT + len(queries[0]) + len(golds[0]) + len(queries[1])


@pytest.mark.parametrize("kwargs, message", [
    ({"mode": "multi_chat"}, "mode must be one of"),
    ({"mode": "multi_turn", "history": "gold"}, "needs one gold answer per query"),
    ({"history": "gold", "gold_answers": [torch.tensor([1])] * 3}, "history='gold' is a multi_turn option"),
    ({"history": "mine"}, "history must be one of"),
])
def test_a_mistaken_mode_or_history_is_one_line(llama, kwargs, message):
    with pytest.raises(ValueError, match=message):
        ec.generate_shared(llama, random_prompt(CONTEXT, seed=7), _queries(), ec.Full(), **kwargs)
