"""Results that leave evalkit: kvpress' leaderboard folders (``evalkit-report export kvpress``) and a dataset on the
Hugging Face Hub (``evalkit-report push``). The slow test scores an export with kvpress' own evaluation code, in
kvpress' own environment (benchmarks/kvpress_venv.sh)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import yaml
from helpers import evalkit

from evalkit.results import kvpress_export as kv
from evalkit.results import metrics_table, samples_table, write_table


def report(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "evalkit.results.cli", *args], capture_output=True, text=True,
                          env=env, timeout=600)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Two real runs of the built-in task on the built-in model, two documents each: the full cache and SnapKV 4x."""
    folder = tmp_path_factory.mktemp("travel")
    for args in (["method=full"], ["method=snapkv", "budget=4x"]):
        result = evalkit("task=kv_retrieval", *args, "limit=2", f"results_dir={folder / 'results'}", cwd=folder)
        assert result.returncode == 0, result.stderr[-3000:]
    return folder / "results"


# -- kvpress ------------------------------------------------------------------------------------------------------

def test_export_writes_each_run_as_kvpress_evaluation_writes_it(runs, tmp_path):
    result = report("export", "kvpress", str(runs), "--out", str(tmp_path / "kvpress"))
    assert result.returncode == 0, result.stderr[-3000:]
    metrics, samples = pd.read_parquet(runs / "metrics"), pd.read_parquet(runs / "samples")
    snapkv = samples[samples["method"] == "snapkv"]
    ratio = snapkv["compression_ratio"].mean()  # realized: 4x sizes the cache from max_context, not per prompt
    assert 0.5 < ratio < 0.9
    names = {"full": "kv_retrieval__kv_retrieval_tiny__no_press__0.00",
             "snapkv": f"kv_retrieval__kv_retrieval_tiny__snapkv__{ratio:.2f}__query_aware"}
    assert sorted(p.name for p in (tmp_path / "kvpress").iterdir()) == sorted(names.values())
    assert "first 2 documents only (limit)" in result.stderr
    for method, name in names.items():
        folder = tmp_path / "kvpress" / name
        own = samples[samples["method"] == method].sort_values("doc_id")
        predictions = pd.read_csv(folder / "predictions.csv", keep_default_na=False)
        assert predictions["predicted_answer"].tolist() == own["prediction"].tolist()
        assert predictions["answer"].tolist() == own["target"].tolist()
        assert predictions["evalkit_score"].tolist() == own["score"].tolist()
        assert predictions["realized_compression_ratio"].tolist() == pytest.approx(own["compression_ratio"].tolist())
        run = metrics[(metrics["method"] == method) & (metrics["metric"] == "exact_match")]
        expected = {row.subset: row.value for row in run.itertuples()}
        scores = json.loads((folder / "metrics.json").read_text())
        assert scores.pop("exact_match") == expected.pop("all")  # a task kvpress does not score: evalkit's metric
        assert scores == {subset: {"exact_match": value} for subset, value in expected.items()}
        config = yaml.safe_load((folder / "config.yaml").read_text())
        assert list(config) == list(kv.CONFIG_FIELDS)
        assert config["press_name"] == {"full": "no_press", "snapkv": "snapkv"}[method]
        assert config["compression_ratio"] == pytest.approx({"full": 0.0, "snapkv": ratio}[method])
        assert (config["dataset"], config["data_dir"], config["model"], config["seed"]) == (
            "kv_retrieval", None, "kv_retrieval_tiny", 1234)
        assert config["query_aware"] is (method == "snapkv")
        sidecar = json.loads((folder / "evalkit.json").read_text())
        assert sidecar["scorer"] == "evalkit" and sidecar["run_id"] == own["run_id"].iloc[0]
        assert sidecar["config"]["method"] == method and sidecar["config"]["limit"] == 2


