"""SCBench (Li et al., 2024, arXiv 2412.10319; microsoft/MInference ``scbench/``): its 12 shared-context tasks, ported
from the official code. This module: the constants, ``eval_utils.py``'s templates and the prompts of a doc, and the
rows (hub or file) checked and cut into per-turn docs (``run_scbench.py``: the turn cut). Beside it: scoring.py (the
ground truth and ``compute_scores.py``'s and ``repo_qa_utils.py``'s scorers) and generators.py (evalkit's own offline
generators for the four synthetic tasks, which the official repository does not ship); the names callers used here
before the split are re-exported.

Pure Python: the standard library, and ``datasets`` (or ``pyarrow``) only to read the hub or a Parquet file.

A row is the hub's: ``{id, context, multi_turns: [{input, answer, ...}]}`` (mf: ``context`` a list of ints, answers
ints; choice_eng turns: ``options``; repoqa rows: ``lang``, ``repo``, turns ``name``; mixed tasks: turns ``task``).
A doc is one turn of one row (:func:`rows_to_docs`); the prompts (:func:`context_part`, :func:`question`,
:func:`follow_up`, ...) and :func:`scoring.score` read docs.
"""

from __future__ import annotations

import collections
import json
import re
from pathlib import Path

# moved to generators.py and scoring.py; re-exported for callers of the one-module port
from evalkit.tasks.scbench.generators import (  # noqa: F401 (re-exported)
    CHARS_PER_TOKEN,
    GENERATOR_VERSION,
    MF_STATISTICS,
    SYNTHETIC,
    generate,
)
from evalkit.tasks.scbench.scoring import (  # noqa: F401 (re-exported)
    CODE_EXTRACTOR,
    TREE_SITTER,
    repoqa_best_match,
    sanitize_output,
    score,
    score_rouge_lsum,
    sentence_bleu,
)

HUB_ID = "microsoft/SCBench"
TASKS = ("kv", "prefix_suffix", "vt", "repoqa", "qa_eng", "qa_chn", "choice_eng", "many_shot", "summary", "mf",
         "summary_with_needles", "repoqa_and_kv")
SOURCES = ("auto", "generated", "hub", "file")
# eval_utils.DATA_NAME_TO_MAX_NEW_TOKENS (a mixed task's cap is per turn, by the turn's sub-task)
MAX_NEW_TOKENS = {"choice_eng": 40, "qa_eng": 40, "qa_chn": 40, "kv": 150, "mf": 5, "prefix_suffix": 150,
                  "repoqa": 1024, "summary": 200, "vt": 30, "many_shot": 10,
                  "summary_with_needles": {"scbench_summary": 800, "scbench_passkey": 15},
                  "repoqa_and_kv": {"scbench_repoqa": 1024, "scbench_kv": 80}}
MIXED = {"summary_with_needles": ("scbench_summary", "scbench_passkey"),
         "repoqa_and_kv": ("scbench_repoqa", "scbench_kv")}
# the metric each task reports: compute_scores' per-turn value of its scorer
METRICS = {"kv": "accuracy", "prefix_suffix": "accuracy", "vt": "string_match_all", "repoqa": "pass_at_1",
           "qa_eng": "accuracy", "qa_chn": "qa_f1_zh", "choice_eng": "accuracy", "many_shot": "accuracy",
           "summary": "rougeLsum", "mf": "accuracy", "summary_with_needles": "score", "repoqa_and_kv": "score"}
# the tasks whose official prompt builder reads eg["context"] if present, else eg["input"] (the generic branch)
CONTEXT_OR_INPUT = ("kv", "prefix_suffix", "vt", "repoqa", "many_shot", "summary_with_needles", "repoqa_and_kv")
LANGUAGES = ("python", "java", "typescript", "rust", "cpp", "go")  # repo_qa_utils.FUNCTION_QUERY

