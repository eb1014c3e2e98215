"""Speculative prefill inside the agent loop (evalkit/compression/spec_calls.py, ``ec.generate_calls(draft=)``): the
draft reads each call on top of its own cache (never the history again) and its choice is the one a draft reading the
whole session from scratch makes; the target prefills exactly the kept tokens at their original positions (its
answers are a plain transformers forward's over them); a draft of another family (another tokenizer) runs; keep=1
gives the answers of no draft token for token; bad settings are one line, in Python and through the CLI."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import torch
from helpers import evalkit
from test_spec_prefill import char_tokenizer
from test_trust import assert_one_line_error
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import evalkit.compression as ec
from evalkit.models import synthetic
from evalkit.models.train_tiny import build_tokenizer
from evalkit.results.tables import read_runs

NEW_TOKENS = 4


def tiny(family, vocab: int, seed: int, hidden: int = 32):
    torch.manual_seed(seed)
    config_class, model_class = family
    config = config_class(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    model = model_class(config).double().eval()
    model.config._attn_implementation = "eager"
    model.generation_config.eos_token_id = None
    return model


LLAMA, QWEN2 = (LlamaConfig, LlamaForCausalLM), (Qwen2Config, Qwen2ForCausalLM)


@pytest.fixture(scope="module", params=["same_family", "cross_family"])
def pair(request):
    """(target, its tokenizer, draft, its tokenizer): a Llama draft over the target's words (same family), or a Llama
    draft reading characters beside a Qwen2 target reading words (two tokenizers)."""
    words = build_tokenizer()
    if request.param == "same_family":
        return tiny(LLAMA, len(words), 0), words, tiny(LLAMA, len(words), 1, hidden=16), words
    chars = char_tokenizer(" ".join(synthetic.vocabulary()) + "?")
    return tiny(QWEN2, len(words), 0), words, tiny(LLAMA, len(chars), 1, hidden=16), chars


def session(tokenizer, calls: int = 4, pairs: int = 16):
    """A session in the target's words: the context ids, the calls (new content, question) and their CallTexts."""
    examples = [synthetic.make_example(random.Random(seed), pairs, 0.3) for seed in range(calls)]
    first = examples[0]["context"] + " " + examples[0]["question"]
    ids, text = ec.call_text(tokenizer, first, len(examples[0]["context"]), add_special_tokens=True)
    context, texts = torch.tensor([ids[: text.content]]), [text]
    turns = [(torch.zeros(0, dtype=torch.long), torch.tensor(ids[text.content:]))]
    for example in examples[1:]:
        ids, text = ec.call_text(tokenizer, f" {example['context']} {example['question']}", 1 + len(example["context"]))
        texts.append(text)
        turns.append((torch.tensor(ids[: text.content]), torch.tensor(ids[text.content:])))
    return context, turns, texts


def run(pair, policy=None, keep: float = 0.3, draft: bool = True, **kwargs):
    target, words, draft_model, draft_words = pair
    context, calls, texts = session(words)
    spec = ec.SpecPrefill(draft=draft_model, draft_tokenizer=draft_words, keep=keep, chunk_size=4, look_ahead_cnt=4,
                          pool_kernel=3)
    drafted = ec.SpecCalls(spec, words, texts) if draft else None
    out = ec.generate_calls(target, context, calls, policy or ec.Full(), max_new_tokens=NEW_TOKENS, eos_token_id=[],
                            draft=drafted, **kwargs)
    return out, drafted, context, calls


