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
from evalkit.compression.recompress import keeps_fed_ids
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


@pytest.mark.parametrize("make", [snapkv, lambda: ec.StreamingLLM(sink=4, window=40), lambda: ec.KNorm(capacity=48),
                                  lambda: ec.SnapStream(capacity=64, window=8, recent=24)],
                         ids=["snapkv", "streaming_llm", "knorm", "snapstream"])
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
                                   (SMALL_POLICIES["tova"](), "new_content", "per-head layout other than H2O"),
                                   (SMALL_POLICIES["kvgrad"](), "each_call", "passes of its own other than KVzip's"),
                                   (SMALL_POLICIES["kvzip_plus"](), "new_content", "passes of its own other than")):
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


# -- H2O, SnapStream, StreamingLLM, KVzip, Full: what each rule keeps ------------------------------------------------
def held_by_head(session) -> list[list[tuple]]:
    """Every layer's held tokens per KV head, each head's own (a per-head layout's heads may hold different counts):
    ``(positions, keys, values)`` in text order, read off the layers' tensors and validity."""
    if not session.cache.layers[0].layout.per_head:
        return [[(positions[0, head], keys[0, head], values[0, head]) for head in range(keys.shape[1])]
                for keys, values, positions in ec.held_tokens(session)]
    out = []
    for layer in session.cache.layers:
        heads, per_head = layer.heads, []
        for head in range(heads.valid.shape[1]):
            valid = heads.valid[0, head]
            positions = heads.positions[0, head][valid]
            order = positions.argsort()
            per_head.append((positions[order], layer.keys[0, head][valid][order], layer.values[0, head][valid][order]))
        out.append(per_head)
    return out


def kept_positions(session) -> list[list[torch.Tensor]]:
    return [[positions for positions, _, _ in layer] for layer in held_by_head(session)]


def by_position(session) -> list[dict]:
    """Every layer's held (key, value) per KV head and text position."""
    return [{(head, int(p)): (keys[i], values[i]) for head, (positions, keys, values) in enumerate(layer)
             for i, p in enumerate(positions)} for layer in held_by_head(session)]