# -- eval_utils.py's templates, verbatim ------------------------------------------------------------------------------
_CHOICE = "Question: {question}\nA. {OPTION_A}\nB. {OPTION_B}\nC. {OPTION_C}\nD. {OPTION_D}\n\n"
FIRST_TURN = {  # multiturn_templates: turn 1 (and, cut after {context}, multiturn_templates_scdq)
    "kv": "Extract the value corresponding to the specified key in the JSON object below.\n\n{context}\n\n{input}",
    "choice_eng": "Read the book and answer the question.\n\n{context}\n\n" + _CHOICE + "The the correct answer is",
    "qa_eng": "Read the book and answer the question. Be very concise in your answer.\n\n{context}\n\nQuestion: "
              "{question}\nAnswer:",
    "qa_chn": "阅读以下书籍然后回答问题。\n\n{context}\n\n问题：{question}\n答案：",
    "mf": "{prefix}\n\n{context}\n\n{input}",
    "repoqa": "Based on the function description and code context, please retrieve and repeat the exact described "
              "function from the code context in a code block wrapped by ```:\n\n{context}\n\n{input}",
    **{name: "{context}\n\n{input}" for name in ("summary", "vt", "many_shot", "summary_with_needles",
                                                  "repoqa_and_kv", "prefix_suffix")},
}
CHAT_FOLLOW_UP = {  # multiturn_follow_up_templates_in_chat_tempate: a later turn's user text in a chat
    **{name: "{input}" for name in TASKS},
    "choice_eng": _CHOICE + "The the correct answer is",
    "qa_eng": "Question: {question}\nAnswer:",
    "qa_chn": "问题：{question}\n答案：",
    "mf": "{prefix}\n\n{input}",
}
PLAIN_FOLLOW_UP = {  # multiturn_follow_up_templates: without a chat template, after the gold answer ({pre_ans})
    **{name: "{pre_ans}\n\n{input}" for name in TASKS},
    "choice_eng": "{pre_ans}\n\n" + _CHOICE + "The letter of the correct answer is",
    "qa_eng": "{pre_ans}\n\nQuestion: {question}\nAnswer:",
    "qa_chn": "{pre_ans}\n\n问题：{question}\n答案：",
    "mf": "{pre_ans}\n\n{prefix}\n\n{input}",
}
SUMMARY_FOLLOW_UP_PREFIX = "This paper"  # create_multiturn_prompt: appended after a summary follow-up's chat template


def max_gen_toks(task: str) -> int:
    """The most new tokens a turn of ``task`` may take (a mixed task's: the larger of its sub-tasks')."""
    cap = MAX_NEW_TOKENS[task]
    return max(cap.values()) if isinstance(cap, dict) else cap


def mf_prefix(query: str) -> str:
    """eval_utils: ``re.findall(r"The .+ is", input)[0].lower()[:-3]`` as ``What is {target}?``."""
    return f"What is {re.findall(r'The .+ is', query)[0].lower()[:-3]}?"


# -- prompts of a doc ---------------------------------------------------------------------------------------------------
def _fields(doc: dict, prefix: str = "") -> dict:
    options = list(doc.get("options") or [])
    return {"input": doc["input"], "question": doc["input"], "prefix": prefix,
            **{f"OPTION_{letter}": options[i] for i, letter in enumerate("ABCD") if i < len(options)}}


def context_part(doc: dict) -> str:
    """The first-turn template up to and including the context: the same for every turn of a session. It equals
    the official multi-request context prompt (``multiturn_templates_scdq``) but for mf, whose official one starts
    with turn 1's raw input: here it starts as turn 1's prompt does, with ``What is <turn 1's target>?``."""
    head = FIRST_TURN[doc["scbench_task"]].split("{context}")[0]
    return head.format(prefix=doc.get("prefix", "")) + doc["context"]


def question(doc: dict) -> str:
    """What follows the context in this doc's single request: the first-turn template's query part (``\\n\\n`` then the
    query). For mf turns after the first, the query carries its own ``What is ...?`` line as the official follow-ups
    and multi-request queries do (the session's shared prefix names turn 1's target only)."""
    task = doc["scbench_task"]
    if task == "mf" and doc["turn"] > 1:
        return "\n\n" + CHAT_FOLLOW_UP["mf"].format(**_fields(doc, mf_prefix(doc["input"])))
    return FIRST_TURN[task].split("{context}")[1].format(**_fields(doc))