def test_the_draft_reads_each_call_once_on_top_of_its_own_cache(pair):
    """Per call the draft runs only what is new (the last answer, the call) and its look-ahead, which it drops again:
    its cache holds every token it read, none twice."""
    draft_model, draft_words = pair[2], pair[3]
    counted = []
    hook = draft_model.register_forward_pre_hook(lambda _, args, kwargs: counted.append(kwargs["input_ids"].shape[1]),
                                                 with_kwargs=True)
    try:
        out, drafted, _, _ = run(pair)
    finally:
        hook.remove()
    reads, said = [], ""
    for turn, (stats, text) in enumerate(zip(out.stats, drafted.calls)):
        new = len(draft_words(said + text.text, add_special_tokens=turn == 0)["input_ids"])
        assert stats["draft_tokens_computed"] == new and 0 <= stats["draft_look_ahead_tokens"] <= 3
        reads.append(new)
        said = pair[1].decode(out.answers[turn].tolist())
    looked = sum(stats["draft_look_ahead_tokens"] for stats in out.stats)
    assert sum(counted) == sum(reads) + looked  # never the history again
    assert drafted.read == drafted.cache.get_seq_length() == sum(reads)


def scratch_choice(spec: ec.SpecPrefill, history: list[int], text: str, said: str, call: ec.CallText, first: bool):
    """The kept content of one call as a draft reading the whole session from scratch (no cache) chooses it."""
    encoded = spec.draft_tokenizer(said + text, add_special_tokens=first, return_offsets_mapping=True)
    sequence, end, rows = torch.tensor([history + encoded["input_ids"]]), len(history) + len(encoded["input_ids"]), []
    eos = ec.stop_token_ids(spec.draft, spec.draft_tokenizer)
    for _ in range(spec.look_ahead_cnt):
        with torch.no_grad():
            out = spec.draft(input_ids=sequence, output_attentions=True)
        attention = torch.stack([a[0, :, -1, :end] for a in out.attentions]).double()
        rows.append(attention / attention.sum(-1, keepdim=True))
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        if int(token) in eos:
            break
        sequence = torch.cat([sequence, token], dim=1)
    scores = torch.stack(rows)
    pooled = torch.nn.functional.avg_pool1d(scores.reshape(-1, 1, end), spec.pool_kernel, stride=1,
                                            padding=spec.pool_kernel // 2).reshape(scores.shape)
    importance = pooled.amax(dim=(1, 2)).mean(dim=0)[len(history):]
    target = [(start + len(said), stop + len(said)) for start, stop in call.offsets[: call.content]]
    kept = spec.choose(ec.map_by_characters(encoded["offset_mapping"], importance.float(), target))
    return kept.tolist(), history + encoded["input_ids"]


def test_each_calls_choice_is_the_one_a_draft_reading_the_whole_session_makes(pair):
    out, drafted, _, _ = run(pair)
    history, said = [], ""
    for turn, call in enumerate(drafted.calls):
        kept, history = scratch_choice(drafted.spec, history, call.text, said, call, turn == 0)
        assert drafted.kept[turn] == kept
        assert out.stats[turn]["spec_kept_tokens"] == len(kept) < call.content
        said = pair[1].decode(out.answers[turn].tolist())


def test_the_target_prefills_exactly_the_kept_tokens_at_their_original_positions(pair):
    """The answers are those of a plain forward of the target over the kept tokens at their positions, the
    questions and the answers so far; each call computes its kept tokens and its question, nothing else."""
    out, drafted, context, calls = run(pair)
    target, ids, positions, cursor = pair[0], [], [], 0
    for turn, (new, question) in enumerate(calls):
        content = context[0] if turn == 0 else new
        ids += [int(content[i]) for i in drafted.kept[turn]] + question.tolist()
        positions += [cursor + i for i in drafted.kept[turn]] + list(range(cursor + len(content),
                                                                           cursor + len(content) + len(question)))
        cursor += len(content) + len(question)
        answer = []
        for _ in range(NEW_TOKENS):
            with torch.no_grad():
                logits = target(input_ids=torch.tensor([ids]), position_ids=torch.tensor([positions])).logits
            answer.append(int(logits[0, -1].argmax()))
            ids, positions, cursor = ids + answer[-1:], positions + [cursor], cursor + 1
        assert out.answers[turn].tolist() == answer
        fed = len(drafted.kept[turn]) + len(question) + (1 if turn else 0)  # the last answer's last token, then
        assert out.stats[turn]["prefill_tokens_computed"] == fed


@pytest.mark.parametrize("history", ["own", "gold"])
def test_keep_all_gives_the_answers_of_no_draft_token_for_token(pair, history):
    policy = ec.SnapKV(capacity=24, window=4, kernel_size=3)
    gold = {"history": history, "gold_answers": [torch.tensor([5, 6, 7])] * 4} if history == "gold" else {}
    drafted, _, _, _ = run(pair, policy, keep=1.0, **gold)
    plain, _, _, _ = run(pair, policy, draft=False, **gold)
    assert [a.tolist() for a in drafted.answers] == [a.tolist() for a in plain.answers]
    for with_draft, without in zip(drafted.stats, plain.stats):
        assert with_draft["prefill_tokens_computed"] == without["prefill_tokens_computed"]
        assert with_draft["spec_kept_tokens"] == with_draft["new_content_tokens"] or with_draft["turn"] == 0
        assert with_draft["time_to_first_token_s"] >= with_draft["draft_seconds"] > 0


def test_bad_settings_are_one_line(pair):
    target, words, draft_model, draft_words = pair
    context, calls, texts = session(words)
    spec = ec.SpecPrefill(draft=draft_model, draft_tokenizer=draft_words)
    asks = [
        (lambda: run(pair, ec.SnapKV(capacity=24, window=4), recompress="each_call"), "session.recompress=never only"),
        (lambda: run(pair, context_positions=torch.arange(context.shape[1])), "give context_positions or draft"),
        (lambda: ec.generate_calls(target, context, [(calls[1][0], calls[0][1]), *calls[1:]], ec.Full(),
                                   draft=ec.SpecCalls(spec, words, texts)), "first call's new content is the context"),
        (lambda: ec.SpecCalls(spec, words, texts).choose(0, None, context[0, :-1]), "disagree"),
        (lambda: ec.SpecCalls(spec, words, texts).choose(1, None, calls[1][0]), "in order"),
        (lambda: ec.SpecCalls(spec, words, []), "non-empty list of CallText"),
        (lambda: ec.CallText("a b", [(0, 1), (2, 3)], 3), "a call's content"),
    ]
    gemma = Gemma3ForCausalLM(Gemma3TextConfig(vocab_size=len(words), hidden_size=16, intermediate_size=32,
                                               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                               head_dim=8, sliding_window=8))
    asks.append((lambda: ec.SpecCalls(ec.SpecPrefill(draft=gemma, draft_tokenizer=words), words, texts),
                 "sliding-window layers"))
    for ask, fragment in asks:
        with pytest.raises(ValueError, match=fragment) as error:
            ask()
        assert "\n" not in str(error.value)


TINY = ("task=agent_loop", "task.mode=multi_turn", "model=kv_retrieval_tiny", "model.max_context=512",
        "task.generation.max_gen_toks=3")


def calls_file(tmp_path) -> str:
    """Two sessions of three calls in the tiny model's words, each call's document 24 words long."""
    rows = [{"session_id": session, "turn": turn, "question": f"k{turn * 10 + 1}", "answer": str(100 + turn),
             "content": " ".join(f"k{turn * 10 + i} v{turn * 10 + i}" for i in range(12))}
            for session in ("a", "b") for turn in (1, 2, 3)]
    path = tmp_path / "calls.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def cli_rows(tmp_path, name: str, *overrides: str):
    results = tmp_path / name
    result = evalkit(*TINY, f"task.dataset.path={calls_file(tmp_path)}", *overrides, f"results_dir={results}",
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    return read_runs(results)[1].sort_values(["session_id", "turn"]).reset_index(drop=True)


def test_the_agent_loop_runs_its_draft_through_the_cli_call_by_call(tmp_path):
    """Every call's row carries the draft's kept tokens and seconds; the target computes a later call's kept tokens
    and its question instead of the whole document; keep=1 gives the predictions of the run without a draft."""
    draft = ("method=spec_prefill", "method.draft_model=builtin:kv_retrieval_tiny", "method.chunk_size=4")
    plain = cli_rows(tmp_path, "plain")
    half = cli_rows(tmp_path, "half", *draft, "method.keep=0.5")
    later = half["turn"] > 1
    assert half["spec_kept_tokens"].notna().all() and (half["draft_seconds"] > 0).all()
    assert (half["time_to_first_token_s"] > half["draft_seconds"]).all()
    assert (half["spec_kept_tokens"][later] == 16).all()  # ceil(7 chunks x 0.5) of the 27-token document
    assert (half["prefill_tokens_computed"][later] == plain["prefill_tokens_computed"][later] - 11).all()
    everything = cli_rows(tmp_path, "all", *draft, "method.keep=1.0")
    assert everything["prediction"].tolist() == plain["prediction"].tolist()
    assert (everything["prefill_tokens_computed"] == plain["prefill_tokens_computed"]).all()


def test_a_recompress_rule_beside_the_loops_draft_is_one_line(tmp_path):
    result = evalkit(*TINY, f"task.dataset.path={calls_file(tmp_path)}", "method=spec_prefill",
                     "method.draft_model=builtin:kv_retrieval_tiny", "+session.recompress=each_call",
                     f"results_dir={tmp_path / 'results'}", cwd=tmp_path)
    assert_one_line_error(result, tmp_path, "session.recompress=each_call does not combine with method=spec_prefill")


BENCH_COMMAND = "python benchmarks/bench_agent_draft.py --sessions 20 --calls 3 --doc-tokens 120 --keep 0.5 --threads 1"
ROOT = Path(__file__).resolve().parents[1]


def bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_agent_draft

    return bench_agent_draft


def test_the_benchmarks_documented_command_parses_and_its_mistakes_are_one_line(tmp_path, capsys):
    module = bench()
    for doc in ("docs/benchmarks.md", "docs/engine.md"):
        assert BENCH_COMMAND in (ROOT / doc).read_text(), doc
    args = module.parse(BENCH_COMMAND.split()[2:])
    assert (args.model, args.draft, args.sessions, args.calls, args.doc_tokens, args.keep, args.threads) == \
        ("gemma3_270m", module.SMOLLM2, 20, 3, 120, 0.5, 1)
    for argv, fragment in ((["--keep", "0"], "--keep must be in (0, 1], got 0.0"),
                           (["--calls", "13"], "--calls must be at least 2 and at most 12, got 13"),
                           (["--sessions", "1"], "--sessions must be at least 2, got 1"),
                           (["--variant", "x"], "invalid choice: 'x'")):
        with pytest.raises(SystemExit) as raised:
            module.parse(argv)
        error = capsys.readouterr().err
        assert raised.value.code == 2 and fragment in error and error.count("\n") == 1, error
    # A setting the harness refuses is one line too, before anything loads.
    assert module.main(["--model", "no_such_model", "--results", str(tmp_path / "bad")]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_the_benchmark_runs_with_and_without_the_draft_side_by_side(tmp_path, capsys):
    """benchmarks/bench_agent_draft.py on the built-in model: both runs, the table per call, the paired interval."""
    module = bench()
    assert module.main(["--model", "kv_retrieval_tiny", "--draft", "builtin:kv_retrieval_tiny", "--max-context", "512",
                        "--sessions", "2", "--calls", "2", "--doc-tokens", "40", "--chunk-size", "4",
                        "--results", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| call | prefill tokens, no draft | with "))
    assert lines[header - 1].startswith("agent_loop (recall) on kv_retrieval_tiny, draft builtin:kv_retrieval_tiny: 2 ")
    calls = [line.split(" | ") for line in lines[header + 2: header + 4]]
    assert [call[0] for call in calls] == ["| 1", "| 2"]
    assert all(int(call[2]) < int(call[1]) for call in calls)  # the target computes fewer tokens with the draft
    assert 0.4 < float(calls[1][3]) < 0.75  # keep 0.5 of the document's chunks of 4
    assert lines[-1].startswith("accuracy: no draft") and "95% interval" in lines[-1] and "over 2 sessions" in lines[-1]
    plain, drafted = (read_runs(tmp_path / name)[1] for name in ("plain", "draft"))
    assert plain["spec_kept_tokens"].isna().all() and drafted["spec_kept_tokens"].notna().all()
