"""The agent_loop task (tasks/agent_loop): each call's question needs facts of the calls so far (recall) or of the
first and the latest document (first_latest); a call's prompt is the shared context, the documents so far and its
question, and its multi_turn follow-up is its new document, then its question; a file of calls runs through the CLI
under task.mode=single and multi_turn, and one missing a call or a call's content is one line, nothing written."""

from __future__ import annotations

import json

import pytest
from helpers import evalkit
from test_trust import assert_one_line_error

from evalkit.lm.prompts import context_end
from evalkit.results.tables import read_runs
from evalkit.tasks.agent_loop import agent_loop, utils

TINY = ("model=kv_retrieval_tiny", "model.max_context=512")


def docs(variant: str, calls: int = 4) -> list[dict]:
    return agent_loop.docs_of(agent_loop.sessions_of(agent_loop.build_calls(calls, 2, 120, variant, 7), "generated"))


def test_a_recall_question_names_a_fact_of_a_call_so_far():
    built = docs("recall", 6)
    assert {doc["turn"] for doc in built} == set(range(1, 7)) and len({doc["session_id"] for doc in built}) == 2
    assert any(doc["asked"] < doc["turn"] for doc in built)  # later calls reach back into the pile
    for doc in built:
        session = {other["turn"]: other for other in built if other["session_id"] == doc["session_id"]}
        door = doc["question"].split("of the ")[1].split(" door")[0]
        planted = agent_loop.CODE.format(door=door, code=doc["answer"])
        assert doc["asked"] <= doc["turn"] and planted in session[doc["asked"]]["content"]
        assert [turn for turn, other in session.items() if planted in other["content"]] == [doc["asked"]]


def test_a_first_latest_question_needs_the_first_document_and_the_latest():
    for doc in docs("first_latest"):
        first = next(other for other in docs("first_latest")
                     if other["session_id"] == doc["session_id"] and other["turn"] == 1)
        door = doc["question"].split("that the ")[1].split(" door")[0]
        lead = next(sentence for sentence in first["content"].split(". ") if f"The {door} door leads" in sentence)
        room = lead.split("to the ")[1].split(" room")[0]
        assert agent_loop.ROOM_CODE.format(room=room, code=doc["answer"]) in doc["content"]
        if doc["turn"] > 1:  # the latest document names the room, not the door; the first one, not the code
            assert f"The {door} door" not in doc["content"] and f"The code of the {room} room" not in first["content"]


def test_a_calls_prompt_is_the_shared_context_the_documents_so_far_and_its_question():
    built = [doc for doc in docs("recall") if doc["session_id"] == "recall-0"]
    for doc in built:
        prompt = utils.doc_to_text(doc)
        assert prompt.startswith(doc["context"]) and doc["context"] == built[0]["context"]
        assert prompt[: context_end(prompt, utils.doc_to_question(doc))] == doc["context"]
        shown = [prompt.index(agent_loop.tool_output(k, built[k - 1]["content"])) for k in range(1, doc["turn"] + 1)]
        assert shown == sorted(shown) and prompt.endswith(agent_loop.question_part(doc["question"]))
        follow = utils.doc_to_follow_up(doc)
        assert follow == utils.doc_to_new_content(doc) + agent_loop.question_part(doc["question"])
        assert (utils.doc_to_new_content(doc) == "") == (doc["turn"] == 1)


