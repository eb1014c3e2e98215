"""docs/leaderboard.md's builder (benchmarks/build_leaderboard.py) on a tiny results folder, and the jobs of its preset
(conf/experiment/leaderboard_small.yaml)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pandas as pd
import pytest
from helpers import evalkit
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.types import RunMode

from evalkit.core.paths import conf_dir
from evalkit.run.sweeper import job_configs, planned

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("build_leaderboard", ROOT / "benchmarks" / "build_leaderboard.py")
builder = importlib.util.module_from_spec(spec)
spec.loader.exec_module(builder)
TINY = "model.pretrained=builtin:kv_retrieval_tiny"  # offline: every job names the shipped tiny model's weights


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """Three real runs of the built-in task and model (the full cache, SnapKV 4x, StreamingLLM 4x, 8 documents each)
    and the page the builder makes of them."""
    folder = tmp_path_factory.mktemp("leaderboard")
    results = folder / "results" / "kv_retrieval_tiny"
    result = evalkit("-m", "task=kv_retrieval", "model=kv_retrieval_tiny", "hydra/sweeper=evalkit",
                     "method=full,snapkv,streaming_llm", "budget=none,4x", "limit=8", f"results_dir={results}",
                     f"hydra.sweep.dir={folder / 'sweep'}", cwd=folder)
    assert result.returncode == 0, result.stderr[-3000:]
    # The RULER probe's answer, as a real build caches it (building lm-eval's RULER data takes minutes).
    (folder / "results" / "ruler_offline.json").write_text(json.dumps(
        {"niah_single_1": "ok", "niah_single_2": "ConnectionError: Couldn't reach 'baber/paul_graham_essays'"}))
    builder.main(["--limit", "8", "--models", "kv_retrieval_tiny", "--results", str(folder / "results"),
                  "--page", str(folder / "docs" / "leaderboard.md"), "--skip-runs"])
    return folder


def test_the_page_gives_each_configuration_its_score_delta_mark_and_memory_ratio_from_the_results(built):
    page = (built / "docs" / "leaderboard.md").read_text()
    summary = pd.read_csv(built / "results" / "kv_retrieval_tiny" / "report" / "summary.csv")
    full = summary[summary["method"] == "full"].iloc[0]
    assert f"| full cache | - | {100 * full['value']:.1f} [" in page
    for method in ("snapkv", "streaming_llm"):
        run = summary[summary["method"] == method].iloc[0]
        row = re.search(rf"^\| {method} \| query-\w+ \| (.*) \|$", page, flags=re.M)
        assert row, page
        # one task: the pooled comparison is the report's own, delta and interval in points, its mark, memory ratio
        assert row[1].startswith(f"{100 * run['value']:.1f} ({100 * run['delta']:+.1f} [{100 * run['delta_low']:+.1f}, "
                                 f"{100 * run['delta_high']:+.1f}] "), (row[1], run.to_dict())
        assert row[1].endswith(f"×{run['memory_ratio']:.2f}")
        assert {"worse": "▼", "better": "▲"}.get(run["verdict"], "≈") in row[1]
    assert "python benchmarks/build_leaderboard.py --limit 8" in page
    assert re.search(r"- 0\.75 \(4x\): .*full cache [\d.]+ \*\*a", page), page
    assert "most often lost" in page and "What this table cannot show at this scale" in page
    assert "items for" not in page or "McNemar" in page


def test_the_assets_beside_the_page_are_small_and_the_export_holds_only_tables(built):
    assets = built / "docs" / "leaderboard" / "kv_retrieval_tiny"
    png = assets / "score_vs_ratio.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size < 200_000
    assert (assets / "report.html").read_text().startswith("<!DOCTYPE html>")
    exported = [p for p in (assets / "kvpress").rglob("*") if p.is_file()]
    assert {p.name for p in exported} == {"predictions.csv", "metrics.json", "config.yaml", "evalkit.json"}
    assert len({p.parent for p in exported}) == 3  # a folder per run


def preset_jobs(*overrides: str) -> tuple[list[list[str]], dict]:
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        config = loader.load_configuration("config", ["+experiment=leaderboard_small", TINY, *overrides],
                                           RunMode.MULTIRUN)
        sweep = planned(config)
        configs = {tuple(job): plain for job, plain in job_configs(config, sweep.jobs, loader)}
    return sweep.jobs, configs


def chosen(job: list[str], key: str) -> str:
    return next(o.split("=", 1)[1] for o in job if o.lstrip("+").startswith(key + "="))


def test_the_presets_jobs_are_the_full_cache_and_every_method_at_kvpress_ratios_per_task():
    """One task's jobs (the others differ only in the task), both halves, and every task's full-cache job."""
    preset = (conf_dir() / "experiment" / "leaderboard_small.yaml").read_text()
    params = dict(re.findall(r"^      ([+\w/]+): (.+)$", preset, flags=re.M))
    assert params["+experiment/leaderboard_task"].split(",") == builder.TASKS
    methods = params["method"].split(",")
    assert set(builder.QUERY_AWARE) < set(methods) and "snapstream" in methods and methods[0] == "full"
    # tests/test_preset_jobs.py checks every job of a task against Hydra's own sweep; here, the pairs of three methods
    jobs, configs = preset_jobs("+experiment/leaderboard_task=niah_single_1", "method=full,snapkv,kvzip")
    pairs = sorted((chosen(j, "method"), chosen(j, "budget")) for j in jobs)
    assert pairs == sorted([("full", "none")] + [(m, b) for m in ("snapkv", "kvzip") for b in builder.RATIOS])
    plain = next(iter(configs.values()))
    assert plain["task"]["name"] == "niah_single_1" and plain["task"]["metadata"]["max_seq_lengths"] == [4096]
    assert plain["model"]["max_context"] == 4096 and plain["compression_scope"] == "context"
    aware, configs = preset_jobs("+experiment/leaderboard_task=niah_single_1", "compression_scope=prompt",
                                 f"method={','.join(builder.QUERY_AWARE)}", "budget=" + ",".join(builder.RATIOS))
    assert len(aware) == len(builder.QUERY_AWARE) * 4
    assert {plain["compression_scope"] for plain in configs.values()} == {"prompt"}
    fulls, configs = preset_jobs("method=full", "budget=none")
    assert len(fulls) == len(builder.TASKS)
    names = {chosen(j, "experiment/leaderboard_task"): plain["task"] for j, plain in zip(fulls, configs.values())}
    assert names["needle"]["name"] == "needle" and names["needle"]["dataset"]["lengths"] == [3500]
    assert names["ruler_fwe"]["name"] == "ruler_fwe"


def test_the_builders_commands_are_the_presets_two_halves():
    class Args:
        limit, threads, tasks, methods, results = 3, 1, builder.TASKS, None, Path("results/leaderboard")
        max_gen_toks, scopes, budgets = None, ["context", "prompt"], None
    context, prompt = builder.sweep_commands("gemma3_270m", Args)
    assert not any(part.startswith("budget=") for part in context)  # the preset's own budgets
    assert context[:6] == ["evalkit", "-m", "+experiment=leaderboard_small", "model=gemma3_270m", "limit=3", "threads=1"]
    assert "compression_scope=prompt" in prompt and f"method={','.join(builder.QUERY_AWARE)}" in prompt
    Args.tasks, Args.methods = ["needle"], ["full", "snapkv", "knorm"]
    context, prompt = builder.sweep_commands("gemma3_270m", Args)
    assert "+experiment/leaderboard_task=needle" in context and "method=full,snapkv,knorm" in context
    assert "method=snapkv" in prompt
    Args.budgets = ["2x", "8x"]  # a part of the ratios: the full cache still runs (budget none)
    context, prompt = builder.sweep_commands("gemma3_270m", Args)
    assert "budget=none,2x,8x" in context and "budget=2x,8x" in prompt
