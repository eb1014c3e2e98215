"""``evalkit-report export kvpress``: each run of a results directory as kvpress' evaluation writes a run.

    evalkit-report export kvpress results/ --out kvpress_results/

kvpress 0.5.5's ``evaluation/evaluate.py`` writes a folder per run, which its leaderboard takes as it is. Here: one
folder per run and kvpress dataset (a RULER run: one per length; a LongBench group: one per task), named as
``EvaluationConfig.get_results_dir`` names it: ``{dataset}__{data_dir}__{org--model}__{press}__{ratio:.2f}``, then
``__query_aware`` when the question was compressed with the context. In it:

- ``predictions.csv``: one row per sample (the first generation), kvpress' columns (``predicted_answer``,
  ``answer``/``answers``, ``task``, ``compression_ratio``, the dataset's own) and evalkit's (``sample_id``,
  ``evalkit_score``, ``realized_compression_ratio``); list-valued answers as Python list literals.
- ``metrics.json``: kvpress' scorer of the dataset (RULER, LongBench, LongBench-v2: ported below, checked against
  kvpress' own in tests/test_results_travel.py) over those predictions; a task kvpress does not score keeps evalkit's
  metrics, as evalkit reports them (the primary metric overall, then per subset).
- ``config.yaml``: kvpress' ``EvaluationConfig`` fields, in its order.
- ``evalkit.json``: the run id, the scorer behind metrics.json and the run's whole evalkit config.

evalkit -> kvpress: the task's dataset (RULER tasks of lm-eval's registry -> ``ruler``, the length as ``data_dir``,
``ruler_vt`` -> ``vt``, ``ruler_qa_squad`` -> ``qa_1``, ...; ``longbench_<task>`` -> ``longbench``/``<task>``;
evalkit's ``longbench_v2`` -> ``longbench-v2``/``0shot``; any other task under its own name); the model's hub id
(else evalkit's model name); the method's press (:data:`PRESSES`; a method kvpress lacks as ``evalkit_<method>``);
``compression_ratio`` (the fraction of the prompt removed): a ``removed_R`` budget's R, which is kvpress' own setting;
the full cache 0; any other budget (``4x`` sizes the cache from ``max_context``, not from each prompt) the mean of
the samples' realized ``compression_ratio``. ``query_aware``: ``compression_scope=prompt``. A run evaluated with
``limit`` covers the first documents only: the export says so; it is no leaderboard entry.
"""

from __future__ import annotations

import ast
import itertools
import json
import math
import re
import string
import sys
from collections import Counter
from pathlib import Path

import pandas as pd

from evalkit.core import budget as budget_grammar

from .outputs import OneLineParser, refusing, writing_into
from .summary import primary_metric, run_task
from .tables import CONFIG_COLUMNS, read_runs

# evalkit method -> kvpress' PRESS_REGISTRY name (evaluation/evaluate_registry.py), where the registry's press is the
# same method; the wrapping ones (WRAPPING) only over their default SnapKV scorer.
PRESSES = {"full": "no_press", "snapkv": "snapkv", "streaming_llm": "streaming_llm", "knorm": "knorm",
           "keydiff": "keydiff", "lagkv": "lagkv", "cur": "cur", "qfilter": "qfilter", "tova": "tova",
           "pyramidkv": "pyramidkv", "random": "random", "observed_attention": "observed_attention", "think": "think",
           "kvzip": "kvzip", "kvzip_plus": "kvzip_plus", "fastkvzip": "fastkvzip", "compactor": "compactor",
           "duo_attention": "duo_attention", "chunkkv": "chunkkv", "adakv": "adakv_snapkv",
           "criticalkv": "critical_snapkv", "criticaladakv": "critical_adakv_snapkv"}
WRAPPING = {"adakv", "criticalkv", "criticaladakv", "chunkkv"}  # kvpress' name only over the default scorer
# lm-eval's RULER task -> kvpress' (its RULER dataset names the tasks as RULER's scripts do)
RULER_TASKS = {"ruler_vt": "vt", "ruler_cwe": "cwe", "ruler_fwe": "fwe", "ruler_qa_squad": "qa_1",
               "ruler_qa_hotpot": "qa_2", **{name: name for name in (
                   "niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
                   "niah_multikey_3", "niah_multivalue", "niah_multiquery")}}