def test_kvpress_names_for_evalkits_config():
    run = pd.Series({"model": "qwen3", "model_source": "hub:Qwen/Qwen3-8B@0123abcd", "method": "snapkv",
                     "budget": "removed_0.75", "policy_params": "{}", "compression_scope": "context"})
    empty = pd.DataFrame({"compression_ratio": [0.5]})
    assert kv.kvpress_model(run) == "Qwen/Qwen3-8B"
    assert kv.kvpress_model(run.drop("model_source")) == "qwen3"
    assert kv.compression_ratio(run, empty) == 0.75  # kvpress' own setting, whatever was realized
    four = run.copy()
    four["budget"] = "4x"
    assert kv.compression_ratio(four, empty) == 0.5  # realized
    assert kv.compression_ratio(four, empty.iloc[:0]) == 0.75  # nothing realized recorded: the budget's
    assert kv.press_name(run) == "snapkv" and kv.press_name(run.replace("snapkv", "full")) == "no_press"
    assert kv.press_name(run.replace("snapkv", "snapstream")) == "evalkit_snapstream"  # no such kvpress press
    adakv = run.replace("snapkv", "adakv")
    assert kv.press_name(adakv) == "adakv_snapkv"
    assert kv.press_name(adakv.replace("{}", '{"scorer": {"name": "knorm"}}')) == "evalkit_adakv"
    config = kv.kvpress_config(run, "ruler", "4096", 0.75, Path("out"))
    assert kv.folder_name(config) == "ruler__4096__Qwen--Qwen3-8B__snapkv__0.75"  # context only: not query-aware


def test_the_ported_scorers_score_as_kvpress_does():
    ruler = pd.DataFrame({"task": ["niah_single_1", "niah_single_1", "qa_1", "qa_1", "vt"],
                          "predicted_answer": [" 12\x0034 ", "nothing", "Paris!", "Rome", "X1 and x2"],
                          "answer": [["1234"], ["5678"], ["Paris", "the city of Paris"], ["Berlin"], ["X1", "X2", "X3"]]})
    assert kv.score_ruler(ruler) == {"niah_single_1": {"string_match": 50.0},  # control characters removed
                                     "qa_1": {"string_match": 50.0},  # qa: any of the answers
                                     "vt": {"string_match": 66.67}}  # the others: the share of them
    v2 = pd.DataFrame({"predicted_answer": ["**The correct answer is (A)**", "The correct answer is C", "B", "hmm"],
                       "answer": ["A", "C", "B", "D"], "difficulty": ["easy", "hard", "hard", "hard"],
                       "length": ["short", "short", "long", "long"]})
    assert kv.score_longbench_v2(v2) == {"average": 0.5, "easy": 1.0, "hard": 1 / 3, "short": 1.0, "long": 0.0}
    longbench = pd.DataFrame({"task": ["narrativeqa"] * 2, "predicted_answer": [" The old man", "a dog"],
                              "answers": [["an old man", "man"], ["the cat"]]})
    assert kv.score_longbench(longbench) == 50.0
    count = pd.DataFrame({"task": ["passage_count"], "predicted_answer": ["3 or 4"], "answers": [["4"]]})
    assert kv.score_longbench(count) == 50.0


def test_runs_that_kvpress_would_name_alike_get_numbered_folders_as_kvpress_numbers_them(tmp_path):
    """Two SnapKV runs that differ in a setting kvpress' name does not carry (the window): the second goes to a
    numbered folder inside the first's, as kvpress' get_results_dir does with a name already used."""
    for window in (16, 32):
        config = {"run_id": f"w{window}", "model": "m", "task": "kv_retrieval", "method": "snapkv",
                  "budget": "removed_0.5", "window": window, "started_at": f"2026-01-01T00:00:{window}"}
        samples = [{"doc_id": 0, "sample_id": "0", "repeat": 0, "prediction": "a", "target": "a", "score": 1.0}]
        write_table(samples_table(samples, config), tmp_path / "results", "samples", config["run_id"])
        write_table(metrics_table([{"subset": "all", "metric": "exact_match", "value": 1.0, "n": 1}], config),
                    tmp_path / "results", "metrics", config["run_id"])
    folders = kv.export(tmp_path / "results", tmp_path / "out")
    name = tmp_path / "out" / "kv_retrieval__m__snapkv__0.50__query_aware"
    assert folders == [name, name / "1"]
    assert [json.loads((f / "evalkit.json").read_text())["config"]["window"] for f in folders] == [16, 32]