def follow_up(doc: dict) -> str:
    """The user text of this doc's query at turn >= 2 of a chat (``multiturn_follow_up_templates_in_chat_tempate``);
    mf's names the session's last turn's target, as the official code's stale loop variable does."""
    return CHAT_FOLLOW_UP[doc["scbench_task"]].format(**_fields(doc, doc.get("chat_prefix", "")))


def follow_up_plain(doc: dict) -> str:
    """The text after the gold answer at turn >= 2 without a chat template (``multiturn_follow_up_templates``)."""
    template = PLAIN_FOLLOW_UP[doc["scbench_task"]].removeprefix("{pre_ans}")
    prefix = mf_prefix(doc["input"]) if doc["scbench_task"] == "mf" else ""
    return template.format(**_fields(doc, prefix))


def follow_up_prefix(doc: dict) -> str:
    """What the official chat follow-up appends after the assistant's generation prompt (summary: ``This paper``):
    forced answer text the prediction does not contain."""
    return SUMMARY_FOLLOW_UP_PREFIX if doc["scbench_task"] == "summary" and doc["turn"] > 1 else ""


# -- rows: reading and checking ------------------------------------------------------------------------------------------
class RowError(ValueError):
    """What is wrong with one row: ``field`` and the problem."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"field {field!r}: {problem}")
        self.field, self.problem = field, problem


def row_context(row: dict, task: str):
    """The row's context as the official prompt builder reads it (the generic branch falls back to ``input``)."""
    if task in CONTEXT_OR_INPUT and "context" not in row:
        return row.get("input")
    return row.get("context")


def check_row(row, task: str) -> dict:
    """The row if the official code can build its prompts and ground truth; else :class:`RowError`."""
    if not isinstance(row, dict):
        raise RowError("row", f"must be a JSON object, got {type(row).__name__}")
    context = row_context(row, task)
    if context is None:
        raise RowError("context", "missing" + (" (nor a row-level 'input')" if task in CONTEXT_OR_INPUT else ""))
    if not (isinstance(context, str) or (task == "mf" and isinstance(context, list))):
        raise RowError("context", f"must be a string{' or a list of numbers' if task == 'mf' else ''}, "
                                  f"got {type(context).__name__}")
    turns = row.get("multi_turns")
    if turns is None:
        raise RowError("multi_turns", "missing")
    if not isinstance(turns, list) or not turns:
        raise RowError("multi_turns", "must be a non-empty list of turns")
    if task in ("repoqa", "repoqa_and_kv"):
        if row.get("lang") not in LANGUAGES:
            raise RowError("lang", f"must be one of {', '.join(LANGUAGES)}, got {row.get('lang')!r}")
        if not isinstance(row.get("repo"), str):
            raise RowError("repo", "missing (a string)")
    for index, turn in enumerate(turns):
        _check_turn(turn, task, f"multi_turns[{index}]")
    return row


def _check_turn(turn, task: str, where: str) -> None:
    if not isinstance(turn, dict):
        raise RowError(where, "must be an object with input and answer")
    if not isinstance(turn.get("input"), str):
        raise RowError(f"{where}.input", "missing" if turn.get("input") is None else "must be a string")
    answer = turn.get("answer")
    if answer is None:
        raise RowError(f"{where}.answer", "missing")
    sub = turn.get("task") if task in MIXED else f"scbench_{task}"
    if task in MIXED and sub not in MIXED[task]:
        raise RowError(f"{where}.task", f"must be one of {', '.join(MIXED[task])}, got {sub!r}")
    problem = _answer_problem(sub, answer)
    if problem:
        raise RowError(f"{where}.answer", problem)
    if sub == "scbench_mf" and not re.findall(r"The .+ is", turn["input"]):
        raise RowError(f"{where}.input", "has no 'The ... is' (the target the mf prompt names)")
    if sub == "scbench_choice_eng":
        options = turn.get("options")
        if not isinstance(options, list) or len(options) < 4 or not all(isinstance(o, str) for o in options):
            raise RowError(f"{where}.options", "must be a list of 4 strings")
        if answer not in options:
            raise RowError(f"{where}.answer", "is not one of the options")
    if sub == "scbench_repoqa" and not isinstance(turn.get("name"), str):
        raise RowError(f"{where}.name", "missing (the function's name)")


