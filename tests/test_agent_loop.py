"""The agent loop (evalkit/compression/agent_calls.py): calls that bring new content over one compressed cache, under
``session.recompress``. never is generate_shared's chat; each_call is the method re-applied to everything held plus
the new content (compress-mode chunked prefill's definition) and holds the cache at the budget after every call;
new_content compresses the new tokens alone and leaves the held ones as they were, bit for bit; the mistakes are one
line, at the library and before anything loads."""

from __future__ import annotations

import pytest
import torch
from conftest import SMALL_POLICIES, random_prompt, tiny_model

import evalkit.compression as ec
from evalkit.compression.generate import prefill
from evalkit.config import compose
from evalkit.core.errors import ConfigError
from evalkit.run import precheck, validate

CONTEXT, CONTENT, NEW = 120, 80, 5
NONE = torch.empty(0, dtype=torch.long)


def snapkv() -> ec.Policy:
    return ec.SnapKV(capacity=64, window=8)


def agent_calls(count: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first call's content is the context's end; each later one brings CONTENT tokens and a short question."""
    calls = [(NONE, random_prompt(6, seed=11)[0])]
    return calls + [(random_prompt(CONTENT, seed=20 + i)[0], random_prompt(6, seed=30 + i)[0]) for i in range(count - 1)]


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.mark.parametrize("make", [snapkv, lambda: ec.StreamingLLM(sink=4, window=40), ec.Full],
                         ids=["snapkv", "streaming_llm", "full"])
@pytest.mark.parametrize("history", ["own", "gold"])
def test_never_is_generate_shareds_multi_turn_chat(llama, make, history):
    context, calls = random_prompt(CONTEXT, seed=7), agent_calls()
    gold = [random_prompt(3, seed=40 + i)[0] for i in range(len(calls))] if history == "gold" else None
    shared = ec.generate_shared(llama, context, [torch.cat(call) for call in calls], make(), mode="multi_turn",
                                history=history, gold_answers=gold, max_new_tokens=NEW, eos_token_id=[])
    out = ec.generate_calls(llama, context, calls, make(), recompress="never", history=history, gold_answers=gold,
                            max_new_tokens=NEW, eos_token_id=[])
    for mine, theirs, stats, reference in zip(out.answers, shared.answers, out.stats, shared.stats):
        assert torch.equal(mine, theirs)
        for key in ("prompt_tokens", "prefill_tokens_computed", "prefill_tokens_shared", "peak_cache_tokens",
                    "kept_prompt_tokens", "tokens_seen"):
            assert stats[key] == reference[key], key
        assert stats["recompress"] == "never" and stats["cache_tokens_compressed"] is None
    assert [s["new_content_tokens"] for s in out.stats] == [0, CONTENT, CONTENT]
    if make is ec.Full:  # nothing evicted: the cache holds every token it was fed
        assert out.stats[-1]["cache_tokens_after"] == out.stats[-1]["tokens_seen"]


def test_each_call_recompresses_as_compress_mode_chunked_prefill_does(llama):
    """Taking in new content under each_call is the method over the held tokens and the content as one prompt, the
    content's queries observing: bit for bit what prefill_chunk_mode=compress keeps at a chunk boundary."""
    context, content = random_prompt(CONTEXT, seed=7), random_prompt(CONTENT, seed=8)
    session, _, _ = prefill(llama, snapkv(), context)
    logits = ec.take_in(session, content, "each_call")
    chunked, chunk_logits, _ = prefill(llama, snapkv(), torch.cat([context, content], dim=1), prefill_chunk=CONTEXT,
                                       prefill_chunk_mode="compress")
    assert torch.equal(logits, chunk_logits)
    for (keys, values, positions), layer in zip(ec.held_tokens(session), chunked.cache.layers):
        assert torch.equal(positions, layer.prompt_positions) and torch.equal(keys, layer.keys)
        assert torch.equal(values, layer.values)


@pytest.mark.parametrize("make", [snapkv, lambda: ec.StreamingLLM(sink=4, window=40), lambda: ec.KNorm(capacity=48)],
                         ids=["snapkv", "streaming_llm", "knorm"])
def test_each_call_holds_the_cache_at_the_budget_after_every_call(llama, make):
    context, calls = random_prompt(CONTEXT, seed=7), agent_calls(4)
    capacity = make().prompt_capacity()
    session, _, _ = prefill(llama, make(), context)
    for new, question in calls[1:]:
        ec.take_in(session, new[None], "each_call")
        assert all(layer.keys.shape[-2] == capacity for layer in session.cache.layers)  # the real tensors
        assert [keys.shape[-2] for keys, _, _ in ec.held_tokens(session)] == [capacity] * len(session.cache.layers)
        assert int(session.state.valid.sum()) == capacity and ec.cache_tokens(session) == capacity
        session.step(question[None])
        assert ec.cache_tokens(session) == min(capacity + len(question), make().cache_capacity() or 10**9)
    out = ec.generate_calls(llama, context, calls, make(), recompress="each_call", max_new_tokens=NEW, eos_token_id=[])
    never = ec.generate_calls(llama, context, calls, make(), recompress="never", max_new_tokens=NEW, eos_token_id=[])
    assert [s["cache_tokens_compressed"] for s in out.stats] == [None] + [capacity] * 3
    assert all(s["cache_tokens_after"] <= capacity + 6 + NEW for s in out.stats)
    assert out.stats[-1]["peak_cache_tokens"] < never.stats[-1]["peak_cache_tokens"] or make().cache_capacity()
    assert torch.equal(out.answers[0], never.answers[0])  # the first call brings nothing new
    assert any(not torch.equal(a, b) for a, b in zip(out.answers[1:], never.answers[1:]))  # content over the budget


def test_new_content_compresses_only_the_new_tokens(llama):
    context, content = random_prompt(CONTEXT, seed=7), random_prompt(CONTENT, seed=8)
    session, _, _ = prefill(llama, snapkv(), context)
    session.step(random_prompt(6, seed=9))  # a question and an answer held after the compressed context
    before = ec.held_tokens(session)
    held = before[0][0].shape[-2]
    share = ec.share_of(session.policy, CONTENT, CONTEXT)
    assert share == -(-CONTENT * 64 // CONTEXT) and share < CONTENT
    # at least sink + window, and a size the method takes (SnapKV keeps more than its window)
    assert ec.share_of(ec.SnapKV(capacity=64, window=32), 40, 400) == 33
    assert ec.share_of(ec.SnapKV(capacity=64, window=32), 20, 400) == 20 and ec.share_of(ec.Full(), 20, 400) == 20
    ec.take_in(session, content, "new_content", share)
    last = int(before[0][2].max())
    for (keys, values, positions), (old_keys, old_values, old_positions) in zip(ec.held_tokens(session), before):
        assert keys.shape[-2] == held + share
        assert torch.equal(keys[:, :, :held], old_keys) and torch.equal(values[:, :, :held], old_values)
        assert torch.equal(positions[:, :, :held], old_positions)
        new = positions[:, :, held:]
        assert (new > last).all() and (new <= last + CONTENT).all()
        assert (new[..., -8:] == last + CONTENT - 7 + torch.arange(8)).all()  # its window: its last tokens
    assert ec.cache_tokens(session) == held + share
    out = ec.generate_calls(llama, context, agent_calls(), snapkv(), recompress="new_content", max_new_tokens=NEW,
                            eos_token_id=[])
    sizes = [s["cache_tokens_compressed"] for s in out.stats]
    asked = 6 + NEW  # a question, then its answer: every token of it held but the last, fed with the next call
    assert sizes[1] == 64 + asked + share and sizes[2] == sizes[1] + asked + share


def test_a_method_that_cannot_rescore_a_held_cache_refuses_in_one_line(llama):
    context, calls = random_prompt(CONTEXT, seed=7), agent_calls()
    for policy, rule, fragment in ((SMALL_POLICIES["adakv"](), "each_call", "per-head layout"),
                                   (SMALL_POLICIES["blockwise"](), "new_content", "sizes each layer's budget"),
                                   (SMALL_POLICIES["think"](), "each_call", "rewrites the tokens it keeps"),
                                   (SMALL_POLICIES["non_causal_attention"](), "each_call", "reads every prompt query"),
                                   (SMALL_POLICIES["snapstream"](), "new_content", "one static size")):
        with pytest.raises(ValueError, match=fragment) as raised:
            ec.generate_calls(llama, context, calls, policy, recompress=rule, max_new_tokens=NEW, eos_token_id=[])
        assert "\n" not in str(raised.value) and f"session.recompress={rule}" in str(raised.value)
    assert ec.recompress_refusal(SMALL_POLICIES["non_causal_attention"](), "new_content") is None


@pytest.mark.parametrize("calls, rule, fragment", [
    (agent_calls(), "sometimes", "session.recompress must be one of never, each_call, new_content, got 'sometimes'"),
    ([(NONE, torch.tensor([5, 6])), (NONE, torch.tensor([7]))], "each_call", "call 2 brings no new content for"),
    ([(NONE, torch.tensor([5, 6])), (torch.tensor([3, 4]), NONE)], "never", "call 2 has no question"),
])
def test_a_mistaken_rule_or_call_is_one_line(llama, calls, rule, fragment):
    with pytest.raises(ValueError, match=fragment):
        ec.generate_calls(llama, random_prompt(CONTEXT, seed=7), calls, snapkv(), recompress=rule, eos_token_id=[])


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["each_call", "new_content"])
def test_every_registered_method_refuses_a_rule_in_one_line_or_runs_it(llama, rule):
    context, calls = random_prompt(CONTEXT, seed=7), agent_calls()
    for name, make in sorted(SMALL_POLICIES.items()):
        if ec.recompress_refusal(make(), rule) is None:
            out = ec.generate_calls(llama, context, calls, make(), recompress=rule, max_new_tokens=2, eos_token_id=[])
            assert out.stats[-1]["cache_tokens_compressed"] is not None, name


# -- the setting ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, fragment", [
    (["+session.recompress=each_call"], "session.recompress=each_call takes no effect with task.mode=single"),
    (["task.mode=multi_request", "+session.recompress=new_content"],
     "session.recompress=new_content takes no effect with task.mode=multi_request"),
    (["task.mode=multi_turn", "+session.recompress=sometimes"],
     "session.recompress must be one of never, each_call, new_content, got 'sometimes'"),
    (["+session=5"], "session must be a mapping, got 5"),
    (["+session.other=1"], "session.other"),
])
def test_a_mistaken_recompress_setting_is_one_line_before_anything_loads(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment) as raised:
        precheck(compose("task=agent_loop", *overrides), method_explicit=False)
    assert "\n" not in str(raised.value)


def test_a_method_the_rule_cannot_take_is_refused_when_the_run_is_built():
    with pytest.raises(ConfigError, match="session.recompress=each_call cannot re-score the cache adakv holds"):
        validate(compose("task=agent_loop", "task.mode=multi_turn", "+session.recompress=each_call", "method=adakv",
                         "budget=2x"))


def test_the_default_rule_leaves_the_digest_and_a_set_rule_is_a_column():
    from evalkit.results.tables import CONFIG_COLUMNS
    from evalkit.run.digest import config_digest

    tiny = "model.pretrained=builtin:kv_retrieval_tiny"
    plain = validate(compose("task=agent_loop", "task.mode=multi_turn", tiny), method_explicit=False)
    never = validate(compose("task=agent_loop", "task.mode=multi_turn", "+session.recompress=never", tiny),
                     method_explicit=False)
    assert config_digest(plain) == config_digest(never) and "session_recompress" not in plain.flat_config()
    assert plain.recompress == never.recompress == "never" and "session_recompress" in CONFIG_COLUMNS
