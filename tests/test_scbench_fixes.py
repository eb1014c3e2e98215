"""SCBench (tasks/scbench) beside its official code, where it once left it: RepoQA's function extraction without
tree-sitter (held to tree-sitter's text, which the tree-sitter side checks where it is installed) and the extractor
each RepoQA row records; RepoQA's candidates under lm-eval's ``limit`` (the docs evaluated, not every loaded one);
the prefill columns of a single request; generated sessions made as lm-eval reads them."""

from __future__ import annotations

import json
from pathlib import Path

import lm_eval
import pytest
from helpers import evalkit
from lm_eval.api.model import LM

from evalkit.benchmark import task_of
from evalkit.results.tables import read_table
from evalkit.run.tasks import task_manager, task_object
from evalkit.tasks.scbench import generated_docs, generators, scbench, scoring, utils

FIXTURES = Path(__file__).parent / "fixtures" / "scbench"

# (block, the function tree-sitter's query captures first, as repo_qa_utils.sanitize_output takes it)
JAVA = {
    "abstract declaration before the method": (
        "public abstract class Shape {\n    public abstract double area();\n\n    public double twice() {\n"
        "        return 2 * area();\n    }\n}", "public abstract double area();"),
    "bare constructor": ("public Point(int x, int y) {\n    this.x = x;\n    this.y = y;\n}",
                         "public Point(int x, int y) {\n    this.x = x;\n    this.y = y;\n}"),
    "bare constructor, then a method": ("public Point(int x) {\n    this.x = x;\n}\n\npublic int getX() {\n    return x;\n}",
                                        "public Point(int x) {\n    this.x = x;\n}"),
    "annotated bare constructor": ("@Inject\npublic Service(Repo repo) {\n    this.repo = repo;\n}",
                                   "@Inject\npublic Service(Repo repo) {\n    this.repo = repo;\n}"),
    "constructor inside a class": (
        "public class Point {\n    public Point(int x) {\n        this.x = x;\n    }\n\n    public int getX() {\n"
        "        return x;\n    }\n}", "public int getX() {\n        return x;\n    }"),
    "constructor inside an enum": (
        "enum Kind {\n    ROUND(\"r\");\n    private final String code;\n    Kind(String code) { this.code = code; }\n"
        "    public String code() { return code; }\n}", "public String code() { return code; }"),
    "interface method": ("interface Shape {\n    double area();\n    default double twice() {\n        return 2 * area();\n"
                         "    }\n}", "double area();"),
    "native declaration": ("private static native long alloc(int size) throws OutOfMemoryError;\nstatic int f() { return 1; }",
                           "private static native long alloc(int size) throws OutOfMemoryError;"),
    "record": ("public record Pair(int a, int b) {\n    int sum() { return a + b; }\n}", "int sum() { return a + b; }"),
    "a call, not a constructor": ("public Point(x) {\n    this.x = x;\n}\nint getX() { return x; }",
                                  "int getX() { return x; }"),
    "constructor without modifiers": ("Point(int x) {\n    this.x = x;\n}", None),
    "braces in strings and comments": ("public String brace() {\n    // }\n    return \"}\" + '{';\n}",
                                       "public String brace() {\n    // }\n    return \"}\" + '{';\n}"),
    "generic method": ("@Override\npublic <T extends Comparable<T>> T max(List<T> items) {\n    return Collections.max(items);"
                       "\n}", "@Override\npublic <T extends Comparable<T>> T max(List<T> items) {\n"
                       "    return Collections.max(items);\n}"),
}
PYTHON = {
    "the first of two": ("import os\n\ndef helper(x):\n    return x + 1\n\ndef main():\n    pass",
                         "def helper(x):\n    return x + 1"),
    "decorated method": ("class A:\n    @staticmethod\n    def f(x):\n        return x\n", "def f(x):\n        return x"),
    "async": ("async def fetch(url):\n    return await get(url)", "async def fetch(url):\n    return await get(url)"),
    "signature over lines": ("def f(\n    a,\n    b,\n):\n    return a + b\n\nx = 1", "def f(\n    a,\n    b,\n):\n    return a + b"),
    "one line": ("def f(x): return x\nprint(f(1))", "def f(x): return x"),
    "no function": ("x = 1\nprint(x)", None),
}
SNIPPETS = [pytest.param("java", *case, id=f"java: {name}") for name, case in JAVA.items()] + [
    pytest.param("python", *case, id=f"python: {name}") for name, case in PYTHON.items()]