def differs(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> bool:
    return any(not torch.equal(x, y) for one, other in zip(a, b) for x, y in zip(one, other))


def assert_stayed_bit_for_bit(before: list[dict], after: list[dict], start: int) -> int:
    """Every held token (position < ``start``) still held is as it was; returns how many stayed."""
    stayed = 0
    for old, new in zip(before, after):
        for key, (keys, values) in new.items():
            if key[1] < start:
                assert torch.equal(keys, old[key][0]) and torch.equal(values, old[key][1]), key
                stayed += 1
    return stayed


def appended(llama, make, context, content):
    """The session after ``content`` appended as never appends it."""
    session, _, _ = prefill(llama, make(), context)
    session.step(random_prompt(6, seed=9))
    session.step(content)
    return session


def h2o() -> ec.Policy:
    return ec.H2O(capacity=40, recent=10)


@pytest.fixture(scope="module")
def sharp():
    """A tiny model whose attention is far from uniform (the default's ranks every token by its position alone)."""
    return tiny_model("llama", initializer_range=0.2)


@pytest.mark.parametrize("rule", ["each_call", "new_content"])
def test_h2o_takes_in_new_content_per_head_at_its_capacity(sharp, rule):
    """Both rules hold H2O at capacity - 1 per layer and head (the real tensors' validity), positions and running sums
    kept with the tokens, the recent window the content's last tokens; new_content keeps at most the share of the
    content and the held tokens that stay bit for bit; neither keeps what appending keeps."""
    context, content = random_prompt(CONTEXT, seed=7), random_prompt(CONTENT, seed=8)
    session, _, _ = prefill(sharp, h2o(), context)
    session.step(random_prompt(6, seed=9))
    before, start = by_position(session), int(session.state.seq_len[0])
    share = ec.share_of(session.policy, CONTENT, CONTEXT)
    ec.take_in(session, content, rule, share if rule == "new_content" else None)
    assert ec.cache_tokens(session) == 39
    for layer, positions in zip(session.cache.layers, map(torch.stack, kept_positions(session))):
        heads = layer.heads
        assert (heads.valid[0].sum(dim=-1) == 39).all() and layer.keys.shape[-2] >= 40  # a free slot for the next
        assert (heads.positions[~heads.valid] == -1).all() and (heads.scores[~heads.valid] == 0).all()
        assert (positions[..., -10:] == start + CONTENT - 10 + torch.arange(10)).all()  # its recent window
        assert (heads.scores[heads.valid] > 0).all()  # every kept token's accumulated attention
        if rule == "new_content":
            assert ((positions >= start).sum(dim=-1) <= share).all()
    stayed = assert_stayed_bit_for_bit(before, by_position(session), start)
    assert 0 < stayed < 39 * 2 * len(before)  # some held tokens went, some stayed
    never = appended(sharp, h2o, context, content)
    assert differs(kept_positions(session), kept_positions(never))
    logits = session.step(random_prompt(1, seed=3))  # decoding goes on: H2O evicts one per step at its capacity
    assert ec.cache_tokens(session) == 39 and torch.isfinite(logits).all()


def test_h2o_each_call_keeps_the_heaviest_by_accumulated_attention(sharp):
    """each_call is H2O's own rank: the held tokens' running sums plus what the content's queries gave them; a token
    kept outside the recent window is at least as heavy as every one dropped (the sums kept with the tokens)."""
    context, content = random_prompt(CONTEXT, seed=7), random_prompt(CONTENT, seed=8)
    session, _, _ = prefill(sharp, h2o(), context)
    before = [layer.heads.scores[layer.heads.valid].sum() for layer in session.cache.layers]
    ec.take_in(session, content, "each_call")
    for layer, total in zip(session.cache.layers, before):
        heads = layer.heads
        recent = heads.positions >= int(session.state.seq_len[0]) - 10
        kept = heads.scores.masked_fill(~heads.valid | recent, float("inf")).amin(dim=-1)
        assert (kept > 0).all() and heads.scores[heads.valid].sum() > 0 and total > 0


@pytest.mark.parametrize("make", [lambda: ec.SnapStream(capacity=64, window=8, recent=40),
                                  lambda: ec.StreamingLLM(sink=4, window=60)], ids=["snapstream", "streaming_llm"])
def test_a_ring_takes_in_the_new_contents_share_through_its_ring(llama, make):
    """new_content on a static cache: the content alone cut to its share by the prefill rule, written through the ring
    (the oldest ring tokens go): the fixed slots and the ring tokens that stay bit for bit, the cache at one size."""
    context, content = random_prompt(CONTEXT, seed=7), random_prompt(CONTENT, seed=8)
    session, _, _ = prefill(llama, make(), context)
    session.step(random_prompt(6, seed=9))
    state = session.state
    fixed, ring, start = int(state.fixed[0]), int(state.ring[0]), int(state.seq_len[0])
    before, held = by_position(session), list(map(torch.stack, kept_positions(session)))
    share = ec.share_of(session.policy, CONTENT, CONTEXT)
    assert share < CONTENT
    ec.take_in(session, content, "new_content", share)
    after = list(map(torch.stack, kept_positions(session)))
    written = min(share, ring)
    for old, new, layer in zip(held, after, session.cache.layers):
        assert layer.keys.shape[-2] == fixed + min(ring, old.shape[-1] - fixed + share)  # the real tensors
        assert torch.equal(new[..., :fixed], old[..., :fixed])  # the fixed slots stay
        assert ((new >= start).sum(dim=-1) == written).all()  # the share's last tokens, in the ring
        assert (new[..., -1] == start + CONTENT - 1).all()
        stays = new[:, fixed:][:, : new.shape[-1] - fixed - written]
        assert torch.equal(stays, old[:, old.shape[-1] - stays.shape[-1]:]) and (stays < start).all()  # the newest
    assert ec.cache_tokens(session) <= make().cache_capacity()
    assert assert_stayed_bit_for_bit(before, by_position(session), start) > 0
    assert int(session.state.fixed[0]) == fixed and int(session.state.ring[0]) == ring
    never = appended(llama, make, context, content)
    assert differs([list(layer) for layer in after], kept_positions(never))
    for _ in range(ring + 2):  # decoding goes on through the ring: the cache keeps its one size
        session.step(random_prompt(1, seed=3))
        assert ec.cache_tokens(session) <= make().cache_capacity()


def kvzip() -> ec.Policy:
    return SMALL_POLICIES["kvzip"]()


def test_kvzip_new_content_keeps_the_contents_share_by_its_passes(llama):
    """new_content: KVzip's passes over the new content alone; its tokens keep the share's budget over every layer and
    head (share x layers x KV heads), scored unequally per head; every held token stays, bit for bit."""
    context, content = random_prompt(CONTEXT, seed=7), random_prompt(CONTENT, seed=8)
    session, _, _ = prefill(llama, kvzip(), context)
    session.step(random_prompt(6, seed=9))
    before, start, held = by_position(session), int(session.state.seq_len[0]), ec.cache_tokens(session)
    share = ec.share_of(session.policy, CONTENT, CONTEXT)
    assert share < CONTENT
    ec.take_in(session, content, "new_content", share)
    layers = session.cache.layers
    new = [(layer.heads.valid[0] & (layer.heads.positions[0] >= start)).sum(dim=-1) for layer in layers]
    assert sum(int(count.sum()) for count in new) == share * len(layers) * layers[0].keys.shape[1]
    assert len({int(c) for count in new for c in count}) > 1  # the passes' scores spread it unequally
    assert ec.cache_tokens(session) == held + share
    assert assert_stayed_bit_for_bit(before, by_position(session), start) == held * len(layers) * layers[0].keys.shape[1]


def test_kvzip_each_call_cuts_what_it_holds_and_the_content_to_its_budget(llama):
    """each_call: KVzip's passes over the held text (its ids as the session was fed them) and the new content; every
    layer and head together keep capacity x layers x KV heads, the context's first sink tokens among them. Without
    the fed ids it is one line."""
    context, content = random_prompt(CONTEXT, seed=7), random_prompt(CONTENT, seed=8)
    session, _, _ = prefill(llama, kvzip(), context)
    with pytest.raises(ValueError, match="kept no ids of what it was fed") as raised:
        ec.take_in(session.fork(), content, "each_call")
    assert "\n" not in str(raised.value)
    session = keeps_fed_ids(session, context)
    session.step(random_prompt(6, seed=9))
    ec.take_in(session, content, "each_call")
    layers = session.cache.layers
    assert ec.cache_tokens(session) == 40
    assert sum(int(layer.heads.valid.sum()) for layer in layers) == 40 * len(layers) * layers[0].keys.shape[1]
    for layer in layers:
        assert set(range(4)) <= set(layer.heads.positions[layer.heads.valid].tolist())  # the sinks
    never = appended(llama, kvzip, context, content)
    assert differs(kept_positions(session), kept_positions(never))


def test_kvzip_through_generate_calls(llama):
    """new_content grows by each call's share; each_call (the loop keeps the ids it feeds, ec.keeps_fed_ids) cuts
    the held text and each content back to the budget."""
    context, calls = random_prompt(CONTEXT, seed=7), agent_calls()
    out = ec.generate_calls(llama, context, calls, kvzip(), recompress="each_call", max_new_tokens=NEW, eos_token_id=[])
    assert [s["cache_tokens_compressed"] for s in out.stats][1:] == [40.0, 40.0]
    out = ec.generate_calls(llama, context, calls, kvzip(), recompress="new_content", max_new_tokens=NEW,
                            eos_token_id=[])
    sizes = [s["cache_tokens_compressed"] for s in out.stats]
    assert sizes[2] > sizes[1] > 40


@pytest.mark.parametrize("rule", ["each_call", "new_content"])
def test_full_takes_in_every_token_under_every_rule(llama, rule):
    """The full cache has nothing to compress: every rule appends, the rows' cache_tokens_compressed are every token
    held (the tokens seen so far), and the answers are never's."""
    context, calls = random_prompt(CONTEXT, seed=7), agent_calls()
    out = ec.generate_calls(llama, context, calls, ec.Full(), recompress=rule, max_new_tokens=NEW, eos_token_id=[])
    never = ec.generate_calls(llama, context, calls, ec.Full(), recompress="never", max_new_tokens=NEW, eos_token_id=[])
    for turn, (stats, reference) in enumerate(zip(out.stats, never.stats)):
        assert stats["cache_tokens_after"] == reference["cache_tokens_after"] == stats["tokens_seen"]
        if turn:  # after the content: every token fed so far but the question
            assert stats["cache_tokens_compressed"] == stats["prompt_tokens"] - len(calls[turn][1])
    assert all(torch.equal(a, b) for a, b in zip(out.answers, never.answers))


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
