"""Config values that used to be accepted and ignored, and one-liners that misled: each is now one line, exit 2 and
nothing written, or, where the run still means what it says, a warning line at its start (the CLI as users run it)."""

from __future__ import annotations

import pandas as pd
import pytest
from helpers import evalkit
from test_benchmarks import aime_rows_h4, write_jsonl
from test_trust import assert_one_line_error, error_lines

from evalkit.config import compose
from evalkit.core.errors import ConfigError
from evalkit.run import precheck


# -- settings that would take no effect ---------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, fragments", [
    (["kv_group_size=64"], ["kv_group_size=64 takes no effect at kv_bits=16 (no quantization): add kv_bits=2, 4 or 8"]),
    (["kv_residual=64"], ["kv_residual=64 takes no effect at kv_bits=16"]),
    (["kv_residual=abc"], ["kv_residual must be a positive integer, got 'abc'"]),
    (["kv_residual=abc", "kv_bits=4"], ["kv_residual must be a positive integer, got 'abc'"]),
    (["kv_group_size=x", "kv_bits=16"], ["kv_group_size must be a positive integer, got 'x'"]),
    (["parallel.replicas=4"], ["parallel.replicas=4 takes no effect with parallel=single", "add parallel=ray"]),
    (["+parallel.address=auto"], ["parallel.address=auto takes no effect with parallel=single"]),
    (["+logger.project=mine"], ["logger.project=mine takes no effect with logger=none",
                                "add logger=trackio or logger=wandb"]),
    (["task=needle_multiturn", "task.mode=multi_turn", "+session.recompress=each_call"],
     ["session.recompress=each_call takes no effect with task needle_multiturn: its calls bring no new content"]),
])
def test_a_setting_that_would_take_no_effect_is_one_line(tmp_path, overrides, fragments):
    result = evalkit(*overrides, "limit=2", f"results_dir={tmp_path / 'results'}", cwd=tmp_path)
    assert_one_line_error(result, tmp_path, "config error", *fragments)


def test_the_defaults_given_explicitly_pass_and_a_sweeps_16_bit_job_is_warned_not_refused():
    for overrides in (["kv_residual=128", "kv_group_size=32"], ["kv_bits=16", "kv_residual=128"], ["parallel.replicas=1"],
                      ["kv_bits=4", "kv_residual=64"]):
        assert precheck(compose(*overrides), method_explicit=False)["warnings"] == []
    # -m kv_bits=16,4 kv_residual=32: the residual is meant for the 4-bit jobs; the 16-bit one runs, unquantized
    (warning,) = precheck(compose("kv_residual=32"), method_explicit=False, sweeping=True)["warnings"]
    assert warning == "kv_residual=32 takes no effect at kv_bits=16 (no quantization): this job runs unquantized"
    with pytest.raises(ConfigError, match="kv_residual=32 takes no effect"):
        precheck(compose("kv_residual=32"), method_explicit=False)


