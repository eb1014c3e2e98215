"""A task's identity is what it does: its YAML and its declared ``metadata.version`` (evalkit.run.digest), not its code's
bytes. So that a change of behaviour cannot slip in under the same identity, every shipped task's first prompt (lm-eval
builds it from a small deterministic input: generated data, or rows in the hub's schema) and the scores of two fixed
responses (the gold target and a wrong one) are pinned here with the version they belong to, in tests/task_golden.json.

A prompt or score that changes while the version stays is refused, naming the YAML to bump; after the bump (a new
identity: earlier results of the task are no longer resumed) ``python tests/test_task_versions.py`` rewrites the file
(``python tests/test_task_versions.py NAME`` pins a new task). An edit that keeps the behaviour (a helper tidied, an
import renamed) keeps the task's digest."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import uuid
from pathlib import Path

import pytest

from evalkit.benchmark import FolderTask, task_names
from evalkit.core.paths import tasks_dir
from evalkit.run.digest import task_definition

GOLDEN = Path(__file__).with_name("task_golden.json")
FIXTURES = Path(__file__).with_name("fixtures")
WRONG = "I cannot tell."

# Rows in the hub's schema of the tasks whose data is not generated (tests/test_benchmarks.py holds the same kinds).
AIME = [{"id": 60, "problem": "Find $2+2$.", "solution": "4", "answer": "4", "url": "u", "year": "2024"}]
MATH500 = [{"problem": "Simplify $\\frac{6}{4}$.", "solution": "...", "answer": "\\frac{3}{2}", "subject": "Algebra",
            "level": 2, "unique_id": "test/algebra/1.json"}]
LONGBENCH = [{"_id": "lb-1", "domain": "Single-Document QA", "sub_domain": "Academic", "difficulty": "easy",
              "length": "short", "question": "Which colour is the sky? ", "choice_A": " red ", "choice_B": "blue",
              "choice_C": "green", "choice_D": "black", "answer": "B", "context": "  The sky is blue.  "}]
LCB = [{"platform": "atcoder", "contest_id": "abc001", "question_title": "Sum",
        "question_content": "Read two integers and print their sum.", "question_id": "abc001_a",
        "contest_date": "2024-05-04T00:00:00", "starter_code": "", "difficulty": "easy",
        "public_test_cases": json.dumps([{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]),
        "private_test_cases": json.dumps([{"input": "10 -4\n", "output": "6\n", "testtype": "stdin"}]),
        "metadata": "{}"}]
SUM_PROGRAM = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"


def rows_file(folder: Path, name: str, rows: list[dict]) -> str:
    path = folder / f"{name}.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def inputs(task: str, folder: Path) -> tuple[dict, object]:
    """The task's dataset options for a small deterministic input, and its right response (from the doc and target)."""
    boxed = lambda doc, target: f"So the answer is \\boxed{{{target}}}."  # noqa: E731
    if task in ("aime24", "aime25"):
        return {"path": rows_file(folder, task, AIME)}, boxed
    if task == "math500":
        return {"path": rows_file(folder, task, MATH500)}, boxed
    if task == "longbench_v2":
        return {"path": rows_file(folder, task, LONGBENCH)}, lambda doc, target: f"The correct answer is ({target})"
    if task == "livecodebench":
        return {"path": rows_file(folder, task, LCB)}, lambda doc, target: SUM_PROGRAM
    if task == "kv_retrieval":
        return {"n_samples": 2, "min_pairs": 4, "max_pairs": 6}, lambda doc, target: doc["answer"]
    if task == "needle":
        return {"lengths": [300], "depths": [0.5], "per_cell": 1}, lambda doc, target: f" {target}."
    if task == "needle_multikey":
        return {"lengths": [300], "depths": [0.5], "keys": 3, "per_cell": 1}, lambda doc, target: f" {target}."
    if task == "needle_multiturn":
        return {"lengths": [300], "needles": 3, "per_length": 1}, lambda doc, target: f"{target}"
    if task == "agent_loop":
        return {"calls": 2, "n_sessions": 1, "doc_tokens": 60}, lambda doc, target: f"{target}"
    if task.startswith("scbench_"):  # rows in the hub's schema (tests/fixtures/scbench)
        code = task.startswith("scbench_repoqa")
        return {"source": "file", "path": str(FIXTURES / "scbench" / f"{task}.jsonl")}, lambda doc, target: (
            f"```python\n{doc['answer']}\n```" if code else str(doc["answer"]))
    raise KeyError(f"no input for task {task}: add one to inputs() in {Path(__file__).name}")


