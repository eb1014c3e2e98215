"""The SN40L memory budget checker: hand-computed geometry, sharding rules, verdicts and the commands around it."""

from __future__ import annotations

import dataclasses
import json

import pytest
from transformers import LlamaConfig

from evalkit import memory
from evalkit.run import ConfigError, validate

GIB = 2**30


def test_llama31_8b_is_128_kib_per_token_and_16_gib_per_128k_sequence():
    assert memory.kv_bytes_per_token("llama31_8b") == 131_072
    assert memory.kv_bytes_per_token("llama31_8b") * 131_072 == 16 * GIB
    assert memory.kv_bytes_per_token("llama31_70b") == 320 * 1024
    assert memory.kv_bytes_per_token("llama31_405b") == 504 * 1024


def test_deepseek_mla_latent_is_70272_bytes_per_token():
    assert memory.kv_bytes_per_token("deepseek_r1_671b") == 70_272
    assert memory.kv_bytes_per_token("deepseek_r1_671b") * 131_072 / GIB == pytest.approx(8.578, abs=1e-3)
    assert memory.kv_bytes_per_token("deepseek_r1_671b", dtype="fp8") == 35_136


def test_geometry_from_a_transformers_config_and_a_config_json(tmp_path):
    config = LlamaConfig(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_size=4096)
    assert memory.kv_bytes_per_token(config) == 131_072
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "deepseek_v3", "num_hidden_layers": 61, "num_attention_heads": 128, "kv_lora_rank": 512,
        "qk_rope_head_dim": 64, "hidden_size": 7168}))
    assert memory.kv_bytes_per_token(str(tmp_path / "config.json")) == 70_272
    assert memory.kv_bytes_per_token(str(tmp_path)) == 70_272


def test_gqa_kv_heads_shard_and_replicate_mla_does_not_shard():
    llama = memory.PRESETS["llama31_8b"]
    per_token = {tp: llama.kv_bytes_per_token_per_socket(tp) for tp in (1, 2, 4, 8, 16, 32)}
    assert per_token[1] == 131_072 and per_token[2] == 65_536 and per_token[8] == 16_384
    assert per_token[16] == per_token[32] == per_token[8]  # one replicated KV head per socket beyond 8-way
    deepseek = memory.PRESETS["deepseek_r1_671b"]
    assert {deepseek.kv_bytes_per_token_per_socket(tp) for tp in (1, 8, 16)} == {70_272}


@pytest.mark.parametrize("tp, message", [(3, "does not divide"), (0, "positive integer"), (12, "does not divide")])
def test_tensor_parallel_degrees_that_cannot_split_the_heads_are_refused(tp, message):
    with pytest.raises(ValueError, match=message):
        memory.PRESETS["llama31_8b"].kv_bytes_per_token_per_socket(tp)


def test_a_4x_budget_holds_exactly_4x_less_kv_per_socket():
    deployment = memory.load_deployment("deepseek_r1_tp16_128k")
    full = memory.price(deployment)
    quarter = memory.price(deployment, memory.capacity_for_budget("4x", deployment.context))
    assert quarter.cached_tokens == 32_768 and full.kv == 4 * quarter.kv and quarter.onchip_ratio == 4.0
    assert full.kv == 131_072 * 70_272 / 16  # the latent split by token over the 16 sockets, batch 1
    whole = memory.price(dataclasses.replace(deployment, kv_sharding="head"))
    assert whole.kv == 131_072 * 70_272  # head-wise TP: the whole latent on each socket


def test_largest_fitting_batch_is_the_largest_not_off_by_one():
    for name, budget in [("deepseek_r1_tp16_128k", None), ("deepseek_r1_tp16_128k", "4x"),
                         ("llama31_8b_tp1_128k", "8x"), ("llama31_70b_tp8_128k", None)]:
        deployment = memory.load_deployment(name)
        capacity = memory.capacity_for_budget(budget, deployment.context)
        best = memory.price(deployment, capacity).max_batch
        assert best >= 1
        assert memory.price(dataclasses.replace(deployment, batch=best), capacity).fits
        assert not memory.price(dataclasses.replace(deployment, batch=best + 1), capacity).fits


