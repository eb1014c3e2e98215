"""Reference KV-cache compression for transformers causal LMs: Full, StreamingLLM, SnapKV, SnapStream, and
speculative prefill (a draft model picks the prompt tokens the target prefills).

Pure torch + transformers; no Hydra or lm-eval imports here.

    import evalkit.compression as ec
    policy = ec.SnapStream(capacity=1024, sink=4, window=32, kernel_size=7, pooling="max", recent=256)
    out = ec.generate(model, input_ids, policy, max_new_tokens=64)
"""

from .base import Policy, snapkv_scores
from .budget import POLICIES, budget_capacity, policy_from_budget
from .cache import CompressedCache
from .engine import Completion, Engine, Request, compile_backend
from .fidelity import fidelity
from .full import Full
from .generate import GenerationOutput, generate
from .session import CompressionSession
from .snapkv import SnapKV
from .snapstream import SnapStream
from .spec_prefill import SpecPrefill, map_by_characters
from .streaming_llm import StreamingLLM

__all__ = [
    "POLICIES",
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
    "budget_capacity",
    "compile_backend",
    "fidelity",
    "generate",
    "map_by_characters",
    "policy_from_budget",
    "snapkv_scores",
]
