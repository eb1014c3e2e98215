"""Every ranking method's prefill scores on a bf16 model are fp32 and agree with the same computation in fp64 to
within 1e-4 (fp32 lands near 1e-6; a bf16 product near 1e-3): on the CPU here, on CUDA in the GPU tier."""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch
from test_gpu import FAMILIES, POLICIES, SHAPE, prompt

import evalkit.compression as ec
from evalkit.compression.methods.base import Policy

# Scores that are not computed in fp32, each for a reason of its own.
NOT_FP32 = {
    "rkv": "R-KV's reference computes its importance in the keys' dtype; evalkit follows it (parity_rkv.py)",
    "kvzip": "scored in pass_scores, from fp32 copies of the pass's queries, keys and values, not in score",
    "kvzip_plus": "scored in pass_scores, from fp32 copies of the pass's queries, keys and values, not in score",
    "kvgrad": "scored in pass_scores and run_pass, from fp32 copies of the pass's queries, keys and values and of the "
              "gradients' norms, not in score",
    "restorekv": "scored in pass_scores (KVzip's), from fp32 copies of the pass's queries, keys and values",
    "restorekv_plus": "scored in pass_scores (KVzip's), from fp32 copies of the pass's queries, keys and values",
    "kvcompose": "scored in pass_scores, in fp32 or wider, not in score",
}
SCORED = [name for name, make in POLICIES.items() if make().needs_scores and name not in NOT_FP32]
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]
_MODELS: dict = {}


def bf16_model(device: str) -> torch.nn.Module:
    if device not in _MODELS:
        config_cls, model_cls = FAMILIES["llama"]
        torch.manual_seed(0)
        config = config_cls(**SHAPE)
        config._attn_implementation = "sdpa"
        _MODELS[device] = model_cls(config).to(device, torch.bfloat16).eval()
        _MODELS[device].generation_config.eos_token_id = None
    return _MODELS[device]


def policies_in(policy: Policy) -> list[Policy]:
    """The policy and every policy it wraps (a wrapper's own ``score`` may hand the view to its inner policy's)."""
    found = [policy]
    for field in dataclasses.fields(policy) if dataclasses.is_dataclass(policy) else ():
        value = getattr(policy, field.name)
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, Policy):
                found += policies_in(item)
    return found


def relative_error(scores: torch.Tensor, reference: torch.Tensor) -> float:
    """Over the finite entries (a window scored ``inf``, a padded key ``-inf``: the same entries both ways)."""
    finite = reference.isfinite()
    assert torch.equal(finite, scores.isfinite()), "the infinite scores differ from fp64's"
    diff = (scores.double() - reference)[finite].norm()
    norm = reference[finite].norm()
    return (diff / norm if norm > 0 else diff).item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", SCORED)
def test_scores_are_accumulated_in_fp32_on_a_bf16_model(name, device):
    policy = POLICIES[name]()
    seen = []
    patches = []
    for cls in {type(p) for p in policies_in(policy)}:
        def recording(self, view, original=cls.score):
            scores = original(self, view)
            wide = dataclasses.replace(view, query=view.query.double(), keys=view.keys.double(),
                                       values=view.values.double())
            seen.append((scores.dtype, relative_error(scores, original(self, wide))))
            return scores

        patches.append(mock.patch.object(cls, "score", recording))
    for patch in patches:
        patch.start()
    try:
        ec.generate(bf16_model(device), prompt(300, seed=9)[None].to(device), policy, max_new_tokens=4,
                    return_logits=False)
    finally:
        for patch in patches:
            patch.stop()
    assert seen, "the policy scored nothing"
    for dtype, error in seen:
        assert dtype in (torch.float32, torch.float64)  # fp32 or wider
        assert error < 1e-4, error