needs_tree_sitter = pytest.mark.skipif(scoring.TREE_SITTER is None, reason="needs pip install -e '.[scbench]'")


# -- RepoQA's function extraction ------------------------------------------------------------------------------------
@pytest.mark.parametrize("lang, block, captured", SNIPPETS)
def test_the_fallback_extracts_the_function_tree_sitter_captures(lang, block, captured):
    assert scoring.first_function(block, lang, "fallback") == captured
    # a block without a function stands for itself, as the official sanitize_output has it
    assert scoring.sanitize_output(f"```{lang}\n{block}\n```", lang, "fallback") == (captured or block + "\n")


@needs_tree_sitter
@pytest.mark.parametrize("lang, block, captured", SNIPPETS)
def test_tree_sitter_captures_what_the_fallback_is_held_to(lang, block, captured):
    assert scoring.first_function(block, lang, "tree-sitter") == captured


@pytest.mark.skipif(scoring.TREE_SITTER is not None, reason="tree-sitter is installed here")
def test_asking_for_tree_sitter_where_it_is_not_installed_says_how_to_install_it():
    assert scoring.CODE_EXTRACTOR == "fallback"
    with pytest.raises(RuntimeError, match=r"pip install -e '\.\[scbench\]'"):
        scoring.first_function("def f():\n    pass", "python", "tree-sitter")


def test_every_repoqa_turn_records_the_extractor_that_scores_it():
    for task in ("repoqa", "repoqa_and_kv"):
        docs = list(utils.load(task, path=str(FIXTURES / f"scbench_{task}.jsonl"))["test"])
        assert {doc["code_extractor"] for doc in docs if doc["task"] == "scbench_repoqa"} == {scoring.CODE_EXTRACTOR}
        assert all(doc["code_extractor"] is None for doc in docs if doc["task"] != "scbench_repoqa")


# -- RepoQA's candidates: the docs evaluated ---------------------------------------------------------------------------
ASKED = '''def moving_average(values, window):
    """The mean of each run of window values."""
    if window <= 0:
        raise ValueError("window must be positive")
    totals, running = [], 0.0
    for index, value in enumerate(values):
        running += value
        if index >= window:
            running -= values[index - window]
        if index >= window - 1:
            totals.append(running / window)
    return totals'''
NEIGHBOUR = ASKED.replace("moving_average", "moving_average_checked").replace("if window <= 0", "if window < 1")


