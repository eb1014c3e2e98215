"""The report over a results directory written by the tests: pivots, paired deltas against the baseline, plots."""

from __future__ import annotations

import subprocess
import sys

import pandas as pd
import pytest

from evalkit.results import metrics_table, samples_table, write_table
from evalkit.results.report import write_report
from evalkit.results.summary import paired_bootstrap, summarize

# Per-document scores of 20 documents: the baseline answers 18; each (method, budget) answers its own count.
CORRECT = {("full", None): 18, ("snapkv", "2x"): 18, ("snapkv", "4x"): 16, ("snapkv", "8x"): 12,
           ("streaming_llm", "2x"): 14, ("streaming_llm", "4x"): 8, ("streaming_llm", "8x"): 4}


KV_BYTES = 64 * 2**20  # the full cache's bytes per request
FACTOR = {None: 1.0, "2x": 2.0, "4x": 4.0, "8x": 8.0}


@pytest.fixture
def results_dir(tmp_path):
    for index, ((method, budget), correct) in enumerate(CORRECT.items()):
        run_id = f"run{index}"
        config = {"run_id": run_id, "model": "tiny", "task": "kv_retrieval", "method": method, "budget": budget,
                  "window": (16 if budget == "8x" and method == "snapkv" else 32) if method != "full" else None}
        scores = [1.0 if doc < correct else 0.0 for doc in range(20)]
        samples = [{"doc_id": doc, "sample_id": str(doc), "repeat": 0, "score": score, "realized_ratio": 2.5}
                   for doc, score in enumerate(scores)]
        metrics = [{"subset": "all", "metric": "exact_match", "value": correct / 20, "stderr": 0.05, "n": 20},
                   {"subset": "all", "metric": "realized_ratio_mean", "value": 2.5, "stderr": None, "n": 20},
                   {"subset": "memory", "metric": "fits", "value": 1.0, "stderr": None, "n": 1},
                   {"subset": "memory", "metric": "onchip_ratio", "value": 4.0, "stderr": None, "n": 1},
                   # measured cost: KV bytes shrink with the budget, decoding speeds up
                   {"subset": "all", "metric": "kv_bytes_peak_mean", "value": KV_BYTES / FACTOR[budget], "stderr": None,
                    "n": 20},
                   {"subset": "all", "metric": "memory_ratio_mean", "value": FACTOR[budget], "stderr": None, "n": 20},
                   {"subset": "all", "metric": "decode_tokens_per_s", "value": 100.0 * FACTOR[budget] ** 0.5,
                    "stderr": None, "n": 20}]
        write_table(samples_table(samples, config), tmp_path, "samples", run_id)
        write_table(metrics_table(metrics, config), tmp_path, "metrics", run_id)
    return tmp_path


def test_pivots_and_deltas_against_the_full_cache(results_dir):
    table = summarize(pd.read_parquet(results_dir / "metrics"), pd.read_parquet(results_dir / "samples"), 500)
    indexed = table.set_index(["method", "budget"])
    assert indexed.loc[("snapkv", "4x"), "value"] == 0.8
    assert indexed.loc[("streaming_llm", "8x"), "delta"] == pytest.approx(4 / 20 - 18 / 20)
    assert indexed.loc[("snapkv", "2x"), "delta"] == 0.0
    low, high = indexed.loc[("streaming_llm", "4x"), ["delta_low", "delta_high"]]
    assert low < -0.5 < high < 0  # 10 documents lost of 20: clearly below zero
    assert indexed.loc[("snapkv", "4x"), "paired_docs"] == 20
    assert bool(indexed.loc[("snapkv", "4x"), "memory_fits"]) and indexed.loc[("snapkv", "4x"), "onchip_ratio"] == 4.0
    assert sorted(table["budget"][table["method"] == "snapkv"]) == ["2x", "4x", "8x"]