def behaviour(task: str, folder: Path) -> dict:
    """What the task does on its small input: its version, its first prompt as lm-eval builds it (without a chat
    template) and the scores of its right response and of a wrong one."""
    from evalkit.run.tasks import load_task

    options, right = inputs(task, folder)
    definition = FolderTask(task)
    config = definition.config({"dataset": options, "repeats": 1})
    built, _ = load_task(config, limit=1)
    built.build_all_requests(limit=1)
    instance = built.instances[0]
    prompt = instance.arguments[0]
    target = built.doc_to_target(instance.doc)
    scores = {kind: built.process_results(instance.doc, [response]) for kind, response in
              (("right", right(instance.doc, target)), ("wrong", WRONG))}
    return {"version": declared_version(task), "yaml": version_file(task),
            "prompt_sha256": hashlib.sha256(prompt.encode()).hexdigest(), "prompt_start": prompt[:120],
            "prompt_end": prompt[-120:], "scores": {kind: {name: plain(value) for name, value in sorted(scored.items())}
                                                    for kind, scored in scores.items()}}


def plain(value):
    """A score as JSON keeps it: NaN (no pass@k from one sample) as text, so that it equals itself."""
    return "nan" if isinstance(value, float) and value != value else round(value, 12) if isinstance(value, float) else value


def declared_version(task: str) -> str:
    return str((FolderTask(task).definition().get("metadata") or {}).get("version"))


def version_file(task: str) -> str:
    """The YAML that declares the task's version (its own, or one it includes: aime25 runs AIME24's)."""
    from evalkit.benchmark import definition

    return definition.declaring(FolderTask(task).yaml_path, "metadata").relative_to(tasks_dir().parent).as_posix()


def golden() -> dict:
    return json.loads(GOLDEN.read_text())


def test_every_shipped_task_is_pinned():
    assert sorted(set(task_names()) - set(golden())) == []


@pytest.mark.parametrize("task", task_names())
def test_a_tasks_behaviour_changes_only_with_its_version(task, tmp_path):
    pinned, now = golden()[task], behaviour(task, tmp_path)
    if now["version"] == pinned["version"]:
        changed = [part for part in ("prompt_sha256", "scores") if now[part] != pinned[part]]
        assert not changed, (f"task {task}: its {' and '.join(changed)} changed but its version did not: bump "
                             f"`version` in {now['yaml']} (metadata.version), then python tests/{Path(__file__).name}")
    else:
        pytest.fail(f"task {task}: version {pinned['version']} -> {now['version']}: rewrite {GOLDEN.name} with "
                    f"python tests/{Path(__file__).name}")
    assert now == pinned


@pytest.fixture
def copied_task():
    """A copy of the needle task under another name (its folder in tasks/, removed afterwards)."""
    name = f"copy_of_needle_{uuid.uuid4().hex[:8]}"
    folder = tasks_dir() / name
    shutil.copytree(tasks_dir() / "needle", folder, ignore=shutil.ignore_patterns("__pycache__"))
    (folder / "needle.yaml").rename(folder / f"{name}.yaml")
    yaml = folder / f"{name}.yaml"
    yaml.write_text(yaml.read_text().replace("task: needle", f"task: {name}"))
    try:
        yield name
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_editing_a_tasks_code_keeps_its_identity_and_its_yaml_or_version_changes_it(copied_task):
    folder = tasks_dir() / copied_task
    before = task_definition(FolderTask(copied_task))
    assert before.startswith("version=1.0 ")
    with (folder / "needle.py").open("a") as code:
        code.write("\n# a helper's comment: no behaviour changes\n")
    (folder / "helpers.py").write_text("HELPER = 1\n")
    assert task_definition(FolderTask(copied_task)) == before
    yaml = folder / f"{copied_task}.yaml"
    text = yaml.read_text()
    yaml.write_text(text.replace("max_gen_toks: 16", "max_gen_toks: 17"))
    assert task_definition(FolderTask(copied_task)) not in (before, None)
    yaml.write_text(text.replace("version: 1.0", "version: 2.0"))
    bumped = task_definition(FolderTask(copied_task))
    assert bumped.startswith("version=2.0 ") and bumped != before


if __name__ == "__main__":
    import tempfile

    keep = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    names = sorted(set(keep) | set(task_names()) if len(sys.argv) < 2 else set(sys.argv[1:]))
    with tempfile.TemporaryDirectory() as scratch:
        keep.update({name: behaviour(name, Path(scratch)) for name in names})
    GOLDEN.write_text(json.dumps(keep, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
    print(f"rewrote {GOLDEN} ({len(names)} tasks)", file=sys.stderr)
