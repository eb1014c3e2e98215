"""CONTRIBUTING.md's checklists stay true: the files they name exist for their examples, and a throwaway method and a
throwaway task, each added as the checklist says and nothing else, run through the CLI."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pandas as pd
import pytest
import yaml
from helpers import evalkit

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "CONTRIBUTING.md"
EXAMPLES = {"A new compression method": "knorm", "A new task": "needle", "A new model family": "gemma3_4b_it"}


def sections() -> dict[str, str]:
    parts = re.split(r"^## ", GUIDE.read_text(), flags=re.M)[1:]
    return {part.splitlines()[0].strip(): part for part in parts}


def named_paths(text: str) -> set[str]:
    """The repository paths a text names in backticks (``evalkit/x.py``, ``tasks/<name>/utils.py``)."""
    return {p for p in re.findall(r"`([\w<>./-]+/[\w<>.-]+)`", text) if not p.startswith(("http", "hydra/"))}


def test_every_file_the_checklists_name_exists_for_their_examples():
    found = sections()
    assert set(EXAMPLES) <= set(found)
    for title, example in EXAMPLES.items():
        paths = named_paths(found[title])
        assert any("<name>" in p for p in paths), title
        for path in paths:
            assert (ROOT / path.replace("<name>", example)).exists(), (title, path)


def test_every_task_folder_says_its_source_official_code_and_deviations():
    """Each task's README names its data, its official code (with the commit checked, where one exists) and its
    deviations, and the documentation's tasks page points to it."""
    readme = (ROOT / "docs" / "tasks.md").read_text()
    folders = sorted(p for p in (ROOT / "tasks").iterdir() if (p / f"{p.name}.yaml").exists())
    assert len(folders) >= 5
    for folder in folders:
        text = (folder / "README.md").read_text()
        assert text.startswith(f"# {folder.name}:"), folder.name
        assert "**Data**" in text and "**Official code**" in text and "\n## Deviations\n" in text, folder.name
        if "**Official code**: none" not in text:
            assert re.search(r"`[0-9a-f]{40}`", text), f"{folder.name}: the official code's commit"
        assert f"tasks/{folder.name}/README.md" in readme, folder.name


def test_a_task_readme_is_documentation_not_identity(tmp_path):
    """Editing a task's README leaves the task's fingerprint (so every run's digest) as it was; editing its YAML or code
    does not."""
    from evalkit.core.identity import fingerprint

    folder = tmp_path / "mytask"
    folder.mkdir()
    (folder / "mytask.yaml").write_text("task: mytask\n")
    (folder / "README.md").write_text("# mytask: first words\n")
    before = fingerprint([folder], skip_suffixes=(".md",))
    (folder / "README.md").write_text("# mytask: other words\n")
    assert fingerprint([folder], skip_suffixes=(".md",)) == before
    assert fingerprint([folder]) != fingerprint([folder], skip_suffixes=(".md",))
    (folder / "mytask.yaml").write_text("task: mytask\nrepeats: 2\n")
    assert fingerprint([folder], skip_suffixes=(".md",)) != before


def _added(files: dict[Path, str]):
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def _removed(files: dict[Path, str]) -> None:
    for path in files:
        path.unlink(missing_ok=True)
        if path.parent.is_dir() and path.parent.parent == ROOT / "tasks":
            shutil.rmtree(path.parent, ignore_errors=True)