# kvpress' EvaluationConfig fields in its order (config.yaml); threshold and head_compression_ratio are left out, as
# save_config leaves them out when unset.
CONFIG_FIELDS = ("dataset", "data_dir", "model", "device", "press_name", "compression_ratio",
                 "key_channel_compression_ratio", "fraction", "max_new_tokens", "max_context_length", "query_aware",
                 "needle_depth", "compression_interval", "target_size", "hidden_states_buffer_size", "output_dir",
                 "log_level", "model_kwargs", "trust_remote_code", "press_init_command", "seed", "fp8")


# -- kvpress' scorers (evaluation/benchmarks/*/calculate_metrics.py), ported as they are --------------------------

def _ruler_match(preds: list[str], refs: list[list[str]], part: bool) -> float:
    hits = [[1.0 if r.lower() in pred.lower() else 0.0 for r in ref] for pred, ref in zip(preds, refs)]
    total = sum(max(h) for h in hits) if part else sum(sum(h) / len(h) for h in hits)
    return round(total / len(preds) * 100, 2)


def score_ruler(frame: pd.DataFrame) -> dict:
    """``{task: {"string_match": percent}}``: all of the answers found (string_match_part for qa: any of them)."""
    control = re.compile(r"[\x00-\x1f]")
    preds = frame["predicted_answer"].map(lambda text: control.sub("", text.strip()).strip())
    return {task: {"string_match": _ruler_match(preds[rows.index].tolist(), rows["answer"].tolist(),
                                                task.split("_")[0] == "qa")}
            for task, rows in frame.groupby("task")}


def score_longbench_v2(frame: pd.DataFrame) -> dict:
    """``{"average": mean, <difficulty>: mean, <length>: mean}``: "The correct answer is (X)" anywhere in the
    answer, ``*`` removed."""
    def correct(prediction: str, answer: str) -> bool:
        prediction = prediction.replace("*", "")
        return (f"The correct answer is ({answer})" in prediction) or (f"The correct answer is {answer}" in prediction)

    scored = frame.assign(score=[correct(p, a) for p, a in zip(frame["predicted_answer"], frame["answer"])])
    metrics = {"average": float(scored["score"].mean())}
    for column in ("difficulty", "length"):
        metrics.update({key: float(value) for key, value in scored.groupby(column)["score"].mean().items()})
    return metrics


def _normalize(text: str) -> str:
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def _normalize_zh(text: str) -> str:
    cn = "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
    return "".join("".join(ch for ch in text.lower() if ch not in set(string.punctuation + cn)).split())


def _f1(prediction: list, truth: list) -> float:
    same = sum((Counter(prediction) & Counter(truth)).values())
    if same == 0:
        return 0
    precision, recall = same / len(prediction), same / len(truth)
    return (2 * precision * recall) / (precision + recall)


def _count(prediction: str, truth: str) -> float:
    numbers = re.findall(r"\d+", prediction)
    return 0.0 if not numbers else sum(str(n) == str(truth) for n in numbers) / len(numbers)


def _retrieval(pattern: str):
    def score(prediction: str, truth: str) -> float:
        return _count(prediction, re.findall(pattern, truth)[0])
    return score


def _qa_f1_zh(prediction: str, truth: str) -> float:
    import jieba

    def tokens(text):
        return [t for t in (_normalize_zh(token) for token in jieba.cut(text, cut_all=False)) if t]
    return _f1(tokens(prediction), tokens(truth))


def _rouge(prediction: str, truth: str) -> float:
    from rouge import Rouge

    try:
        return Rouge().get_scores([prediction], [truth], avg=True)["rouge-l"]["f"]
    except Exception:  # kvpress' scorer: any failure scores 0
        return 0.0


def _rouge_zh(prediction: str, truth: str) -> float:
    import jieba

    return _rouge(" ".join(jieba.cut(prediction, cut_all=False)), " ".join(jieba.cut(truth, cut_all=False)))


def _code_sim(prediction: str, truth: str) -> float:
    from fuzzywuzzy import fuzz

    line = next((line for line in prediction.lstrip("\n").split("\n")
                 if "`" not in line and "#" not in line and "//" not in line), "")
    return fuzz.ratio(line, truth) / 100