def test_export_refuses_a_folder_without_results(tmp_path):
    result = report("export", "kvpress", str(tmp_path), "--out", str(tmp_path / "out"))
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].endswith("not an evalkit results directory")


def kvpress_venv() -> Path:
    """kvpress' environment (benchmarks/kvpress_venv.sh), from EVALKIT_KVPRESS_VENV or /tmp/kvpress-venv."""
    venv = Path(os.environ.get("EVALKIT_KVPRESS_VENV", "/tmp/kvpress-venv"))
    if not (venv / "bin" / "python").exists() or not (venv / "kvpress-evaluation" / "evaluate.py").exists():
        pytest.skip(f"no kvpress environment at {venv}: make it with `bash benchmarks/kvpress_venv.sh {venv}` "
                    "(or point EVALKIT_KVPRESS_VENV at one)")
    return venv


# Run in kvpress' environment, in its evaluation/ folder: each exported folder's config.yaml as kvpress'
# EvaluationConfig (its registries check the dataset and the press), the folder name its get_results_dir gives,
# and its SCORER_REGISTRY's metrics over predictions.csv (list answers read back from their literals).
KVPRESS_LOAD = """
import ast, json, sys, tempfile
from pathlib import Path
import pandas as pd, yaml
from evaluate import EvaluationConfig
from evaluate_registry import SCORER_REGISTRY
LISTS = {"ruler": "answer", "longbench": "answers"}
found, scratch = {}, Path(tempfile.mkdtemp())
for folder in sorted(Path(sys.argv[1]).iterdir()):
    config = EvaluationConfig(**yaml.safe_load((folder / "config.yaml").read_text()))
    frame = pd.read_csv(folder / "predictions.csv", keep_default_na=False)
    if config.dataset in LISTS:
        frame[LISTS[config.dataset]] = frame[LISTS[config.dataset]].map(ast.literal_eval)
    found[folder.name] = {"name": config.get_results_dir(scratch).name,
                          "metrics": SCORER_REGISTRY[config.dataset](frame)}
print("FOUND " + json.dumps(found))
"""


def write_run(results: Path, run_id: str, config: dict, rows: list[tuple], score) -> list[float]:
    """A run's tables from ``(subset, prediction, target, doc)`` rows, each scored by ``score(doc, prediction)`` as
    the task's own scorer scores it; the scores."""
    scores = [score(doc, prediction) for _, prediction, _, doc in rows]
    samples = [{"doc_id": i, "sample_id": f"d{i}", "subset": subset, "repeat": 0, "prediction": prediction,
                "target": target, "score": value, "compression_ratio": 0.5}
               for i, ((subset, prediction, target, _), value) in enumerate(zip(rows, scores))]
    metric = {"longbench_v2": "accuracy", "longbench": "score"}.get(config["task"], "4096")
    metrics = [{"subset": "all", "metric": metric, "value": sum(scores) / len(scores), "stderr": None,
                "n": len(scores)}]
    write_table(samples_table(samples, config), results, "samples", run_id)
    write_table(metrics_table(metrics, config), results, "metrics", run_id)
    return scores


def ruler_rows() -> list[tuple]:
    """RULER samples of a group run (subset task/length): hits, misses, several answers, a qa answer among aliases,
    a needle split by a control character."""
    cells = [("niah_single_1", "The special magic number is 7419.", ["7419"]),
             ("niah_single_1", "I do not know.", ["2220"]),
             ("niah_multivalue", "They are 11, 22 and 44.", ["11", "22", "33", "44"]),
             ("ruler_vt", "X1, X2", ["X1", "X2"]),
             ("ruler_qa_squad", "Paris", ["Paris", "the city of Paris"]),  # evalkit: 0.5 (lm-eval's share)
             ("niah_single_2", "It is 12\n34.", ["1234"])]  # evalkit: 0 (lm-eval keeps the newline)
    return [(f"{task}/{length}", prediction, str(answers), {"outputs": answers, "max_length": length, "task": task})
            for length in (4096, 8192) for task, prediction, answers in cells]


