"""The harness: config composition and validation, the CLI as a subprocess, the lm-eval adapter, result tables."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pandas as pd
import pytest
import torch
from helpers import evalkit
from yaml import safe_load

import evalkit.compression as ec
from evalkit.cli import method_was_chosen
from evalkit.config import compose as compose_config
from evalkit.core.paths import conf_dir
from evalkit.results import metrics_table, read_table, write_table
from evalkit.run import ConfigError, validate


def composed(*overrides: str) -> dict:
    return compose_config(*overrides)


def spec_for(*overrides: str):
    return validate(composed(*overrides), method_explicit=method_was_chosen(list(overrides)))


# -- composition and validation ----------------------------------------------------------------------------------
def test_no_budget_is_the_full_cache_baseline():
    spec = spec_for("task=kv_retrieval")
    assert spec.method == "full" and spec.budget is None and isinstance(spec.policy, ec.Full)


def test_plus_budget_compresses_with_snapstream():
    spec = spec_for("+budget=4x", "task=kv_retrieval")
    assert spec.method == "snapstream" and spec.budget == "4x"
    assert spec.policy.cache_capacity() == 256 // 4
    assert spec.flat_config()["capacity"] == 64 and spec.flat_config()["window"] == 32


def test_budget_is_a_plain_key_and_the_appending_form_still_works():
    plain, appended = spec_for("budget=4x", "task=kv_retrieval"), spec_for("+budget=4x", "task=kv_retrieval")
    assert plain.flat_config() == appended.flat_config() and plain.policy.cache_capacity() == 64
    assert spec_for("+budget=4x", "~budget").budget is None  # ~budget: no budget, the full-cache baseline
    assert spec_for("budget=tokens_100").policy.cache_capacity() == 100
    with pytest.raises(ConfigError, match="budget must look like '4x', '2.5x', 'tokens_4096' or 'removed_0.75' "
                                          "\\(kvpress' compression_ratio\\), got '3q'"):
        spec_for("budget=3q")


def test_a_config_error_is_answered_before_torch_loads(tmp_path):
    """`evalkit budget=3q task=needle`: the one line and exit 2, and torch, transformers and lm-eval never imported
    (Python's -X importtime lists every module a process imports)."""
    import subprocess
    import sys

    for override in ("budget=3q", "+budget=3q", "limit=0", "device=tpu"):
        result = subprocess.run([sys.executable, "-X", "importtime", "-m", "evalkit.cli", override, "task=needle",
                                 f"results_dir={tmp_path / 'results'}"], cwd=tmp_path, capture_output=True, text=True,
                                timeout=120)
        errors = [line for line in result.stderr.splitlines() if line.startswith("evalkit:")]
        assert result.returncode == 2 and len(errors) == 1 and "config error" in errors[0], result.stderr[-2000:]
        imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
        assert "hydra" in imported and not imported & {"torch", "transformers", "lm_eval"}
    assert not (tmp_path / "results").exists()


def test_sweep_axes_reach_the_policy():
    spec = spec_for("+budget=2x", "method=snapkv", "method.window=16", "method.kernel_size=5", "method.pooling=avg")
    assert (spec.policy.capacity, spec.policy.window, spec.policy.kernel_size, spec.policy.pooling) == (128, 16, 5, "avg")
    streaming = spec_for("+budget=8x", "method=streaming_llm")
    assert (streaming.policy.sink, streaming.policy.window) == (4, 28)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["method=snapkv"], "needs a budget"),
        (["method=full", "+budget=4x"], "takes no budget"),
        (["+budget=4x", "method.window=0"], "window"),
        (["+budget=4x", "method.kernel_size=4"], "kernel_size"),
        (["+budget=4x", "method.pooling=median"], "pooling"),
        (["+budget=16x"], "capacity"),  # 16 slots cannot hold sink + window + recent
        (["+budget=4x", "model.max_context=-3"], "max_context"),
        (["+budget=4x", "prefill_chunk=0"], "prefill_chunk must be a positive integer"),
        (["+budget=4x", "prefill_chunk=64", "prefill_chunk_mode=stream"], "prefill_chunk_mode must be one of"),
        (["+budget=4x", "method=h2o", "prefill_chunk=64", "prefill_chunk_mode=compress"], "one budget for every layer"),
        (["+budget=4x", "batch_size=0"], "batch_size"),
        (["+budget=4x", "task.name=nonexistent"], "unknown task"),
        (["+budget=4x", "+method.bogus=1"], "bogus"),
        (["+budget=4x", "model.device_map=everywhere"], "model.device_map must be null, one of"),
    ],
)
def test_bad_configs_give_one_clear_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        spec_for(*overrides)