def _answer_problem(sub: str, answer) -> str | None:
    """Why the official scorer of ``sub`` could not take ``answer`` as its label (None: it can)."""
    strings = isinstance(answer, list) and answer and all(isinstance(a, str) for a in answer)
    if sub == "scbench_mf":
        first = answer[0] if isinstance(answer, list) and answer else answer
        return None if _is_number(first) else f"must be a number, got {answer!r:.40}"
    if sub in ("scbench_vt", "scbench_many_shot", "scbench_qa_chn"):  # scored item by item
        if not answer:
            return "is empty"
        return None if isinstance(answer, str) or strings else "must be a string or a list of strings"
    if sub == "scbench_passkey":
        return None if isinstance(answer, (str, int)) or (isinstance(answer, list) and answer) else "must be a string"
    return None if isinstance(answer, str) else f"must be a string, got {type(answer).__name__}"


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_file(path: str) -> list[dict]:
    """The rows of a local ``.jsonl``, ``.json`` (a list of rows) or ``.parquet`` file; a folder, or a file without
    rows, is one line."""
    file = Path(path).expanduser()
    if file.is_dir():
        raise ValueError(f"task.dataset.path: {path} is a folder; give a .jsonl, .json or .parquet file of rows")
    if not file.is_file():
        raise FileNotFoundError(f"task.dataset.path: no such file: {path}")
    rows = _file_rows(file, path)
    if not rows:
        raise ValueError(f"task.dataset.path: {path} holds no rows")
    return rows


def _file_rows(file: Path, path: str) -> list[dict]:
    if file.suffix == ".parquet":
        import pyarrow.parquet

        return pyarrow.parquet.read_table(file).to_pylist()
    if file.suffix not in (".jsonl", ".json"):
        raise ValueError(f"task.dataset.path: {path}: need a .jsonl, .json or .parquet file")
    text = file.read_text(encoding="utf-8")
    if file.suffix == ".json":
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: line {error.lineno}: not valid JSON ({error.msg})") from None
        rows = rows if isinstance(rows, list) else [rows]
        if not all(isinstance(row, dict) for row in rows):
            raise ValueError(f"{path}: expected a list of JSON objects (or JSON Lines)")
        return rows
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}: line {number}: not valid JSON ({error.msg})") from None
            if not isinstance(rows[-1], dict):
                raise ValueError(f"{path}: line {number}: a row must be a JSON object, got {type(rows[-1]).__name__}")
    return rows


def resolve_source(task: str, source: str = "auto", path: str | None = None) -> str:
    """generated | hub | file: ``auto`` is file with a path, generated for the synthetic tasks, else hub."""
    if task not in TASKS:
        raise ValueError(f"task.dataset.task must be one of {', '.join(TASKS)}, got {task!r}")
    if source not in SOURCES:
        raise ValueError(f"task.dataset.source must be one of {', '.join(SOURCES)}, got {source!r}")
    if source == "auto":
        return "file" if path else "generated" if task in SYNTHETIC else "hub"
    if source == "file" and not path:
        raise ValueError("task.dataset.source=file needs task.dataset.path=/path/to/rows.jsonl")
    if source != "file" and path:
        raise ValueError(f"task.dataset.path is given with task.dataset.source={source}: use source=file (or auto)")
    if source == "generated" and task not in SYNTHETIC:
        raise ValueError(f"task.dataset.source=generated is for {', '.join(SYNTHETIC)} only; scbench_{task} reads "
                         f"the hub ({HUB_ID}) or task.dataset.path")
    return source


