"""A model loaded with accelerate's device map: each layer's cache on that layer's device, the same tokens as the
model on one device. On a CPU-only machine every layer is on "cpu"; the checks on several GPUs need such a machine."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompt, tiny_model

import evalkit.compression as ec
from evalkit.models import load_model
from evalkit.run import ConfigError
from evalkit.run.spec import _device_map


def _device_map_of(model) -> dict:
    """One entry per module, as a user would write it to place each layer."""
    names = ["model.embed_tokens", "model.norm", "model.rotary_emb", "lm_head"]
    names += [f"model.layers.{i}" for i in range(model.config.num_hidden_layers)]
    return {name: "cpu" for name in names}


@pytest.mark.parametrize("method", ["snapstream", "h2o"])
def test_a_device_mapped_model_generates_what_it_does_on_one_device(random_model_dir, method):
    from accelerate import dispatch_model

    plain, tokenizer = load_model(str(random_model_dir), device="cpu")
    mapped, _ = load_model(str(random_model_dir), device_map=_device_map_of(plain))
    # transformers installs accelerate's hooks only for a map over several devices; install them here as it would
    # (inputs moved to each layer's device, the cache left where it is), so that path runs on one device too.
    dispatch_model(mapped, _device_map_of(mapped), force_hooks=True, skip_keys=mapped._skip_keys_device_placement)
    assert hasattr(mapped.model.layers[0], "_hf_hook")
    assert ec.model_spec.layer_devices(mapped) == [torch.device("cpu")] * mapped.config.num_hidden_layers
    policy = ec.policy_from_budget(method, "4x", 256)
    requests = [ec.Request(input_ids=random_prompt(length, seed=length)[0], max_new_tokens=12)
                for length in (150, 90, 200)]
    outputs = []
    for model in (plain, mapped):
        engine = ec.Engine(model, policy, slots=2, eos_token_id=tokenizer.eos_token_id)
        completions = engine.run(requests)
        outputs.append([c.tokens for c in completions])
        assert engine.cache.layers[0].keys.shape[-2] == policy.cache_capacity() < 200  # really compressed
    assert outputs[0] == outputs[1]


def test_layers_offloaded_to_meta_are_refused():
    with torch.device("meta"):
        model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"layers \[0, 1\] are offloaded"):
        ec.model_spec.layer_devices(model)


@pytest.mark.parametrize("value, message", [
    ("everywhere", "must be null, one of"),
    ({"model.layers.0": "disk", "lm_head": 0}, "offloads layers to meta/disk"),
    (["cpu"], "must be null, one of"),
])
def test_bad_device_maps_are_refused_in_one_line(value, message):
    with pytest.raises(ConfigError, match=message):
        _device_map(value)


def test_a_device_map_is_recorded_in_the_run_config():
    from test_harness import spec_for

    spec = spec_for("+budget=4x", "model.device_map=auto")
    assert spec.device_map == "auto" and spec.flat_config()["device_map"] == '"auto"'
    assert "device_map" not in spec_for("+budget=4x").flat_config()  # earlier runs keep their digest