def test_a_gpu_without_ddr_cannot_hold_weights_beyond_its_hbm():
    deployment = memory.load_deployment("llama31_405b_tp16_128k", hardware="h100_80g", tp=4)
    verdict = memory.price(deployment)  # 203 GB of weights per GPU
    assert not verdict.fits and not verdict.fits_ddr and verdict.weights_ddr > 0 and verdict.max_batch == 0
    roomy = memory.price(dataclasses.replace(deployment, hardware=memory.load_hardware("h200_141g"), tp=8))
    assert roomy.fits and roomy.fits_sram and roomy.max_batch >= 1  # a GPU's L2 is no limit on the KV cache


def test_report_has_one_row_per_tier_with_headroom():
    frame = memory.deployment_report("llama31_8b_tp1_128k", budget="4x", batch=2)
    assert list(frame["tier"]) == ["sram", "hbm", "ddr"]
    hbm = frame.set_index("tier").loc["hbm"]
    assert hbm["kv_bytes"] == 2 * 32_768 * 131_072
    assert hbm["headroom_bytes"] == pytest.approx(hbm["available_bytes"] - hbm["used_bytes"])
    assert frame["decode_tokens_per_s"].iloc[0] > 0


@pytest.mark.parametrize(
    "change, message",
    [({"hardware": {"name": "bad", "sram": "-5GiB", "hbm": "64GiB", "hbm_bandwidth": "1TB/s", "sockets_per_node": 16}},
      "cannot read a size"),
     ({"tp": 5}, "does not divide"),
     ({"tp": 32}, "more sockets"),
     ({"batch": 0}, "positive integers")],
)
def test_bad_specs_are_clear_errors(change, message):
    hardware = change.pop("hardware", None)
    with pytest.raises(ValueError, match=message):
        memory.load_deployment("deepseek_r1_tp16_128k", hardware=hardware, **change)


def test_unknown_deployment_names_the_available_ones():
    with pytest.raises(ValueError, match="unknown deployment 'gpt5'.*deepseek_r1_tp16_128k"):
        memory.load_deployment("gpt5")


def _composed(*overrides):
    from evalkit.config import compose

    return compose(*overrides)


R1 = "deployment=deepseek_r1_tp16_128k"


def test_a_run_prices_its_budget_on_the_deployment_it_names():
    spec = validate(_composed("+budget=4x", R1), method_explicit=False)
    assert spec.memory.cached_tokens == 32_768 and spec.memory.fits
    assert spec.flat_config()["deployment"] == "deepseek_r1_tp16_128k" and spec.flat_config()["hardware"] == "sn40l"
    baseline = validate(_composed(R1), method_explicit=False)
    assert baseline.memory.cached_tokens == 131_072


def test_a_run_prices_its_own_models_deployment_or_none():
    """No deployment is priced for a model that has none (never DeepSeek-R1 for whatever runs); Llama-3.1-8B's config
    names its own."""
    assert validate(_composed("+budget=4x"), method_explicit=False).memory is None
    llama = validate(_composed("+budget=4x", "model=llama31_8b_instruct"), method_explicit=False)
    assert llama.memory.deployment.model.name == "llama31_8b" and llama.flat_config()["deployment"] == "llama31_8b_tp1_128k"


def test_memory_enforce_refuses_a_budget_that_does_not_fit_before_loading():
    with pytest.raises(ConfigError, match="does not fit .* largest batch that fits: 115"):
        validate(_composed("+budget=4x", R1, "memory.enforce=true", "deployment.batch=116"), method_explicit=False)
    validate(_composed("+budget=4x", R1, "memory.enforce=true", "deployment.batch=115"), method_explicit=False)


