"""The task type: a run's task is one of evalkit's folders or a task of lm-eval's registry, and the harness asks it
(never a task's name nor a `source` key) for its config, its identity inputs, its hooks and its primary metric."""

from __future__ import annotations

import shutil
import textwrap
import uuid
from pathlib import Path

import pytest

from evalkit.benchmark import FolderTask, RegistryTask, task_of
from evalkit.core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def throwaway_task():
    """A task made of its folder alone (YAML, utils.py and a module of its own), removed afterwards."""
    name = f"probe_task_{uuid.uuid4().hex[:8]}"
    folder = ROOT / "tasks" / name
    folder.mkdir()
    (folder / f"{name}.yaml").write_text(textwrap.dedent(f"""\
        task: {name}
        custom_dataset: !function utils.load
        test_split: test
        output_type: generate_until
        doc_to_text: "{{{{question}}}}"
        doc_to_target: answer
        process_results: !function utils.process_results
        metric_list:
          - metric: exact
            aggregation: mean
            higher_is_better: true
        metadata:
          version: 1.0
        """))
    (folder / "words.py").write_text("WORDS = ['k1', 'v2', 'k3']\n")
    (folder / "utils.py").write_text(textwrap.dedent(f"""\
        import datasets
        from transformers import AutoTokenizer

        from evalkit.tasks.{name}.words import WORDS


        def load(pretrained=None, **_options):
            tokenizer = AutoTokenizer.from_pretrained(pretrained)  # the run's own tokenizer
            rows = [{{"id": word, "question": word, "answer": word, "tokens": len(tokenizer(word)["input_ids"])}}
                    for word in WORDS]
            return datasets.DatasetDict({{"test": datasets.Dataset.from_list(rows)}})


        def process_results(doc, results):
            return {{"exact": float(results[0] == doc["answer"])}}
        """))
    try:
        yield name
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_a_runs_task_options_say_which_kind_it_is():
    assert isinstance(task_of("needle"), FolderTask) and not task_of("needle").from_registry
    assert isinstance(task_of("aime25", {"source": "lm_eval"}), RegistryTask)
    assert task_of("needle").primary_metric() == "exact_match" and task_of("needle").heatmap() == ("depth", "length")
    assert task_of("aime25", {"source": "lm_eval"}).primary_metric() is None
    assert task_of("math500").members() == ["math500"]


def test_a_folder_tasks_identity_is_its_yaml_what_it_includes_and_its_version():
    """MATH-500 runs AIME24's YAML (and code): its identity covers both YAML files, and its own declared version."""
    assert set(task_of("math500").definition_paths()) == {ROOT / "tasks" / "math500" / "math500.yaml",
                                                         ROOT / "tasks" / "aime24" / "aime24.yaml"}
    assert task_of("math500").version() == "1.0" and task_of("aime25").version() == "1.0"  # aime25: AIME24's


def test_an_edit_to_a_tasks_code_keeps_its_identity_and_one_to_its_yaml_changes_it(throwaway_task):
    from evalkit.run.digest import task_definition

    task = task_of(throwaway_task)
    before = task_definition(task)
    (ROOT / "tasks" / throwaway_task / "words.py").write_text("WORDS = ['k1', 'v2', 'k3']  # the same words\n")
    assert task_definition(task) == before
    yaml = ROOT / "tasks" / throwaway_task / f"{throwaway_task}.yaml"
    yaml.write_text(yaml.read_text().replace("version: 1.0", "version: 2.0"))
    assert task_definition(task) != before and task_definition(task).startswith("version=2.0 ")


def test_a_task_without_a_version_is_refused_naming_its_yaml(throwaway_task):
    yaml = ROOT / "tasks" / throwaway_task / f"{throwaway_task}.yaml"
    yaml.write_text(yaml.read_text().replace("metadata:\n  version: 1.0\n", ""))
    with pytest.raises(ConfigError, match=f"task {throwaway_task} declares no version: add `metadata: {{version: 1.0}}` "
                                          f"to tasks/{throwaway_task}/{throwaway_task}.yaml"):
        task_of(throwaway_task).check()


def test_a_folder_task_builds_its_data_with_the_runs_tokenizer(throwaway_task, random_model_dir):
    """The run's model reaches the task's loader (with its dataset arguments, as lm-eval passes a registry task's
    metadata), so the data can be built with the run's own tokenizer; the loader's sibling module imports as a
    package's."""
    from transformers import AutoTokenizer

    from evalkit.run.tasks import load_task

    config = task_of(throwaway_task).config({}, pretrained=str(random_model_dir))
    assert config["metadata"]["pretrained"] == str(random_model_dir)
    built, skipped = load_task(config)
    tokenizer = AutoTokenizer.from_pretrained(random_model_dir)
    docs = list(built.test_docs())
    assert [doc["tokens"] for doc in docs] == [len(tokenizer(doc["question"])["input_ids"]) for doc in docs]
    assert [doc["id"] for doc in docs] == ["k1", "v2", "k3"] and skipped == []


def test_longbenchs_chain_of_thought_is_the_tasks_own_flow():
    """LongBench-v2's two calls are its hook (``generation_flow``), which leaves a run without ``cot`` to its one
    pass; other tasks have none."""
    flow = task_of("longbench_v2").generation_flow()
    assert flow is not None and task_of("needle").generation_flow() is None

    def no_evaluation(config):
        raise AssertionError("a run without cot is the runner's one pass")

    assert flow(no_evaluation, task_of("longbench_v2").config({}), {}, Path("unused")) is None


def test_longbenchs_chain_of_thought_runs_the_reasoning_then_the_answer(tmp_path):
    """The flow's first call reasons over the document (up to reasoning_max_gen_toks), the second gets the reasoning
    (its file) and is scored; the answer's rows carry the reasoning call's statistics."""
    flow = task_of("longbench_v2").generation_flow()
    config = task_of("longbench_v2").config({"dataset": {"cot": True, "reasoning_max_gen_toks": 7}})
    calls = []

    def evaluate(config):
        calls.append(config)
        text = "reasoned" if len(calls) == 1 else "The correct answer is (A)"
        return {"samples": {"longbench_v2": [{"doc": {"_id": "d1"}, "doc_id": 0, "resps": [[text]]}]}}

    results, stats, reasoning = flow(evaluate, config, {("longbench_v2", 0, 0): {"kept": 3}}, tmp_path / "run")
    assert calls[0]["generation_kwargs"]["max_gen_toks"] == 7 and "reasoning_file" not in calls[0]["dataset_kwargs"]
    assert Path(calls[1]["dataset_kwargs"]["reasoning_file"]).read_text().strip() == '{"id": "d1", "reasoning": "reasoned"}'
    assert reasoning == {"d1": "reasoned"} and stats == {("longbench_v2", 0, 0): {"kept": 3}}
    assert results["samples"]["longbench_v2"][0]["resps"] == [["The correct answer is (A)"]]
