"""Which differences a report says are real: every configuration's paired test against its full cache at the
independent unit, the p-values adjusted over the report, ties per budget, flips.csv, the terminal's marks and its
line when nothing separates; ``evalkit-report compare`` and ``evalkit-report plan`` (docs/results.md); lm-eval's
results file with evalkit's statistics beside lm-eval's own fields."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from helpers import evalkit
from statsmodels.stats.multitest import multipletests

from evalkit.results import metrics_table, samples_table, write_table
from evalkit.results.cli import main
from evalkit.results.power import items_needed

# Correct documents of 40 per configuration; snapkv 2x gets right two documents the full cache missed.
CORRECT = {("full", None): 34, ("snapkv", "2x"): 34, ("snapkv", "4x"): 31, ("streaming_llm", "2x"): 26,
           ("streaming_llm", "4x"): 12, ("knorm", "4x"): 30}


def write_run(folder: Path, run_id: str, config: dict, samples: list[dict]) -> None:
    scores = [s["score"] for s in samples]
    metrics = [{"subset": "all", "metric": "exact_match", "value": float(np.mean(scores)), "stderr": 0.05,
                "n": len({s["doc_id"] for s in samples})}]
    config = {"run_id": run_id, "model": "tiny", "task": "kv_retrieval", **config}
    write_table(samples_table(samples, config), folder, "samples", run_id)
    write_table(metrics_table(metrics, config), folder, "metrics", run_id)


@pytest.fixture
def results(tmp_path) -> Path:
    """Six configurations of 40 documents (two subsets), each answering its count of CORRECT: the first ones."""
    for index, ((method, budget), correct) in enumerate(CORRECT.items()):
        right = set(range(correct)) if (method, budget) != ("snapkv", "2x") else set(range(2, 36))
        samples = [{"doc_id": d, "sample_id": f"q{d}", "repeat": 0, "score": float(d in right),
                    "subset": "short" if d % 2 else "long"} for d in range(40)]
        write_run(tmp_path, f"run{index}", {"method": method, "budget": budget}, samples)
    return tmp_path


def report(args: list[str], capsys) -> tuple[list[str], str]:
    main(args)
    said = capsys.readouterr()
    return said.out.splitlines(), said.err


def refused(args: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as stop:
        main(args)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err.strip()


def test_every_configuration_is_tested_against_its_full_cache_and_marked(results, capsys):
    lines, err = report([str(results), "--bootstrap", "500"], capsys)
    summary = pd.read_csv(results / "report" / "summary.csv").set_index(["method", "budget"])
    tested = summary.dropna(subset=["p_value"])
    assert len(tested) == 5 and set(tested["unit"]) == {"document"} and set(tested["test"]) == {"McNemar exact"}
    assert (tested["adjustment"] == "Holm over 5").all()
    assert tested["p_adjusted"].tolist() == pytest.approx(multipletests(tested["p_value"], method="holm")[1])
    assert summary.loc[("streaming_llm", "4x"), "verdict"] == "worse"  # 22 lost of 40
    assert summary.loc[("snapkv", "4x"), "verdict"] == "indistinguishable from the full cache"  # 3 lost
    assert (summary.loc[("snapkv", "2x"), ["lost", "gained"]] == [2, 2]).all()
    rows = {tuple(line.split()[2:4]): line for line in lines[2:8]}
    assert "-0.5500 [-0.70, -0.40] ▼" in rows[("streaming_llm", "4x")] and "] ≈" in rows[("snapkv", "4x")]
    assert rows[("full", "full")].endswith("0.8500 ± 0.0500                        -          -")
    assert max(map(len, lines[:-1])) <= 120
    assert lines[-1].endswith("marks: ▼ worse, ▲ better, ≈ indistinguishable from the full cache at Holm-adjusted "
                              "p < 0.05")
    assert err == "" and "no configuration separates" not in lines[-1]  # something separates: no plan


def test_the_report_writes_the_tests_ties_and_flips_and_the_page_shows_them(results, capsys):
    report([str(results), "--bootstrap", "300", "--html"], capsys)
    out = results / "report"
    markdown = (out / "report.md").read_text()
    assert "## Which differences are real" in markdown and "[flips.csv](flips.csv)" in markdown
    assert "## Ties at each budget" in markdown
    flips = pd.read_csv(out / "flips.csv")
    streaming = flips[flips["configuration"] == "streaming_llm 4x"]
    assert sorted(streaming["doc_id"]) == list(range(12, 34)) and set(streaming["change"]) == {"lost"}
    assert set(streaming["subset"]) == {"short", "long"} and set(streaming["sample_id"]) == {f"q{d}" for d in
                                                                                            range(12, 34)}
    snapkv = flips[flips["configuration"] == "snapkv 2x"].set_index("doc_id")["change"].to_dict()
    assert snapkv == {0: "lost", 1: "lost", 34: "gained", 35: "gained"}
    ties = pd.read_csv(out / "ties.csv")
    at_4x = ties[ties["budget"] == "4x"].set_index("configuration")["group"].to_dict()
    # snapkv 4x (31) and knorm 4x (30) are not separated; streaming_llm 4x (12) is below both
    assert at_4x["snapkv 4x"] == at_4x["knorm 4x"] and not set(at_4x["streaming_llm 4x"]) & set(at_4x["snapkv 4x"])
    assert (ties[ties["budget"] == "4x"]["adjustment"] == "Holm over 3 pairs").all()
    page = (out / "report.html").read_text()
    assert 'id="tests-table"' in page and 'id="ties-table"' in page and 'href="flips.csv"' in page
    assert '<td class="worse">worse</td>' in page


def test_benjamini_hochberg_is_asked_for_and_named(results, capsys):
    report([str(results), "--bootstrap", "200", "--adjust", "bh"], capsys)
    tested = pd.read_csv(results / "report" / "summary.csv").dropna(subset=["p_value"])
    assert (tested["adjustment"] == "Benjamini-Hochberg over 5").all()
    assert tested["p_adjusted"].tolist() == pytest.approx(multipletests(tested["p_value"], method="fdr_bh")[1])
    assert refused([str(results), "--adjust", "bonferroni"], capsys).startswith(
        "evalkit-report: argument --adjust: invalid choice")


def test_sessions_and_repeats_are_resampled_as_units(tmp_path, capsys):
    """multi_turn runs: 12 sessions of 5 turns, the compressed cache losing whole sessions: the unit is the session
    (a permutation test over session means, said in the table). Repeated samples of a problem: the problem."""
    rng = np.random.default_rng(0)
    lost = rng.random(12) < 0.4
    for method, budget in (("full", None), ("snapkv", "4x")):
        samples = [{"doc_id": 5 * s + t, "sample_id": f"s{s}-{t}", "session_id": f"s{s}", "turn": t + 1, "repeat": 0,
                    "score": 0.0 if method == "snapkv" and lost[s] else 1.0} for s in range(12) for t in range(5)]
        write_run(tmp_path, f"chat-{method}", {"method": method, "budget": budget, "task_mode": "multi_turn"},
                  samples)
        samples = [{"doc_id": d, "sample_id": str(d), "repeat": r, "score": float((d + r + (method == "full")) % 3 > 0)}
                   for d in range(15) for r in range(4)]
        write_run(tmp_path, f"aime-{method}", {"method": method, "budget": budget, "task": "aime24"}, samples)
    report([str(tmp_path), "--bootstrap", "300"], capsys)
    summary = pd.read_csv(tmp_path / "report" / "summary.csv").dropna(subset=["p_value"]).set_index("task")
    assert summary.loc["kv_retrieval", ["unit", "paired_units", "paired_items"]].tolist() == ["session", 12, 60]
    assert summary.loc["kv_retrieval", "test"] == "paired permutation over sessions"
    assert summary.loc["aime24", ["unit", "paired_units", "paired_items"]].tolist() == ["problem", 15, 60]
    assert summary.loc["aime24", "test"] == "paired permutation over problems"
    flips = pd.read_csv(tmp_path / "report" / "flips.csv")
    chat = flips[flips["run_id"] == "chat-snapkv"]
    assert set(chat["session_id"]) == {f"s{s}" for s in np.flatnonzero(lost)} and len(chat) == 5 * lost.sum()


def test_a_report_that_separates_nothing_says_how_many_items_would(tmp_path, capsys):
    for method, budget, right in (("full", None, 5), ("snapkv", "4x", 4), ("streaming_llm", "4x", 3)):
        write_run(tmp_path, f"{method}", {"method": method, "budget": budget},
                  [{"doc_id": d, "sample_id": str(d), "repeat": 0, "score": float(d < right)} for d in range(6)])
    lines, err = report([str(tmp_path), "--bootstrap", "200"], capsys)
    needed, _ = items_needed(2 / 6, 0.05, 0.05 / 2)  # the largest discordance seen: 2 of 6; two comparisons
    said = ("no configuration separates from its full cache at Holm-adjusted p < 0.05 (on 6 items at most): a change "
            f"of 0.05 at a discordance of 0.33 takes about {needed} items for 80% power over 2 comparisons "
            "(evalkit-report plan shows the arithmetic)")
    assert lines[-1].endswith(f"at Holm-adjusted p < 0.05; {said}") and len(lines) == 1 + 1 + 3 + 1
    assert err == "" and "] ≈" in lines[3]
    assert f"Note: {said}." in (tmp_path / "report" / "report.md").read_text()


# -- evalkit-report compare --------------------------------------------------------------------------------------

def test_compare_two_runs_gives_the_test_interval_unit_and_flips(results, tmp_path, capsys):
    flips = tmp_path / "flips.csv"
    lines, _ = report(["compare", "run0", str(results / "samples" / "run4.parquet"), "--results", str(results),
                       "--bootstrap", "500", "--flips", str(flips)], capsys)
    assert lines[0] == "evalkit-report compare: A full (tiny, run run0) vs B streaming_llm 4x (tiny, run run4)"
    assert lines[1] == ("task kv_retrieval · metric exact_match · unit document: 40 paired items in 40 documents "
                        "(A scored 40, B 40)")
    assert lines[2].startswith("A 0.8500 · B 0.3000 · delta (B - A) -0.5500, 95% CI [-0.")
    assert lines[3] == f"McNemar exact: p = {2 * 0.5**22:.4g} (22 lost, 0 gained)"
    assert lines[4].startswith("lost (A higher, B lower): 22: doc 12 [long], doc 13 [short],") and "12 more" in lines[4]
    assert lines[5] == "gained (B higher, A lower): 0"
    written = pd.read_csv(flips)
    assert len(written) == 22 and set(written["change"]) == {"lost"} and (written["score_a"] == 1).all()


def test_compare_refuses_runs_without_common_items_in_one_line(results, capsys):
    write_run(results, "other", {"method": "full", "budget": None},
              [{"doc_id": 100 + d, "sample_id": str(100 + d), "repeat": 0, "score": 1.0} for d in range(5)])
    write_run(results, "needle", {"method": "full", "budget": None, "task": "needle"},
              [{"doc_id": d, "sample_id": f"q{d}", "repeat": 0, "score": 1.0} for d in range(5)])
    base = ["--results", str(results)]
    assert refused(["compare", "run0", "other", *base], capsys) == (
        "evalkit-report compare: run0 and other share no items: none of the 40 and 5 scored rows has the same "
        "subset, doc_id, sample_id and repeat in both")
    assert refused(["compare", "run0", "needle", *base], capsys) == (
        "evalkit-report compare: run0 and needle ran different tasks (kv_retrieval, needle): no items to pair")
    assert refused(["compare", "run0", "nope", *base], capsys).startswith(
        f"evalkit-report compare: no run 'nope' in {results}")
    assert "give more of it" in refused(["compare", "run0", "run", *base], capsys)
    assert refused(["compare", str(results / "x.parquet"), "run0", *base], capsys) == (
        f"evalkit-report compare: {results / 'x.parquet'}: no such samples table")


# -- evalkit-report plan -----------------------------------------------------------------------------------------

def test_plan_gives_the_items_for_80_percent_power(capsys):
    lines, _ = report(["plan", "--baseline", "0.6", "--discordance", "0.2", "--delta", "0.05"], capsys)
    n, _ = items_needed(0.2, 0.05, baseline=0.6)
    assert lines == [f"evalkit-report plan: a change of 0.05 from a baseline of 0.6, with 0.2 of the items discordant "
                     f"(lost 0.125, gained 0.075): {n} items for 80% power (McNemar exact, two-sided alpha 0.05, exact)"]
    assert refused(["plan", "--discordance", "0.01", "--delta", "0.05"], capsys).startswith(
        "evalkit-report plan: the change (0.05) must be above 0 and at most the discordance (0.01")
    assert refused(["plan", "--delta", "2"], capsys).startswith("evalkit-report plan: argument --delta: a share")
    assert refused(["plan"], capsys) == ("evalkit-report plan: give --discordance (and --baseline), or a pilot run's "
                                         "results directory")


def test_plan_reads_a_pilot_runs_rates(results, capsys):
    lines, _ = report(["plan", str(results), "--delta", "0.1"], capsys)
    assert lines[0] == f"evalkit-report plan: 5 comparisons in {results}, to detect a change of 0.1 (alpha split over 5)"
    n, _ = items_needed(22 / 40, 0.1, 0.05 / 5)  # as the report's Holm adjustment at its strictest step
    assert f"  streaming_llm 4x: a change of 0.1 with 0.55 of the items discordant (lost 0.325, gained 0.225): {n} " \
           "items for 80% power (McNemar exact, two-sided alpha 0.01, exact)" in lines
    one, _ = report(["plan", str(results), "--delta", "0.1", "--comparisons", "1"], capsys)
    assert f"gained 0.225): {items_needed(22 / 40, 0.1)[0]} items" in "\n".join(one) and n > items_needed(22 / 40, 0.1)[0]
    assert "  snapkv 2x: a change of 0.1 with 0.1 of the items discordant (lost 0.1, gained 0): " in "\n".join(lines)


# -- lm-eval's results file --------------------------------------------------------------------------------------

def test_a_copy_of_lm_evals_results_file_carries_the_statistics_under_evalkits_key(results, capsys):
    """A run's results file as lm-eval's EvaluationTracker writes it (where a run writes it): the report's copy
    has lm-eval's fields as they were and the comparison under ``evalkit``; the run's own file is untouched."""
    from lm_eval.loggers import EvaluationTracker

    tracker = EvaluationTracker(output_path=str(results / "lm_eval" / "run4"))
    tracker.general_config_tracker.log_experiment_args(model_source="evalkit", model_args={"method": "streaming_llm"},
                                                       system_instruction=None, chat_template=None,
                                                       fewshot_as_multiturn=False)
    tracker.save_results_aggregated(results={"results": {"kv_retrieval": {"exact_match,none": 0.3}},
                                             "versions": {"kv_retrieval": 1}, "n-shot": {"kv_retrieval": 0}})
    own = next((results / "lm_eval" / "run4").glob("*/results_*.json"))
    before = own.read_bytes()
    lines, _ = report([str(results), "--bootstrap", "200"], capsys)
    copy = results / "report" / own.relative_to(results)
    written = json.loads(copy.read_text())
    statistics = written.pop("evalkit")["against_full_cache"]
    assert written == json.loads(before) and own.read_bytes() == before
    assert statistics == pytest.approx({
        "metric": "exact_match", "value": 0.3, "baseline": 0.85, "baseline_run_id": "run0", "delta": -0.55,
        "delta_low": statistics["delta_low"], "delta_high": statistics["delta_high"], "unit": "document",
        "paired_units": 40, "paired_items": 40, "paired_docs": 40, "test": "McNemar exact", "p_value": 2 * 0.5**22,
        "p_adjusted": statistics["p_adjusted"], "adjustment": "Holm over 5", "verdict": "worse", "lost": 22,
        "gained": 0, "interval_level": 0.95})
    assert statistics["delta_low"] < -0.55 < statistics["delta_high"] < 0
    assert [p.name for p in (results / "report" / "lm_eval").iterdir()] == ["run4"]
    assert "lm_eval" in lines[-1]


@pytest.mark.slow(reason="two real runs of the built-in task (~25 s on two busy cores)")
def test_lm_evals_results_file_keeps_its_fields_and_gets_evalkits_statistics(tmp_path, capsys):
    for args in (["method=full"], ["method=snapkv", "budget=4x"]):
        result = evalkit("task=kv_retrieval", *args, "limit=4", f"results_dir={tmp_path / 'results'}", cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
    results = tmp_path / "results"
    lines, _ = report([str(results), "--bootstrap", "200"], capsys)
    summary = pd.read_csv(results / "report" / "summary.csv")
    snapkv = summary[summary["method"] == "snapkv"].iloc[0]
    own = next((results / "lm_eval" / snapkv["run_id"]).glob("*/results_*.json"))
    copy = results / "report" / own.relative_to(results)
    original, written = json.loads(own.read_text()), json.loads(copy.read_text())
    statistics = written.pop("evalkit")["against_full_cache"]
    assert written == original  # lm-eval's fields as lm-eval wrote them
    assert statistics["baseline_run_id"] == summary[summary["method"] == "full"]["run_id"].iloc[0]
    assert statistics["unit"] == "document" and statistics["paired_items"] == 4
    assert statistics["test"] == "McNemar exact" and statistics["adjustment"] == "Holm over 1"
    assert statistics["delta"] == pytest.approx(snapkv["delta"]) and statistics["interval_level"] == 0.95
    assert not list((results / "report" / "lm_eval").glob(f"{summary[summary['method'] == 'full']['run_id'].iloc[0]}*"))
    compared, _ = report(["compare", snapkv["baseline_run_id"], snapkv["run_id"][:20], "--results", str(results)],
                         capsys)
    assert compared[1].startswith("task kv_retrieval · metric exact_match · unit document: 4 paired items")