def test_evalkit_mem_prints_and_writes_the_table(tmp_path):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "evalkit.memory.cli", f"results_dir={tmp_path}", "batches=[1,2]",
                             "hardware=h200_141g", "deployment=llama31_8b_tp1_128k"],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "llama31_8b_tp1_128k on h200_141g" in result.stdout and "assumptions:" in result.stdout
    lines = result.stdout.splitlines()
    assert lines[1].split() == ["budget", "batch", "capacity", "hbm_used_GiB", "hbm_free_GiB", "ddr_used_GiB",
                                "working_set_on_chip", "fits", "max_batch", "onchip_ratio", "decode_tokens_per_s"]
    shown = [line.split() for line in lines[2:12]]  # a row per budget and batch, the tiers side by side
    assert [row[:2] for row in shown] == [[b, n] for b in ("full", "2x", "4x", "8x", "16x") for n in ("1", "2")]
    assert not lines[12].strip()
    from evalkit.results import read_table

    frame = read_table(tmp_path, "memory")
    assert len(frame) == 5 * 2 * 3 and set(frame["budget"]) == {"full", "2x", "4x", "8x", "16x"}
    hbm = frame[frame["tier"] == "hbm"].set_index(["budget", "batch"])
    assert all(float(row[3]) == round(hbm.loc[(row[0], int(row[1])), "used_bytes"] / 2**30, 3) for row in shown)
    assert all(row[7] == str(hbm.loc[(row[0], int(row[1])), "fits"]) for row in shown)
    assert (frame["hardware"] == "h200_141g").all()


def test_a_sweep_over_deployments_is_a_hydra_multirun(tmp_path):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "evalkit.memory.cli", "-m", f"results_dir={tmp_path}", "batches=[1]",
                             "deployment=deepseek_r1_tp16_128k,llama31_8b_tp1_128k", "hardware=sn40l,h200_141g",
                             f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count("skipped in this sweep: tp=16 needs more sockets") == 1
    assert "[HYDRA]" not in result.stdout + result.stderr  # each job's title instead of Hydra's launcher lines
    assert sum(line.startswith("[#") for line in result.stdout.splitlines()) == 4
    from evalkit.results import read_table

    frame = read_table(tmp_path, "memory")
    assert set(zip(frame["model"], frame["hardware"])) == {
        ("deepseek_r1_671b", "sn40l"), ("llama31_8b", "sn40l"), ("llama31_8b", "h200_141g")}


def test_a_hybrid_models_sliding_layers_hold_their_window_whatever_the_budget():
    deployment = memory.load_deployment("gpt_oss_120b_tp1_128k_h100")
    per_layer_token = 2 * 8 * 64 * 2  # K and V, 8 KV heads of 64, bf16
    full, quarter = memory.price(deployment), memory.price(deployment, 32_768)
    assert full.kv == per_layer_token * (18 * 131_072 + 18 * 128)  # 18 full-attention layers, 18 of 128 tokens
    assert quarter.kv == per_layer_token * (18 * 32_768 + 18 * 128)
    assert full.working_set == per_layer_token * 131_072  # one full-attention layer, the largest
    # Its geometry read from a transformers config: layer_types count the sliding-window layers.
    config = {"num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "sliding_window": 512, "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}
    geometry = memory.resolve_model(config)
    assert (geometry.sliding_layers, geometry.sliding_window) == (5, 512)
    assert geometry.held_tokens(4096) == (4096 + 5 * 512) / 6 and geometry.held_tokens(100) == 100


