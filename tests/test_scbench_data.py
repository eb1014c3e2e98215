"""SCBench (tasks/scbench): its 12 tasks loaded from fixtures in the hub's schema into per-turn docs, evalkit's own
generators, the official scorers on known right and wrong predictions, the prompts' shape, and the one-line refusals
of bad rows. (benchmarks/parity_scbench.py runs the official code itself beside the port.)"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from evalkit.benchmark import definition
from evalkit.tasks.scbench import generators, scbench, scoring, utils

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures" / "scbench"


def fixture(task: str) -> str:
    return str(FIXTURES / f"scbench_{task}.jsonl")


def docs_of(task: str, **options) -> list[dict]:
    return list(utils.load(task, path=fixture(task), **options)["test"])


def one_line_error(error) -> str:
    text = str(error.value)
    assert "\n" not in text, text
    return text


# -- loading -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("task", scbench.TASKS)
def test_every_task_loads_from_its_fixture_into_one_doc_per_turn(task):
    rows = scbench.read_file(fixture(task))
    docs = docs_of(task)
    turns = [turn for row in rows for turn in row["multi_turns"]]
    assert len(rows) == 2 and len(docs) == len(turns)
    for doc, turn in zip(docs, turns):
        assert json.loads(doc["target"]) == turn["answer"] and doc["answer"] == str(turn["answer"])
        assert doc["input"] == turn["input"] and isinstance(doc["context"], str) and doc["context"]
        assert doc["task"] == turn.get("task", f"scbench_{task}")
        assert doc["length"] == len(doc["context"]) // 4
        assert utils.doc_to_history(doc) == str(turn["answer"])
        assert utils.doc_to_text(doc).endswith(utils.doc_to_question(doc))
        assert set(utils.process_results(doc, [doc["answer"]])) == {scbench.METRICS[task]}
    sessions = {}
    for doc in docs:
        sessions.setdefault(doc["session_id"], []).append(doc)
    assert len(sessions) == 2
    for session in sessions.values():
        assert [doc["turn"] for doc in session] == list(range(1, len(session) + 1))
        parts = {utils.doc_to_text(d).removesuffix(utils.doc_to_question(d)) for d in session}
        assert parts == {scbench.context_part(session[0])}  # the context part is the session's, turn after turn


def test_ids_come_from_the_rows_or_their_positions_and_the_context_from_a_rows_input():
    assert [d["session_id"] for d in docs_of("kv")] == ["0"] * 3 + ["1"] * 2
    assert [d["session_id"] for d in docs_of("prefix_suffix")] == ["0"] * 2 + ["1"] * 3  # the rows carry no id
    vt = docs_of("vt")
    assert vt[0]["context"] == scbench.read_file(fixture("vt"))[0]["input"]  # vt rows hold the context as `input`
    assert utils.doc_to_history(vt[0]) == "['QWERT', 'ASDFG', 'POIUY']"  # the answer list as str() writes it


def test_the_prompts_are_the_official_templates():
    kv = docs_of("kv")[1]
    assert utils.doc_to_text(kv) == ("Extract the value corresponding to the specified key in the JSON object below."
                                     f"\n\n{kv['context']}\n\n{kv['input']}")
    assert utils.doc_to_follow_up(kv) == kv["input"] and utils.doc_to_follow_up_plain(kv) == "\n\n" + kv["input"]
    choice = docs_of("choice_eng")[0]
    question = ("Question: What did the storm destroy?\nA. The ferry\nB. The lamp's lens\nC. The letters\n"
                "D. Port Ellen\n\n")
    assert utils.doc_to_text(choice) == (f"Read the book and answer the question.\n\n{choice['context']}\n\n{question}"
                                         "The the correct answer is")
    assert utils.doc_to_follow_up(choice) == question + "The the correct answer is"
    assert utils.doc_to_follow_up_plain(choice) == f"\n\n{question}The letter of the correct answer is"
    chn = docs_of("qa_chn")[0]
    assert utils.doc_to_text(chn) == f"阅读以下书籍然后回答问题。\n\n{chn['context']}\n\n问题：书店叫什么名字？\n答案："
    summary = docs_of("summary")
    assert [utils.doc_to_follow_up_prefix(d) for d in summary] == ["", "This paper", "", "This paper"]


def test_mf_prompts_name_their_target_and_the_chat_follow_ups_the_last_turns():
    first, second, third = docs_of("mf")[:3]
    numbers = "[31, 7, 88, 12, 55, 3, 70, 41, 19]"
    assert utils.doc_to_text(first) == (f"What is the largest number of the list?\n\n{numbers}\n\n"
                                        "The largest number of the list is: ")
    assert utils.doc_to_question(second) == ("\n\nWhat is the smallest number of the list?\n\n"
                                             "The smallest number of the list is: ")
    # the official chat follow-up reuses the session's last turn's prefix (a stale loop variable)
    assert utils.doc_to_follow_up(second) == "What is the median of the list?\n\nThe smallest number of the list is: "
    assert utils.doc_to_follow_up_plain(second) == utils.doc_to_question(second)
    assert utils.doc_to_history(third) == "31"


def test_hub_and_file_rows_are_cut_to_their_first_turns_as_row_0_decides(tmp_path):
    long = {"id": 0, "context": "c", "multi_turns": [{"input": f"q{i}", "answer": f"a{i}"} for i in range(7)]}
    short = {**long, "id": 1, "multi_turns": long["multi_turns"][:3]}
    assert len(scbench.rows_to_docs([long, short], "qa_eng", 5)) == 5 + 3
    assert len(scbench.rows_to_docs([short, long], "qa_eng", 5)) == 3 + 7  # run_scbench.py looks at row 0 only
    assert len(scbench.rows_to_docs([long], "qa_eng", 0)) == 7
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([long, short]))
    assert len(utils.load("qa_eng", path=str(path), turns=2)["test"]) == 4


# -- generators --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("task", generators.SYNTHETIC)
def test_the_generators_are_deterministic_in_the_schema_and_sized_by_lengths(task):
    rows = generators.generate(task, [256, 1024], n_sessions=2, turns=3, seed=7)
    assert rows == generators.generate(task, [256, 1024], n_sessions=2, turns=3, seed=7)
    assert rows != generators.generate(task, [256, 1024], n_sessions=2, turns=3, seed=8)
    assert [row["length"] for row in rows] == [256, 256, 1024, 1024] and len({row["id"] for row in rows}) == 4
    for row in rows:
        scbench.check_row(row, task)
        assert set(row) == {"id", "context", "multi_turns", "length"} and len(row["multi_turns"]) == 3
        assert 0.75 <= len(str(row["context"])) / (4 * row["length"]) <= 1.25
        for turn in row["multi_turns"]:
            _assert_answerable(task, row["context"], turn)
    docs = list(utils.load(task, lengths=[512], n_sessions=3, turns=4)["test"])  # source auto: generated
    assert len(docs) == 12 and {d["length"] for d in docs} == {512} and [d["turn"] for d in docs[:4]] == [1, 2, 3, 4]


def _assert_answerable(task, context, turn):
    """The gold answer follows from the context."""
    if task == "kv":
        key = turn["input"].split('"')[1]
        assert json.loads(context.removeprefix("JSON data:\n"))[key] == turn["answer"]
    elif task == "prefix_suffix":
        prefix, suffix = turn["input"].split('"')[1], turn["input"].split('"')[3]
        assert [s for s in context.split("\n") if s.startswith(prefix) and s.endswith(suffix)] == [turn["answer"]]
    elif task == "vt":
        value = turn["input"].split("the value ")[1].split(" ")[0]
        chain = turn["answer"]
        assert len(chain) == 5 and f"VAR {chain[0]} = {value}" in context
        assert all(f"VAR {b} = VAR {a} " in context for a, b in zip(chain, chain[1:]))
    else:
        ordered = sorted(context)
        name = turn["input"].removeprefix("The ").removesuffix(" of the list is: ")
        assert generators.MF_STATISTICS[name](ordered) == turn["answer"] and len(context) % 2 == 1


# -- scorers ---------------------------------------------------------------------------------------------------------
def score(task, index, prediction):
    doc = docs_of(task)[index]
    return utils.process_results(doc, [prediction])[scbench.METRICS[task]]


@pytest.mark.parametrize("task, index, prediction, expected", [
    ("kv", 0, None, 1.0), ("kv", 0, "I am not sure.", 0.0), ("kv", 1, "The value: <uuid>", 0.0),
    ("prefix_suffix", 0, "The string is Qx7kab3Lmn0pZZ9w.", 1.0), ("prefix_suffix", 0, "Mn9pQx7kRs0tZZ9w", 0.0),
    ("vt", 0, "QWERT, ASDFG, POIUY", 1.0), ("vt", 0, "qwert and asdfg", 0.67), ("vt", 0, "none", 0.0),
    ("qa_eng", 0, "ELEVEN winters", 1.0), ("qa_eng", 0, "twelve", 0.0),
    ("qa_chn", 0, "晨光书屋", 0.4), ("qa_chn", 0, "晨", 1.0), ("qa_chn", 0, "苏州", 0.0),  # F1 per answer character
    ("choice_eng", 0, "B", 1.0), ("choice_eng", 0, "A. The ferry", 0.0), ("choice_eng", 0, "The lamp's lens", 1.0),
    ("choice_eng", 0, "The answer is B", 1.0), ("choice_eng", 0, "I think A", 0.0),
    ("many_shot", 0, "(A)", 1.0), ("many_shot", 0, "(B)", 1.0), ("many_shot", 0, "B", 0.0),  # any answer character
    ("mf", 0, "88", 1.0), ("mf", 0, "The answer is 88.", 1.0), ("mf", 0, "-88", 1.0), ("mf", 0, "88.9", 1.0),
    ("mf", 0, "87", 0.0), ("mf", 0, "", 0.0),
    ("summary", 1, "The experiments evaluate eight models.", 0.7692307692307693), ("summary", 1, "", 0.0),
    ("summary_with_needles", 1, "The pass key is 70431.", 1.0), ("summary_with_needles", 1, "704310", 0.0),
    ("summary_with_needles", 0, None, 1.0),
    ("repoqa_and_kv", 1, None, 1.0), ("repoqa_and_kv", 1, "no idea", 0.0),
])
def test_each_scorer_gives_the_official_score(task, index, prediction, expected):
    if prediction is None:  # the gold answer itself
        prediction = docs_of(task)[index]["answer"]
    assert score(task, index, prediction) == pytest.approx(expected)


def test_repoqa_needs_the_asked_function_at_bleu_0_8():
    docs = docs_of("repoqa")
    asked, other = docs[0], docs[1]
    assert score("repoqa", 0, f"Here it is:\n```python\n{asked['answer']}\n```") == 1.0
    assert score("repoqa", 0, f"```python\nimport os\n\n{asked['answer']}\n```") == 1.0  # the function, found
    assert score("repoqa", 0, f"```python\n{other['answer']}\n```") == 0.0
    # a block of several functions stands for its first one: the asked one here, another one there
    assert score("repoqa", 0, f"```python\n{asked['context']}\n```") == 1.0
    assert score("repoqa", 2, f"```python\n{asked['context']}\n```") == 0.0
    assert [n["name"] for n in json.loads(asked["needles"])] == [
        "get_auth_from_url", "to_native_string", "urldefragauth", "get_auth_from_url"]  # every turn's, by repo
    kv = docs_of("repoqa_and_kv")
    assert [n["name"] for n in json.loads(kv[0]["needles"])] == ["urldefragauth", "to_native_string"]


def test_the_ported_bleu_and_rouge_match_nltk_and_rouge_score_values():
    assert scoring.sentence_bleu("a b c d e f".split(), "a b c d".split()) == pytest.approx(math.exp(-0.5))
    assert scoring.sentence_bleu("a b c d".split(), "a b x y".split()) == pytest.approx(0.16821895003341453)
    assert scoring.sentence_bleu("a b".split(), "c d".split()) == 0
    hypothesis, reference = "It was warm, the cat sat.\nOn a mat!", "The cat sat on the mat.\nIt was warm."
    assert scoring.score_rouge_lsum(hypothesis, reference) == pytest.approx(0.8888888888888888)


# -- refusals ----------------------------------------------------------------------------------------------------------
TURN = {"input": "q", "answer": "a"}


@pytest.mark.parametrize("task, row, field", [
    ("qa_eng", {"id": 7, "multi_turns": [TURN]}, "'context'"),
    ("qa_eng", {"id": 7, "context": "c"}, "'multi_turns'"),
    ("qa_eng", {"id": 7, "context": "c", "multi_turns": []}, "'multi_turns'"),
    ("qa_eng", {"id": 7, "context": "c", "multi_turns": [TURN, {"answer": "a"}]}, "'multi_turns[1].input'"),
    ("kv", {"id": 7, "context": "c", "multi_turns": [{"input": "q"}]}, "'multi_turns[0].answer'"),
    ("choice_eng", {"id": 7, "context": "c", "multi_turns": [{**TURN, "options": ["b", "c", "d", "e"]}]},
     "'multi_turns[0].answer'"),
    ("mf", {"id": 7, "context": [1, 2], "multi_turns": [{"input": "Largest?", "answer": 2}]}, "'multi_turns[0].input'"),
    ("repoqa", {"id": 7, "context": "c", "lang": "cobol", "repo": "r", "multi_turns": [TURN]}, "'lang'"),
    ("summary_with_needles", {"id": 7, "context": "c", "multi_turns": [TURN]}, "'multi_turns[0].task'"),
])
def test_a_bad_row_is_a_one_line_error_naming_its_id_and_field(task, row, field):
    good = scbench.read_file(fixture(task))[0]
    with pytest.raises(ValueError) as error:
        scbench.rows_to_docs([good, row], task)
    text = one_line_error(error)
    assert "row 2 (id=7)" in text and field in text


def test_bad_rows_in_a_file_are_refused_or_skipped(tmp_path):
    from evalkit.benchmark.data import collecting_skipped_rows

    path = tmp_path / "rows.jsonl"
    rows = [{"id": 1, "context": "c", "multi_turns": [TURN]}, {"id": 2, "context": "c", "multi_turns": []},
            {"id": 1, "context": "d", "multi_turns": [TURN]}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(ValueError) as error:
        utils.load("qa_eng", path=str(path))
    assert "row 2 (id=2): field 'multi_turns'" in one_line_error(error)
    with collecting_skipped_rows() as skipped:
        docs = utils.load("qa_eng", path=str(path), bad_rows="skip")["test"]
    assert [d["session_id"] for d in docs] == ["1"] and len(skipped) == 2  # the empty row, and the repeated id
    path.write_text('{"id": 1}\nnot json\n')
    with pytest.raises(ValueError) as error:
        utils.load("qa_eng", path=str(path))
    assert "line 2: not valid JSON" in one_line_error(error)


@pytest.mark.parametrize("error_type", [ConnectionError, FileNotFoundError])
def test_an_unreachable_hub_names_the_local_file_way_out(monkeypatch, error_type):
    import datasets

    def unreachable(*args, **kwargs):
        raise error_type("Couldn't reach 'microsoft/SCBench' on the Hub (LocalEntryNotFoundError)\nretries: 5")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    with pytest.raises(error_type) as error:
        utils.load("qa_eng")
    assert "task.dataset.path=/path/to/scbench_qa_eng.jsonl" in one_line_error(error)


@pytest.mark.parametrize("options, fragment", [
    ({"source": "generated"}, "task.dataset.source=generated is for kv, prefix_suffix, vt, mf only"),
    ({"source": "file"}, "task.dataset.source=file needs task.dataset.path"),
    ({"source": "web"}, "task.dataset.source must be one of auto, generated, hub, file"),
    ({"source": "file", "path": "/nonexistent/rows.jsonl"}, "no such file: /nonexistent/rows.jsonl"),
])
def test_a_mistaken_source_is_one_line(options, fragment):
    with pytest.raises((ValueError, FileNotFoundError)) as error:
        utils.load("qa_eng", **options)
    assert fragment in one_line_error(error)


# -- the task files -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("task", scbench.TASKS)
def test_each_task_has_its_yaml_and_its_hydra_group(task):
    config = definition.read(ROOT / "tasks" / "scbench" / f"scbench_{task}.yaml")
    assert config["task"] == f"scbench_{task}" and config["doc_to_target"] == "target"
    assert config["dataset_kwargs"] == {"task": task, "source": "auto", "path": None, "revision": None,
                                        "lengths": [1024], "n_sessions": 10, "turns": 5, "seed": 1234}
    assert config["generation_kwargs"] == {"until": [], "max_gen_toks": scbench.max_gen_toks(task), "do_sample": False}
    assert [m["metric"] for m in config["metric_list"]] == [scbench.METRICS[task]]
    assert config["metadata"]["sessions"] is True and config["metadata"]["primary_metric"] == scbench.METRICS[task]
    conf = (ROOT / "conf" / "task" / f"scbench_{task}.yaml").read_text()
    assert f"name: scbench_{task}\n" in conf and "${task_default:dataset_kwargs.path}" in conf
    kwargs = config["dataset_kwargs"]
    hub = task not in generators.SYNTHETIC
    assert utils.dataset_sources(kwargs) == ("microsoft/SCBench" if hub else None)
    assert utils.dataset_sources({**kwargs, "source": "hub"}) == "microsoft/SCBench"
    assert utils.dataset_identity(kwargs) == f"evalkit-scbench-generator-v1:{task}"
