"""SCBench's 12 tasks: evalkit's port (tasks/scbench) beside the official code (microsoft/MInference ``scbench/``:
eval_utils.py's prompt builders, compute_scores.py's and repo_qa_utils.py's scorers).

    python benchmarks/parity_scbench.py /tmp/scbench-venv [--official DIR] [--mirror GITDIR] [--rouge-script FILE]

Run it with evalkit's environment. VENV is a throwaway virtual environment, never an evalkit dependency, holding
what the official scorer imports (no GPU package: torch, transformers and minference are stubbed, the prompt builders
and scorers do not use them), made once with

    python3 -m venv /tmp/scbench-venv
    /tmp/scbench-venv/bin/pip install tree_sitter==0.21.3 tree_sitter_languages rich tempdir jieba rouge evaluate \
        nltk rouge_score datasets numpy tqdm

The official files come from DIR (a clone's ``scbench/`` folder: compute_scores.py, eval_utils.py, repo_qa_utils.py),
else from a git mirror of microsoft/MInference (``git show HEAD:scbench/<file>``; the README's numbers: fb56c917). compute_scores.py loads evaluate's "rouge" metric at import,
from the hub; offline, pass its script (evaluate's ``metrics/rouge/rouge.py``) as --rouge-script, or a git mirror of
huggingface/evaluate as --evaluate-mirror.

Scorers: per task, predictions built from the fixtures' gold answers (right, wrong, partial, formatting variants;
repoqa also over functions in the five other languages; kv, prefix_suffix, vt and mf also over two sessions of
evalkit's generator) scored by the official functions and by
``utils.process_results``; the count of equal scores is printed (and for RepoQA, the port's scores with tree-sitter,
computed in VENV, where it is installed). Prompts: per row, the official multi-turn prompts (plain, and under a
stand-in chat template that marks each message) and multi-request prompts beside doc_to_text, doc_to_follow_up,
doc_to_follow_up_plain, doc_to_follow_up_prefix, doc_to_history and doc_to_question; the count of identical ones.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import types
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "scbench"
OFFICIAL_FILES = ("compute_scores.py", "eval_utils.py", "repo_qa_utils.py")
MINFERENCE_MIRROR = "/work/.mirror/microsoft+MInference/repo"
EVALUATE_MIRROR = "/work/.mirror/huggingface+evaluate/repo"
MODEL = "parity"
# the stand-in chat template: each message as <|role|>content<|end|>, the generation prompt <|assistant|>
END, GEN = "<|end|>", "<|assistant|>"


# -- the official side (run by VENV's Python: no evalkit) ----------------------------------------------------------------
class MarkedChatTemplate:
    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=False):
        return "".join(f"<|{m['role']}|>{m['content']}{END}" for m in messages) + (GEN if add_generation_prompt else "")


def _stub_modules() -> None:
    """torch, transformers, minference and args.py's parser: imported by the official files, unused by the parts run."""
    torch = types.ModuleType("torch")
    torch.profiler = types.ModuleType("torch.profiler")
    transformers = types.ModuleType("transformers")
    for name in ("GenerationConfig", "SinkCache", "AutoConfig"):
        setattr(transformers, name, type(name, (), {}))
    args = types.ModuleType("args")
    args.parse_args = lambda: None
    sys.modules.update({"torch": torch, "torch.profiler": torch.profiler, "transformers": transformers, "args": args})


def official_side(given: Path, official: Path, port: Path) -> dict:
    sys.path.insert(0, str(official))
    import evaluate  # noqa: F401 (first: datasets looks for a real torch, which the stubs are not)

    _stub_modules()
    os.chdir(official)  # evaluate.load("rouge") finds ./rouge/rouge.py before the hub
    import compute_scores
    import eval_utils
    import repo_qa_utils

    for name in ("torch", "torch.profiler", "transformers"):  # datasets (evaluate's rouge) checks sys.modules' torch
        del sys.modules[name]

    spec = importlib.util.spec_from_file_location("scbench_scoring", port)  # the port's scorers: no evalkit here
    port_scoring = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(port_scoring)
    result = {}
    for task, case in json.loads(given.read_text()).items():
        data_name = f"scbench_{task}"
        examples = case["rows"]
        if 0 < 5 < len(examples[0]["multi_turns"]):  # run_scbench.py's --max_turns 5
            examples = [{**eg, "multi_turns": eg["multi_turns"][:5]} for eg in examples]
        entries = _prediction_entries(eval_utils, examples, data_name)
        needles = _needle_by_repo(entries, data_name)
        scores = [_official_score(compute_scores, repo_qa_utils, {**entries[c["doc"]], "prediction": c["pred"]},
                                  data_name, needles) for c in case["cases"]]
        result[task] = {"scores": scores, "prompts": [_official_prompts(eval_utils, eg, data_name) for eg in examples]}
        if task in ("repoqa", "repoqa_and_kv"):
            result[task]["port_tree_sitter"] = port_scoring.TREE_SITTER is not None
            result[task]["port_scores"] = [port_scoring.score(case["docs"][c["doc"]], c["pred"]) for c in case["cases"]]
            result[task]["matches"] = [_official_match(repo_qa_utils, entries[c["doc"]], c["pred"], needles)
                                       for c in case["cases"]]
    return result


