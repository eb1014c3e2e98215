"""Reference KV-cache compression for transformers causal LMs: Full, StreamingLLM, SnapKV, SnapStream; the baselines
a study compares against (KNorm, Random, ObservedAttention, ExpectedAttention, PyramidKV, AdaKV; H2O, TOVA and SnapKV
re-applied while decoding); and speculative prefill (a draft model picks the prompt tokens the target prefills).

Pure torch + transformers; no Hydra or lm-eval imports here.

    import evalkit.compression as ec
    policy = ec.SnapStream(capacity=1024, sink=4, window=32, kernel_size=7, pooling="max", recent=256)
    out = ec.generate(model, input_ids, policy, max_new_tokens=64)
"""

from .agent_calls import generate_calls
from .cache import CompressedCache
from .engine import Completion, Engine, Request, compile_backend
from .fidelity import fidelity
from .generate import GenerationOutput, generate
from .kept import kept_positions
from .kernels import snapkv_scores
from .kv_format import KVFormat, kv_format
from .loglikelihood import score_continuation
from .methods.base import Policy
from .methods.budget import POLICIES, budget_capacity, method_params, policy_from_budget
from .recompress import RECOMPRESS, cache_tokens, held_tokens, recompress_refusal, share_of, take_in
from .session import CHUNK_MODES, CompressionSession, chunk_mode_refusal
from .shared_context import SharedContextOutput, generate_shared, prefill_context
from .spec_calls import CallText, SpecCalls, call_text
from .spec_prefill import SpecPrefill, map_by_characters
from .stopping import stop_token_ids
from .views import DecodeView, PrefillView

# Every registered method under its class name (ec.SnapKV, ec.KNorm, ...): a new method's file is all it takes.
globals().update({cls.__name__: cls for cls in POLICIES.values()})

__all__ = [
    *sorted(cls.__name__ for cls in POLICIES.values()),
    "POLICIES",
    "DecodeView",
    "PrefillView",
    "method_params",
    "Completion",
    "CompressedCache",
    "CompressionSession",
    "Engine",
    "GenerationOutput",
    "KVFormat",
    "kv_format",
    "Policy",
    "Request",
    "SpecPrefill",
    "SpecCalls",
    "CallText",
    "call_text",
    "CHUNK_MODES",
    "budget_capacity",
    "chunk_mode_refusal",
    "compile_backend",
    "fidelity",
    "generate",
    "kept_positions",
    "map_by_characters",
    "policy_from_budget",
    "score_continuation",
    "SharedContextOutput",
    "RECOMPRESS",
    "cache_tokens",
    "generate_calls",
    "held_tokens",
    "recompress_refusal",
    "share_of",
    "take_in",
    "generate_shared",
    "prefill_context",
    "snapkv_scores",
    "stop_token_ids",
]