def _qa_f1(prediction: str, truth: str) -> float:
    return _f1(_normalize(prediction).split(), _normalize(truth).split())


# LongBench's metric per task, as kvpress scores them; trec and lsht (classification) also need the dataset's
# all_classes, which evalkit's samples do not record: they keep evalkit's scores.
LONGBENCH_METRICS = {"narrativeqa": _qa_f1, "qasper": _qa_f1, "multifieldqa_en": _qa_f1, "hotpotqa": _qa_f1,
                     "2wikimqa": _qa_f1, "musique": _qa_f1, "triviaqa": _qa_f1, "multifieldqa_zh": _qa_f1_zh,
                     "dureader": _rouge_zh, "vcsum": _rouge_zh, "gov_report": _rouge, "qmsum": _rouge,
                     "multi_news": _rouge, "samsum": _rouge, "passage_count": _count,
                     "passage_retrieval_en": _retrieval(r"Paragraph (\d+)"),
                     "passage_retrieval_zh": _retrieval(r"段落(\d+)"), "lcc": _code_sim, "repobench-p": _code_sim}


def score_longbench(frame: pd.DataFrame) -> float:
    """The task's percent: per answer the best of its ground truths (the first line only, for triviaqa and samsum)."""
    task = frame["task"].iloc[0]
    total = 0.0
    for prediction, truths in zip(frame["predicted_answer"], frame["answers"]):
        if task in ("trec", "triviaqa", "samsum", "lsht"):
            prediction = prediction.lstrip().split("\n")[0]
        total += max([0.0] + [LONGBENCH_METRICS[task](prediction.lstrip(), truth) for truth in truths])
    return round(100 * total / len(frame), 2)


SCORERS = {"ruler": score_ruler, "longbench": score_longbench, "longbench-v2": score_longbench_v2}


# -- evalkit's run -> kvpress' names ---------------------------------------------------------------------------

def kvpress_model(run: pd.Series) -> str:
    """The model's hub id (from its recorded source ``hub:<id>@<commit>``), else evalkit's name for it."""
    source = run.get("model_source")
    if isinstance(source, str) and source.startswith("hub:"):
        return source.removeprefix("hub:").split("@")[0]
    return str(run["model"])


def press_name(run: pd.Series) -> str:
    """kvpress' registry name of the run's method; ``evalkit_<method>`` where kvpress has no such press."""
    method = run["method"]
    params = json.loads(run["policy_params"]) if isinstance(run.get("policy_params"), str) else {}
    if method in PRESSES and not (method in WRAPPING and params.get("scorer")):
        return PRESSES[method]
    return f"evalkit_{method}"


def compression_ratio(run: pd.Series, samples: pd.DataFrame) -> float:
    """kvpress' ``compression_ratio``: 0 for the full cache; a ``removed_R`` budget's R; otherwise the mean realized
    fraction of the prompt removed (the samples' ``compression_ratio``), else ``1 - 1/factor`` of the budget."""
    if run["method"] == "full":
        return 0.0
    budget = run["budget"] if isinstance(run["budget"], str) else None
    removed = budget_grammar.removed(budget)
    if removed is not None:
        return removed
    realized = samples["compression_ratio"].dropna() if "compression_ratio" in samples else pd.Series(dtype=float)
    if len(realized):
        return float(realized.mean())
    factor = budget_grammar.factor(budget)
    return 0.0 if math.isnan(factor) else 1 - 1 / factor


def _options(run: pd.Series) -> dict:
    try:
        options = json.loads(run.get("task_options") or "{}")
    except (TypeError, ValueError):
        return {}
    return options if isinstance(options, dict) else {}


def _answers(target: str) -> list[str]:
    """A sample's target as a list of answers (lm-eval logs list targets as their Python literal)."""
    try:
        value = ast.literal_eval(target)
    except (ValueError, SyntaxError, TypeError):
        return [target]
    return [str(v) for v in value] if isinstance(value, (list, tuple)) else [target]