# -- the CLI as a subprocess ---------------------------------------------------------------------------------------
def test_bad_config_exits_nonzero_and_writes_nothing(tmp_path):
    result = evalkit("method=snapkv", f"results_dir={tmp_path / 'results'}", cwd=tmp_path)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("evalkit:")]
    assert errors == ["evalkit: config error: method=snapkv needs a budget: add +budget=4x (or 2x, 8x, 16x, tokens_N)"]
    assert not (tmp_path / "results").exists()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("override, message", [
    ("method=h3o", "Could not find 'method/h3o'; Available options in 'method': "
                   + ", ".join(sorted(path.stem for path in (conf_dir() / "method").glob("*.yaml")))),
    ("bogus=1", "Could not override 'bogus'. To append to your config use +bogus=1"),
    ("method.window==", "Error parsing override 'method.window=='"),
])
def test_hydra_composition_errors_are_one_line(tmp_path, override, message):
    result = evalkit(override, f"results_dir={tmp_path / 'results'}", cwd=tmp_path)
    assert result.returncode == 2
    (line,) = [line for line in result.stderr.splitlines() if line.strip()]
    assert line.startswith("evalkit: config error: ") and message in line, line
    assert not (tmp_path / "results").exists()


@pytest.mark.slow
def test_cli_run_writes_tidy_tables(tmp_path, random_model_dir):
    results = tmp_path / "results"
    result = evalkit("+budget=4x", "task=kv_retrieval", f"model.pretrained={random_model_dir}", "limit=6",
                     f"results_dir={results}", "deployment=deepseek_r1_tp16_128k", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "exact_match" in result.stdout
    assert "note: the memory rows price deepseek_r1_671b on deepseek_r1_tp16_128k" in result.stdout  # not this model
    metrics, samples = read_table(results, "metrics"), read_table(results, "samples")
    best = metrics[(metrics["subset"] == "memory") & (metrics["metric"] == "best_tokens_per_s_estimate")]["value"]
    assert f"~{best.iloc[0]:.0f} tok/s at best" in result.stdout  # the summary line reads the run's memory rows
    assert set(metrics["metric"]) >= {"exact_match", "realized_ratio_mean"}
    assert "all" in set(metrics["subset"]) and len(set(metrics["subset"])) > 1
    assert len(samples) == 6 and samples["doc_id"].is_unique
    for frame in (metrics, samples):
        row = frame.iloc[0]
        assert (row["method"], row["budget"], row["capacity"], row["window"], row["kernel_size"]) == ("snapstream", "4x", 64, 32, 7)
        assert (row["pooling"], row["sink"], row["recent"], row["task"], row["seed"]) == ("max", 4, 16, "kv_retrieval", 1234)
        assert row["torch_version"] and row["transformers_version"] and row["run_id"]
    # Realized compression is real: prompts of 123-219 tokens held in at most 64 slots.
    assert (samples["peak_cache_tokens"] <= 64).all()
    assert (samples["realized_ratio"] > 2).all()
    assert (samples["prompt_tokens"] > 120).all()
    assert len(list((results / "csv" / "metrics").glob("*.csv"))) == 1


@pytest.mark.slow
def test_multirun_sweep_reads_back_in_one_call(tmp_path, random_model_dir):
    results = tmp_path / "results"
    result = evalkit("-m", "+budget=2x,4x", "method=snapkv,snapstream", "method.window=16", "limit=2",
                     f"model.pretrained={random_model_dir}", f"results_dir={results}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    metrics = pd.read_parquet(results / "metrics")
    runs = metrics.groupby("run_id")[["method", "budget"]].first()
    assert sorted(map(tuple, runs.values)) == [("snapkv", "2x"), ("snapkv", "4x"), ("snapstream", "2x"), ("snapstream", "4x")]
    assert set(metrics["window"]) == {16}


# -- the lm-eval adapter -------------------------------------------------------------------------------------------
class Request:
    def __init__(self, *args):
        self.args = args


@pytest.fixture(scope="module")
def adapter_parts(random_model_dir):
    from evalkit.models import load_model

    return load_model(str(random_model_dir), device="cpu")


@pytest.mark.slow
def test_lm_eval_cli_runs_the_documented_command(tmp_path):
    """docs/running.md's `lm_eval --model evalkit ...` as written (plus --limit), through lm-eval's own CLI, on the CPU."""
    import os
    import shutil
    import subprocess
    import sys

    from evalkit.core.paths import tasks_dir

    executable = shutil.which("lm_eval", path=os.path.dirname(sys.executable))
    assert executable, "lm-eval's CLI is not installed beside this python"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    result = subprocess.run(
        [executable, "--model", "evalkit", "--model_args",
         "pretrained=builtin:kv_retrieval_tiny,method=snapstream,budget=4x,max_context=256",
         "--include_path", str(tasks_dir()), "--tasks", "kv_retrieval", "--limit", "8"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    row = next(line for line in result.stdout.splitlines() if line.startswith("|kv_retrieval"))
    assert "exact_match" in row and float(row.split("|")[7]) >= 0.0
    assert "'method': 'snapstream', 'budget': '4x'" in result.stdout


def test_lm_eval_plugin_is_only_loaded_for_lm_eval():
    from evalkit.lm.plugin import is_lm_eval_cli

    assert is_lm_eval_cli(["python", "/venv/bin/lm_eval", "--model", "evalkit"])
    assert is_lm_eval_cli(["python", "/venv/bin/lm-eval", "run"]) and is_lm_eval_cli(["python", "-m", "lm_eval"])
    assert not is_lm_eval_cli(["python", "-m", "pytest"]) and not is_lm_eval_cli(["python", "/venv/bin/evalkit"])


def test_evalkit_is_a_registered_lm_eval_model():
    from lm_eval.api.registry import get_model

    from evalkit.lm import EvalkitLM

    assert get_model("evalkit") is EvalkitLM


def test_generate_until_uses_the_policy_and_records_realized_compression(adapter_parts):
    from evalkit.lm import EvalkitLM
    from evalkit.models.synthetic import build_examples

    model, tokenizer = adapter_parts
    rows = build_examples(3, seed=5)
    prompts = [f"{r['context']} {r['question']}" for r in rows]
    requests = [Request(p, {"until": ["</s>"], "max_gen_toks": 3, "do_sample": False}) for p in prompts]
    compressed = EvalkitLM(model=model, tokenizer=tokenizer, method="snapkv", budget="4x", max_context=256, window=8, kernel_size=3)
    outputs = compressed.generate_until(requests, disable_tqdm=True)
    assert len(outputs) == 3 and all(isinstance(o, str) for o in outputs)
    assert sorted(compressed.request_stats) == [(None, position, 0) for position in range(3)]
    for stats in compressed.request_stats.values():
        assert stats["kept_prompt_tokens"] == [64] * model.config.num_hidden_layers
        assert stats["prompt_tokens"] > 64
    full = EvalkitLM(model=model, tokenizer=tokenizer, method="full", max_context=256)
    full.generate_until(requests, disable_tqdm=True)
    assert [s["realized_ratio"] for s in full.request_stats.values()] == [1.0] * 3


def test_loglikelihood_is_compress_then_score(adapter_parts):
    from evalkit.lm import EvalkitLM
    from evalkit.models.synthetic import build_examples

    model, tokenizer = adapter_parts
    row = build_examples(1, seed=8)[0]
    context, continuation = f"{row['context']} {row['question']}", f" {row['answer']} ?"
    ids = tokenizer(context + continuation, return_tensors="pt")["input_ids"]
    split = len(tokenizer(context)["input_ids"])
    with torch.no_grad():
        logprobs = model(ids).logits[0].log_softmax(-1)
    expected = float(sum(logprobs[i - 1, ids[0, i]] for i in range(split, ids.shape[1])))
    full = EvalkitLM(model=model, tokenizer=tokenizer, method="full", max_context=256)
    (value, _), = full.loglikelihood([Request(context, continuation)], disable_tqdm=True)
    assert value == pytest.approx(expected, abs=1e-3)
    compressed = EvalkitLM(model=model, tokenizer=tokenizer, method="streaming_llm", budget="8x", max_context=256)
    (squeezed, _), = compressed.loglikelihood([Request(context, continuation)], disable_tqdm=True)
    assert squeezed != pytest.approx(expected, abs=1e-3)
    assert compressed.request_stats[(None, 0, 0)]["peak_cache_tokens"] == 32


def test_stop_strings_work_with_a_word_level_tokenizer(adapter_parts):
    # transformers' StopStringCriteria cannot index this vocabulary; generation falls back to decoding the tail.
    model, tokenizer = adapter_parts
    ids = tokenizer("k1 v2 u3 k4 ? k1", return_tensors="pt")["input_ids"]
    free = ec.generate(model, ids, ec.Full(), max_new_tokens=12, return_logits=False).sequences[0, ids.shape[1]:]
    stop = tokenizer.decode(free[3:4])
    out = ec.generate(model, ids, ec.Full(), max_new_tokens=12, stop_strings=[stop], tokenizer=tokenizer)
    count = out.stats[0]["generated_tokens"]
    generated = out.sequences[0, ids.shape[1]: ids.shape[1] + count]
    assert 1 <= count <= 4 and torch.equal(generated, free[:count])
    assert stop in tokenizer.decode(generated) and stop not in tokenizer.decode(generated[:-1])


def test_rolling_loglikelihood_is_refused(adapter_parts):
    from evalkit.lm import EvalkitLM

    model, tokenizer = adapter_parts
    lm = EvalkitLM(model=model, tokenizer=tokenizer, method="full", max_context=256)
    with pytest.raises(NotImplementedError, match="rolling"):
        lm.loglikelihood_rolling([Request("text")])


def test_unknown_adapter_argument_is_refused(adapter_parts):
    from evalkit.lm import EvalkitLM

    model, tokenizer = adapter_parts
    with pytest.raises(ValueError, match="windw"):
        EvalkitLM(model=model, tokenizer=tokenizer, method="snapkv", budget="4x", max_context=256, windw=8)


# -- result tables -------------------------------------------------------------------------------------------------
def test_tables_of_different_runs_read_back_as_one(tmp_path):
    base = {"model": "m", "task": "t", "seed": 1}
    rows = [{"subset": "all", "metric": "exact_match", "value": 0.5, "stderr": 0.1, "n": 10}]
    write_table(metrics_table(rows, {**base, "run_id": "a", "method": "full"}), tmp_path, "metrics", "a")
    write_table(metrics_table(rows, {**base, "run_id": "b", "method": "snapkv", "capacity": 64, "window": 8}), tmp_path, "metrics", "b")
    (tmp_path / "metrics" / ".c.parquet.123.tmp").write_bytes(b"half a file")  # a crashed writer's leftover
    frame = read_table(tmp_path, "metrics")
    assert sorted(frame["run_id"]) == ["a", "b"]
    assert frame.set_index("run_id").loc["b", "capacity"] == 64
    assert pd.isna(frame.set_index("run_id").loc["a", "capacity"])
    assert str(frame["capacity"].dtype) == "Int64" or frame["capacity"].dtype.kind in "if"


def test_table_refuses_config_fields_without_a_column(tmp_path):
    with pytest.raises(ValueError, match="colour"):
        metrics_table([], {"run_id": "a", "colour": "red"})


HUB_MODELS = sorted(p.stem for p in (conf_dir() / "model").glob("*.yaml")
                    if not str(safe_load(p.read_text())["pretrained"]).startswith(("builtin:", "gguf:")))


@pytest.mark.parametrize("name", HUB_MODELS)
def test_every_hub_model_config_validates(name):
    spec = spec_for(f"model={name}", "method=snapstream", "+budget=4x")
    assert spec.model_name == name and spec.max_context >= 32768 and spec.dtype == "bfloat16"
    assert spec.apply_chat_template


def test_a_hub_model_missing_offline_fails_with_one_line_saying_where_to_put_it(tmp_path):
    assert {"llama31_8b_instruct", "deepseek_r1_distill_llama_8b", "deepseek_v2_lite_chat", "qwen3_8b"} <= set(HUB_MODELS)
    result = evalkit("model=qwen3_8b", "task=kv_retrieval", "limit=2", f"results_dir={tmp_path / 'results'}", cwd=tmp_path)
    assert result.returncode == 2
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("evalkit:")]
    assert "huggingface-cli download Qwen/Qwen3-8B" in line and "model.pretrained=/path/to/that/folder" in line
    assert not (tmp_path / "results" / "metrics").exists()


# -- per-sample statistics and stopping -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def many_eos_model_dir(random_model_dir, tmp_path_factory):
    """The random model with 150 EOS ids in its generation config: sampled generations end at many lengths."""
    import shutil

    from transformers import GenerationConfig

    path = tmp_path_factory.mktemp("many_eos")
    shutil.copytree(random_model_dir, path, dirs_exist_ok=True)
    GenerationConfig(eos_token_id=list(range(200, 350)), pad_token_id=0).save_pretrained(path)
    return path


def test_each_sample_row_carries_its_own_requests_statistics(many_eos_model_dir, tmp_path):
    """Repeats of a prompt finish in another order than they were issued (the short ones first); each row's
    generated_tokens must still be the length of its own prediction."""
    import json

    from transformers import AutoTokenizer

    from evalkit.run import run

    data = tmp_path / "aime.jsonl"
    data.write_text("".join(json.dumps({"id": str(n), "problem": f"k{n} v2 u3 ?", "answer": str(n)}) + "\n"
                            for n in range(3)))
    spec = spec_for("task=aime24", f"task.dataset.path={data}", f"model.pretrained={many_eos_model_dir}",
                    f"results_dir={tmp_path}", "batch_size=12", "task.repeats=4", "device=cpu",
                    "model.max_context=256", "task.generation.max_gen_toks=16")
    samples = run(spec).samples
    tokenizer = AutoTokenizer.from_pretrained(many_eos_model_dir)
    lengths = samples["prediction"].map(lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"]))
    assert len(samples) == 12 and samples.groupby("doc_id")["repeat"].nunique().eq(4).all()
    # The test can fail: within a prompt, the samples' lengths differ, so finishing order is not issue order.
    assert samples.groupby("doc_id")["generated_tokens"].nunique().gt(1).all()
    assert lengths.tolist() == samples["generated_tokens"].tolist()


def test_generation_stops_on_every_eos_of_the_generation_config(adapter_parts, tmp_path):
    """Two EOS ids in the generation config, neither the tokenizer's: a request ends at whichever comes first, in the
    engine, ec.generate and the fidelity pass; the run identity records the list."""
    from lm_eval.api.instance import Instance

    from evalkit.lm import EvalkitLM
    from evalkit.models import stop_token_ids_of

    model, tokenizer = adapter_parts
    prompt = "k1 v2 u3 k4 v5 ? k1"
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    saved = model.generation_config.eos_token_id
    try:
        model.generation_config.eos_token_id = []
        free = ec.generate(model, ids, ec.Full(), max_new_tokens=24).sequences[0, ids.shape[1]:].tolist()
        # Two tokens the model emits, each at the step it first appears, neither the tokenizer's EOS.
        new = [step for step, token in enumerate(free) if token not in free[:step] and token != tokenizer.eos_token_id]
        end_second, end_first = new[:2]
        first, second = free[end_first], free[end_second]
        model.generation_config.eos_token_id = [first, second]
        assert ec.stop_token_ids(model, tokenizer) == sorted({first, second, tokenizer.eos_token_id})
        assert ec.generate(model, ids, ec.Full(), max_new_tokens=24, tokenizer=tokenizer).stats[0]["generated_tokens"] == end_second + 1
        lm = EvalkitLM(model=model, tokenizer=tokenizer, method="full", max_context=256, fidelity_tokens=24)
        request = Instance("generate_until", {}, (prompt, {"until": [], "max_gen_toks": 24}), 0)
        lm.generate_until([request], disable_tqdm=True)
        stats = lm.request_stats[(None, 0, 0)]
        assert stats["generated_tokens"] == end_second + 1 and stats["token_agreement"] == 1.0
        assert stats["compared_tokens"] == end_second + 1  # the fidelity pass stopped there too
        model.generation_config.eos_token_id = [first]
        lm = EvalkitLM(model=model, tokenizer=tokenizer, method="full", max_context=256)
        lm.generate_until([request], disable_tqdm=True)
        assert lm.request_stats[(None, 0, 0)]["generated_tokens"] == end_first + 1
        model.generation_config.eos_token_id = [first, second]
        model.save_pretrained(tmp_path)
        tokenizer.save_pretrained(tmp_path)
        assert stop_token_ids_of(str(tmp_path)) == sorted({first, second, tokenizer.eos_token_id})
    finally:
        model.generation_config.eos_token_id = saved


def test_context_scope_on_a_task_that_does_not_mark_its_context_says_so(tmp_path, random_model_dir):
    """kv_retrieval's prompts carry no end-of-context mark: under compression_scope=context they are compressed whole,
    which the run counts (context_unmarked) and says on stderr instead of passing it off as query-agnostic."""
    from evalkit.results import read_table

    results = tmp_path / "results"
    result = evalkit("budget=4x", "compression_scope=context", f"model.pretrained={random_model_dir}", "limit=2",
                     "+task.generation.max_gen_toks=4", f"results_dir={results}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "WARNING: compression_scope=context, but 2 of 2 requests of task kv_retrieval" in result.stderr
    metrics = read_table(results, "metrics")
    assert metrics.loc[metrics["metric"] == "context_unmarked", "value"].tolist() == [2.0]


# -- packaging -----------------------------------------------------------------------------------------------------
def test_the_wheel_carries_conf_tasks_and_assets_without_a_setuptools_warning(tmp_path):
    pytest.importorskip("setuptools", minversion="69")
    root = Path(__file__).resolve().parents[1]
    tracked = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    files = [f for f in tracked.stdout.splitlines() if (root / f).is_file()]
    src = tmp_path / "src"
    for name in files:  # a copy of the tracked tree, so the build's own folders never land in the checkout
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes((root / name).read_bytes())
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
                            str(tmp_path / "dist"), str(src)], capture_output=True, text=True)
    assert build.returncode == 0, build.stdout + build.stderr
    assert not re.search(r"[A-Za-z]+Warning:", build.stdout + build.stderr), build.stdout + build.stderr
    (wheel,) = (tmp_path / "dist").glob("evalkit-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    expected = ({"evalkit-lm-eval.pth"}
                | {"evalkit/_conf/" + f[len("conf/"):] for f in files if f.startswith("conf/") and f.endswith(".yaml")}
                | {"evalkit/_tasks/" + f[len("tasks/"):] for f in files if f.startswith("tasks/") and "/" in f[6:]
                   and f.endswith((".yaml", ".py"))}
                | {f for f in files if f.startswith("evalkit/")})
    assert expected - shipped == set()
    assert any(f.startswith("evalkit/assets/kv_retrieval_tiny/") for f in expected)
