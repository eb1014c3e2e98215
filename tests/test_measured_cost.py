"""What a request's cache really took, in bytes, read off the engine's own tensors, and the simulator held to it.

Each byte count here is also computed independently (from the model's config and the dtype), so a compression that
silently did nothing, an allocation that is not what it claims, or a simulator that prices another geometry fails."""

from __future__ import annotations

import pytest
import torch
from test_engine import VOCAB, small_llama, stream
from test_hybrid import WINDOW, tiny_gemma3
from test_mla import KV_LORA_RANK, ROPE, tiny_deepseek

import evalkit.compression as ec
from evalkit import memory
from evalkit.memory.geometry import from_hf_config


@pytest.fixture(scope="module")
def llama():
    return small_llama()


PER_TOKEN = 2 * 2 * (16 + 16) * 4  # layers x kv heads x (key + value width) x fp32 bytes


def _long_requests(count=4, prompt=160, new=60):
    g = torch.Generator().manual_seed(7)
    return [ec.Request(torch.randint(0, VOCAB, (prompt + 7 * i,), generator=g), max_new_tokens=new, seed=i)
            for i in range(count)]


@pytest.mark.parametrize("policy, capacity", [
    (ec.SnapStream(capacity=64, window=8, sink=4, recent=16), 64),
    (ec.StreamingLLM(sink=4, window=40), 44),
])
def test_a_fixed_capacity_request_holds_exactly_capacity_times_the_bytes_of_a_token(llama, policy, capacity):
    assert memory.kv_bytes_per_token(llama.config, dtype="fp32") == PER_TOKEN
    for completion, request in zip(ec.Engine(llama, policy, slots=2).run(_long_requests()), _long_requests()):
        stats, seen = completion.stats, request.input_ids.numel() + 60 - 1
        assert stats["kv_bytes_peak"] == capacity * PER_TOKEN == stats["kv_bytes_reserved"]
        assert stats["kv_bytes_full"] == seen * PER_TOKEN
        assert stats["memory_ratio"] == pytest.approx(seen / capacity) and stats["memory_ratio"] > 3


def test_full_holds_every_token_and_reserves_the_longest_request(llama):
    requests = stream(count=6)
    completions = ec.Engine(llama, ec.Full(), slots=2).run(requests)
    longest = max(r.input_ids.numel() + r.max_new_tokens for r in requests)
    for completion in completions:
        stats = completion.stats
        assert stats["kv_bytes_peak"] == stats["kv_bytes_full"] == stats["tokens_seen"] * PER_TOKEN
        assert stats["memory_ratio"] == 1.0
        assert stats["kv_bytes_reserved"] == stats["reserved_cache_tokens"] * PER_TOKEN >= longest * PER_TOKEN - PER_TOKEN


def test_snapkv_reserves_prompt_capacity_plus_new_tokens_and_holds_what_it_kept(llama):
    requests = _long_requests(new=20)
    completions = ec.Engine(llama, ec.SnapKV(capacity=48, window=8), slots=2).run(requests)
    for completion in completions:
        stats = completion.stats
        assert stats["kv_bytes_reserved"] == (48 + 20) * PER_TOKEN
        assert stats["kv_bytes_peak"] == (48 + 20 - 1) * PER_TOKEN  # the last token is never written


def test_per_head_layouts_count_each_heads_own_tokens(llama):
    """AdaKV spreads one budget unevenly over heads: the bytes are the sum of each head's tokens."""
    completions = ec.Engine(llama, ec.AdaKV.from_config(48, window=4), slots=2).run(_long_requests(new=10))
    per_head_token = (16 + 16) * 4
    for completion in completions:
        stats = completion.stats
        assert stats["kv_bytes_peak"] % per_head_token == 0
        assert stats["kv_bytes_peak"] == pytest.approx(2 * 2 * stats["peak_cache_tokens"] * per_head_token)
        assert stats["memory_ratio"] > 2


@pytest.mark.parametrize("name, model, policy", [
    ("mla", tiny_deepseek, lambda: ec.SnapStream(capacity=28, sink=3, window=6, kernel_size=5, recent=8)),
    ("mla_full", tiny_deepseek, ec.Full),
    ("hybrid", tiny_gemma3, lambda: ec.SnapStream(capacity=20, sink=2, window=4, kernel_size=3, recent=6)),
    ("hybrid_full", tiny_gemma3, ec.Full),
])
def test_mla_and_hybrid_bytes_are_what_evalkit_memory_prices(name, model, policy):
    model, policy = model(), policy()
    geometry = from_hf_config(model.config)
    g = torch.Generator().manual_seed(3)
    requests = [ec.Request(torch.randint(0, 64, (50 + 5 * i,), generator=g), max_new_tokens=30, seed=i) for i in range(3)]
    for completion, request in zip(ec.Engine(model, policy, slots=2).run(requests), requests):
        stats, prompt = completion.stats, request.input_ids.numel()
        priced = geometry.request_kv_bytes(prompt, 30, "fp32", policy.prompt_capacity(), policy.cache_capacity())
        assert stats["kv_bytes_peak"] == priced
        seen = prompt + 29
        assert stats["kv_bytes_full"] == geometry.held_tokens(seen) * geometry.kv_bytes_per_token("fp32") * 1.0
    if name.startswith("mla"):
        assert geometry.kv_bytes_per_token("fp32") == 2 * (KV_LORA_RANK + ROPE) * 4  # the latent, not per-head K/V
    else:
        assert geometry.sliding_layers == 2 and geometry.sliding_window == WINDOW