def kvpress_datasets(run: pd.Series, samples: pd.DataFrame) -> list[tuple[str, str | None, pd.DataFrame]]:
    """``(dataset, data_dir, rows)`` for each kvpress folder of the run: ``rows`` hold kvpress' prediction columns of
    the samples (``samples`` indexed by position). A task kvpress does not score: one folder under its evalkit name,
    no data_dir."""

    task, rows = run["task"], samples
    base = pd.DataFrame({"predicted_answer": rows["prediction"].fillna("")})
    registry = run_task(task, run.get("task_options")).from_registry
    subsets = rows["subset"].fillna("").astype(str)
    if registry and (task == "ruler" or task in RULER_TASKS):
        names = subsets.str.rpartition("/")[0].where(subsets.str.contains("/"), task)
        frame = base.assign(task=names.map(lambda name: RULER_TASKS.get(name, name)),
                            answer=rows["target"].map(_answers), length=subsets.str.rpartition("/")[2])
        return [("ruler", length, group.drop(columns="length")) for length, group in frame.groupby("length")]
    if registry and (task == "longbench" or task.startswith("longbench_")):
        names = subsets.where(subsets.str.startswith("longbench_"), task).str.removeprefix("longbench_")
        frame = base.assign(task=names, answers=rows["target"].map(_answers), all_classes=None)
        left = sorted(set(names) - set(LONGBENCH_METRICS))
        if left:
            print(f"kvpress export: {run['run_id']}: {', '.join(left)} left out (kvpress scores them with the "
                  "dataset's all_classes, which evalkit does not record)", file=sys.stderr)
        return [("longbench", name, group) for name, group in frame.groupby("task") if name in LONGBENCH_METRICS]
    if not registry and task == "longbench_v2" and not _options(run).get("dataset", {}).get("cot"):
        parts = subsets.str.split("/", expand=True).reindex(columns=[0, 1])
        frame = base.assign(_id=rows["sample_id"], answer=rows["target"], difficulty=parts[0], length=parts[1])
        return [("longbench-v2", "0shot", frame)]
    return [(task, None, base.assign(answer=rows["target"], task=subsets.where(subsets != "", task)))]


def evalkit_metrics(run: pd.Series, metrics: pd.DataFrame) -> dict:
    """A task kvpress does not score: evalkit's primary metric (and the task's other scores) overall, then per
    subset, as evalkit reports them."""

    own = metrics[(metrics["run_id"] == run["run_id"]) & (metrics["subset"] != "memory")]
    names = {primary_metric(run["task"], metrics, run.get("task_options"))} | set(own[own["subset"] != "all"]["metric"])
    scores = own[own["metric"].isin(names)].drop_duplicates(["subset", "metric"], keep="last")
    result = {row.metric: row.value for row in scores[scores["subset"] == "all"].itertuples()}
    for subset, group in scores[scores["subset"] != "all"].groupby("subset"):
        result[subset] = dict(zip(group["metric"], group["value"]))
    return result


def kvpress_config(run: pd.Series, dataset: str, data_dir: str | None, ratio: float, out: Path) -> dict:
    """kvpress' EvaluationConfig of the run, field by field (:data:`CONFIG_FIELDS`)."""
    compressing = run["method"] != "full"
    scope = run.get("compression_scope") if isinstance(run.get("compression_scope"), str) else "prompt"  # default
    values = {
        "dataset": dataset, "data_dir": data_dir, "model": kvpress_model(run),
        "device": None if pd.isna(run.get("device_class")) else run.get("device_class"),
        "press_name": press_name(run), "compression_ratio": round(float(ratio), 6),
        "fraction": 1.0, "max_context_length": None,
        "query_aware": compressing and scope == "prompt",
        "output_dir": str(out), "log_level": "INFO",
        "model_kwargs": {"dtype": run["dtype"]} if isinstance(run.get("dtype"), str) else {},
        "trust_remote_code": False, "seed": int(run["seed"]) if pd.notna(run.get("seed")) else 42, "fp8": False,
        "press_init_command": " ".join(part for part in (
            "evalkit", run["method"], f"budget={run['budget']}" if isinstance(run["budget"], str) else "",
            run.get("policy_params") if isinstance(run.get("policy_params"), str) else "") if part not in ("", "{}")),
    }
    return {field: values.get(field) for field in CONFIG_FIELDS}