def test_evalkit_mem_prices_a_quantized_kv_cache(tmp_path):
    """`evalkit-mem ... kv_bits=4`: the KV bytes per socket are the format's (codes plus scales: 160 of 512 bytes per
    token and head of 128 in bf16), the largest batch grows."""
    import subprocess
    import sys

    from evalkit.results import read_table

    frames = {}
    for bits in (16, 4):
        out = tmp_path / str(bits)
        result = subprocess.run([sys.executable, "-m", "evalkit.memory.cli", f"results_dir={out}", "batches=[1]",
                                 "deployment=llama31_8b_tp1_128k", f"kv_bits={bits}"],
                                capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        frames[bits] = read_table(out, "memory").set_index(["budget", "tier"])
    assert "KV 4-bit (KIVI, groups of 32, scales in bf16)" in result.stdout
    assert set(frames[4]["kv_bits"]) == {4} and set(frames[16]["kv_bits"]) == {16}
    kv16, kv4 = frames[16].loc[("full", "hbm"), "kv_bytes"], frames[4].loc[("full", "hbm"), "kv_bytes"]
    assert kv4 == pytest.approx(kv16 * 160 / 512)
    assert frames[4].loc[("4x", "hbm"), "max_batch"] > frames[16].loc[("4x", "hbm"), "max_batch"]


# -- tensor-parallel communication ---------------------------------------------------------------------------------
PER_USER = (198, 250)  # tok/s per user, DeepSeek-R1 on 16 SN40L sockets: SambaNova's DAC 2025 talk; its blog (">250")
AGGREGATE = 1832  # tok/s for the node, SnapStream 4x (arXiv 2511.03092)
HARDWARE_SPEC = {"name": "links", "sram": "520MiB", "hbm": "64GiB", "hbm_bandwidth": "1.6TB/s", "sockets_per_node": 16,
                  "link_bandwidth": "110GB/s", "link_latency": "0.46us"}


def test_deepseek_r1_on_16_sockets_decodes_near_the_published_speeds():
    """Per user at batch 1 (full cache and SnapStream's 4x) within 1.5x of 198-250 tok/s, and the node's best at 4x
    within 1.5x of 1,832 tok/s; without communication, batch 1 would be ~2x too fast."""
    deployment = memory.load_deployment("deepseek_r1_tp16_128k")
    quarter = memory.capacity_for_budget("4x", deployment.context)
    for capacity in (None, quarter):
        verdict = memory.price(deployment, capacity)
        assert PER_USER[0] / 1.5 <= verdict.decode_tokens_per_s <= PER_USER[1] * 1.5
        assert verdict.comm_seconds > verdict.step_seconds / 2  # batch 1 waits mostly on the links
    batch, rate = memory.best_throughput(deployment, quarter)
    assert batch == 115 and AGGREGATE / 1.5 <= rate <= AGGREGATE * 1.5
    memory_only = dataclasses.replace(deployment, hardware=dataclasses.replace(
        deployment.hardware, link_bandwidth=float("inf"), link_latency=0.0))
    assert memory.price(memory_only, quarter).decode_tokens_per_s > PER_USER[1] * 2


def test_one_socket_sends_nothing():
    for name in ("llama31_8b_tp1_128k", "gpt_oss_120b_tp1_128k_h100"):
        deployment = memory.load_deployment(name, batch=2)
        verdict = memory.price(deployment, 32_768)
        assert verdict.comm_seconds == 0
        slow_links = dataclasses.replace(deployment, hardware=dataclasses.replace(
            deployment.hardware, link_bandwidth=1.0, link_latency=1.0))
        assert memory.price(slow_links, 32_768).step_seconds == verdict.step_seconds


def test_communication_grows_with_tp_and_batch():
    base = memory.load_deployment("llama31_70b_tp8_128k")
    by_tp = [memory.price(dataclasses.replace(base, tp=tp)).comm_seconds for tp in (1, 2, 4, 8)]
    assert by_tp[0] == 0 and by_tp == sorted(by_tp) and len(set(by_tp)) == 4
    by_batch = [memory.price(dataclasses.replace(base, batch=b), 8192).comm_seconds for b in (1, 8, 64)]
    assert by_batch == sorted(by_batch) and len(set(by_batch)) == 3
    # A ring all-reduce: 2(tp-1)/tp of the bytes and 2(tp-1) hops; 161 of them (2 x 80 layers, the embedding) and the
    # sampling's (8 bytes a token), no attention exchange (kv_sharding: head).
    hardware, batch = base.hardware, 64
    all_reduce = 2 * (7 / 8 * batch * 8192 * 2 / hardware.link_bandwidth + 7 * hardware.link_latency)
    sampling = 2 * (7 / 8 * batch * 8 / hardware.link_bandwidth + 7 * hardware.link_latency)
    assert by_batch[2] == pytest.approx(161 * all_reduce + sampling, rel=1e-12)


def test_deepseek_r1_on_8_h200_is_priced_with_nvlink():
    deployment = memory.load_deployment("deepseek_r1_tp8_128k_h200")
    hardware = deployment.hardware
    assert (hardware.link_bandwidth, hardware.link_latency) == (450e9, pytest.approx(0.6e-6))
    verdict = memory.price(deployment)
    # 123 all-reduces of 7168 bf16 values (2 x 61 layers, the embedding), the sampling's, and per layer the latent
    # split by token: 128 heads' queries (576 values) gathered and partial outputs (512 + max and sum) scattered.
    ring = lambda payload, phases: phases * (7 / 8 * payload / 450e9 + 7 * 0.6e-6)  # noqa: E731
    expected = 123 * ring(7168 * 2, 2) + ring(8, 2) + 61 * (ring(128 * 576 * 2, 1) + ring(128 * 514 * 2, 1))
    assert verdict.comm_seconds == pytest.approx(expected, rel=1e-12)
    assert verdict.step_seconds == pytest.approx(verdict.read_hbm / 4.8e12 / 0.60 + expected, rel=1e-12)
    fast = dataclasses.replace(deployment, hardware=dataclasses.replace(hardware, link_bandwidth=900e9))
    assert memory.price(fast).comm_seconds < verdict.comm_seconds


def test_sn40l_link_figures_are_fitted_and_say_so():
    """Both hardware files carry the link fields; sn40l.yaml's are the rounded output of the fitting script, and say
    what they are fitted to."""
    import importlib.util

    import yaml

    from evalkit.core.paths import conf_dir

    text = (conf_dir() / "hardware" / "sn40l.yaml").read_text()
    for source in ("FITTED", "198", "250", "1,832", "2511.03092", "DAC 2025", "benchmarks/fit_sn40l_links.py"):
        assert source in text
    for name in ("sn40l", "sn40l_node8", "h100_80g", "h200_141g"):
        assert {"link_bandwidth", "link_latency"} <= set(yaml.safe_load((conf_dir() / "hardware" / f"{name}.yaml").read_text()))
    script = conf_dir().parent / "benchmarks" / "fit_sn40l_links.py"
    spec = importlib.util.spec_from_file_location("fit_sn40l_links", script)
    fit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fit)
    bandwidth, latency = fit.fit(memory.load_deployment("deepseek_r1_tp16_128k"))
    shipped = memory.load_hardware("sn40l")
    assert shipped.link_bandwidth == pytest.approx(bandwidth, rel=0.02)
    assert shipped.link_latency == pytest.approx(latency, rel=0.02)
    assert memory.load_hardware("sn40l_node8").link_bandwidth == shipped.link_bandwidth