def test_the_summary_carries_what_each_run_measured_and_plots_it_against_accuracy(results_dir):
    table = summarize(pd.read_parquet(results_dir / "metrics"), pd.read_parquet(results_dir / "samples"), 200)
    indexed = table.set_index(["method", "budget"])
    assert indexed.loc[("snapkv", "4x"), "kv_bytes_peak"] == KV_BYTES / 4
    assert indexed.loc[("full", "full"), "memory_ratio"] == 1.0 and indexed.loc[("streaming_llm", "8x"), "memory_ratio"] == 8
    assert indexed.loc[("snapkv", "2x"), "decode_tokens_per_s"] == pytest.approx(100 * 2**0.5)
    assert table["peak_rss_bytes"].isna().all()  # not measured in these runs: missing, never zero
    paths = write_report(results_dir, iterations=200)
    for name in ("accuracy_vs_memory", "accuracy_vs_speed"):
        assert paths[name].read_bytes()[:4] == b"\x89PNG" and paths[name].stat().st_size > 10_000
        assert f"({name}.png)" in paths["markdown"].read_text()


def test_the_pareto_front_keeps_only_what_nothing_beats_on_both_axes():
    from evalkit.results.report import pareto

    memory = pd.Series([64.0, 32.0, 16.0, 16.0, 8.0, 32.0])
    accuracy = pd.Series([0.9, 0.9, 0.8, 0.6, 0.4, 0.7])
    assert pareto(memory, accuracy, lower_x_is_better=True).tolist() == [False, True, True, False, True, False]
    speed = pd.Series([100.0, 200.0, 300.0])
    assert pareto(speed, pd.Series([0.9, 0.9, 0.5]), lower_x_is_better=False).tolist() == [False, True, True]


def test_paired_bootstrap_of_identical_runs_is_zero():
    series = pd.Series([1.0, 0.0, 1.0, 1.0])
    assert paired_bootstrap(series, series, 200) == (0.0, 0.0, 0.0, 4)


def test_report_writes_markdown_csv_and_a_plot(results_dir):
    paths = write_report(results_dir, iterations=200)
    markdown = paths["markdown"].read_text()
    assert "| kv_retrieval | tiny    | snapkv" in markdown and "delta" in markdown
    pivot = pd.read_csv(paths["pivot"])
    assert list(pivot.columns) == ["task", "model", "method", "window", "full cache", "budget 2x", "budget 4x", "budget 8x"]
    snapkv = pivot[pivot["method"] == "snapkv"].set_index("window")
    assert snapkv.loc["32", "budget 4x"] == 0.8 and snapkv.loc["16", "budget 8x"] == 0.6  # a swept window: its own row
    assert pd.isna(snapkv.loc["32", "budget 8x"]) and pd.isna(snapkv.loc["16", "budget 4x"])
    assert "`delta` = value - baseline, computed on the documents both runs scored" in markdown
    assert paths["plot"].stat().st_size > 10_000 and paths["plot"].read_bytes()[:4] == b"\x89PNG"


