"""LongBench-v2, AIME24 and LiveCodeBench: official prompts, extraction and scoring on fixtures in the hub schemas."""

from __future__ import annotations

import base64
import json
import pickle
import zlib

import pytest

from evalkit.benchmark.data import load_rows
from evalkit.lm.prompts import context_end
from evalkit.tasks.aime24 import aime
from evalkit.tasks.livecodebench import livecodebench as lcb
from evalkit.tasks.longbench_v2 import longbench


# -- fixtures in the exact hub schemas ---------------------------------------------------------------------------
def longbench_rows() -> list[dict]:
    base = {"domain": "Single-Document QA", "sub_domain": "Academic", "choice_A": " red ", "choice_B": "blue",
            "choice_C": "green", "choice_D": "black"}
    return [
        {**base, "_id": "lb-1", "difficulty": "easy", "length": "short", "question": "Which colour is the sky? ",
         "answer": "B", "context": "  The sky is blue. The grass is green.  "},
        {**base, "_id": "lb-2", "difficulty": "hard", "length": "long", "question": "Which colour is the grass?",
         "answer": "C", "context": "Grass is green. " * 100},
    ]


def aime_rows_h4() -> list[dict]:
    return [{"id": 60, "problem": "Find $2+2$.", "solution": "4", "answer": "4", "url": "u", "year": "2024"},
            {"id": 61, "problem": "Find $10 \\cdot 10$.", "solution": "100", "answer": "100", "url": "u", "year": "2024"}]


def math500_rows() -> list[dict]:  # HuggingFaceH4/MATH-500's schema
    return [{"problem": "Simplify $\\frac{6}{4}$.", "solution": "...", "answer": "\\frac{3}{2}", "subject": "Algebra",
             "level": 2, "unique_id": "test/algebra/1.json"},
            {"problem": "Find $3 \\cdot 4$.", "solution": "...", "answer": "12", "subject": "Prealgebra", "level": 1,
             "unique_id": "test/prealgebra/2.json"}]


def aime_rows_maxwell() -> list[dict]:
    return [{"ID": "2024-I-1", "Problem": "Find $2+2$.", "Solution": "4", "Answer": 4}]


def encode_private(tests: list[dict]) -> str:
    return base64.b64encode(zlib.compress(pickle.dumps(json.dumps(tests)))).decode()