@pytest.mark.slow
def test_a_method_is_its_file_its_yaml_and_its_test(tmp_path, random_model_dir):
    """The method checklist, followed to the letter with a KeyDiff-like prompt scorer: its file, its YAML and its
    exactness test, nothing else. Its test passes, every every-method test runs it (by its name), a bad value of its
    setting is one line before torch loads, the CLI runs it within its budget, and the baselines grid lists it."""
    name = f"probe_{uuid.uuid4().hex[:8]}"
    files = {
        ROOT / "evalkit" / "compression" / "methods" / f"{name}.py": f'''
            """A throwaway prompt scorer: keeps the keys least like the mean key (a test of the contributing checklist)."""
            import dataclasses
            from typing import ClassVar

            import torch

            from evalkit.core.method_settings import setting

            from .base import PromptScoring


            @dataclasses.dataclass
            class Probe(PromptScoring):
                name: ClassVar[str] = "{name}"
                sharpness: float = setting(1.0, low=0)

                def prefill_queries(self):
                    return 0

                def score(self, view):
                    keys, valid = view.keys.float(), view.key_valid[:, None, :, None]
                    mean = (keys * valid).sum(dim=2, keepdim=True) / valid.sum(dim=2, keepdim=True)
                    return -self.sharpness * torch.cosine_similarity(keys, mean, dim=-1)
            ''',
        ROOT / "conf" / "method" / f"{name}.yaml": f"name: {name}\nsink: 0\nwindow: 0\nsharpness: 1.0\n",
        ROOT / "tests" / f"test_{name}.py": f'''
            import torch
            from baseline_reference import full_run, top
            from conftest import random_prompt
            from test_methods import held_positions, reference_keys

            import evalkit.compression as ec


            def test_{name}_keeps_the_keys_least_like_the_mean(llama):
                prompt = random_prompt(50, seed=11)
                session = ec.CompressionSession(llama, ec.Probe(capacity=20))
                session.prefill(prompt)
                expected = {{layer: [top((-torch.cosine_similarity(k, k.mean(dim=0), dim=-1)).tolist(), 20)
                                     for k in r["key"]] for layer, r in full_run(llama, prompt).items()}}
                assert held_positions(session, reference_keys(llama, prompt)) == expected
            ''',
    }
    try:
        _added(files)
        tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
                                "-k", name, "tests/"], cwd=ROOT, capture_output=True, text=True, timeout=1200)
        assert tests.returncode == 0, tests.stdout[-3000:]
        passed = int(re.search(r"(\d+) passed", tests.stdout).group(1))
        assert passed >= 12, tests.stdout[-3000:]  # its own test and the every-method ones, by its name
        for every in ("test_methods.py", "test_engine.py", "test_chunked_prefill.py", "test_method_schema.py"):
            assert re.search(rf"{every}::\S*{name}", _collected(name)), every
        bad = evalkit(f"method={name}", "budget=4x", "method.sharpness=-1", cwd=tmp_path)
        assert bad.returncode == 2 and bad.stderr.strip() == "evalkit: config error: Probe.sharpness must be a number >= 0, got -1"
        grid = subprocess.run([sys.executable, "-c", "from evalkit.config import registered_methods as m; print(m())"],
                              capture_output=True, text=True, timeout=300)
        assert name in grid.stdout.split(","), grid.stderr[-2000:]
        results = tmp_path / "results"
        result = evalkit(f"method={name}", "budget=4x", "task=kv_retrieval", f"model.pretrained={random_model_dir}",
                         "limit=2", f"results_dir={results}", cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
        samples = pd.read_parquet(results / "samples")
        assert set(samples["method"]) == {name} and (samples["kept_prompt_tokens"] <= 64).all()
        assert (samples["realized_ratio"] > 1).all()
    finally:
        _removed(files)


def _collected(name: str) -> str:
    """The ids of the fast tier's tests that select ``name``."""
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m",
                             "not slow", "-k", name, "tests/"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    return listed.stdout


@pytest.mark.slow
def test_a_task_is_its_folder_and_its_yaml(tmp_path, random_model_dir):
    """The task checklist: tasks/<name>/ (YAML, utils.py, schema.py and a module of its own) and conf/task/<name>.yaml; the CLI
    runs it, its loader builds the data with the run's tokenizer, the rows carry its subsets, and the report reads its
    declared primary metric and heatmap."""
    from evalkit.benchmark import task_of

    name = f"probe_task_{uuid.uuid4().hex[:8]}"
    files = {
        ROOT / "tasks" / name / f"{name}.yaml": f"""
            task: {name}
            custom_dataset: !function utils.load
            test_split: test
            output_type: generate_until
            doc_to_text: !function utils.doc_to_text
            doc_to_target: answer
            generation_kwargs:
              until: []
              max_gen_toks: 4
              do_sample: false
            process_results: !function utils.process_results
            metric_list:
              - metric: contains
                aggregation: mean
                higher_is_better: true
              - metric: question_tokens
                aggregation: mean
                higher_is_better: true
            metadata:
              version: 1.0
              subset_field: [size, kind]
              heatmap: {{rows: kind, columns: size}}
            """,
        ROOT / "tasks" / name / "schema.py": """
            from evalkit.core.schema import Key

            DATASET = {}
            ROWS = {"id": Key("text"), "question": Key("text"), "answer": Key("text"), "size": Key("int", low=1),
                    "kind": Key("str", choices=("a", "b"))}
            """,
        ROOT / "tasks" / name / "scoring.py": """
            def contains(answer, response):
                return float(answer in response)
            """,
        ROOT / "tasks" / name / "utils.py": f"""
            import datasets
            from transformers import AutoTokenizer

            from evalkit.tasks.{name}.scoring import contains


            def load(pretrained=None, **_options):
                tokenizer = AutoTokenizer.from_pretrained(pretrained)  # the run's model's
                rows = [{{"id": str(i), "question": f"Repeat {{i}}:", "answer": str(i), "size": 1 + i % 2,
                         "kind": "ab"[i % 2], "tokens": len(tokenizer(f"Repeat {{i}}:")["input_ids"])}} for i in range(4)]
                return datasets.DatasetDict({{"test": datasets.Dataset.from_list(rows)}})


            def doc_to_text(doc):
                return doc["question"]


            def process_results(doc, results):
                return {{"contains": contains(doc["answer"], results[0]), "question_tokens": doc["tokens"]}}


            def dataset_identity(dataset_kwargs):
                return "probe@1"
            """,
        ROOT / "conf" / "task" / f"{name}.yaml": f"name: {name}\n",
    }
    try:
        _added(files)
        results = tmp_path / "results"
        result = evalkit(f"task={name}", f"model.pretrained={random_model_dir}", "limit=4", f"results_dir={results}",
                         cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
        samples, metrics = pd.read_parquet(results / "samples"), pd.read_parquet(results / "metrics")
        assert len(samples) == 4 and set(samples["subset"]) == {"1/a", "2/b"} and (samples["dataset_source"] == "probe@1").all()
        assert "contains" in set(metrics["metric"])
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(random_model_dir)
        counted = [len(tokenizer(f"Repeat {i}:")["input_ids"]) for i in range(4)]
        overall = metrics[(metrics["metric"] == "question_tokens") & (metrics["subset"] == "all")]
        assert overall["value"].tolist() == [pytest.approx(sum(counted) / 4)]
        assert task_of(name).primary_metric() == "contains" and task_of(name).heatmap() == ("kind", "size")
        report = subprocess.run([sys.executable, "-m", "evalkit.results.cli", str(results)], capture_output=True,
                                text=True, timeout=300)
        assert report.returncode == 0, report.stderr[-2000:]
        assert (results / "report" / f"{name}_heatmap.png").is_file()
    finally:
        _removed(files)


# conf/task/<name>.yaml's groups and the YAML keys they set (see evalkit.benchmark.FolderTask.config).
CONF_TO_YAML = {"dataset": "dataset_kwargs", "generation": "generation_kwargs", "repeats": "repeats",
                "gen_prefix": "gen_prefix"}


def test_a_task_default_lives_once_in_its_yaml():
    """A conf/task value equal to the task YAML's own default would be the same default kept twice: conf/task reads it
    with ${task_default:...} instead (or sets a different value, an evalkit setting such as MATH-500's repeats)."""
    from evalkit.benchmark import task_of

    derived = 0
    for path in sorted((ROOT / "conf" / "task").glob("*.yaml")):
        conf = yaml.safe_load(path.read_text())
        definition = task_of(conf["name"]).definition() if conf.get("source") is None else {}
        for group, yaml_key in CONF_TO_YAML.items():
            value = conf.get(group)
            pairs = value.items() if isinstance(value, dict) else [(None, value)] if group in conf else []
            for key, literal in pairs:
                own = definition.get(yaml_key, "<absent>")
                if key is not None:
                    own = own.get(key, "<absent>") if isinstance(own, dict) else "<absent>"
                if isinstance(literal, str) and literal.startswith("${task_default:"):
                    derived += 1
                    continue
                assert own == "<absent>" or own != literal, f"{path.name}: {group}.{key} = {literal!r} repeats the YAML's"
    assert derived >= 20


def test_task_default_reads_the_tasks_yaml_and_names_a_missing_key():
    from evalkit.config import compose

    cfg = compose("task=longbench_v2", "task.generation.max_len=1000")
    assert cfg["task"]["generation"] == {"max_gen_toks": 128, "max_len": 1000, "do_sample": True, "temperature": 0.1}
    assert cfg["task"]["dataset"]["path"] == "THUDM/LongBench-v2"
    with pytest.raises(Exception, match=r"task needle: its YAML \(tasks/needle/needle.yaml\) has no 'dataset_kwargs.nope'"):
        compose("task=needle", "+task.dataset.extra=${task_default:dataset_kwargs.nope}")