@pytest.mark.slow
def test_kvpress_scores_the_export_as_its_metrics_json_says(tmp_path):
    """Exported runs (a real RULER run; RULER, LongBench and LongBench-v2 tables scored by their evalkit scorers),
    loaded by kvpress' own evaluation code: its config accepts every config.yaml and names the folder alike, its
    scorer gives metrics.json's values, which are evalkit's score wherever the two scorers agree."""
    venv = kvpress_venv()
    from lm_eval.tasks.ruler import common_utils

    from evalkit.tasks.longbench_v2 import longbench

    results = tmp_path / "results"
    run = evalkit("budget=removed_0.5", "method=snapkv", "task=lm_eval", "task.name=niah_single_1",
                  "task.metadata.max_seq_lengths=[200]", "limit=2", f"results_dir={results}", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    model = {"model": "qwen3", "model_source": "hub:Qwen/Qwen3-8B@0123abcd", "compression_scope": "context"}
    registry = '{"source": "lm_eval"}'

    def ruler_score(doc, prediction):  # lm-eval's RULER scorer, as evalkit's RULER runs score
        scorer = common_utils.process_results_part if "qa" in doc["task"] else common_utils.process_results
        return scorer(doc, [prediction])[str(doc["max_length"])]

    ruler = {method: write_run(results, f"ruler-{method}", {**model, "run_id": f"ruler-{method}", "task": "ruler",
                                                            "task_options": registry, "method": method,
                                                            "budget": budget}, ruler_rows(), ruler_score)
             for method, budget in (("full", None), ("snapkv", "removed_0.5"))}
    v2_rows = [("easy/short", "The correct answer is (A).", "A", {"answer": "A"}),
               ("hard/short", "**The correct answer is B**", "B", {"answer": "B"}),
               ("hard/long", "The correct answer is (C)", "D", {"answer": "D"}),
               ("easy/long", "The correct answer is (B). No. The correct answer is (A)", "A", {"answer": "A"})]
    v2 = write_run(results, "v2", {**model, "run_id": "v2", "task": "longbench_v2", "method": "streaming_llm",
                                   "budget": "removed_0.75", "task_options": '{"dataset": {"cot": false}}'},
                   v2_rows, lambda doc, prediction: longbench.score(doc, prediction)["accuracy"])
    # LongBench as lm-eval scores it (token F1 after normalizing; the share of the numbers that are right), the
    # values evalkit's LongBench runs record (lm-eval's scorer module needs jieba, fuzzywuzzy and rouge to import)
    lb_cells = [("narrativeqa", "The old man.", ["an old man", "a fisherman"], 1.0),
                ("narrativeqa", "a boy", ["the boy"], 1.0), ("narrativeqa", "an old boat", ["Santiago's boat"], 0.5),
                ("passage_count", "There are 7 or 8", ["8"], 0.5), ("trec", "Location", ["Location"], 1.0)]
    lb_rows = [(f"longbench_{task}", prediction, str(answers), {"score": value})
               for task, prediction, answers, value in lb_cells]
    lb = write_run(results, "lb", {**model, "run_id": "lb", "task": "longbench", "task_options": registry,
                                   "method": "knorm", "budget": "removed_0.25"}, lb_rows, lambda doc, _: doc["score"])

    out = tmp_path / "kvpress"
    exported = report("export", "kvpress", str(results), "--out", str(out))
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert "lb: trec left out" in exported.stderr  # kvpress scores it with all_classes, which evalkit does not keep
    load = subprocess.run([str(venv / "bin" / "python"), "-c", KVPRESS_LOAD, str(out)], capture_output=True,
                          text=True, cwd=venv / "kvpress-evaluation", timeout=600,
                          env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HOME": str(tmp_path)})
    found = json.loads(next(line[6:] for line in load.stdout.splitlines() if line.startswith("FOUND ")) if
                       "FOUND " in load.stdout else "null")
    assert found, load.stderr[-3000:]
    real = "ruler__200__kv_retrieval_tiny__snapkv__0.50__query_aware"
    model_dirs = {f"ruler__{n}__Qwen--Qwen3-8B__{press}__{r}" for n in (4096, 8192)
                  for press, r in (("no_press", "0.00"), ("snapkv", "0.50"))}
    expected = {real, *model_dirs, "longbench-v2__0shot__Qwen--Qwen3-8B__streaming_llm__0.75",
                "longbench__narrativeqa__Qwen--Qwen3-8B__knorm__0.25",
                "longbench__passage_count__Qwen--Qwen3-8B__knorm__0.25"}
    assert set(found) == expected
    for name, loaded in found.items():
        assert loaded["name"] == name  # kvpress' get_results_dir names it the same
        assert loaded["metrics"] == json.loads((out / name / "metrics.json").read_text())  # kvpress' scorer
    # evalkit's real run: kvpress' score is evalkit's
    real_scores = pd.read_parquet(results / "samples").query("task == 'niah_single_1'")["score"]
    assert found[real]["metrics"] == {"niah_single_1": {"string_match": round(100 * real_scores.mean(), 2)}}
    # RULER per task and length, as evalkit scored it where the scorers agree; kvpress' rules where they do not
    for method, press in (("full", "no_press"), ("snapkv", "snapkv")):
        for offset, length in ((0, 4096), (6, 8192)):
            got = found[f"ruler__{length}__Qwen--Qwen3-8B__{press}__{'0.00' if method == 'full' else '0.50'}"]
            evalkit_scores = dict(zip(["niah_single_1", "niah_single_1b", "niah_multivalue", "vt", "qa_1",
                                       "niah_single_2"], ruler[method][offset:offset + 6]))
            assert got["metrics"]["niah_single_1"]["string_match"] == round(
                100 * (evalkit_scores["niah_single_1"] + evalkit_scores["niah_single_1b"]) / 2, 2) == 50.0
            assert got["metrics"]["niah_multivalue"]["string_match"] == 100 * evalkit_scores["niah_multivalue"] == 75
            assert got["metrics"]["vt"]["string_match"] == 100 * evalkit_scores["vt"] == 100
            assert evalkit_scores["qa_1"] == 0.5 and got["metrics"]["qa_1"]["string_match"] == 100  # any alias
            assert evalkit_scores["niah_single_2"] == 0 and got["metrics"]["niah_single_2"]["string_match"] == 100
    # LongBench-v2: evalkit's first "The correct answer is" against kvpress' any
    got = found["longbench-v2__0shot__Qwen--Qwen3-8B__streaming_llm__0.75"]["metrics"]
    assert v2 == [1.0, 1.0, 0.0, 0.0] and got == {"average": 0.75, "easy": 1.0, "hard": 0.5, "long": 0.5,
                                                   "short": 1.0}
    # LongBench: the same F1 and count scores
    assert found["longbench__narrativeqa__Qwen--Qwen3-8B__knorm__0.25"]["metrics"] == round(100 * sum(lb[:3]) / 3, 2)
    assert found["longbench__passage_count__Qwen--Qwen3-8B__knorm__0.25"]["metrics"] == round(100 * lb[3], 2) == 50


# -- the Hub ------------------------------------------------------------------------------------------------------

def test_push_dry_run_builds_a_dataset_that_loads_with_its_card(runs, tmp_path):
    import datasets
    from huggingface_hub import DatasetCard

    folder = tmp_path / "dataset"
    result = report("push", "me/evalkit-results", str(runs), "--dry-run", str(folder))
    assert result.returncode == 0, result.stderr[-3000:]
    metrics, samples = pd.read_parquet(runs / "metrics"), pd.read_parquet(runs / "samples")
    run_ids = sorted(metrics["run_id"].unique())
    assert sorted(p.stem for p in (folder / "metrics").glob("*.parquet")) == run_ids
    assert sorted(p.stem for p in (folder / "samples").glob("*.parquet")) == run_ids
    for run_id in run_ids:
        config = json.loads((folder / "configs" / f"{run_id}.json").read_text())
        assert config["run_id"] == run_id and config["task"] == "kv_retrieval" and config["limit"] == 2
        assert config["method"] == metrics[metrics["run_id"] == run_id]["method"].iloc[0]
    card = DatasetCard.load(folder / "README.md")  # the card's metadata, parsed back as the Hub parses it
    assert {c["config_name"]: c["data_files"] for c in card.data.configs} == {
        "metrics": [{"split": "train", "path": "metrics/*.parquet"}],
        "samples": [{"split": "train", "path": "samples/*.parquet"}]}
    assert card.data.license == "other" and "evalkit" in card.data.tags and card.data.size_categories == "n<1K"
    for plot in ("accuracy_vs_budget.png", "accuracy_vs_memory.png"):
        assert f"(report/{plot})" in card.text and (folder / "report" / plot).read_bytes()[:4] == b"\x89PNG"
    assert "| kv_retrieval | kv_retrieval_tiny | snapkv" in card.text
    cache = tmp_path / "hf-datasets-cache"
    for name, table in (("metrics", metrics), ("samples", samples)):
        loaded = datasets.load_dataset(str(folder), name, split="train", cache_dir=str(cache)).to_pandas()
        key = ["run_id", "subset", "metric"] if name == "metrics" else ["run_id", "doc_id"]
        loaded, table = (t.sort_values(key).reset_index(drop=True) for t in (loaded, table))
        assert len(loaded) == len(table) and list(loaded.columns) == list(table.columns)
        column = "value" if name == "metrics" else "prediction"
        assert loaded[column].tolist() == table[column].tolist()


def test_push_without_a_token_says_in_one_line_how_to_log_in(runs, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")}
    env |= {"HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_OFFLINE": "1"}
    result = report("push", "me/evalkit-results", str(runs), env=env)
    assert result.returncode == 2 and not (tmp_path / "hf-home" / "token").exists()
    assert result.stderr.strip().splitlines() == [
        "evalkit-report push: not logged in to the Hugging Face Hub: run `hf auth login` (or set HF_TOKEN)"]


def test_push_creates_the_dataset_repo_and_uploads_the_folder_in_one_commit(runs, monkeypatch, capsys):
    import huggingface_hub

    from evalkit.results import hub

    calls = []

    class Api:  # huggingface_hub.HfApi, recording instead of uploading
        def __init__(self, token=None):
            calls.append(("token", token))

        def create_repo(self, repo_id, **options):
            calls.append(("create_repo", repo_id, options))

        def upload_folder(self, **options):
            folder = Path(options.pop("folder_path"))
            calls.append(("upload_folder", sorted(p.name for p in folder.iterdir()), options))
            return type("Commit", (), {"commit_url": "https://huggingface.co/datasets/me/x/commit/1"})()

    monkeypatch.setattr(huggingface_hub, "HfApi", Api)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_test")
    hub.main(["me/x", str(runs), "--private"])
    assert calls == [("token", "hf_test"),
                     ("create_repo", "me/x", {"repo_type": "dataset", "private": True, "exist_ok": True}),
                     ("upload_folder", ["README.md", "configs", "metrics", "report", "samples"],
                      {"repo_id": "me/x", "repo_type": "dataset",
                       "commit_message": "evalkit-report push: results, configs and report"})]
    assert "pushed: https://huggingface.co/datasets/me/x" in capsys.readouterr().out

    def refused(self, repo_id, **options):
        raise huggingface_hub.errors.HfHubHTTPError("403 Forbidden: you cannot write to me/x\nmore detail",
                                                    response=SimpleNamespace(headers={}, status_code=403, request=None))

    monkeypatch.setattr(Api, "create_repo", refused)
    with pytest.raises(SystemExit) as exit:
        hub.main(["me/x", str(runs)])
    assert exit.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "evalkit-report push: uploading to me/x failed: 403 Forbidden: you cannot write to me/x"]