def lcb_rows() -> list[dict]:
    common = {"platform": "atcoder", "contest_id": "abc001"}
    stdin_problem = {
        **common, "question_title": "Sum", "question_content": "Read two integers and print their sum.",
        "question_id": "abc001_a", "contest_date": "2024-05-04T00:00:00", "starter_code": "", "difficulty": "easy",
        "public_test_cases": json.dumps([{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]),
        "private_test_cases": encode_private([{"input": "10 -4\n", "output": "6\n", "testtype": "stdin"},
                                              {"input": "0 0\n", "output": "0\n", "testtype": "stdin"}]),
        "metadata": "{}",
    }
    functional_problem = {
        **common, "platform": "leetcode", "question_title": "Double", "question_content": "Return twice the list.",
        "question_id": "lc-7", "contest_date": "2024-08-10T00:00:00",
        "starter_code": "class Solution:\n    def double(self, nums: List[int]) -> List[int]:\n        ",
        "difficulty": "medium",
        "public_test_cases": json.dumps([{"input": "[1, 2]", "output": "[2, 4]", "testtype": "functional"}]),
        "private_test_cases": json.dumps([{"input": "[]", "output": "[]", "testtype": "functional"},
                                          {"input": "[-3]", "output": "[-6]", "testtype": "functional"}]),
        "metadata": json.dumps({"func_name": "double"}),
    }
    return [stdin_problem, functional_problem]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


# -- LongBench-v2 --------------------------------------------------------------------------------------------------
def test_longbench_prompt_is_the_official_template_with_the_documents_end_known():
    doc = longbench_rows()[0]
    prompt = longbench.fill(longbench.ZERO_SHOT, doc)
    assert prompt.startswith("Please read the following text and answer the question below.\n\n<text>\nThe sky is blue.")
    end = context_end(prompt, longbench.question(longbench.ZERO_SHOT, doc))
    head, tail = prompt[:end], prompt[end:]
    assert head.endswith("The grass is green.\n</text>\n\n")
    assert tail == ("What is the correct answer to this question: Which colour is the sky?\nChoices:\n(A) red\n(B) blue\n"
                    "(C) green\n(D) black\n\nFormat your response as follows: \"The correct answer is (insert answer here)\".")


def test_longbench_cot_prompts_reason_over_the_document_then_answer_without_it():
    doc = longbench_rows()[0]
    reasoning_prompt = longbench.fill(longbench.COT, doc)
    assert "The sky is blue." in reasoning_prompt and reasoning_prompt.endswith("(D) black\n\nLet\u2019s think step by step:")
    answer_prompt = longbench.fill(longbench.COT_ANSWER, doc, " The sky is blue, so B. ")
    assert "The sky is blue." not in answer_prompt.split("step by step:")[0]
    assert longbench.question(longbench.COT_ANSWER, doc, " The sky is blue, so B. ") is None  # no document to end
    assert "The text is too long and omitted here." in answer_prompt
    assert "Let\u2019s think step by step: The sky is blue, so B.\n\nBased on the above" in answer_prompt


@pytest.mark.parametrize(
    "response, expected",
    [("The correct answer is (B)", "B"), ("**The correct answer is (B)**", "B"), ("The correct answer is B.", "B"),
     ("I think (B)", None), ("", None)],
)
def test_longbench_answer_extraction(response, expected):
    assert longbench.extract_answer(response) == expected


def test_longbench_scores_right_wrong_and_malformed():
    doc = longbench_rows()[0]
    scored = {"empty_outputs": 0.0}
    assert longbench.score(doc, "The correct answer is (B)") == {"accuracy": 1.0, "extraction_failed": 0.0, **scored}
    assert longbench.score(doc, "The correct answer is (A)") == {"accuracy": 0.0, "extraction_failed": 0.0, **scored}
    assert longbench.score(doc, "blue, obviously") == {"accuracy": 0.0, "extraction_failed": 1.0, **scored}


def test_longbench_bad_row_is_refused():
    row = dict(longbench_rows()[0], answer="E")
    with pytest.raises(ValueError, match="'answer': must be A, B, C or D, got 'E'"):
        longbench.check_row(row)


# -- AIME24 --------------------------------------------------------------------------------------------------------
def test_aime_reads_both_hub_schemas():
    assert aime.normalize_row(aime_rows_h4()[0]) == {"id": "60", "problem": "Find $2+2$.", "answer": "4"}
    assert aime.normalize_row(aime_rows_maxwell()[0]) == {"id": "2024-I-1", "problem": "Find $2+2$.", "answer": "4"}


def test_aime_prompt_asks_for_a_boxed_answer():
    assert aime.prompt({"problem": "Find $2+2$."}) == "Find $2+2$.\nPlease reason step by step, and put your final answer within \\boxed{}."


def test_aime_scores_right_wrong_and_malformed():
    doc = {"answer": "4"}
    assert aime.score(doc, ["so \\boxed{4}"])["pass@1"] == 1.0
    assert aime.score(doc, ["so \\boxed{5}"])["pass@1"] == 0.0
    malformed = aime.score(doc, ["the answer is 4"])
    assert malformed["pass@1"] == 0.0 and malformed["extraction_failed"] == 1.0


def test_aime_uses_the_final_answer_after_thinking_and_votes():
    doc = {"answer": "100"}
    responses = ["<think>maybe \\boxed{99}</think> The answer is \\boxed{100}", "\\boxed{10^2}", "\\boxed{7}", "no box"]
    scores = aime.score(doc, responses)
    assert scores["pass@1"] == 0.5 and scores["extraction_failed"] == 0.25
    assert scores["cons@n"] == 1.0  # 100 and 10^2 are different strings: the vote picks the first most common, 100


def test_aime_last_boxed_handles_nested_braces():
    assert aime.last_boxed("\\boxed{1} then \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert aime.last_boxed("\\boxed{unclosed") is None


# -- LiveCodeBench -------------------------------------------------------------------------------------------------
def test_lcb_private_tests_decode_from_both_encodings():
    rows = [lcb.prepare(row) for row in lcb_rows()]
    assert len(json.loads(rows[0]["tests"])) == 3 and rows[1]["func_name"] == "double"
    assert len(json.loads(rows[1]["tests"])) == 3


def test_lcb_prompts_follow_the_official_template():
    stdin_doc, functional_doc = (lcb.prepare(row) for row in lcb_rows())
    assert lcb.prompt(stdin_doc) == (
        "### Question:\nRead two integers and print their sum.\n\n### Format: " + lcb.WITHOUT_STARTER
        + "\n```python\n# YOUR CODE HERE\n```\n\n### Answer: (use the provided format with backticks)\n\n")
    assert f"```python\n{functional_doc['starter_code']}\n```" in lcb.prompt(functional_doc)


def test_lcb_extracts_between_the_last_two_fences():
    response = "Plan:\n```python\nprint(0)\n```\nFinal:\n```python\nprint(1)\n```\nDone"
    assert lcb.extract_code(response) == "print(1)"
    assert lcb.extract_code("no code here") is None


STDIN_RIGHT = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
FUNCTIONAL_RIGHT = "```python\nclass Solution:\n    def double(self, nums):\n        return [2 * x for x in nums]\n```"


def test_lcb_scores_right_wrong_and_malformed():
    stdin_doc, functional_doc = (lcb.prepare(row) for row in lcb_rows())
    assert lcb.score(stdin_doc, [STDIN_RIGHT], timeout_s=5)["pass@1"] == 1.0
    assert lcb.score(functional_doc, [FUNCTIONAL_RIGHT], timeout_s=5)["pass@1"] == 1.0
    wrong = "```python\na, b = map(int, input().split())\nprint(a - b)\n```"
    assert lcb.score(stdin_doc, [wrong], timeout_s=5)["pass@1"] == 0.0
    malformed = lcb.score(stdin_doc, ["print(3)"], timeout_s=5)
    assert malformed["pass@1"] == 0.0 and malformed["extraction_failed"] == 1.0


@pytest.mark.parametrize(
    "code",
    [
        "import sys\nsys.exit(0)",  # exits before any test runs
        "import builtins\nbuiltins.print = lambda *a, **k: None\nclass Solution:\n    def double(self, nums):\n        return 'x'",
        "import json, sys\nclass Solution:\n    def double(self, nums):\n        sys.stdout.write('@@evalkit-result-0@@[2, 4]')\n        sys.exit(0)",
        pytest.param("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)", marks=pytest.mark.skipif(
            not __import__("evalkit.benchmark.sandbox", fromlist=["isolation"]).isolation()["namespaces"], reason="needs PID namespaces")),
    ],
)
def test_lcb_hostile_programs_cannot_fake_a_pass(code):
    functional_doc = lcb.prepare(lcb_rows()[1])
    assert lcb.score(functional_doc, [f"```python\n{code}\n```"], timeout_s=5)["pass@1"] == 0.0


def test_lcb_numeric_stdout_comparison():
    assert lcb._stdout_matches("1.0 2\n", "1 2.000000000\n")
    assert not lcb._stdout_matches("1 2 3", "1 2")
    assert not lcb._stdout_matches("abc", "abd")


def test_lcb_pass_at_k_is_the_unbiased_estimator():
    assert lcb.pass_at_k(10, 0, 1) == 0.0
    assert lcb.pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert lcb.pass_at_k(10, 3, 5) == pytest.approx(1 - (7 * 6 * 5 * 4 * 3) / (10 * 9 * 8 * 7 * 6))
    assert lcb.pass_at_k(4, 4, 4) == 1.0


def test_lcb_loader_filters_by_contest_date(tmp_path):
    import importlib.util

    from evalkit.core.paths import tasks_dir

    spec = importlib.util.spec_from_file_location("lcb_utils", tasks_dir() / "livecodebench" / "utils.py")
    utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(utils)
    path = write_jsonl(tmp_path / "test6.jsonl", lcb_rows())
    assert len(utils.load(path=str(path))["test"]) == 2
    only_august = utils.load(path=str(path), start_date="2024-08-01", end_date="2024-08-31")["test"]
    assert only_august["question_id"] == ["lc-7"]
    with pytest.raises(ValueError, match="no LiveCodeBench problems"):
        utils.load(path=str(path), start_date="2030-01-01")


def test_missing_local_dataset_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="not found: .*absent.jsonl"):
        load_rows(str(tmp_path / "absent.jsonl"))


# -- end to end through the CLI on the tiny model (scores ~0; the whole path runs and writes correct tables) ---------
def write_json_list(path, rows):
    path.write_text(json.dumps(rows))
    return path


# A few real end-to-end runs in the fast tier (CI): every official task through the CLI on the tiny model.
@pytest.mark.parametrize(
    "task, make_file, extra, subsets, per_doc",
    [
        ("longbench_v2", lambda p: write_json_list(p / "data.json", longbench_rows()),
         ["+budget=4x", "method=snapkv", "compression_scope=context"], {"all", "easy", "hard", "short", "long"}, 1),
        ("longbench_v2", lambda p: write_json_list(p / "data.json", longbench_rows()),
         ["+budget=4x", "method=snapkv", "task.dataset.cot=true", "+task.dataset.reasoning_max_gen_toks=6"],
         {"all", "easy", "hard", "short", "long"}, 1),
        ("aime24", lambda p: write_jsonl(p / "aime.jsonl", aime_rows_h4()),
         ["task.repeats=2", "+budget=2x", "fidelity_tokens=4"], {"all"}, 2),
        ("livecodebench", lambda p: write_jsonl(p / "test6.jsonl", lcb_rows()), ["task.repeats=2"],
         {"all", "easy", "medium"}, 2),
        ("aime25", lambda p: write_jsonl(p / "aime25.jsonl", aime_rows_h4()), ["task.repeats=2", "budget=2x"],
         {"all"}, 2),
        ("math500", lambda p: write_jsonl(p / "math500.jsonl", math500_rows()), ["task.repeats=2", "budget=2x"],
         {"all", "1", "2"}, 2),
    ],
)
def test_task_runs_end_to_end_through_the_cli(tmp_path, random_model_dir, task, make_file, extra, subsets, per_doc):
    from helpers import evalkit

    from evalkit.results import read_table

    data, results = make_file(tmp_path), tmp_path / "results"
    result = evalkit(f"task={task}", f"task.dataset.path={data}", f"model.pretrained={random_model_dir}",
                     "task.generation.max_gen_toks=8", f"results_dir={results}", *extra, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics, samples = read_table(results, "metrics"), read_table(results, "samples")
    assert set(metrics["subset"]) - {"memory"} == subsets
    assert len(samples) == 2 * per_doc and samples.groupby("doc_id").size().eq(per_doc).all()
    assert samples["generated_tokens"].between(1, 8).all() and samples["prompt_tokens"].gt(0).all()
    options = json.loads(metrics["task_options"].iloc[0])
    assert options["dataset"]["path"] == str(data) and options["generation"]["max_gen_toks"] == 8
    if "compression_scope=context" in extra:  # LongBench says where its document ends: every prompt split there
        assert metrics.loc[metrics["metric"] == "context_unmarked", "value"].tolist() == [0.0]
    if task == "longbench_v2":
        assert set(metrics["metric"]) >= {"accuracy", "extraction_failed"}
        # With CoT, the statistics are the reasoning call's, over the document; the reasoning is kept.
        assert samples["truncated"].any() and samples["prompt_tokens"].max() > 200
        assert samples["peak_cache_tokens"].max() < samples["prompt_tokens"].max()  # compressed for real
        assert samples["reasoning"].notna().all() == ("task.dataset.cot=true" in extra)
    else:
        assert set(metrics["metric"]) >= {"pass@1", "extraction_failed"}
    if task in ("aime25", "math500"):  # AIME24's protocol under its own name, its data identified as the file
        assert set(samples["task"]) == {task} and samples["dataset_source"].str.startswith("local:sha256:").all()
    if task == "math500":  # MATH-500's ids and levels came through
        assert set(samples["sample_id"]) == {"test/algebra/1.json", "test/prealgebra/2.json"}
    if task == "aime24":  # fidelity against the full cache, on the same prompts
        assert {"token_agreement_mean", "kl_mean"} <= set(metrics["metric"])
        assert samples["token_agreement"].between(0, 1).all() and samples["kl_mean"].ge(0).all()


def test_adapter_middle_truncation_keeps_both_ends_and_the_document_split(random_model_dir):
    from evalkit.lm import EvalkitLM

    lm = EvalkitLM(pretrained=str(random_model_dir), max_context=64, device="cpu")
    text = " ".join(f"k{i}" for i in range(100)) + " ? k5"
    end = context_end(text, " ? k5")
    ids, _, truncated, starts = lm.prompts.encode([text], reserve=4, truncation="middle", context_ends=[end])
    tokens = lm.tokenizer.convert_ids_to_tokens(ids[0])
    assert truncated == [True] and len(tokens) == 60
    assert tokens[:3] == ["<s>", "k0", "k1"] and tokens[29] == "k28" and tokens[30] == "k72"
    assert tokens[-2:] == ["?", "k5"]
    assert starts == [58]  # 30 + 28 document tokens kept, then the question
    ids, _, _, starts = lm.prompts.encode([text], reserve=4, truncation="left")
    assert lm.tokenizer.convert_ids_to_tokens(ids[0])[0] == "k42" and starts == [None]
