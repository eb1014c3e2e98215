"""Shared fixtures: tiny random-weight models of the supported families, all with GQA."""

from __future__ import annotations

import os
from pathlib import Path

# Under pytest-xdist (-n auto), each worker takes its share of the cores, so that workers do not oversubscribe them;
# the CLI processes the tests start inherit the share.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    share = (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, share)))

pytest_plugins = ["fast_tier_limit", "pytester"]

import learned_files  # noqa: E402  (tests/ is on the path)
import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import evalkit.compression as ec
from evalkit.compression.methods.kvzip import ReconstructionPrompts

VOCAB = 97
# KVzip's reconstruction prompt in the tiny vocabulary (a real tokenizer's comes from bind_tokenizer)
TINY_RECONSTRUCTION = ReconstructionPrompts(prefix=(), suffix=(1, 2), first=(5, 6, 7), next=(5, 6, 8))
_SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None, "head_dim": 16}),
}


def tiny_model(family: str = "llama", seed: int = 0, attn_implementation: str = "sdpa", **overrides):
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = config_cls(**{**_SHAPE, **extra, **overrides})
    config._attn_implementation = attn_implementation
    model = model_cls(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(params=sorted(FAMILIES))
def family_model(request):
    return tiny_model(request.param)


@pytest.fixture
def llama():
    return tiny_model("llama")


def random_prompt(length: int, seed: int = 1, batch: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=generator)


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory) -> Path:
    """A random-weight model with the built-in task's tokenizer, saved like a real checkpoint."""
    from evalkit.models.train_tiny import build_model, build_tokenizer

    path = tmp_path_factory.mktemp("random_model")
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    build_model(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# Methods whose defaults are sized for long prompts, at sizes for prompts of a few hundred tokens.
SMALL_SETTINGS = {
    "full": lambda: ec.Full(),
    "snapstream": lambda: ec.SnapStream(capacity=64, window=8, sink=4, recent=16, kernel_size=5),
    "snapkv": lambda: ec.SnapKV(capacity=48, window=8, kernel_size=5),
    "headkv": lambda: ec.HeadKV.from_config(40, scores=str(learned_files.headkv_scores())),
    "nacl": lambda: ec.NACL(capacity=40, window=8, random_budget=8, seed=3),  # its seeded draws too
    "expected_attention_stats": lambda: ec.ExpectedAttentionStats(capacity=40, n_future_positions=16, stats=str(
        learned_files.expected_attention_stats())),
    "streaming_llm": lambda: ec.StreamingLLM(sink=4, window=40),
    "pyramidkv": lambda: ec.PyramidKV.from_config(48, window=8),
    "adakv": lambda: ec.AdaKV.from_config(48, window=4, alpha_safeguard=0.5),
    "h2o": lambda: ec.H2O(capacity=40, recent=10),
    "expected_attention": lambda: ec.ExpectedAttention(capacity=40, n_future_positions=16),
    "random": lambda: ec.Random(capacity=40, selection_seed=3),
    "decoding_snapkv": lambda: ec.DecodingSnapKV.from_config(64, window=4, kernel_size=3, interval=8),
    "per_layer": lambda: ec.PerLayer.from_config(48, window=8, weights=(1.5, 0.5)),
    "composed": lambda: ec.Composed(capacity=40, then={"name": "snapkv", "window": 8, "kernel_size": 5}),
    "chunkkv": lambda: ec.ChunkKV.from_config(40, window=8, chunk_length=10),
    "criticalkv": lambda: ec.CriticalKV.from_config(40, window=8),
    "criticaladakv": lambda: ec.CriticalAdaKV.from_config(40, window=8),
    "chunkwise": lambda: ec.ChunkWise.from_config(40, chunk_length=64, window=4),
    "simlayerkv": lambda: ec.SimLayerKV(lazy_threshold=0.05, n_recent=32),
    "qfilter": lambda: ec.QFilter(capacity=40, filters=str(learned_files.qfilters())),
    "duo_attention": lambda: ec.DuoAttention(patterns=str(learned_files.duo_pattern([[0.9, 0.1], [0.3, 0.7]])),
                                             head_ratio=1.0),  # every head streams: the layers shrink
    "entropy_gated_chunkkv": lambda: ec.EntropyGatedChunkKV.from_config(40, window=8),
    "prefill_decoding": lambda: ec.PrefillDecoding.from_config(64, window=4, kernel_size=3, interval=8,
                                                                prefill="knorm"),
    "fastkvzip": lambda: ec.FastKVzip(capacity=40, gates=str(learned_files.fastkvzip_gates())),
    "lukv": lambda: ec.LUKV.from_config(40, curve=str(learned_files.lukv_curve()), n_future_positions=16),
    "key_rerotation": lambda: ec.KeyRerotation.from_config(40, window=8),
    "lacache": lambda: ec.LaCache(capacity=40, start_size=4, span=1),
    "gear": lambda: ec.GEAR.from_config(40, window=8, group_size=16, streaming_gap=16),  # H*D = 32: groups of 16
    "merging": lambda: ec.Merging.from_config(40, window=8),
    "think": lambda: ec.ThinK.from_config(40, window=8, window_size=8),
    "kvzap": lambda: ec.KVzap(capacity=40, weights=str(learned_files.kvzap(hidden_dim=24))),
    "threshold": lambda: ec.Threshold(threshold=0.0, sliding_window_size=8,
                                      scorer={"name": "kvzap", "weights": str(learned_files.kvzap())}),
    "kvzip": lambda: ec.KVzip(capacity=40, chunk_size=64).with_prompts(TINY_RECONSTRUCTION),
    "kvzip_plus": lambda: ec.KVzipPlus(capacity=40, chunk_size=64).with_prompts(TINY_RECONSTRUCTION),
    "kvgrad": lambda: ec.KVgrad(capacity=40, chunk_size=64).with_prompts(TINY_RECONSTRUCTION),
    "quest": lambda: ec.Quest(capacity=24, page_size=8, dense_layers=1),  # the tiny models have 2 layers
    "shadowkv": lambda: ec.ShadowKV(capacity=24, rank=8, chunk_size=4, outlier_chunks=4),  # H*D = 32
    "rkv": lambda: ec.RKV(capacity=64, window=4, interval=8, kernel_size=3),
    "snapkv_d": lambda: ec.SnapKVD(capacity=40, window=8, kernel_size=3),
    "raas": lambda: ec.RaaS(capacity=48, alpha=0.02),
    "compression_ratio_decoding": lambda: ec.CompressionRatioDecoding(capacity=40, interval=8, buffer=8),
    # CaM on TOVA: KNorm's layer-0 ties between repeated tokens fall to the keys' last bit
    "cam": lambda: ec.CaM.from_config(64, interval=8, merge_budget=4, scorer="tova"),
    "minicache": lambda: ec.MiniCache(start_layer=0),  # the tiny models have 2 layers: one merged pair
    "restorekv": lambda: ec.RestoreKV(capacity=40, chunk_size=64, adapter=str(learned_files.restorekv(
        targets=learned_files.ATTENTION_TARGETS))).with_prompts(TINY_RECONSTRUCTION),
    "restorekv_plus": lambda: ec.RestoreKVPlus(capacity=40, chunk_size=64, adapter=str(learned_files.restorekv(
        targets=learned_files.ATTENTION_TARGETS))).with_prompts(TINY_RECONSTRUCTION),
}


def registered(name: str, capacity: int):
    """A registered method with its defaults at ``capacity`` tokens (what a new method gets in every every-method
    test until its defaults need a small entry)."""
    return lambda: ec.policy_from_budget(name, f"tokens_{capacity}" if ec.POLICIES[name].takes_budget else None,
                                         capacity)


# Every registered method, sized for prompts of a few hundred tokens (each one compresses them: test_methods.py says
# which does not, by name). The every-method tests of the chunked, engine, latent and GPU tiers run these.
SMALL_POLICIES = {name: SMALL_SETTINGS.get(name) or registered(name, 40) for name in sorted(ec.POLICIES)}