class FixedAnswer(LM):
    """A stand-in model: every request is answered with the same text (what is held here is the scoring)."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        return [self.text] * len(requests)

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError


def test_repoqa_picks_its_best_match_among_the_evaluated_turns_only(tmp_path):
    """Two sessions of one repo ask two near-identical functions; every answer is the second one. With limit=1
    only the first is evaluated: the official pool (that one prediction's repo) holds the asked function alone,
    which the answer matches at BLEU 0.9; every loaded turn's pool would hold the answer itself, a better match of
    another name (score 0)."""
    assert 0.8 <= scoring.function_similarity(NEIGHBOUR, ASKED) < 1
    rows = [{"id": name, "context": f"{ASKED}\n\n\n{NEIGHBOUR}", "lang": "python", "repo": "demo/stats",
             "multi_turns": [{"input": f"The function named {name}.", "answer": code, "name": name}]}
            for name, code in (("moving_average", ASKED), ("moving_average_checked", NEIGHBOUR))]
    path = tmp_path / "scbench_repoqa.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = task_of("scbench_repoqa").config({"dataset": {"path": str(path)}})
    answer = FixedAnswer(f"Here it is:\n```python\n{NEIGHBOUR}\n```")

    def evaluate(limit):
        return lm_eval.simple_evaluate(model=answer, tasks=[task_object(config)], task_manager=task_manager(),
                                       limit=limit, log_samples=True)

    limited, whole = evaluate(1), evaluate(None)
    assert limited["results"]["scbench_repoqa"]["pass_at_1,none"] == 1.0
    assert [s["pass_at_1"] for s in whole["samples"]["scbench_repoqa"]] == [0.0, 1.0]  # the answer is the 2nd's
    assert [s["filtered_resps"] for s in limited["samples"]["scbench_repoqa"]] == [[answer.text]]
    assert limited["samples"]["scbench_repoqa"][0]["doc"]["code_extractor"] == scoring.CODE_EXTRACTOR
    # a doc alone (no filter) is scored against every loaded turn's function, as before
    first = scbench.rows_to_docs(rows, "repoqa")[0]
    assert utils.process_results(first, [answer.text]) == {"pass_at_1": 0.0}


# -- the prefill columns of a single request -------------------------------------------------------------------------
def test_a_single_requests_row_says_it_computed_its_whole_prompt_and_shared_nothing(tmp_path):
    result = evalkit("task=kv_retrieval", "limit=2", f"results_dir={tmp_path / 'results'}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    samples = read_table(tmp_path / "results", "samples")
    assert len(samples) == 2 and samples["prompt_tokens"].gt(0).all()
    assert samples["prefill_tokens_computed"].tolist() == samples["prompt_tokens"].tolist()
    assert samples["prefill_tokens_shared"].tolist() == [0, 0]


# -- generated sessions, made as they are read -------------------------------------------------------------------------
def test_lm_evals_limit_generates_only_the_sessions_it_reads():
    task = task_object(task_of("scbench_kv").config({"dataset": {"n_sessions": 200_000}}))
    docs = [doc for _, doc in task.doc_iterator(limit=4)]
    assert len(task.eval_docs) == 1_000_000 and task.eval_docs.sessions_made == 1
    first = scbench.rows_to_docs(generators.generate("kv", [1024], 1, 5, 1234), "kv")
    assert docs == first[:4]


@pytest.mark.parametrize("task", generators.SYNTHETIC)
def test_generated_docs_are_the_rows_docs_in_their_order_holding_a_few_sessions_at_a_time(task):
    rows = generators.generate(task, [96, 128], n_sessions=40, turns=3, seed=5)
    expected = scbench.rows_to_docs(rows, task, 3)
    docs = utils.load(task, lengths=[96, 128], n_sessions=40, turns=3, seed=5)["test"]
    assert len(docs) == len(expected) == 240 and list(docs.features) == list(expected[0])
    assert list(docs) == expected  # a pass over every doc: each session made once, the latest few kept
    assert docs.sessions_made == 80 and len(docs._kept) == generated_docs.KEPT_SESSIONS
    assert docs[4] == expected[4] and docs[-1] == expected[-1] and docs[10:14] == expected[10:14]  # made again
    assert docs.select([0, 239]) == [expected[0], expected[239]]
    with pytest.raises(IndexError):
        docs[240]


def test_a_repoqa_row_of_the_samples_table_records_its_extractor(tmp_path):
    results = tmp_path / "results"
    result = evalkit("task=scbench_repoqa", "task.dataset.source=file", f"task.dataset.path={FIXTURES / 'scbench_repoqa.jsonl'}",
                     "limit=1", "task.generation.max_gen_toks=8", "task.truncation=left", f"results_dir={results}",
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert read_table(results, "samples")["code_extractor"].tolist() == [scoring.CODE_EXTRACTOR]
