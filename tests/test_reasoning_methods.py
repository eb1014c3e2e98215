"""Reasoning-time methods (R-KV) against plain definitions written from their reference code
(zoo_reference.rkv_generate), in ``generate`` and in the engine."""

from __future__ import annotations

import pytest
import torch
import zoo_reference as ref
from conftest import random_prompt, tiny_model

import evalkit.compression as ec

NEW = 40


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def held_positions(session_or_cache) -> list[list[list[int]]]:
    cache = getattr(session_or_cache, "cache", session_or_cache)
    return [[sorted(layer.heads.positions[0, head][layer.heads.valid[0, head]].tolist())
             for head in range(layer.heads.valid.shape[1])] for layer in cache.layers]


@pytest.mark.parametrize("length,capacity,interval", [(70, 48, 16), (30, 48, 16), (100, 60, 8)])
def test_rkv_holds_what_the_reference_holds_step_by_step(model, length, capacity, interval):
    prompt = random_prompt(length, seed=length)
    policy = ec.RKV(capacity=capacity, window=4, interval=interval, kernel_size=3)
    tokens, logits, held = ref.rkv_generate(model, prompt, NEW, capacity, 4, interval, kernel=3)
    session = ec.CompressionSession(model, policy)
    last = session.prefill(prompt)[0]
    ours = []
    for step in range(NEW):
        ours.append(int(last.argmax()))
        if step < NEW - 1:
            last = session.step(torch.tensor([[ours[-1]]]))[0, -1]
    assert ours == tokens
    assert held_positions(session) == held
    budget = capacity - interval
    assert all(len(h) <= capacity for layer in held for h in layer)
    # it compressed: the cache holds fewer than every token seen, and the last compression left the budget
    seen = length + NEW - 1
    assert all(len(h) < seen for layer in held for h in layer)
    last = max(p for p in range(seen) if p % interval == 0)
    assert all(len(h) == budget + (seen - 1 - last) for layer in held for h in layer)


def test_rkv_generate_matches_the_reference_logits(model):
    prompt = random_prompt(70, seed=3)
    tokens, logits, _ = ref.rkv_generate(model, prompt, NEW, 48, 4, 16, kernel=3)
    out = ec.generate(model, prompt, ec.RKV(capacity=48, window=4, interval=16, kernel_size=3), max_new_tokens=NEW)
    assert out.sequences[0, -NEW:].tolist() == tokens
    torch.testing.assert_close(out.logits[0], logits, rtol=1e-4, atol=1e-4)
    full = ec.generate(model, prompt, ec.Full(), max_new_tokens=NEW)
    assert (out.logits - full.logits).abs().max() > 1e-3  # compression changed what the model reads
    assert out.stats[0]["peak_cache_tokens"] <= 48 < 70 + NEW


def test_rkv_settings_are_checked():
    with pytest.raises(ValueError, match="capacity must be > interval \\+ window"):
        ec.RKV(capacity=100, window=8, interval=128)
    with pytest.raises(ValueError, match="mix_lambda"):
        ec.RKV(capacity=300, mix_lambda=1.5)


@pytest.mark.slow
def test_rkv_holds_what_the_reference_repository_held_at_every_step():
    """`benchmarks/parity_rkv.py` against its shipped record of Zefan-Cai/R-KV's own code: with the reference's top-k
    in text order every step evicts the same positions and greedy decoding gives the same tokens; as shipped, the
    prefill agrees and the first decode-time compression is the first difference (its cache is in top-k order)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    result = subprocess.run([sys.executable, str(root / "benchmarks" / "parity_rkv.py")], capture_output=True,
                            text=True, timeout=900, cwd=root)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = {tuple(line.split()[:2]): line.split()[2:] for line in result.stdout.splitlines()
            if line.startswith(("long_prompt", "short_prompt"))}
    assert rows[("long_prompt", "sorted_topk")] == ["True", "420/420", "None"]
    assert rows[("short_prompt", "sorted_topk")] == ["True", "300/300", "None"]
    # as shipped: the first decode-time compression (position 384 = 300 + 85 - 1; 128 = 60 + 69 - 1)
    assert rows[("long_prompt", "as_shipped")][2] == "85" and rows[("short_prompt", "as_shipped")][2] == "69"


@pytest.mark.parametrize("policy", [ec.Full(), ec.RKV(capacity=48, window=4, interval=16, kernel_size=3),
                                    ec.SnapKVD(capacity=40, window=8, kernel_size=3)], ids=lambda p: p.name)
def test_engine_rows_say_whether_a_trace_hit_its_limit_and_price_its_byte_seconds(model, policy):
    prompts = [random_prompt(50, seed=s)[0] for s in (1, 2)]
    done = ec.Engine(model, policy, slots=2).run([ec.Request(prompts[0], max_new_tokens=NEW),
                                                  ec.Request(prompts[1], max_new_tokens=NEW + 10)])
    for completion in done:
        stats = completion.stats
        assert stats["hit_limit"] is True and stats["generated_tokens"] in (NEW, NEW + 10)
        prefill = stats["kv_bytes_prefill_peak"] * stats["prefill_seconds"]
        assert prefill < stats["kv_byte_seconds"] <= prefill + stats["kv_bytes_peak"] * stats["decode_seconds"]
        if policy.name != "full":
            assert stats["kv_bytes_peak"] < stats["kv_bytes_full"]  # it held less than a full cache


@pytest.mark.slow
def test_the_reasoning_trace_benchmark_reports_trace_costs_on_the_real_model(tmp_path):
    """`benchmarks/bench_reasoning_traces.py` on two problems and four configurations of SmolLM2: every configuration
    ran through the CLI and the table has the trace costs against the full cache."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    result = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_reasoning_traces.py"), "--problems", "2",
                             "--repeats", "1", "--max-tokens", "48", "--configs", "4", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=1800, cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    table = [line for line in result.stdout.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in table[0].strip("|").split("|")]
    assert {"length_ratio", "hit_limit_share", "accuracy_per_1k_tokens", "MiB_s_per_correct"} <= set(header) or \
        {"length_ratio", "hit_limit_share", "accuracy_per_1k_tokens"} <= set(header)
    assert len(table) == 2 + 4  # header, rule, four configurations