def _prediction_entries(eval_utils, examples, data_name) -> list[dict]:
    """run_scbench.py's prediction records, one per turn (without the prediction)."""
    entries = []
    for i, eg in enumerate(examples):
        for turn_idx, (gt, turn) in enumerate(zip(eval_utils.get_ground_truth(eg, data_name), eg["multi_turns"])):
            entry = {"id": i, "turn_idx": turn_idx, "ground_truth": gt}
            if data_name in ("scbench_summary_with_needles", "scbench_repoqa_and_kv"):
                entry["task"] = turn["task"]
            if data_name == "scbench_repoqa":
                entry |= {"lang": eg["lang"], "repo": eg["repo"], "func_name": turn["name"]}
            if data_name == "scbench_repoqa_and_kv":
                entry |= {"lang": eg["lang"], "repo": eg["repo"]}
                if turn["task"] == "scbench_repoqa":
                    entry["func_name"] = turn["name"]
            entries.append(entry)
    return entries


def _needle_by_repo(entries, data_name) -> dict:
    """compute_scores.compute_scores' needle_by_repo over the whole prediction file."""
    needles = {}
    if data_name in ("scbench_repoqa", "scbench_repoqa_and_kv"):
        for pred in entries:
            if data_name == "scbench_repoqa_and_kv" and pred["task"] != "scbench_repoqa":
                continue
            needles.setdefault(pred["repo"], []).append({"needle": pred["ground_truth"], "name": pred["func_name"]})
    return needles


def _official_score(compute_scores, repo_qa_utils, entry, data_name, needles) -> float:
    sub = entry.get("task", data_name)
    if sub == "scbench_repoqa":
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            acc = repo_qa_utils.compute_score(MODEL, [entry], [entry["ground_truth"]], needles)
        return float(acc[MODEL]["scores"]["all"][0.8]["pass@1"])
    name = compute_scores.Multiturnbench_to_Infinitebench.get(sub, sub)
    return compute_scores.get_score_one(entry["prediction"], entry["ground_truth"], name, MODEL)


def _official_match(repo_qa_utils, entry, prediction, needles):
    """A RepoQA turn's sanitized output, best match and its BLEU (needle_evaluator); None for another sub-task."""
    if "func_name" not in entry:
        return None
    lang = entry["lang"]
    verdict, best, similarity = repo_qa_utils.needle_evaluator(prediction, entry, needles[entry["repo"]], lang, False)
    return [repo_qa_utils.sanitize_output(prediction, lang), best, similarity]


def _official_prompts(eval_utils, eg, data_name) -> dict:
    chat = MarkedChatTemplate()
    return {"plain": eval_utils.create_multiturn_prompt(eg, data_name, None, False)["prompts"],
            "chat": eval_utils.create_multiturn_prompt(eg, data_name, chat, True)["prompts"],
            "scdq": eval_utils.create_scdq_prompt(eg, data_name, None, False)["prompts"],
            "scdq_chat": eval_utils.create_scdq_prompt(eg, data_name, chat, True)["prompts"]}


