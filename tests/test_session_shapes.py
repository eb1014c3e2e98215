"""``CompressionSession``'s shapes: ``prefill`` returns the next token's logits ``[batch, vocab]``, ``step`` one row
per token fed ``[batch, q, vocab]`` whose last is that same shape, so docs/methods.md's greedy loop runs; ids of any
other shape are refused at the door in one line naming the expected shape, before the cache is touched."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
import torch
from conftest import random_prompt

import evalkit.compression as ec
from evalkit.models import load_model
from evalkit.models.synthetic import make_example

DOCS = Path(__file__).resolve().parents[1] / "docs" / "methods.md"


@pytest.fixture(scope="module")
def tiny():
    return load_model("builtin:kv_retrieval_tiny", device="cpu")


def documented_loop() -> str:
    section = DOCS.read_text().split("exposes `prefill` / `step` for custom loops", 1)[1]
    return re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)


def test_the_documented_greedy_loop_runs_and_decodes_what_generate_does(tiny):
    model, tokenizer = tiny
    example = make_example(random.Random(3), n_pairs=40, depth=0.5)
    input_ids = tokenizer(f"{example['context']} {example['question']}", return_tensors="pt")["input_ids"]
    policy = ec.SnapKV(capacity=64, window=8, kernel_size=5)
    session = ec.CompressionSession(model, policy)
    fed = []
    original_step = session.step
    session.step = lambda ids: fed.append(ids.clone()) or original_step(ids)  # what the loop feeds, as it feeds it
    scope = {"session": session, "input_ids": input_ids}
    exec(documented_loop(), scope)
    assert [tuple(ids.shape) for ids in fed] == [(1, 1)] * 4 and scope["logits"].shape == (1, len(tokenizer))
    greedy = ec.generate(model, input_ids, policy, max_new_tokens=4).sequences[0, input_ids.shape[1]:].tolist()
    assert len(greedy) >= 2 and torch.cat(fed, dim=1)[0, :len(greedy)].tolist() == greedy
    assert tokenizer.decode(greedy[:2]) == example["answer"]  # the tiny model retrieves: a real decode


def test_prefill_and_the_last_step_row_have_one_shape(llama):
    session = ec.CompressionSession(llama, ec.StreamingLLM(sink=4, window=16))
    first = session.prefill(random_prompt(30, seed=1, batch=2))
    steps = session.step(first.argmax(dim=-1, keepdim=True))
    assert first.dim() == 2 and steps.shape == (2, 1, first.shape[-1]) and steps[:, -1].shape == first.shape
    chunk = session.step(torch.tensor([[5, 6, 7], [8, 9, 10]]))
    assert chunk.shape == (2, 3, first.shape[-1])


def one_line_refusal(call) -> str:
    with pytest.raises(ValueError) as refused:
        call()
    message = str(refused.value)
    assert "\n" not in message
    return message


def test_step_refuses_the_argmax_of_its_own_logits_with_keepdim(llama):
    session = ec.CompressionSession(llama, ec.StreamingLLM(sink=4, window=16))
    session.prefill(random_prompt(30, seed=1))
    step_logits = session.step(torch.tensor([[5]]))
    held = [layer.keys.clone() for layer in session.cache.layers]
    written = session.state.written.clone()
    message = one_line_refusal(lambda: session.step(step_logits.argmax(dim=-1, keepdim=True)))
    assert message.startswith("step takes input_ids of shape [batch = 1, tokens] (integer ids), got shape [1, 1, 1]")
    assert "logits[:, -1].argmax(-1, keepdim=True)" in message
    assert all(torch.equal(a, layer.keys) for a, layer in zip(held, session.cache.layers))  # refused at the door
    assert torch.equal(written, session.state.written)
    assert session.step(step_logits[:, -1].argmax(dim=-1, keepdim=True)).shape[:2] == (1, 1)  # the way it says


@pytest.mark.parametrize("ids, shown", [
    (torch.tensor([5, 6]), "got shape [2] (torch.int64)"),
    (torch.tensor([[5], [6]]), "got shape [2, 1] (torch.int64)"),  # two rows after a one-row prefill
    (torch.tensor([[5.0]]), "got shape [1, 1] (torch.float32)"),
    (torch.zeros(1, 0, dtype=torch.long), "got shape [1, 0] (torch.int64)"),
    ([[5]], "got a list"),
])
def test_step_refuses_other_shapes_in_one_line(llama, ids, shown):
    session = ec.CompressionSession(llama, ec.Full())
    session.prefill(random_prompt(20, seed=2))
    message = one_line_refusal(lambda: session.step(ids))
    assert message == f"step takes input_ids of shape [batch = 1, tokens] (integer ids), {shown}"


def test_prefill_refuses_ids_and_masks_of_the_wrong_shape(llama):
    prompt = random_prompt(20, seed=2)
    session = ec.CompressionSession(llama, ec.Full())
    message = one_line_refusal(lambda: session.prefill(prompt[0]))
    assert message == "prefill takes input_ids of shape [batch, tokens] (integer ids), got shape [20] (torch.int64)"
    message = one_line_refusal(lambda: session.prefill(prompt, attention_mask=torch.ones(1, 19, dtype=torch.long)))
    assert message == "prefill takes attention_mask of input_ids' shape [1, 20], got [1, 19]"
    assert session.state is None  # nothing ran: the same session still prefills
    assert session.prefill(prompt).shape == (1, llama.config.vocab_size)