def test_a_run_records_bytes_per_sample_and_the_simulator_agrees(tmp_path, random_model_dir):
    from test_harness import composed

    import evalkit.run.runner as runner
    from evalkit.run import validate

    def run(*extra):
        spec = validate(composed(f"model.pretrained={random_model_dir}", "limit=4", "batch_size=2",
                                        "+task.generation.max_gen_toks=8", f"results_dir={tmp_path / 'r'}", *extra),
                               method_explicit=bool(extra))
        return runner.run(spec)

    full, snapstream = run(), run("+budget=4x", "method=snapstream")
    for result, freed in ((full, 0.0), (snapstream, 1.0)):
        samples, rows = result.samples, result.metrics.set_index("metric")["value"]
        assert samples["kv_bytes_peak"].notna().all() and (samples["kv_bytes_predicted"] == samples["kv_bytes_peak"]).all()
        assert rows["kv_bytes_predicted_error_max"] == 0.0 and rows["memory_freed"] == freed
        assert rows["memory_ratio_mean"] == pytest.approx((samples["kv_bytes_full"] / samples["kv_bytes_peak"]).mean())
    assert (full.samples["memory_ratio"] == 1.0).all()
    assert snapstream.metrics.set_index("metric")["value"]["memory_ratio_mean"] > 3


def test_a_budget_that_did_not_take_effect_is_loud_and_strict_budget_makes_it_an_error(tmp_path, random_model_dir,
                                                                                      monkeypatch, capsys):
    """A method that silently kept everything (here: the engine handed a full cache instead of the run's policy)
    cannot pass unnoticed: each request is flagged, the run prints a warning and records ``over_budget``; with
    ``strict_budget=true`` it is an error and no table is written. A correct run records 0."""
    from test_harness import composed

    import evalkit.lm
    import evalkit.run.runner as runner
    from evalkit.run import ConfigError, validate

    def spec(results, *extra):
        return validate(composed(f"model.pretrained={random_model_dir}", "limit=3", "+budget=4x",
                                        "method=snapkv", "+task.generation.max_gen_toks=4", f"results_dir={results}",
                                        *extra), method_explicit=True)

    honest = runner.run(spec(tmp_path / "honest"))
    assert honest.metrics.set_index("metric")["value"]["over_budget"] == 0 and not honest.samples["over_budget"].any()
    assert "WARNING" not in capsys.readouterr().err

    real_engine = evalkit.lm.model.ec.Engine
    monkeypatch.setattr(evalkit.lm.model.ec, "Engine", lambda model, policy, **kw: real_engine(model, ec.Full(), **kw))
    broken = runner.run(spec(tmp_path / "broken"))
    assert broken.samples["over_budget"].all() and broken.metrics.set_index("metric")["value"]["over_budget"] == 3
    assert "evalkit: WARNING: 3 of 3 requests held more than budget 4x allows" in capsys.readouterr().err
    with pytest.raises(runner.RunError, match="strict_budget: 3 of 3 requests held more than budget 4x"):
        runner.run(spec(tmp_path / "strict", "strict_budget=true"))
    assert not (tmp_path / "strict" / "metrics").exists()
    with pytest.raises(ConfigError, match="strict_budget must be true or false"):
        spec(tmp_path / "x", "strict_budget=sometimes")


def test_each_request_records_its_time_to_first_token_and_decode_time(llama):
    """Two slots, four requests: the last two wait for a slot, so their first token comes later than any prefill."""
    requests = _long_requests(count=4, new=24)
    completions = ec.Engine(llama, ec.SnapStream(capacity=64, window=8, sink=4, recent=16), slots=2).run(requests)
    stats = [c.stats for c in completions]
    assert all(s["decode_seconds"] > 0 and s["time_to_first_token_s"] >= s["prefill_seconds"] > 0 for s in stats)
    first_two = max(s["time_to_first_token_s"] for s in stats[:2])
    assert min(s["time_to_first_token_s"] for s in stats[2:]) > first_two  # queued behind a whole request


@pytest.mark.parametrize("policy", [ec.SnapStream(capacity=5, sink=1, window=2, kernel_size=1, recent=2),
                                    ec.SnapKV(capacity=4, window=2, kernel_size=1)], ids=["snapstream", "snapkv"])
def test_a_hybrid_models_sliding_layers_keep_their_window_without_counting_against_the_budget(policy):
    """Gemma 3's sliding-window layers keep the window the model defines, whatever the budget: the budget check reads
    the compressed layers' kept tokens and allows each sliding layer its window, so an honest run is not flagged,
    while the same stats with the compressed layers holding the window are."""
    from test_hybrid import WINDOW, tiny_gemma3

    from evalkit.memory.request_cost import RequestCost

    model = tiny_gemma3()
    ids = torch.randint(3, 90, (1, 60), generator=torch.Generator().manual_seed(0))
    stats = ec.generate(model, ids, policy, max_new_tokens=6, return_logits=False).stats[0]
    kept = stats["kept_prompt_tokens"]
    assert stats["compressed_layers"] == [1, 3] and kept[0] >= WINDOW - 1 > kept[1]  # the window, the budget
    cost = RequestCost(model, policy)
    assert cost.over_budget(stats) is False
    swollen = {**stats, "kept_prompt_tokens": [kept[0]] * len(kept),
               "peak_cache_tokens": min(WINDOW, stats["prompt_tokens"] + 6)}
    assert cost.over_budget(swollen) is True
