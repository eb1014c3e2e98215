"""Conformance with the official code, as golden cases: each expected value below is what the official script itself
produced on the same input (THUDM/LongBench pred.py/result.py; lcb_runner testing_util.py; open-r1 rewards.py and
lighteval's aime24 at open-r1's pin). A change that drifts from the official behaviour fails here."""

from __future__ import annotations

from importlib import metadata

import pytest

from evalkit.lm.prompts import context_end
from evalkit.tasks.longbench_v2 import longbench

# -- LongBench-v2 (pred.py, result.py) ------------------------------------------------------------------------------
TRICKY = {"context": "  A paper: let $Q$ be the set and $C_B$ a constant; $DOC$ here. ", "question": " Is $DOC$ in $C_A$? ",
          "choice_A": " yes $C_B$ ", "choice_B": "no", "choice_C": "$Q$", "choice_D": "maybe"}


def test_longbench_fills_the_template_in_pred_py_order():
    """pred.py: ``template.replace('$DOC$', ...).replace('$Q$', ...).replace('$C_A$', ...)...`` then ``$COT$``: a
    document holding ``$Q$`` gets the question, a question holding ``$DOC$`` keeps it, reasoning is not filled."""
    prompt = longbench.fill(longbench.ZERO_SHOT, TRICKY)
    assert prompt == (
        "Please read the following text and answer the question below.\n\n<text>\nA paper: let Is $DOC$ in yes no? be "
        "the set and no a constant; $DOC$ here.\n</text>\n\nWhat is the correct answer to this question: Is $DOC$ in "
        "yes no?\nChoices:\n(A) yes no\n(B) no\n(C) $Q$\n(D) maybe\n\nFormat your response as follows: \"The correct "
        "answer is (insert answer here)\".")
    question = longbench.question(longbench.ZERO_SHOT, TRICKY)  # what follows the document
    assert context_end(prompt, question) == prompt.index("</text>\n\n") + len("</text>\n\n")
    answer = longbench.fill(longbench.COT_ANSWER, TRICKY, "Because $C_A$ and $Q$ hold, (A).")
    assert answer == (
        "Please read the following text and answer the questions below.\n\nThe text is too long and omitted here.\n\n"
        "What is the correct answer to this question: Is $DOC$ in yes no?\nChoices:\n(A) yes no\n(B) no\n(C) $Q$\n"
        "(D) maybe\n\nLet\u2019s think step by step: Because $C_A$ and $Q$ hold, (A).\n\nBased on the above, what is "
        "the single, most likely answer choice? Format your response as follows: \"The correct answer is (insert "
        "answer here)\".")