def load_hub(task: str, revision: str | None = None) -> list[dict]:
    """The hub rows of ``scbench_<task>`` (split test); offline, a one-line error naming the way out."""
    import datasets

    try:
        return list(datasets.load_dataset(HUB_ID, f"scbench_{task}", split="test", revision=revision))
    except (ConnectionError, FileNotFoundError) as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        kind = ConnectionError if isinstance(error, ConnectionError) else FileNotFoundError
        raise kind(f"could not load {HUB_ID} (config scbench_{task}) from the hub: {first}. Without network, pass a "
                   f"local file in its schema: task.dataset.path=/path/to/scbench_{task}.jsonl"
                   + (" (or task.dataset.source=generated)" if task in SYNTHETIC else "")) from None


# -- rows to docs ------------------------------------------------------------------------------------------------------
def cut_turns(rows: list[dict], turns: int) -> list[dict]:
    """run_scbench.py's ``--max_turns``: every row cut to its first ``turns`` turns, only if ``0 < turns <`` row 0's
    turn count (so a later row keeps more turns when row 0 has no more than ``turns``)."""
    if rows and 0 < turns < len(rows[0]["multi_turns"]):
        return [{**row, "multi_turns": row["multi_turns"][:turns]} for row in rows]
    return rows


def rows_to_docs(rows: list[dict], task: str, turns: int = 5, where: str | None = None) -> list[dict]:
    """One doc per turn of each row (checked: a bad row is a one-line ValueError naming it and the field)."""
    where = where or f"scbench_{task}"
    seen = {}
    for position, row in enumerate(rows, 1):
        ident = row_id(row, position - 1)
        try:
            check_row(row, task)
            if str(ident) in seen:
                raise RowError("id", f"duplicate id (first at row {seen[str(ident)]})")
        except RowError as error:
            raise ValueError(f"{where}: row {position} (id={ident}): {error}") from None
        seen[str(ident)] = position
    rows = cut_turns(rows, int(turns))
    docs = []
    for position, row in enumerate(rows):
        docs += _row_docs(row, task, row_id(row, position))
    if task in ("repoqa", "repoqa_and_kv"):
        pools = needle_pools(docs)
        for doc in docs:
            doc["needles"] = json.dumps(pools.get(doc["repo"], []), ensure_ascii=False)
    return docs


def row_id(row, index: int) -> str:
    """A row's id as a session id: its ``id``, else its 0-based position (as run_scbench.py numbers rows)."""
    ident = row.get("id") if isinstance(row, dict) else None
    return str(index if ident is None else ident)


def _row_docs(row: dict, task: str, session_id: str) -> list[dict]:
    context = str(row_context(row, task))  # str.format renders mf's list as its repr, as the official prompt does
    turns = row["multi_turns"]
    length = row.get("length")
    session = {"session_id": session_id, "context": context, "scbench_task": task,
               "length": int(length) if isinstance(length, int) else len(context) // CHARS_PER_TOKEN}
    if task == "mf":
        session |= {"prefix": mf_prefix(turns[0]["input"]), "chat_prefix": mf_prefix(turns[-1]["input"])}
    docs = []
    for number, turn in enumerate(turns, 1):
        doc = {**session, "turn": number, "input": turn["input"], "answer": str(turn["answer"]),
               "target": json.dumps(turn["answer"], ensure_ascii=False),
               "task": turn["task"] if task in MIXED else f"scbench_{task}"}
        if task == "choice_eng":
            doc["options"] = list(turn["options"])
        if task in ("repoqa", "repoqa_and_kv"):  # the extractor that scores a RepoQA turn in this process
            doc |= {"lang": row["lang"], "repo": row["repo"], "name": turn.get("name") or "",
                    "code_extractor": CODE_EXTRACTOR if doc["task"] == "scbench_repoqa" else None}
        docs.append(doc)
    return docs


def needle_pools(docs) -> dict[str, list[dict]]:
    """compute_scores' ``needle_by_repo`` over ``docs`` (the turns scored together): every RepoQA turn's function,
    by repo, in doc order; the candidates a prediction's best BLEU match is picked from."""
    pools: dict[str, list[dict]] = collections.defaultdict(list)
    for doc in docs:
        if doc["task"] == "scbench_repoqa":
            pools[doc["repo"]].append({"needle": json.loads(doc["target"]), "name": doc["name"]})
    return dict(pools)