# -- a quantized format whose residual covers the cache -----------------------------------------------------------
def test_a_residual_that_covers_the_cache_is_a_warning_and_the_rows_count_the_tokens_priced_quantized(tmp_path):
    """SnapStream 4x on the built-in task holds 64 tokens per request: under KIVI's default residual of 128 its
    generated tokens are never quantized, only its kept prompt (said at the start; the rows price and count the
    prompt quantized, below the 16-bit bytes). A residual of 32 says nothing (generated tokens beyond it are
    quantized)."""
    results = tmp_path / "results"
    covered = evalkit("+budget=4x", "kv_bits=4", "limit=2", f"results_dir={results}", cwd=tmp_path)
    assert covered.returncode == 0, covered.stderr[-2000:]
    (line,) = error_lines(covered)
    assert line.startswith("evalkit: WARNING: kv_residual=128 covers the whole cache (64 tokens per request)"), line
    assert "only the kept prompt is" in line and "kv_residual=32 quantizes them too" in line
    priced = evalkit("+budget=4x", "kv_bits=4", "kv_residual=32", "limit=2", f"results_dir={results}", cwd=tmp_path)
    assert priced.returncode == 0 and error_lines(priced) == [], priced.stderr[-2000:]
    metrics = pd.read_parquet(results / "metrics")
    values = metrics[metrics["metric"].isin(["kv_quantized_tokens_mean", "kv_bytes_peak_mean"])].pivot_table(
        index="kv_residual", columns="metric", values="value")
    # the built-in task generates a few tokens, fewer than either residual: the same prompt quantized under both
    assert 0 < values.loc[128, "kv_quantized_tokens_mean"] <= values.loc[32, "kv_quantized_tokens_mean"]
    assert values.loc[32, "kv_bytes_peak_mean"] <= values.loc[128, "kv_bytes_peak_mean"]
    sixteen = evalkit("+budget=4x", "limit=2", f"results_dir={results}", cwd=tmp_path)
    assert sixteen.returncode == 0, sixteen.stderr[-2000:]
    metrics = pd.read_parquet(results / "metrics")
    peak = metrics[metrics["metric"] == "kv_bytes_peak_mean"].groupby("kv_bits", dropna=False)["value"].min()
    assert peak.loc[4] < peak.drop(4).iloc[0]  # the quantized prompt priced below the 16-bit cache
    assert metrics.groupby("kv_residual")["config_digest"].nunique().eq(1).all()


def test_the_tokens_priced_quantized_are_those_beyond_each_heads_residual():
    import evalkit.compression as ec

    fmt = ec.KVFormat(4, 32, 128)
    assert fmt.quantized_tokens(2 * 64, 2) == 0  # generated unknown: each head's last 128 held ones are the residual
    assert fmt.quantized_tokens(2 * 300, 2) == 2 * (300 - 128)
    assert fmt.quantized_tokens(2 * 64, 2, generated=20) == 2 * 44  # the kept prompt is quantized, 20 fed back are not
    assert fmt.quantized_tokens(2 * 300, 2, generated=200) == 2 * (300 - 128)
    full = 2 * 64 * 4  # float32 keys and values of one head, 64 wide
    assert fmt.held_bytes(2 * 64, 2, 64, 64, 4) == 2 * 64 * full  # all residual: the unquantized bytes
    assert fmt.held_bytes(2 * 64, 2, 64, 64, 4, generated=0) == 2 * 64 * fmt.token_bytes(64, 64, 4)


# -- misleading one-liners ----------------------------------------------------------------------------------------
def test_the_report_refuses_a_bootstrap_count_that_is_not_positive_in_one_line(tmp_path, capsys):
    from evalkit.results.cli import main

    for count in ("-5", "0", "many"):
        with pytest.raises(SystemExit) as stop:
            main([str(tmp_path / "results"), "--bootstrap", count])
        assert stop.value.code == 2
        lines = capsys.readouterr().err.splitlines()
        assert lines == [f"evalkit-report: argument --bootstrap: the number of bootstrap resamples must be a positive "
                         f"integer, got '{count}' (evalkit-report --help shows the arguments)"]
    assert list(tmp_path.iterdir()) == []


def test_speculative_prefill_with_a_budget_names_its_decoding_method(tmp_path):
    result = evalkit("method=spec_prefill", "method.draft_model=builtin:kv_retrieval_tiny", "+budget=4x",
                     f"results_dir={tmp_path / 'results'}", cwd=tmp_path)
    assert_one_line_error(result, tmp_path, "method=spec_prefill decodes with method.then=full, which takes no budget",
                          "set method.then=snapkv")
    assert "method=full takes no budget" not in result.stderr


@pytest.mark.parametrize("override, hint", [
    ("method=snapkvv", "method=snapkvv: did you mean method=snapkv? In 'config': Could not find 'method/snapkvv'"),
    ("task=aime42", "task=aime42: did you mean task=aime24"),
    ("task=kv_retreival", "task=kv_retreival: did you mean task=kv_retrieval?"),
])
def test_a_misspelled_method_or_task_names_the_nearest_one(tmp_path, override, hint):
    result = evalkit(override, f"results_dir={tmp_path / 'results'}", cwd=tmp_path)
    assert_one_line_error(result, tmp_path, hint, "Available options in")


