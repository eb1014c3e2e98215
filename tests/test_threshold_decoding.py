"""Threshold with ``decoding`` (kvpress ``DMSPress(decoding=True)``): the tokens each layer and KV head holds after
prefill and after every decode step, and the logits, against a plain float64 definition written from kvpress 0.5.5's
``dms_press.py``: every token is scored once by KVzap from its attention input (the prompt's at prefill, each new
token's at its own step, after its attention), its score waits in a buffer while it is among the last
``sliding_window_size`` tokens, and as it leaves the window it is evicted (masked from the next step on) if its score
is below ``threshold``."""

from __future__ import annotations

import pytest
import torch
from baseline_reference import full_run, replay_decoding
from conftest import random_prompt, tiny_model
from learned_files import kvzap
from test_compression import assert_batch_equals_alone, assert_engine_equals_alone
from test_scissorhands import held_now
from test_zoo_methods import surrogates
from zoo_reference import kvzap_scores

import evalkit.compression as ec

# KVzap's fp32 scores agree with fp64 to about 1e-6: a token scored closer than this to the threshold would be kept or
# evicted by the CPU kernels' rounding, and the reference says so instead.
TOLERANCE = 1e-5
PROMPT, STEPS = 40, 24
CASES = {"mlp window 4": dict(hidden_dim=24, window=4, threshold=0.0),
         "linear window 0": dict(hidden_dim=None, window=0, threshold=0.3)}


def policy_of(case: dict, decoding: bool = True) -> ec.Threshold:
    return ec.Threshold(threshold=case["threshold"], sliding_window_size=case["window"], decoding=decoding,
                        scorer={"name": "kvzap", "weights": str(kvzap(hidden_dim=case["hidden_dim"]))})


def judged(score: float, threshold: float) -> bool:
    """Whether a token leaving the window stays (kvpress: evicted where ``score < threshold``)."""
    assert abs(score - threshold) > TOLERANCE, f"a score {score} ties with the threshold {threshold}"
    return score >= threshold


@torch.no_grad()
def simulate(model, case: dict, prompt: torch.Tensor, tokens: list[int]):
    """kvpress' DMSPress over the prompt, then ``tokens`` fed one at a time: the positions held per layer and head
    after prefill, each step's logits and the positions held after each step."""
    tensors, mlp = surrogates(hidden_dim=case["hidden_dim"]), case["hidden_dim"] is not None
    window, threshold = case["window"], case["threshold"]
    n = prompt.shape[1]
    held, buffers = {}, {}
    for layer, r in full_run(model, prompt).items():
        scores = kvzap_scores(r["hidden"], tensors, layer, mlp)  # per head, every prompt token
        held[layer] = [{j for j in range(n) if j >= n - window or judged(head[j], threshold)} for head in scores]
        buffers[layer] = [dict(list(enumerate(head))[max(0, n - window):]) for head in scores]
    prefill = {layer: [set(h) for h in per_head] for layer, per_head in held.items()}
    inputs = {}  # each layer's attention input of the step that runs

    def keep_input(module, args, kwargs):
        inputs[module.layer_idx] = kwargs.get("hidden_states", args[0] if args else None)[0, -1].double()

    def evict(layer, per_head, query, keys, position, steps):
        new = kvzap_scores(inputs[layer][None], tensors, layer, mlp)
        for h, heads in enumerate(per_head):
            buffer = buffers[layer][h]
            buffer[position] = new[h][0]
            if len(buffer) > window:  # the oldest leaves the window: judged once
                leaving = min(buffer)
                if not judged(buffer.pop(leaving), threshold):
                    heads.discard(leaving)

    hooks = [layer.self_attn.register_forward_pre_hook(keep_input, with_kwargs=True) for layer in model.model.layers]
    try:
        return prefill, *replay_decoding(model, prompt, tokens, held, evict)
    finally:
        for hook in hooks:
            hook.remove()


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.mark.parametrize("name", sorted(CASES))
def test_threshold_decoding_holds_what_dms_holds_after_prefill_and_every_step(llama, name):
    case, prompt = CASES[name], random_prompt(PROMPT, seed=4)
    policy = policy_of(case)
    tokens = ec.generate(llama, prompt, policy, max_new_tokens=STEPS).sequences[0, PROMPT:].tolist()
    prefill, reference_logits, history = simulate(llama, case, prompt, tokens[:-1])

    session = ec.CompressionSession(llama, policy)
    first = session.prefill(prompt)
    assert held_now(session) == prefill
    logits = []
    for step, token in enumerate(tokens[:-1]):
        logits.append(session.step(torch.tensor([[token]]))[0, -1])
        assert held_now(session) == history[step], f"step {step}"
        for index, layer in enumerate(session.cache.layers):  # the cache's real held size, per head
            assert layer.heads.valid[0].sum(dim=-1).tolist() == [len(h) for h in history[step][index]]
    assert first.argmax(-1).item() == tokens[0]
    torch.testing.assert_close(torch.stack(logits), reference_logits, atol=2e-4, rtol=1e-4)
    assert reference_logits.argmax(dim=-1).tolist() == tokens[1:]  # the generated tokens are the definition's
    # Decoding evicted in every head (generated tokens older than the window), the cache holds less than prefill
    # left plus the steps, and the window stayed whole.
    last, end = history[-1], PROMPT + STEPS - 1
    old = set(range(PROMPT, end - case["window"]))
    assert all(not old <= heads for per_head in last.values() for heads in per_head)
    held = [int(layer.heads.valid[0].sum()) for layer in session.cache.layers]
    assert all(count < sum(map(len, prefill[index])) + 2 * (STEPS - 1) for index, count in enumerate(held))
    recent = set(range(end - case["window"], end))
    assert all(recent <= heads for per_head in last.values() for heads in per_head)
    if case["window"]:  # prompt tokens in the window at prefill were judged while decoding
        window = set(range(PROMPT - case["window"], PROMPT))
        assert any(window - heads for per_head in last.values() for heads in per_head)