def test_the_command_prints_a_line_per_configuration_and_where_the_report_went(results_dir, capsys):
    from evalkit.results.cli import main

    main([str(results_dir), "--bootstrap", "200"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"evalkit-report: 7 configurations in {results_dir}"
    assert lines[1].split() == ["task", "model", "method", "budget", "window", "metric", "value", "vs", "full",
                                "(95%", "CI)", "KV", "smaller"]
    rows = {tuple(line.split()[2:5]): line for line in lines[2:9]}
    assert len(rows) == 7 and all(len(line) <= 120 for line in lines[1:9])  # a terminal's width, not report.md's
    assert "0.8000 ± 0.0500 -0.1000 [" in rows[("snapkv", "4x", "32")] and rows[("snapkv", "4x", "32")].endswith("4.00x")
    assert rows[("full", "full", "-")].endswith("0.9000 ± 0.0500                        -      1.00x")
    assert lines[9].startswith(f"written to {results_dir / 'report'}/: summary.csv, report.md, accuracy_vs_budget.png")
    assert len(lines) == 10


def test_runs_differing_in_any_config_column_are_never_averaged(tmp_path):
    # Two snapkv 4x runs that differ only in `limit` (and their baselines): two rows, two cells, two lines.
    for limit in (10, 20):
        for method, budget, correct in (("full", None, 9), ("snapkv", "4x", 5 if limit == 10 else 8)):
            run_id = f"{method}-{limit}"
            config = {"run_id": run_id, "model": "tiny", "task": "kv_retrieval", "method": method, "budget": budget,
                      "limit": limit}
            samples = [{"doc_id": d, "sample_id": str(d), "repeat": 0, "score": float(d < correct)} for d in range(limit)]
            metrics = [{"subset": "all", "metric": "exact_match", "value": correct / limit, "stderr": 0.1, "n": limit}]
            write_table(samples_table(samples, config), tmp_path, "samples", run_id)
            write_table(metrics_table(metrics, config), tmp_path, "metrics", run_id)
    table = summarize(pd.read_parquet(tmp_path / "metrics"), pd.read_parquet(tmp_path / "samples"), 200)
    snapkv = table[table["method"] == "snapkv"].set_index("limit")
    assert snapkv.loc[10, "value"] == 0.5 and snapkv.loc[20, "value"] == 0.4  # not their mean, 0.45
    assert snapkv.loc[10, "baseline"] == 0.9 and snapkv.loc[20, "baseline"] == 0.45  # each against its own baseline
    assert snapkv.loc[10, "paired_docs"] == 10 and snapkv.loc[20, "paired_docs"] == 20
    paths = write_report(tmp_path, iterations=200)
    pivot = pd.read_csv(paths["pivot"])
    assert sorted(pivot[pivot["method"] == "snapkv"]["budget 4x"]) == [0.4, 0.5]


def test_report_command_refuses_a_folder_without_results(tmp_path):
    result = subprocess.run([sys.executable, "-m", "evalkit.results.cli", str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 2 and "not an evalkit results directory" in result.stderr


def test_needle_runs_get_depth_by_length_heatmaps(tmp_path):
    from evalkit.results.heatmaps import needle_grid

    for method, budget, lost in (("full", None, set()), ("streaming_llm", "8x", {0.0, 0.5})):
        run_id = f"needle-{method}"
        config = {"run_id": run_id, "model": "smol", "task": "needle", "method": method, "budget": budget}
        samples = [{"doc_id": i, "sample_id": f"{length}-{depth}", "subset": f"{length}/{depth:g}", "repeat": 0,
                    "score": 0.0 if depth in lost else 1.0}
                   for i, (length, depth) in enumerate((l, d) for l in (1000, 2000) for d in (0.0, 0.5, 1.0))]
        metrics = [{"subset": "all", "metric": "exact_match", "value": sum(s["score"] for s in samples) / 6, "stderr": 0.1,
                    "n": 6}]
        write_table(samples_table(samples, config), tmp_path, "samples", run_id)
        write_table(metrics_table(metrics, config), tmp_path, "metrics", run_id)
    grid = needle_grid(pd.read_parquet(tmp_path / "samples"), "needle-streaming_llm")
    assert list(grid.index) == [0.0, 0.5, 1.0] and list(grid.columns) == [1000, 2000]
    assert grid.loc[0.5].tolist() == [0.0, 0.0] and grid.loc[1.0].tolist() == [1.0, 1.0]
    paths = write_report(tmp_path, iterations=100)
    assert paths["needle"].read_bytes()[:4] == b"\x89PNG" and "needle_heatmap.png" in paths["markdown"].read_text()


def test_a_task_of_lm_evals_registry_is_not_taken_for_evalkits_task_of_the_same_name():
    """lm-eval's aime25 (exact_match) and evalkit's aime25 (pass@1, declared in tasks/aime25): each run's primary metric
    is its own task's."""
    import pandas as pd

    from evalkit.results.summary import primary_metric

    ours, registry = '{"repeats": 64}', '{"name": "aime25", "source": "lm_eval"}'
    metrics = pd.DataFrame([
        {"run_id": "a", "task": "aime25", "task_options": ours, "subset": "all", "metric": "pass@1", "value": 0.5},
        {"run_id": "b", "task": "aime25", "task_options": registry, "subset": "all", "metric": "exact_match",
         "value": 0.25},
    ])
    assert primary_metric("aime25", metrics, ours) == "pass@1"
    assert primary_metric("aime25", metrics, registry) == "exact_match"
    # a sweep job's closing line reads its own run's metric rows, which carry no task column
    own_rows = metrics[metrics["run_id"] == "b"].drop(columns=["task", "task_options"])
    assert primary_metric("aime25", own_rows, registry) == "exact_match"


def test_a_ruler_group_run_gets_a_task_by_length_heatmap(tmp_path):
    """A RULER run of lm-eval's registry (its samples' subsets: task/length): the report draws accuracy by task and
    length, one panel per configuration."""
    from evalkit.results.heatmaps import heatmap_axes, subset_grid

    options = '{"name": "ruler", "source": "lm_eval"}'
    for method, budget, lost in (("full", None, set()), ("snapkv", "4x", {("niah_single_2", 8192)})):
        run_id = f"ruler-{method}"
        config = {"run_id": run_id, "model": "m", "task": "ruler", "method": method, "budget": budget,
                  "task_options": options}
        cells = [(task, length) for task in ("niah_single_1", "niah_single_2") for length in (4096, 8192)]
        samples = [{"doc_id": i, "sample_id": str(i), "subset": f"{task}/{length}", "repeat": 0,
                    "score": 0.0 if (task, length) in lost else 1.0} for i, (task, length) in enumerate(cells)]
        metrics = [{"subset": "all", "metric": "4096", "value": 1.0, "stderr": None, "n": 2}]
        write_table(samples_table(samples, config), tmp_path, "samples", run_id)
        write_table(metrics_table(metrics, config), tmp_path, "metrics", run_id)
    samples = pd.read_parquet(tmp_path / "samples")
    axes = heatmap_axes("ruler", samples, registry=True)
    assert axes == (("task", "subset"), ["task", "subset"])
    grid = subset_grid(samples, "ruler-snapkv", "ruler", axes)
    assert list(grid.columns) == [4096, 8192] and grid.loc["niah_single_2"].tolist() == [1.0, 0.0]
    paths = write_report(tmp_path, iterations=100)
    assert paths["ruler"].read_bytes()[:4] == b"\x89PNG" and "ruler_heatmap.png" in paths["markdown"].read_text()
    assert heatmap_axes("ruler", samples.assign(subset="niah_single_1"), registry=True) is None  # one level: none


def test_trace_costs_against_the_full_cache_flag_what_held_less_but_spent_more(tmp_path):
    """Generated lengths, limit hits, accuracy per token and byte-seconds per correct answer, from the samples; the
    ratios against the full cache; a configuration that holds a quarter of the bytes per step but writes traces 5x
    longer (at the limit) spends more byte-seconds in total and is flagged, in the table and in the report."""
    runs = {  # method, budget: (generated tokens per sample, hit the limit, correct of 10, KV bytes held, seconds)
        ("full", None): (100, False, 8, 400.0, 1.0),
        ("h2o", "4x"): (500, True, 5, 100.0, 5.0),
        ("snapstream", "4x"): (110, False, 8, 100.0, 1.1),
    }
    for index, ((method, budget), (length, hit, correct, held, seconds)) in enumerate(runs.items()):
        config = {"run_id": f"run{index}", "model": "tiny", "task": "math500", "method": method, "budget": budget}
        samples = [{"doc_id": doc, "sample_id": str(doc), "repeat": 0, "score": float(doc < correct),
                    "generated_tokens": length, "hit_limit": hit, "kv_bytes_peak": int(held),
                    "kv_byte_seconds": held * seconds} for doc in range(10)]
        metrics = [{"subset": "all", "metric": "pass@1", "value": correct / 10, "stderr": 0.1, "n": 10},
                   {"subset": "all", "metric": "kv_bytes_peak_mean", "value": held, "stderr": None, "n": 10}]
        write_table(samples_table(samples, config), tmp_path, "samples", config["run_id"])
        write_table(metrics_table(metrics, config), tmp_path, "metrics", config["run_id"])
    table = summarize(pd.read_parquet(tmp_path / "metrics"), pd.read_parquet(tmp_path / "samples"), 200)
    row = table.set_index("method").loc
    assert row["full", "generated_tokens_mean"] == 100 and row["full", "hit_limit_share"] == 0.0
    assert row["h2o", "hit_limit_share"] == 1.0 and row["h2o", "length_ratio"] == 5.0
    assert row["h2o", "accuracy_per_1k_tokens"] == pytest.approx(1000 * 5 / 5000)
    assert row["h2o", "kv_byte_seconds_per_correct"] == pytest.approx(10 * 500.0 / 5)
    assert row["h2o", "kv_byte_seconds_ratio"] == pytest.approx(5000 / 4000)
    assert row["h2o", "spent_more_in_total"] is True or bool(row["h2o", "spent_more_in_total"])
    assert not bool(row["snapstream", "spent_more_in_total"])  # a quarter per step, about a quarter in total
    assert row["snapstream", "length_ratio"] == pytest.approx(1.1)
    paths = write_report(tmp_path, tmp_path / "report", iterations=200)
    text = paths["markdown"].read_text()
    assert "## Held less per step, spent more in total" in text and "| h2o" in text.split("spent more in total")[1]
    assert "snapstream" not in text.split("## Held less per step, spent more in total")[1].split("![")[0]
    assert paths["accuracy_vs_byte_seconds"].exists()


def test_a_needle_grid_run_length_by_length_is_one_line_per_method_along_length_and_depth(tmp_path):
    """Each length its own run (its own max_context); the lines pool a method's runs, the heatmaps do not."""
    from evalkit.results.heatmaps import heatmap_axes
    from evalkit.results.subset_lines import field_scores

    for method, budget, lost in (("full", None, set()), ("snapkv", "4x", {0.5})):
        for length in (2048, 4096):
            run_id = f"needle-{method}-{length}"
            config = {"run_id": run_id, "model": "smol", "task": "needle", "method": method, "budget": budget,
                      "max_context": length + 64}
            samples = [{"doc_id": i, "sample_id": f"{length}-{depth}", "subset": f"{length}/{depth:g}", "repeat": 0,
                        "score": 0.0 if depth in lost and length == 4096 else 1.0}
                       for i, depth in enumerate((0.0, 0.5, 1.0))]
            metrics = [{"subset": "all", "metric": "exact_match", "value": sum(s["score"] for s in samples) / 3,
                        "stderr": 0.1, "n": 3}]
            write_table(samples_table(samples, config), tmp_path, "samples", run_id)
            write_table(metrics_table(metrics, config), tmp_path, "metrics", run_id)
    tables = field_scores(pd.read_parquet(tmp_path / "samples"), "needle", heatmap_axes("needle"))
    by_length = tables["length"].set_index(["method", "length"])["score"]
    assert by_length[("snapkv", 2048)] == 1.0 and by_length[("snapkv", 4096)] == 2 / 3
    assert by_length[("full", 4096)] == 1.0 and len(by_length) == 4  # one line a method, both lengths on it
    by_depth = tables["depth"].set_index(["method", "depth"])
    assert by_depth.loc[("snapkv", 0.5), "score"] == 0.5 and by_depth.loc[("snapkv", 0.5), "n"] == 2
    paths = write_report(tmp_path, iterations=100)
    assert paths["needle_lines"].read_bytes()[:4] == b"\x89PNG"
    assert "needle_by_length_and_depth.png" in paths["markdown"].read_text()