def write_calls(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def file_rows() -> list[dict]:
    """Two sessions of calls in the file's schema, their contents in the tiny model's own words."""
    rows = []
    for session in ("a", "b"):
        for turn in (1, 2, 3):
            rows.append({"session_id": session, "turn": turn, "content": f"k{turn} v{turn} k{turn + 3} v{turn + 3}",
                         "question": f"k{turn}", "answer": str(100 + turn)})
    return rows


@pytest.mark.parametrize("mode", ["single", "multi_turn"])
def test_a_file_of_calls_runs_through_the_cli_with_a_subset_per_call(tmp_path, mode):
    path = write_calls(tmp_path / "calls.jsonl", file_rows())
    results = tmp_path / "results"
    result = evalkit("task=agent_loop", f"task.dataset.path={path}", f"task.mode={mode}", *TINY,
                     "task.generation.max_gen_toks=3", f"results_dir={results}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    metrics, samples = read_runs(results)
    assert sorted(samples["turn"]) == [1, 1, 2, 2, 3, 3] and set(samples["session_id"]) == {"a", "b"}
    assert {"1", "2", "3"} <= set(metrics["subset"].dropna())
    later = samples[samples["turn"] > 1]
    if mode == "multi_turn":  # the context is computed once per session; a later call runs its own tokens only
        assert (later["prefill_tokens_shared"] > 0).all()
    else:
        assert (samples.groupby("turn")["prompt_tokens"].mean().diff().dropna() > 0).all()  # the pile grows


@pytest.mark.parametrize("change, fragment", [
    (lambda rows: [row for row in rows if not (row["session_id"] == "b" and row["turn"] == 2)],
     "session b: call 2 is missing (its calls: [1, 3])"),
    (lambda rows: [{**row, "content": " "} if row["turn"] == 3 and row["session_id"] == "a" else row for row in rows],
     "session a, call 3 has no content"),
])
def test_a_file_missing_a_call_or_a_calls_content_is_one_line_and_nothing_written(tmp_path, change, fragment):
    path = write_calls(tmp_path / "calls.jsonl", change(file_rows()))
    result = evalkit("task=agent_loop", f"task.dataset.path={path}", "task.mode=multi_turn", *TINY,
                     f"results_dir={tmp_path / 'results'}", cwd=tmp_path)
    assert_one_line_error(result, tmp_path, str(path), fragment)


def test_each_recompress_rule_runs_through_the_cli_and_its_rows_say_what_the_cache_held(tmp_path):
    """The harness hands a call's new content to the rule: never appends (the rows of a run without the setting),
    each_call holds the cache at one size once the documents exceed it, new_content grows by each call's share."""
    path = write_calls(tmp_path / "calls.jsonl", file_rows())
    runs = {}
    for rule in ("", "never", "each_call", "new_content"):
        results = tmp_path / (rule or "plain")
        result = evalkit("task=agent_loop", f"task.dataset.path={path}", "task.mode=multi_turn", *TINY,
                         "method=snapkv", "method.window=4", "+budget=tokens_24", "task.generation.max_gen_toks=3",
                         *([f"+session.recompress={rule}"] if rule else []), f"results_dir={results}", cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-2000:]
        runs[rule] = read_runs(results)[1].sort_values(["session_id", "turn"]).reset_index(drop=True)
    assert runs["never"]["prediction"].tolist() == runs[""]["prediction"].tolist()
    held = {rule: runs[rule]["cache_tokens_after"].tolist() for rule in ("each_call", "new_content")}
    assert set(runs["each_call"]["session_recompress"]) == {"each_call"}
    assert (runs["new_content"]["new_content_tokens"][runs["new_content"]["turn"] > 1] > 0).all()
    later = runs["each_call"]["turn"] > 1  # the budget, then the call's question and answer: one size every call
    assert runs["each_call"]["cache_tokens_after"][later].nunique() == 1
    assert sum(held["new_content"]) > sum(held["each_call"])  # each call's share stays: the cache grows
    # never appends (in the engine's chats): every call's content and answer stay, so the cache grows call by call
    # past new_content's, and a call's row says what it held: the kept prompt, then every token fed since
    never = runs["never"]
    for _, session in never.groupby("session_id"):
        assert session["cache_tokens_after"].is_monotonic_increasing and session["cache_tokens_after"].nunique() > 1
    assert never["cache_tokens_after"].sum() > sum(held["new_content"])
    first = never[never["turn"] == 1]
    assert (first["cache_tokens_after"] == first["kept_prompt_tokens"] + first["generated_tokens"] - 1).all()


def test_the_agent_loop_table_reads_a_sweeps_runs_and_prints_accuracy_by_call_per_rule(tmp_path, capsys):
    """benchmarks/agent_loop_table.py --skip-runs over runs the CLI wrote: a row per (method, rule), accuracy per call
    and the mean cache_tokens_after, each with its interval over sessions; its mistakes are one line, exit 2."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import agent_loop_table

    path = write_calls(tmp_path / "calls.jsonl", file_rows())
    results = tmp_path / "results"
    for rule in ("never", "each_call"):
        result = evalkit("task=agent_loop", f"task.dataset.path={path}", "task.mode=multi_turn", *TINY,
                         "method=snapkv", "method.window=4", "+budget=tokens_24", "task.generation.max_gen_toks=3",
                         f"+session.recompress={rule}", f"results_dir={results}", cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-2000:]
    samples = read_runs(results)[1]
    assert agent_loop_table.main(["--skip-runs", "--results", str(results), "--methods", "snapkv"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "| method | rule | sessions | call 1 | call 2 | call 3 | cache_tokens_after |"
    rows = {tuple(cell.strip() for cell in line.strip("|").split("|")[:3]) for line in lines[2:]}
    assert rows == {("snapkv", "never", "2"), ("snapkv", "each_call", "2")}
    each = samples[samples["session_recompress"] == "each_call"]
    mean = each["cache_tokens_after"].mean()
    assert any(line.startswith("| snapkv | each_call |") and line.split("|")[-2].strip().startswith(f"{mean:.2f}"
                                                                                                    .rstrip("0").rstrip("."))
               for line in lines)
    for argv, fragment in ((["--skip-runs", "--results", str(tmp_path / "none")], "no results under"),
                           (["--skip-runs", "--results", str(results), "--methods", "h2o"], "no agent_loop runs of h2o")):
        assert agent_loop_table.main(argv) == 2
        assert fragment in capsys.readouterr().err
    with pytest.raises(SystemExit) as raised:
        agent_loop_table.main(["--skip-runs", "--methods", "quest"])
    assert raised.value.code == 2 and "unknown methods ['quest']" in capsys.readouterr().err
