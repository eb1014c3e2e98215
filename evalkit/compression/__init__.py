"""Reference KV-cache compression for transformers causal LMs: Full, StreamingLLM, SnapKV, SnapStream; the baselines
a study compares against (KNorm, Random, ObservedAttention, ExpectedAttention, PyramidKV, AdaKV; H2O, TOVA and SnapKV
re-applied while decoding); and speculative prefill (a draft model picks the prompt tokens the target prefills).

Pure torch + transformers; no Hydra or lm-eval imports here.

    import evalkit.compression as ec
    policy = ec.SnapStream(capacity=1024, sink=4, window=32, kernel_size=7, pooling="max", recent=256)
    out = ec.generate(model, input_ids, policy, max_new_tokens=64)
"""

from .adakv import AdaKV
from .base import DecodeView, Policy, PrefillView, snapkv_scores
from .budget import POLICIES, budget_capacity, method_params, policy_from_budget
from .cache import CompressedCache
from .decoding_snapkv import DecodingSnapKV
from .engine import Completion, Engine, Request, compile_backend
from .expected_attention import ExpectedAttention
from .fidelity import fidelity
from .full import Full
from .generate import GenerationOutput, generate, stop_token_ids
from .h2o import H2O
from .knorm import KNorm
from .observed_attention import ObservedAttention
from .pyramidkv import PyramidKV
from .random_baseline import Random
from .session import CHUNK_MODES, CompressionSession, chunk_mode_refusal
from .snapkv import SnapKV
from .snapstream import SnapStream
from .spec_prefill import SpecPrefill, map_by_characters
from .streaming_llm import StreamingLLM
from .tova import TOVA

__all__ = [
    "POLICIES",
    "TOVA",
    "AdaKV",
    "DecodeView",
    "DecodingSnapKV",
    "ExpectedAttention",
    "H2O",
    "KNorm",
    "ObservedAttention",
    "PrefillView",
    "PyramidKV",
    "Random",
    "method_params",
    "Completion",
    "CompressedCache",
    "CompressionSession",
    "Engine",
    "Full",
    "GenerationOutput",
    "Policy",
    "Request",
    "SnapKV",
    "SnapStream",
    "SpecPrefill",
    "StreamingLLM",
    "CHUNK_MODES",
    "budget_capacity",
    "chunk_mode_refusal",
    "compile_backend",
    "fidelity",
    "generate",
    "map_by_characters",
    "policy_from_budget",
    "snapkv_scores",
    "stop_token_ids",
]
