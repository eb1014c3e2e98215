"""Reference KV-cache compression for transformers causal LMs: Full, StreamingLLM, SnapKV, SnapStream; the baselines
a study compares against (KNorm, Random, ObservedAttention, ExpectedAttention, PyramidKV, AdaKV; H2O, TOVA and SnapKV
re-applied while decoding); and speculative prefill (a draft model picks the prompt tokens the target prefills).

Pure torch + transformers; no Hydra or lm-eval imports here.

    import evalkit.compression as ec
    policy = ec.SnapStream(capacity=1024, sink=4, window=32, kernel_size=7, pooling="max", recent=256)
    out = ec.generate(model, input_ids, policy, max_new_tokens=64)
"""

from .cache import CompressedCache
from .engine import Completion, Engine, Request, compile_backend
from .fidelity import fidelity
from .generate import GenerationOutput, generate
from .kernels import snapkv_scores
from .methods.adakv import AdaKV
from .methods.base import Policy
from .methods.budget import POLICIES, budget_capacity, method_params, policy_from_budget
from .methods.decoding_snapkv import DecodingSnapKV
from .methods.expected_attention import ExpectedAttention
from .methods.full import Full
from .methods.h2o import H2O
from .methods.knorm import KNorm
from .methods.observed_attention import ObservedAttention
from .methods.pyramidkv import PyramidKV
from .methods.random_baseline import Random
from .methods.snapkv import SnapKV
from .methods.snapstream import SnapStream
from .methods.streaming_llm import StreamingLLM
from .methods.tova import TOVA
from .session import CHUNK_MODES, CompressionSession, chunk_mode_refusal
from .spec_prefill import SpecPrefill, map_by_characters
from .stopping import stop_token_ids
from .views import DecodeView, PrefillView

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