def test_help_opens_with_what_evalkit_does_and_its_two_commands(tmp_path):
    result = evalkit("--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("evalkit: the accuracy a compressed KV cache costs an LLM"), lines[0]
    head = "\n".join(lines[:10])
    assert "evalkit +budget=4x task=" in head and "evalkit-report results/" in head
    assert "is powered by Hydra" not in result.stdout and "== Configuration groups ==" in result.stdout
    assert "hydra" not in compose()  # the help is Hydra's setting, no part of a run's config or its digest


# -- a task the model's context cannot take -----------------------------------------------------------------------
def test_a_benchmark_on_the_built_in_test_model_is_refused_before_its_data_or_weights_load(tmp_path):
    """`evalkit +budget=4x task=aime24`, no model named: AIME's 32768 answer tokens leave no room in the built-in
    model's 256-token context. Refused before the hub dataset is fetched (offline here: no data error) and before any
    weights load, naming how to choose a model."""
    result = evalkit("+budget=4x", "task=aime24", f"results_dir={tmp_path / 'results'}", cwd=tmp_path)
    assert_one_line_error(result, tmp_path, "task aime24 generates up to 32768 tokens (task.generation.max_gen_toks)",
                          "256-token context of model kv_retrieval_tiny (model.max_context)",
                          "kv_retrieval_tiny is a built-in test model for task=kv_retrieval",
                          "with model=NAME (deepseek_r1_distill_llama_8b,", "or model.pretrained=PATH")
    assert "Loading weights" not in result.stderr and "could not load dataset" not in result.stderr


def test_needles_declared_lengths_must_fit_the_context(tmp_path):
    result = evalkit("task=needle", "task.dataset.lengths=[200,400]", f"results_dir={tmp_path / 'results'}",
                     cwd=tmp_path)
    assert_one_line_error(result, tmp_path, "task needle's prompts of up to about 400 tokens (task.dataset.lengths)",
                          "with 16 tokens to generate", "model=NAME")


def test_needles_refusal_names_the_context_that_fits_its_lengths(tmp_path, random_model_dir):
    """A model of its own whose 256-token context cannot take 1,500-token needles: the line names the setting that
    would (1,500 and 16 answer tokens, rounded up to 2,048), before the weights load."""
    result = evalkit("task=needle", "task.dataset.lengths=[1500]", f"model.pretrained={random_model_dir}",
                     f"results_dir={tmp_path / 'results'}", cwd=tmp_path)
    assert_one_line_error(result, tmp_path, "task needle's prompts of up to about 1500 tokens", "with 16 tokens to "
                          "generate: choose a model with a longer context (model=NAME, or model.max_context=2048 where "
                          "the model takes that many), or shorten task.dataset.lengths")
    assert "Loading weights" not in result.stderr


def test_a_task_whose_answers_fill_the_context_is_refused_for_any_model(tmp_path, random_model_dir):
    """A model of its own (not the built-in one) and local data (read and checked first: nothing to download): the
    task is refused before the weights load."""
    data = write_jsonl(tmp_path / "aime.jsonl", aime_rows_h4())
    result = evalkit("task=aime24", f"task.dataset.path={data}", f"model.pretrained={random_model_dir}",
                     "task.generation.max_gen_toks=256", f"results_dir={tmp_path / 'results'}", cwd=tmp_path)
    assert_one_line_error(result, tmp_path, "task aime24 generates up to 256 tokens", "choose a model with a longer "
                          "context (model=NAME, or model.max_context where the model takes more), or lower "
                          "task.generation.max_gen_toks")
    assert "Loading weights" not in result.stderr


def test_a_bad_method_setting_is_refused_also_where_the_run_is_the_full_cache_baseline(tmp_path):
    """`evalkit method.window=-1` (no budget: the full-cache baseline of the default method) is refused as with a
    budget, not run with the value ignored."""
    result = evalkit("method.window=-1", "limit=2", f"results_dir={tmp_path / 'results'}", cwd=tmp_path)
    (line,) = error_lines(result)
    assert result.returncode == 2 and "window" in line and "-1" in line, result.stderr[-2000:]
    assert not (tmp_path / "results").exists()