def test_without_decoding_nothing_is_evicted_while_decoding_and_the_config_is_unchanged(llama):
    case = CASES["mlp window 4"]
    session = ec.CompressionSession(llama, policy_of(case, decoding=False))
    token = session.prefill(random_prompt(PROMPT, seed=4)).argmax(-1)[:, None]
    prefill = held_now(session)
    for _ in range(8):
        token = session.step(token)[:, -1].argmax(-1)[:, None]
    assert held_now(session) == {layer: [h | set(range(PROMPT, PROMPT + 8)) for h in per_head]
                                 for layer, per_head in prefill.items()}
    assert "decoding" not in policy_of(case, decoding=False).settings()
    assert policy_of(case).settings()["decoding"] is True


def test_the_definition_detects_another_window(llama):
    """The reference can fail: a window of 6 instead of 4 holds other tokens after the steps."""
    case, prompt = CASES["mlp window 4"], random_prompt(PROMPT, seed=4)
    tokens = ec.generate(llama, prompt, policy_of(case), max_new_tokens=12).sequences[0, PROMPT:].tolist()
    _, _, ours = simulate(llama, case, prompt, tokens[:-1])
    _, _, other = simulate(llama, {**case, "window": 6}, prompt, tokens[:-1])
    assert ours[-1] != other[-1]


@pytest.mark.parametrize("name", sorted(CASES))
def test_threshold_decoding_in_a_left_padded_batch_and_the_engine_equals_each_prompt_alone(llama, name):
    policy = policy_of(CASES[name])
    assert_batch_equals_alone(llama, policy, new_tokens=20)
    assert_engine_equals_alone(llama, policy, new_tokens=20)


def test_decoding_refuses_a_scorer_that_reads_queries():
    with pytest.raises(ValueError, match="cannot be snapkv with decoding: each new token is scored alone"):
        ec.Threshold(threshold=0.0, decoding=True, scorer={"name": "snapkv", "window": 4})
    with pytest.raises(ValueError, match="decoding must be true or false"):
        ec.Threshold(threshold=0.0, decoding="yes")


@pytest.mark.slow
def test_the_dms_decoding_paritys_evalkit_side_evicts_while_decoding(tmp_path):
    """The evalkit worker of `parity_dms_decoding.py` on its saved model: every case holds 4 layers of 2 heads, its
    greedy tokens, the last ``sliding_window_size`` positions whole, and fewer than prefill and decoding made."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "benchmarks"))
    from parity_dms_decoding import CASES, HIDDEN_DIM
    from parity_model import save_model

    length, steps = 200, 40
    save_model(tmp_path, length)
    weights = kvzap(layers=4, input_dim=256, kv_heads=2, hidden_dim=HIDDEN_DIM)
    result = subprocess.run([sys.executable, str(root / "benchmarks" / "parity_dms_decoding.py"), "--worker", "evalkit",
                             "--model", str(tmp_path), "--steps", str(steps), "--weights", str(weights)],
                            capture_output=True, text=True, timeout=600, cwd=root)
    assert result.returncode == 0, result.stderr[-2000:]
    held = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert set(held) == set(CASES)
    for case, (_, window) in CASES.items():
        assert len(held[case]["tokens"]) == steps + 1
        layers = held[case]["held"]
        assert [len(heads) for heads in layers] == [2] * 4
        recent = set(range(length + steps - window, length + steps))
        assert all(recent <= set(head) for heads in layers for head in heads), case
        assert sum(len(head) for heads in layers for head in heads) < 8 * (length + steps), case
        if window < steps:  # generated tokens left the window: some were evicted
            assert any(set(range(length, length + steps - window)) - set(head) for heads in layers
                       for head in heads), case