@pytest.fixture(scope="module")
def byte_level_lm(random_model_dir):
    """The adapter with a GPT-2-style byte-level tokenizer (as SmolLM2's): ``\\n\\n`` at the end of a piece is one
    token, inside ``\\n\\nWhat`` two."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from evalkit.lm import EvalkitLM
    from evalkit.models import load_model

    core = Tokenizer(models.BPE())
    core.pre_tokenizer, core.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    core.train_from_iterator(["doc end.\n</text>\n\n", "What is the answer?"] * 20, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    model, _ = load_model(str(random_model_dir), device="cpu")
    return EvalkitLM(model=model, tokenizer=tokenizer, max_context=256)


@pytest.mark.parametrize("scope", ["prompt", "context"])
def test_longbench_prompt_is_tokenized_whole_with_the_document_end_found_by_offsets(byte_level_lm, scope):
    lm, document = byte_level_lm, "doc end.\n</text>\n\n"
    lm.prompts.compression_scope = scope
    text = document + "What is the answer?"
    ids, _, _, (start,) = lm.prompts.encode([text], reserve=4, context_ends=[context_end(text, "What is the answer?")])
    whole = lm.tokenizer(document + "What is the answer?")["input_ids"]
    pieces = lm.tokenizer(document)["input_ids"] + lm.tokenizer("What is the answer?")["input_ids"]
    assert whole != pieces  # the tokenizer merges across the document's end: tokenizing in two pieces would differ
    assert ids[0].tolist() == whole
    assert lm.tokenizer.convert_ids_to_tokens(whole[start:start + 1]) == ["What"]  # the question starts there


def test_longbench_drops_empty_outputs_from_the_denominator_as_result_py_does():
    """pred.py skips an item whose output is '' (either call under CoT); result.py divides by the items written."""
    doc = {"answer": "B", "prompt_mode": "zero_shot", "reasoning": ""}
    outputs = ["The correct answer is (B)", "", "The correct answer is (A)", " "]
    official_overall = sum(longbench.extract_answer(o) == "B" for o in outputs if o != "") / sum(o != "" for o in outputs)
    scored = [longbench.score(doc, output) for output in outputs]
    accuracy = [s["accuracy"] for s in scored if "accuracy" in s]
    assert sum(accuracy) / len(accuracy) == official_overall == 1 / 3
    assert sum(s["empty_outputs"] for s in scored) == 1
    assert longbench.score(doc, "", "zero") == {"accuracy": 0.0, "extraction_failed": 1.0, "empty_outputs": 1.0}
    cot_answer = {**doc, "prompt_mode": "answer", "reasoning": ""}  # the reasoning call came back empty
    assert longbench.score(cot_answer, "The correct answer is (B)") == {"empty_outputs": 1.0}
    with pytest.raises(ValueError, match="empty_output"):
        longbench.score(doc, "", "drop")


# -- AIME (open-r1 rewards.py accuracy_reward; lighteval aime24 math_pass@1 at open-r1's pin) -----------------------
# (gold, completion, open-r1's reward, lighteval's math_pass@1, the last box after </think>): the first two columns
# of verdicts are what the official functions returned on these completions (open-r1's with math-verify 0.5.2, its pin,
# as OPEN_R1_PIN_CASES below).
AIME_CASES = [
    ("204", "<think>so it is \\boxed{204} I think</think> The answer is 204.", 1, 1, 0),
    ("204", "<think>compute... \\boxed{204}</think>", 1, 1, 0),
    ("204", "The final answer is $204$.", 1, 1, 0),
    ("204", "<think>maybe \\boxed{17}</think> Final: \\boxed{204}", 1, 1, 1),
    ("204", "Therefore, the final answer is: $\\boxed{204}$. I hope it is correct", 1, 1, 1),
    ("204", "The answer is 204.", 0, 1, 0),
    ("204", "I get 204", 0, 1, 0),
    ("204", "\\boxed{ 204 }", 1, 1, 1),
    ("204", "\\boxed{204.}", 0, 0, 0),
    ("204", "\\boxed{\\text{204}}", 1, 1, 1),
    ("204", "\\boxed{203} wait, no: \\boxed{204}", 1, 0, 1),
    ("204", "", 0, 0, 0),
    ("33", "so $m+n = 33$", 0, 1, 0),
    ("33", "**Final Answer**\n\\[\n\\boxed{33}\n\\]", 1, 1, 1),
    ("25", "x = \\frac{50}{2}, so the answer is $\\frac{50}{2}$", 1, 1, 0),
    ("025", "\\boxed{25}", 1, 1, 1),
    ("204", "The answer: 204", 0, 1, 0),
    ("204", "</think>\n\n204", 0, 1, 0),
]


@pytest.mark.parametrize("column, profile", [(2, "open_r1"), (3, "lighteval"), (4, "r1_final_box")])
def test_aime_extraction_profiles_agree_with_the_official_rewards(column, profile):
    from evalkit.tasks.aime24 import aime

    got = [aime.score({"answer": case[0]}, [case[1]], profile)["pass@1"] for case in AIME_CASES]
    assert got == [float(case[column]) for case in AIME_CASES]


# open-r1's accuracy_reward at its pin (math-verify 0.5.2) where a completion boxes more than once, and ordinary cases:
# (gold, completion, reward, the answer it read, as the string math-verify returns last). Recorded by running
# accuracy_reward's code (src/open_r1/rewards.py at 1416fa0: the gold parsed with math-verify's defaults, first match,
# the completion with open-r1's LatexExtractionConfig, verify(gold, answer)) in a throwaway environment with
# math-verify 0.5.2, latex2sympy2-extended 1.0.6 and antlr4-python3-runtime 4.13.2, the pin that cannot be installed
# beside evalkit (hydra-core needs antlr4 4.9). evalkit reads the same under math-verify 0.8.0 and 0.9.0, where
# math-verify itself reads "So \\boxed{100} and then \\boxed{204}" as 100,204 and "<think>\\boxed{7}</think>
# \\boxed{204}" as 7,204.
_L2S_1_11_ON_ANTLR_4_9 = (metadata.version("latex2sympy2_extended") == "1.11.0"
                          and metadata.version("antlr4-python3-runtime").startswith("4.9"))
OPEN_R1_PIN_CASES = [
    ("204", "So \\boxed{100} and then \\boxed{204}", 1, "204"),
    ("204", "<think>\\boxed{7}</think> \\boxed{204}", 1, "204"),
    ("204", "The answer is \\boxed{204}.", 1, "204"),
    ("204", "The answer is \\boxed{205}.", 0, "205"),
    ("204", "\\boxed{\\text{204}}", 1, "\\text{204}"),
    ("204", "The answer is 204.", 0, None),
    ("204", "", 0, None),
    ("204", "\\boxed{100}, \\boxed{150}, finally \\boxed{204}", 1, "204"),
    ("204", "\\boxed{204} hmm, \\boxed{150}, finally \\boxed{100}", 0, "100"),
    ("204", "<think>\\boxed{204}</think> \\boxed{7}", 0, "7"),
    ("204", "\\boxed{203} wait, no: \\boxed{204}", 1, "204"),
    ("204", "<think>\\boxed{204}\\boxed{204}</think> \\boxed{204}", 1, "204"),
    ("204", "\\boxed{100} and \\boxed{204}", 0, "100,204"),
    ("204", "$\\boxed{100}$ and $\\boxed{204}$", 0, "100 and 204"),
    ("204", "So $\\boxed{100}$.\n\nFinal: \\boxed{204}", 1, "204"),
    ("204", "\\[\\boxed{100}\\] then \\boxed{204}", 1, "204"),
    ("204", "\\boxed{100} then \\[\\boxed{204}\\]", 1, "204"),
    ("204", "\\boxed{5}\\boxed{}", 0, None),
    ("204", "\\fbox{100} so \\boxed{204}", 1, "204"),
    ("204", "Therefore, the final answer is: $\\boxed{204}$. I hope it is correct", 1, "204"),
    ("\\frac{3}{2}", "so $x = \\boxed{\\frac{3}{2}}$", 1, "\\frac{3}{2}"),
    ("\\frac{3}{2}", "<think>\\boxed{\\frac{1}{2}}</think> so \\boxed{\\dfrac{3}{2}}", 1, "\\frac{3}{2}"),
    ("\\frac{3}{2}", "so the answer is \\boxed{1.5}", 1, "1.5"),
    ("\\frac{3}{2}", "\\boxed{\\frac{1}{3}} or rather \\boxed{\\frac{3}{2}}", 1, "\\frac{3}{2}"),
    ("(3, 4)", "\\boxed{(1, 2)} then \\boxed{(3, 4)}", 0, "(3, 4)"),
    ("2\\sqrt{2}", "<think>\\boxed{\\sqrt{8}}</think> \\boxed{2\\sqrt{2}}", 0, "2\\sqrt{2}"),
    ("5", "\\boxed{x = 5}", 1, "x = 5"),
    ("90^\\circ", "\\boxed{90^\\circ}", 1, "90^\\circ"),
    # latex2sympy2-extended 1.11.0 (math-verify 0.9.0) ships a parser for antlr4 4.9 whose atoms lack FUNC_GAMMA: with
    # hydra-core's antlr4 4.9 it parses no percentage, and 10\% stays a string that equals no number.
    pytest.param("\\frac{1}{10}", "\\boxed{10\\%}", 1, "10\\%", marks=pytest.mark.xfail(
        _L2S_1_11_ON_ANTLR_4_9, reason="latex2sympy2-extended 1.11.0 under antlr4 4.9 parses no percentage",
        strict=True)),
]


@pytest.mark.parametrize("gold, completion, reward, answer", OPEN_R1_PIN_CASES)
def test_open_r1_profile_reads_what_open_r1_read_at_its_pin(gold, completion, reward, answer):
    from evalkit.tasks.aime24 import aime

    parsed = aime.parse_answer(completion)
    assert (str(parsed[-1]) if parsed else None) == answer
    assert aime.score({"answer": gold}, [completion])["pass@1"] == reward


def test_aime_lighteval_prompt_is_aime_prompt_fn():
    from evalkit.tasks.aime24 import aime

    problem = "Find $x$ if {x} = 2."
    assert aime.prompt({"problem": problem, "prompt_style": "lighteval"}) == (
        "Solve the following math problem efficiently and clearly.  The last line of your response should be of the "
        "following format: 'Therefore, the final answer is: $\\boxed{ANSWER}$. I hope it is correct' (without "
        "quotes) where ANSWER is just the final number or expression that solves the problem. Think step by step "
        "before answering.\n\nFind $x$ if {x} = 2.")
    assert aime.prompt({"problem": problem, "prompt_style": "r1"}) == (
        problem + "\nPlease reason step by step, and put your final answer within \\boxed{}.")


# -- LiveCodeBench (lcb_runner evaluation/testing_util.py run_test, as compute_code_generation_metrics counts it) ----
CALL = [{"input": "[1, 2]", "output": "3", "testtype": "functional"}]
CALL_DICT = [{"input": "[1, 2]", "output": "{\"1\": 1, \"2\": 1}", "testtype": "functional"}]
STDIN = [{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]
SOLUTION = "class Solution:\n    def solve(self, nums):\n"
# (tests, program, whether lcb_runner passes it): each verdict is what the official run_test returned.
LCB_CASES = {
    "numpy int": (CALL, "import numpy as np\n" + SOLUTION + "        return np.int64(sum(nums))", True),
    "numpy float": (CALL, "import numpy as np\n" + SOLUTION + "        return np.float64(sum(nums))", True),
    "Decimal": (CALL, "from decimal import Decimal\n" + SOLUTION + "        return Decimal(3)", True),
    "Counter": (CALL_DICT, SOLUTION + "        return Counter(map(str, nums))", True),
    "defaultdict": (CALL_DICT, SOLUTION + "        d = defaultdict(int)\n        for n in nums: d[str(n)] += 1\n"
                    "        return d", True),
    "tuple": ([{"input": "[1, 2]", "output": "[2, 1]", "testtype": "functional"}], SOLUTION + "        return (2, 1)",
              True),
    "__eq__ always true": (CALL, SOLUTION + "        class F:\n            def __eq__(self, o): return True\n"
                           "        return F()", True),
    "quit()": (STDIN, "a, b = map(int, input().split())\nprint(a + b)\nquit()", False),
    "os.getcwd()": (STDIN, "import os\nos.getcwd()\na, b = map(int, input().split())\nprint(a + b)", False),
    "exit()": (STDIN, "a, b = map(int, input().split())\nprint(a + b)\nexit()", True),
    "subprocess.Popen": (STDIN, "import subprocess\nsubprocess.Popen(['true'])\nprint(3)", False),
    "plain": (STDIN, "a, b = map(int, input().split())\nprint(a + b)", True),
    "3 GiB mapped": (STDIN, "import mmap\nm = mmap.mmap(-1, 3 << 30)\na, b = map(int, input().split())\nprint(a + b)",
                     True),
}


@pytest.mark.parametrize("name", sorted(LCB_CASES))
def test_lcb_verdicts_match_lcb_runner(name):
    """Call-based results compare live with ``==`` in the sandbox; reliability_guard nulls quit, os.getcwd,
    subprocess.Popen...; no address-space cap by default."""
    import json

    from evalkit.tasks.livecodebench import livecodebench as lcb

    tests, program, official = LCB_CASES[name]
    doc = {"tests": json.dumps(tests), "func_name": "solve" if tests[0]["testtype"] == "functional" else ""}
    assert lcb.run_tests(program, doc, timeout_s=6)["passed"] is official


def test_lcb_memory_cap_is_an_option_off_by_default():
    import json

    from evalkit.tasks.livecodebench import livecodebench as lcb

    tests, program, _ = LCB_CASES["3 GiB mapped"]
    doc = {"tests": json.dumps(tests), "func_name": ""}
    assert not lcb.run_tests(program, doc, timeout_s=6, memory_mb=2048)["passed"]
    assert lcb.score(doc | {"func_name": ""}, [f"```python\n{program}\n```"])["sandbox_namespaces"] in (0.0, 1.0)


# -- methods' reference defaults and the budget grammar ---------------------------------------------------------------
def test_adakv_and_pyramidkv_default_to_their_references_settings():
    """kvpress' SnapKVPress (under AdaKVPress) and KVCache-Factory's PyramidKVCluster: window 64, kernel 5, average
    pooling; the config files say the same."""
    from yaml import safe_load

    import evalkit.compression as ec
    from evalkit.core.paths import conf_dir

    for cls, name in ((ec.AdaKV, "adakv"), (ec.PyramidKV, "pyramidkv")):
        policy = cls(capacity=128).scorer
        assert (policy.window, policy.kernel_size, policy.pooling) == (64, 5, "avg")
        conf = safe_load((conf_dir() / "method" / f"{name}.yaml").read_text())
        assert (conf["window"], conf["kernel_size"], conf["pooling"]) == (64, 5, "avg")


@pytest.mark.parametrize("budget, capacity", [("2.5x", 52428), ("4x", 32768), ("tokens_4096", 4096), (None, None)])
def test_one_budget_grammar_for_policies_memory_pricing_and_reports(budget, capacity):
    import evalkit.compression as ec
    from evalkit import memory
    from evalkit.results.summary import compression_factor

    assert memory.capacity_for_budget(budget, 131072) == capacity
    if budget is not None:
        assert ec.budget_capacity(budget, 131072) == capacity
        factor = compression_factor(budget)
        assert factor == float(budget[:-1]) if budget.endswith("x") else factor != factor  # absolute budget: NaN
    for bad in ("0.5x", "x4", "tokens_", "4"):
        with pytest.raises(ValueError, match="budget"):
            memory.capacity_for_budget(bad, 131072)
        with pytest.raises(ValueError, match="budget"):
            ec.budget_capacity(bad, 131072)