@pytest.mark.parametrize("change, message", [
    ({"link_bandwidth": None}, "lacks 'link_bandwidth'"),
    ({"link_latency": None}, "lacks 'link_latency'"),
    ({"link_latency": "-1us"}, "link_latency: cannot read a time"),
    ({"link_bandwidth": -5}, "link_bandwidth: sizes must be non-negative"),
    ({"link_bandwidth": 0}, "need link_bandwidth > 0"),
    ({"link_latency": "3 parsecs"}, "cannot read a time"),
])
def test_bad_link_fields_are_one_line_errors(change, message):
    spec = {k: v for k, v in {**HARDWARE_SPEC, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=message) as error:
        memory.load_hardware(spec)
    assert "\n" not in str(error.value) and "links" in str(error.value)
    assert memory.load_hardware(HARDWARE_SPEC).link_latency == pytest.approx(0.46e-6)


def test_a_model_without_hidden_size_cannot_be_split():
    config = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 16}
    one = memory.load_deployment({"name": "x", "model": config, "tp": 1, "batch": 1, "context": 64}, HARDWARE_SPEC)
    assert memory.price(one).comm_seconds == 0
    with pytest.raises(ValueError, match="tp=2 needs .* hidden_size"):
        memory.load_deployment({"name": "x", "model": config, "tp": 2, "batch": 1, "context": 64}, HARDWARE_SPEC)