def folder_name(config: dict) -> str:
    """kvpress' ``EvaluationConfig.get_results_dir`` name of a config (the parts evalkit's runs can set)."""
    parts = [config["dataset"], str(config["data_dir"]) if config["data_dir"] else "",
             config["model"].replace("/", "--"), config["press_name"], f"{config['compression_ratio']:.2f}"]
    if config["query_aware"]:
        parts.append("query_aware")
    return "__".join(filter(None, parts))


def _plain(value):
    """A config cell as JSON: numpy scalars as Python's, missing as None."""
    if value is None or (isinstance(value, float) and math.isnan(value)) or value is pd.NA:
        return None
    return value.item() if hasattr(value, "item") else value


def export_run(run: pd.Series, metrics: pd.DataFrame, samples: pd.DataFrame, out: Path,
               taken: set[Path] | None = None) -> list[Path]:
    """Write the run's kvpress folders under ``out``; their paths. A name another run of this export ``taken``
    gets a numbered folder inside, as kvpress' get_results_dir numbers a name already used."""
    import yaml

    own = samples[samples["run_id"] == run["run_id"]]
    own = own[own["repeat"].fillna(0) == 0] if "repeat" in own else own
    own = own.sort_values("doc_id").reset_index(drop=True)
    ratio = compression_ratio(run, own)
    if pd.notna(run.get("limit")) and own["doc_id"].nunique() >= int(run["limit"]):
        print(f"kvpress export: {run['run_id']} evaluated its first {int(run['limit'])} documents only (limit): "
              "no leaderboard entry", file=sys.stderr)
    evalkit_columns = pd.DataFrame({"sample_id": own["sample_id"], "evalkit_score": own["score"],
                                    "realized_compression_ratio": own.get("compression_ratio")})
    folders = []
    for dataset, data_dir, rows in kvpress_datasets(run, own):
        config = kvpress_config(run, dataset, data_dir, ratio, out)
        folder = out / folder_name(config)
        taken = set() if taken is None else taken
        if folder in taken:
            folder = folder / str(next(i for i in itertools.count(1) if folder / str(i) not in taken))
        taken.add(folder)
        folder.mkdir(parents=True, exist_ok=True)
        rows = rows.assign(compression_ratio=config["compression_ratio"]).join(evalkit_columns)
        scorer = SCORERS.get(dataset)
        scores = scorer(rows.copy()) if scorer else evalkit_metrics(run, metrics)
        rows.to_csv(folder / "predictions.csv", index=False)
        (folder / "metrics.json").write_text(json.dumps(scores, indent=4))
        (folder / "config.yaml").write_text(yaml.dump(config, default_flow_style=False, indent=2, sort_keys=False))
        evalkit_config = {column: _plain(run[column]) for column in CONFIG_COLUMNS if column in run}
        (folder / "evalkit.json").write_text(json.dumps(
            {"run_id": run["run_id"], "scorer": f"kvpress {dataset}" if scorer else "evalkit",
             "config": evalkit_config}, indent=2, default=str))
        folders.append(folder)
    return folders


def export(results_dir: str | Path, out: str | Path) -> list[Path]:
    """Every run of ``results_dir`` (its newest run of each configuration) as kvpress folders under ``out`` (made
    where missing; the folder it goes in must exist). A damaged table or an ``out`` that cannot be written is a
    :class:`~evalkit.results.tables.ResultsError` before anything is written; an export that fails part way removes
    what it wrote."""
    metrics, samples = read_runs(results_dir)
    runs = metrics.sort_values("started_at").drop_duplicates("run_id")
    if "config_digest" in runs:
        runs = runs[runs["config_digest"].isna() | ~runs.duplicated("config_digest", keep="last")]
    with writing_into(out, parents=False) as out:
        taken: set[Path] = set()
        return [folder for _, run in runs.iterrows() for folder in export_run(run, metrics, samples, out, taken)]


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(prog="evalkit-report export", description=__doc__.splitlines()[0])
    parser.add_argument("format", choices=["kvpress"], help="the layout to write (kvpress' evaluation folders)")
    parser.add_argument("results_dir", type=Path)
    parser.add_argument("--out", type=Path, required=True, help="the folder that receives one folder per run")
    args = parser.parse_args(argv)
    with refusing("evalkit-report export"):  # no runs, a damaged table, an --out that cannot be written
        folders = export(args.results_dir, args.out)
    for folder in folders:
        print(folder)