# -- predictions ----------------------------------------------------------------------------------------------------
def text_variants(gold: str, other: str) -> list[str]:
    """Right, wrong, partial and reformatted answers around a gold string (20)."""
    half = max(1, len(gold) // 2)
    return [gold, f" {gold}\n", gold.upper(), gold.lower(), f"The answer is {gold}.", f'"{gold}"', gold[:half],
            gold[half:], "", "I don't know.", f"{gold} and more text", gold.replace(" ", ""), other, f"**{gold}**",
            f"\n\n{gold}", ("x" + gold[1:]) if gold else "x", gold + gold, f"Answer: {gold}", gold.title(),
            "None of the above"]


def task_variants(task: str, doc: dict, other: dict) -> list[str]:
    gold, wrong = doc["answer"], other["answer"]
    if task == "choice_eng":
        letter = "ABCD"[doc["options"].index(gold)]
        return text_variants(gold, wrong) + [
            letter, f"({letter})", f"{letter}.", letter.lower(), f"The answer is {letter}", f"answer: {letter}",
            f"Option is {letter}", f"The correct answer is: {letter}", f"{letter}. {gold}", f"  {letter}\n",
            "A B", "AB", "I think B", "answer is:", f"answer is {gold}", "D", "C", "B", "A", gold.lower()]
    if task == "mf":
        n = json.loads(doc["target"])
        return [str(n), f"{n}.", f"{n}.0", f"-{n}", f"The answer is {n}", str(n + 1), f"12 and then {n}", f"{n}5",
                "", "x", f"{n}.7", f"0{n}", f" {n} ", f"{n},{n}", f"{n}1.5", f"[{n}]", "none", f"{n - 1}",
                f"about {n}", f"{n:,}", f"{n}e3"]
    if task == "vt":
        names = json.loads(doc["target"])
        return [" ".join(names), ", ".join(names), ", ".join(names).lower(), " ".join(names[:1]),
                " ".join(names[:2]), " ".join(names[::-1]), "", "none", " ".join(json.loads(other["target"])),
                " ".join(names[:-1]) + " XYZZY", "".join(names), f"They are: {names}", names[0][:3], "VAR " + names[0],
                "\n".join(names), " ".join(n.title() for n in names), "ALL", " ".join(names) + " " + names[0],
                names[-1], f"**{names[0]}**"]
    if task == "qa_chn":
        return text_variants(gold, wrong) + [gold + "。", "答案是" + gold, gold[:1], "，。！", "the answer",
                                             "答案：" + gold + "。" + wrong, gold * 3, " ".join(gold)]
    if task == "many_shot":
        return text_variants(gold, wrong) + ["(A)", "(B)", "A", "B", "z", "The answer is (A).", "(C)", " a "]
    if task == "summary" or doc["task"] == "scbench_summary":
        sentences = gold.split("\n")
        return text_variants(gold, wrong) + [" ".join(sentences), "\n".join(sentences[::-1]), gold.replace(".", ""),
                                             "\n\n".join(sentences), gold + "\n" + wrong, "This paper " + gold]
    if doc["task"] == "scbench_passkey":
        return text_variants(gold, wrong) + [f"The pass key is {gold}.", gold[:-1], f"1{gold}", f"{gold}0",
                                             f"key: {gold} ({gold})", f"passkey{gold}", f"{gold[:2]} {gold[2:]}"]
    return text_variants(gold, wrong)


REPOQA_EXTRA = {  # RepoQA rows of the five other languages (only here): (name, function) pairs
    "java": [("gcd", "public static int gcd(int a, int b) {\n    while (b != 0) {\n        int t = b;\n        b = a % b;"
                     "\n        a = t;\n    }\n    return a;\n}"),
             ("toString", "@Override\npublic String toString() {\n    return \"Point(\" + x + \", \" + y + \")\";\n}")],
    "go": [("Reverse", "func Reverse(s string) string {\n\tr := []rune(s)\n\tfor i, j := 0, len(r)-1; i < j; i, j = "
                       "i+1, j-1 {\n\t\tr[i], r[j] = r[j], r[i]\n\t}\n\treturn string(r)\n}"),
           ("Inc", "func (c *Counter) Inc(key string) {\n\tc.mu.Lock()\n\tdefer c.mu.Unlock()\n\tc.counts[key]++\n}")],
    "rust": [("parse_pair", "pub fn parse_pair<'a>(s: &'a str, sep: char) -> Option<(&'a str, &'a str)> {\n    let idx "
                            "= s.find(sep)?;\n    Some((&s[..idx], &s[idx + 1..]))\n}"),
             ("fib", "fn fib(n: u64) -> u64 {\n    if n < 2 { n } else { fib(n - 1) + fib(n - 2) }\n}")],
    "typescript": [("fetchJson", "export async function fetchJson(url: string, opts: { retries: number }): "
                                 "Promise<unknown> {\n  for (let i = 0; i < opts.retries; i++) {\n    const res = await "
                                 "fetch(url);\n    if (res.ok) return res.json();\n  }\n  throw new Error(`failed: "
                                 "${url}`);\n}"),
                   ("clamp", "function clamp(x: number, lo: number, hi: number): number {\n  return Math.min(hi, "
                             "Math.max(lo, x));\n}")],
    "cpp": [("maxOf", "template <typename T>\nT maxOf(const std::vector<T>& v) {\n    T best = v[0];\n    for (const "
                      "auto& x : v) { if (x > best) best = x; }\n    return best;\n}"),
            ("pop", "int Stack::pop() {\n    int v = data_.back();\n    data_.pop_back();\n    return v;\n}")],
}
HELPERS = {"python": "def helper(x):\n    return x + 1", "java": "static int helper(int x) {\n    return x + 1;\n}",
           "go": "func helper(x int) int {\n\treturn x + 1\n}", "rust": "fn helper(x: i32) -> i32 {\n    x + 1\n}",
           "typescript": "function helper(x: number): number {\n  return x + 1;\n}",
           "cpp": "int helper(int x) {\n    return x + 1;\n}"}
PREAMBLE = {"python": "import os\nfrom typing import Any", "java": "import java.util.List;", "go": "import \"fmt\"",
            "rust": "use std::collections::HashMap;", "typescript": "import { x } from \"./x\";",
            "cpp": "#include <vector>"}
COMMENT = {"python": "# the function asked for", **{lang: "// the function asked for" for lang in HELPERS if lang != "python"}}


def repoqa_rows() -> list[dict]:
    rows = []
    for lang, functions in REPOQA_EXTRA.items():
        context = "\n\n".join(code for _, code in functions)
        rows.append({"id": f"extra-{lang}", "context": context, "lang": lang, "repo": f"demo/{lang}",
                     "multi_turns": [{"input": f"Retrieve the function {name}.", "answer": code, "name": name}
                                     for name, code in functions]})
    return rows


def repoqa_variants(doc: dict, other: dict) -> list[str]:
    """Answers to a RepoQA query: the function as asked, in other formats, with more code around it, or another."""
    gold, lang, wrong = doc["answer"], doc["lang"], other["answer"]
    lines = gold.split("\n")
    wrapped = ("class A:\n" + textwrap.indent(gold, "    ") if lang == "python" else
               "public class A {\n" + textwrap.indent(gold, "    ") + "\n}" if lang == "java" else
               "impl A {\n" + textwrap.indent(gold, "    ") + "\n}" if lang == "rust" else
               "namespace a {\n" + gold + "\n}" if lang == "cpp" else "// a\n" + gold)
    decorator = {"python": "@staticmethod", "java": "@Deprecated", "rust": "#[inline]", "cpp": "inline",
                 "typescript": "export", "go": "// Deprecated: no"}[lang]
    return [f"```{lang}\n{gold}\n```", gold, f"Here is the function:\n```{lang}\n{gold}\n```\nIt is short.",
            f"```\n{gold}\n```", f"```{lang}\n{wrong}\n```", f"```{lang}\n{HELPERS[lang]}\n\n{gold}\n```",
            f"```{lang}\n{chr(10).join(lines[: max(1, len(lines) // 2)])}\n```",
            f"```{lang}\n{PREAMBLE[lang]}\n\n{gold}\n```", f"```{lang}\n{gold}\n```\n\n```{lang}\n{wrong}\n```",
            f"```{lang}\n{gold}\n", f"```{lang}\n{gold.replace(doc['name'], doc['name'] + '_v2')}\n```", "",
            f"```{lang}\n{gold}\n\n{HELPERS[lang]}\n```", f"```{lang}\n{wrapped}\n```",
            f"```{lang}\n{COMMENT[lang]}\n{gold}\n```", f"```{lang}\n{decorator}\n{gold}\n```",
            f"```{lang}\n{gold.replace('    ', chr(9))}\n```", f"```{lang}\n{doc['context']}\n```",
            f"```{lang}\n{gold}```", f"```{lang}\n{gold}\n```\n```{lang}\n{HELPERS[lang]}\n```"]


def build_cases(utils, scbench, generators) -> tuple[dict, dict]:
    """Per task: the rows (fixture; RepoQA with the extra languages), the docs, and the predictions to score."""
    cases, docs_by_task = {}, {}
    for task in scbench.TASKS:
        rows = scbench.read_file(str(FIXTURES / f"scbench_{task}.jsonl"))
        if task == "repoqa":
            rows += repoqa_rows()
        if task in generators.SYNTHETIC:  # and two sessions of evalkit's generator
            rows += [{**row, "id": f"generated-{row['id']}"} for row in generators.generate(task, [256], 2, 3, 99)]
        docs = scbench.rows_to_docs(rows, task, 5)
        predictions = []
        for index, doc in enumerate(docs):
            other = docs[(index + 1) % len(docs)]
            if doc["task"] == "scbench_repoqa":
                texts = repoqa_variants(doc, other if other["task"] == "scbench_repoqa" else doc)
            else:
                texts = task_variants(task, doc, other)
            predictions += [{"doc": index, "pred": text} for text in texts]
        cases[task] = {"rows": rows, "docs": docs, "cases": predictions}
        docs_by_task[task] = docs
    return cases, docs_by_task


# -- comparison (evalkit's side) -----------------------------------------------------------------------------------
def _chat_follow_up(text: str) -> tuple[str, str, str]:
    """An official chat follow-up, ``{gold}<|end|><|user|>{text}<|end|><|assistant|>{forced}``, in its parts."""
    gold, _, rest = text.partition(f"{END}<|user|>")
    user, _, forced = rest.partition(f"{END}{GEN}")
    return gold, user, forced


def compare_prompts(utils, docs: list[dict], official: list[dict]) -> dict[str, list[int]]:
    counts = {key: [0, 0] for key in ("first turn", "chat follow-up", "history", "forced prefix", "plain follow-up",
                                      "request context", "request query")}

    def count(key, equal):
        counts[key][0] += bool(equal)
        counts[key][1] += 1

    sessions: dict[str, list[dict]] = {}
    for doc in docs:
        sessions.setdefault(doc["session_id"], []).append(doc)
    for turns, prompts in zip(sessions.values(), official):
        count("first turn", prompts["plain"][0] == utils.doc_to_text(turns[0]))
        first_chat = prompts["chat"][0].removeprefix("<|user|>").removesuffix(END + GEN)
        count("first turn", first_chat == utils.doc_to_text(turns[0]))
        for previous, doc, plain, chat in zip(turns, turns[1:], prompts["plain"][1:], prompts["chat"][1:]):
            gold, user, forced = _chat_follow_up(chat)
            count("history", gold == utils.doc_to_history(previous))
            count("chat follow-up", user == utils.doc_to_follow_up(doc))
            count("forced prefix", forced == utils.doc_to_follow_up_prefix(doc))
            count("plain follow-up", plain == utils.doc_to_history(previous) + utils.doc_to_follow_up_plain(doc))
        for key in ("scdq", "scdq_chat"):
            context, *queries = prompts[key]
            own_context = utils.doc_to_text(turns[0]).removesuffix(utils.doc_to_question(turns[0]))
            count("request context", context.removeprefix("<|user|>") == own_context)
            for doc, query in zip(turns, queries):
                count("request query", "\n\n" + query.removesuffix(END + GEN) == utils.doc_to_question(doc))
    return counts


def compare(parity, args) -> None:
    sys.path.insert(0, str(ROOT))
    from evalkit.tasks.scbench import generators, scbench, scoring, utils

    cases, docs_by_task = build_cases(utils, scbench, generators)
    given = parity.folder / "cases.json"
    given.write_text(json.dumps(cases, ensure_ascii=False))
    official_results = parity.run("official", "--cases", str(given), "--official", str(official_files(args)))
    print(f"{'task':30} {'scorer agrees':>14}  prompts identical (first turn / chat follow-up / history / forced "
          "prefix / plain follow-up / request context / request query)")
    totals = [0, 0, 0, 0, 0]  # equal, all; official ones, between, zeros
    for task in scbench.TASKS:
        docs, result = docs_by_task[task], official_results[task]
        ours = [next(iter(utils.process_results(docs[c["doc"]], [c["pred"]]).values())) for c in cases[task]["cases"]]
        agree = sum(abs(a - b) <= 1e-9 for a, b in zip(ours, result["scores"]))
        counts = compare_prompts(utils, docs, result["prompts"])
        prompts = " / ".join(f"{same}/{total}" for same, total in counts.values())
        print(f"scbench_{task:22} {agree:>6}/{len(ours):<7}  {prompts}")
        values = result["scores"]
        totals = [a + b for a, b in zip(totals, (agree, len(ours), sum(v == 1 for v in values),
                                                 sum(0 < v < 1 for v in values), sum(v == 0 for v in values)))]
        print(f"{'':30} official scores: {sum(v == 1 for v in values)} one, {sum(0 < v < 1 for v in values)} between, "
              f"{sum(v == 0 for v in values)} zero")
        if "matches" in result:
            _compare_matches(scoring, docs, cases[task]["cases"], result)
        for (a, b), case in zip(zip(ours, result["scores"]), cases[task]["cases"]):
            if abs(a - b) > 1e-9 and os.environ.get("PARITY_VERBOSE"):
                print(f"    differs: ours {a} official {b}: {case['pred'][:100]!r}")
    print(f"all tasks: scores equal {totals[0]}/{totals[1]} (official: {totals[2]} one, {totals[3]} between, "
          f"{totals[4]} zero)")


def _compare_matches(scoring, docs, cases, result) -> None:
    """RepoQA: the port's function extraction (heuristic without tree-sitter) and best match beside the official."""
    pairs = [(case, match) for case, match in zip(cases, result["matches"]) if match is not None]
    same_text = same_match = 0
    for case, (text, best, similarity) in pairs:
        doc = docs[case["doc"]]
        same_text += scoring.sanitize_output(case["pred"], doc["lang"]) == text
        own_best, own_similarity = scoring.repoqa_best_match(case["pred"], doc["lang"], json.loads(doc["needles"]))
        same_match += own_best == best and abs(own_similarity - similarity) <= 1e-12
    extraction = "tree-sitter" if scoring.TREE_SITTER else "heuristic"
    print(f"{'':30} RepoQA turns: extracted code identical {same_text}/{len(pairs)} ({extraction}), best match and "
          f"BLEU equal {same_match}/{len(pairs)}")
    if result["port_tree_sitter"]:
        exact = sum(abs(a - b) <= 1e-9 for a, b in zip(result["port_scores"], result["scores"]))
        print(f"{'':30} with tree-sitter (in the throwaway environment): scores equal {exact}/{len(cases)}")


def official_files(args) -> Path:
    """A folder with the official files and ./rouge/rouge.py (evaluate's metric script) where one is at hand."""
    folder = Path(tempfile.mkdtemp(prefix="scbench-official-"))
    for name in OFFICIAL_FILES:
        if args.official:
            (folder / name).write_text((Path(args.official) / name).read_text())
        else:
            text = subprocess.run(["git", f"--git-dir={args.mirror}", "show", f"HEAD:scbench/{name}"], check=True,
                                  capture_output=True, text=True).stdout
            (folder / name).write_text(text)
    rouge = None
    if args.rouge_script:
        rouge = Path(args.rouge_script).read_text()
    elif Path(args.evaluate_mirror).exists():
        rouge = subprocess.run(["git", f"--git-dir={args.evaluate_mirror}", "show", "HEAD:metrics/rouge/rouge.py"],
                               check=True, capture_output=True, text=True).stdout
    if rouge is not None:
        (folder / "rouge").mkdir()
        (folder / "rouge" / "rouge.py").write_text(rouge)
    return folder


def options(parser) -> None:
    parser.add_argument("venv", nargs="?", help="the throwaway virtual environment of the official side")
    parser.add_argument("--official", help="a folder holding compute_scores.py, eval_utils.py, repo_qa_utils.py")
    parser.add_argument("--mirror", default=MINFERENCE_MIRROR, help="a git mirror of microsoft/MInference")
    parser.add_argument("--rouge-script", help="evaluate's metrics/rouge/rouge.py, for an offline machine")
    parser.add_argument("--evaluate-mirror", default=EVALUATE_MIRROR, help="a git mirror of huggingface/evaluate")
    parser.add_argument("--cases", help=argparse.SUPPRESS)


def check(parser, args) -> None:
    if not args.venv:
        parser.error("give the throwaway virtual environment's path (see the docstring)")
    if not args.official and not Path(args.mirror).exists():
        parser.error("give the official files: --official MInference/scbench (a clone's folder) or --mirror GITDIR")


def main() -> None:
    sys.path.insert(0, str(HERE.parent))
    from parity_runner import Side, run_parity

    official = Side(lambda args: official_side(Path(args.cases), Path(args.official),
                                               ROOT / "tasks" / "scbench" / "scoring.py"), reference=True)
    run_parity(str(HERE), __doc__, {"official": official}, compare, options=options, check=check,
               environment=lambda args: Path(args.venv) / "bin" / "python")


if __name__ == "__main__":
    main()
