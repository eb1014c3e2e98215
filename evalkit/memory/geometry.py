"""KV-cache geometry of a model: bytes per token, and how tensor parallelism splits them.

Standard attention and GQA cache K and V per KV head: ``2 x layers x kv_heads x head_dim x bytes`` per token; their
KV heads shard across tensor-parallel ranks (``kv_heads / tp`` per socket, one replicated head per socket when
``tp > kv_heads``). MLA (DeepSeek-V2/V3/R1) caches one latent per token and layer, ``kv_lora_rank + qk_rope_head_dim``
values shared by all heads: head-wise tensor parallelism does not shard it, so every socket holds all of it.

Mixture of experts (DeepSeek-V3/R1, Mixtral, Qwen-MoE): ``experts`` routed experts per MoE layer, each token routed to
``experts_per_token`` of them, plus ``shared_experts`` every token uses; the first ``dense_layers`` layers have a dense
MLP. A decode step reads the experts the batch activates, not all of them (:func:`expected_active_experts`).

Tensor parallelism sends activations of ``hidden_size`` values per token between the sockets (see
:mod:`evalkit.memory.interconnect`); attention split by token over them also exchanges every head's query and partial
output (:meth:`ModelGeometry.split_attention_values`).

Hybrid models (Gemma-2/3, gpt-oss): ``sliding_layers`` of the layers attend over the last ``sliding_window`` tokens
only, so they never hold more; a budget compresses the full-attention layers (as evalkit's cache does).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from evalkit.core.attention_shape import attention_shape, config_reader

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp8": 1, "int8": 1, "int4": 0.5}


def dtype_bytes(dtype: str) -> float:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


@dataclasses.dataclass(frozen=True)
class ModelGeometry:
    """What memory pricing needs to know about a model. ``attention``: ``gqa`` (MHA is GQA with kv_heads = heads) or
    ``mla``. ``active_params``: parameters read per decoded token (all of them for dense models; MoE reads fewer).
    MoE: ``experts`` routed experts per MoE layer (0: a dense model), ``experts_per_token`` (top-k),
    ``shared_experts``, ``dense_layers`` (the first layers, with a dense MLP), ``expert_params`` (one expert's
    parameters: gate, up and down projections), ``mtp_layers`` (DeepSeek's multi-token-prediction blocks, each one
    MoE layer beside the model, not counted in ``params``). ``hidden_size``: the width of the activations
    tensor parallelism all-reduces (needed only when tp > 1)."""

    name: str
    layers: int
    heads: int
    attention: str = "gqa"
    kv_heads: int | None = None
    head_dim: int | None = None
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    params: float = 0.0
    active_params: float | None = None
    experts: int = 0
    experts_per_token: int = 0
    shared_experts: int = 0
    dense_layers: int = 0
    expert_params: float = 0.0
    mtp_layers: int = 0
    sliding_layers: int = 0
    sliding_window: int | None = None
    hidden_size: int | None = None

    def __post_init__(self):
        if self.attention not in ("gqa", "mla"):
            raise ValueError(f"{self.name}: attention must be gqa or mla, got {self.attention!r}")
        for field in ("layers", "heads"):
            if not isinstance(getattr(self, field), int) or getattr(self, field) < 1:
                raise ValueError(f"{self.name}: {field} must be a positive integer, got {getattr(self, field)!r}")
        if self.hidden_size is not None and (not isinstance(self.hidden_size, int) or self.hidden_size < 1):
            raise ValueError(f"{self.name}: hidden_size must be a positive integer, got {self.hidden_size!r}")
        needed = ("kv_heads", "head_dim") if self.attention == "gqa" else ("kv_lora_rank", "qk_rope_head_dim")
        for field in needed:
            value = getattr(self, field)
            if not isinstance(value, int) or value < (1 if field != "qk_rope_head_dim" else 0):
                raise ValueError(f"{self.name}: {self.attention} attention needs a positive {field}, got {value!r}")
        if self.attention == "gqa" and self.heads % self.kv_heads:
            raise ValueError(f"{self.name}: {self.heads} heads are not a multiple of {self.kv_heads} KV heads")
        if self.params < 0 or (self.active_params is not None and not 0 <= self.active_params <= self.params):
            raise ValueError(f"{self.name}: need 0 <= active_params <= params, got {self.active_params}, {self.params}")
        if self.experts:
            if not 1 <= self.experts_per_token <= self.experts:
                raise ValueError(f"{self.name}: need 1 <= experts_per_token <= experts, got {self.experts_per_token} "
                                 f"of {self.experts}")
            if not 0 <= self.dense_layers < self.layers or self.expert_params <= 0 or self.shared_experts < 0:
                raise ValueError(f"{self.name}: a MoE model needs 0 <= dense_layers < layers, expert_params > 0 and "
                                 "shared_experts >= 0")
            if self.routed_params > self.params:
                raise ValueError(f"{self.name}: its routed experts ({self.routed_params:.3g} parameters) exceed params "
                                 f"({self.params:.3g})")
        elif self.experts_per_token or self.shared_experts or self.mtp_layers:
            raise ValueError(f"{self.name}: experts_per_token, shared_experts and mtp_layers need experts > 0")
        if not 0 <= self.sliding_layers < self.layers or (self.sliding_layers and not (self.sliding_window or 0) >= 1):
            raise ValueError(f"{self.name}: need 0 <= sliding_layers < layers, and a positive sliding_window with "
                             f"them; got {self.sliding_layers}, {self.sliding_window}")

    def held_tokens(self, tokens: int) -> float:
        """Tokens the cache holds per layer, averaged over the layers, for a sequence of ``tokens`` (a hybrid model's
        sliding-window layers hold at most their window)."""
        full = self.layers - self.sliding_layers
        return (full * tokens + self.sliding_layers * min(tokens, self.sliding_window or tokens)) / self.layers

    def request_kv_bytes(self, prompt: int, generated: int, dtype: str, prompt_capacity: int | None = None,
                         cache_capacity: int | None = None, uncompressed_tail: int = 0, kv_format=None) -> float:
        """KV bytes one request's cache holds at its peak: a ``prompt``-token prompt of which the policy keeps at
        most ``prompt_capacity`` (the last ``uncompressed_tail`` tokens kept whole: question-agnostic compression),
        then every generated token but the last written, up to ``cache_capacity`` (None: no cap). Full-attention
        layers hold that; a hybrid model's sliding-window layers hold at most their window of all the tokens.
        ``kv_format`` (:class:`evalkit.compression.KVFormat`): the full-attention layers' tokens priced as it stores
        them (codes, scales, minima, the full-precision residual: at most the ``decoded`` tokens written)."""
        decoded = max(generated - 1, 0)
        head = prompt - uncompressed_tail
        kept = (head if prompt_capacity is None else min(head, prompt_capacity)) + uncompressed_tail + decoded
        kept = kept if cache_capacity is None else min(kept, cache_capacity)
        sliding = min(prompt + decoded, self.sliding_window) if self.sliding_layers else 0
        if kv_format is not None and self.attention != "mla":
            element = dtype_bytes(dtype)
            held = kv_format.held_bytes(kept * self.kv_heads, self.kv_heads, self.head_dim, self.head_dim, element,
                                        decoded)
            return (self.layers - self.sliding_layers) * held + \
                self.sliding_layers * sliding * self.values_per_token_per_layer() * element
        tokens = (self.layers - self.sliding_layers) * kept + self.sliding_layers * sliding
        return tokens * self.values_per_token_per_layer() * dtype_bytes(dtype)

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.experts else 0

    @property
    def routed_params(self) -> float:
        """Parameters of the routed experts (all MoE layers): the part a decode step reads only when activated."""
        return self.moe_layers * self.experts * self.expert_params

    @property
    def dense_params(self) -> float:
        """Parameters every decode step reads whatever the batch: attention, dense MLPs, shared experts, embeddings."""
        return self.params - self.routed_params

    @property
    def mtp_params(self) -> float:
        """One multi-token-prediction block: an MoE layer (its routed experts included) beside the model."""
        return self.mtp_layers * (self.dense_params / self.layers + self.experts * self.expert_params)

    @property
    def always_read_params(self) -> float:
        """Parameters every decode step reads whatever the batch: a MoE model's dense part, a dense model's
        ``read_params``."""
        return self.dense_params if self.experts else self.read_params

    def active_experts(self, tokens: int) -> float:
        """Expected distinct routed experts per MoE layer for ``tokens`` tokens routed together (0: dense model)."""
        return expected_active_experts(self.experts, self.experts_per_token, tokens) if self.experts else 0.0

    def routed_step_params(self, tokens: int) -> float:
        """Expected routed-expert parameters one decode step reads for ``tokens`` tokens routed together."""
        return self.moe_layers * self.active_experts(tokens) * self.expert_params

    def step_params(self, tokens: int) -> float:
        """Expected parameters one decode step reads for ``tokens`` tokens routed together: the dense part once, plus
        in every MoE layer the distinct experts those tokens activate (uniform routing)."""
        return self.always_read_params + self.routed_step_params(tokens)

    @property
    def read_params(self) -> float:
        return self.params if self.active_params is None else self.active_params

    def values_per_token_per_layer(self) -> int:
        """Cached values for one token in one layer, whole model (all KV heads)."""
        if self.attention == "mla":
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.kv_heads * self.head_dim

    def split_attention_values(self) -> tuple[int, int]:
        """Values per token and layer that attention split by token over the sockets exchanges: every head's query
        (gathered to every socket) and every head's partial output with its softmax max and sum (reduced back to the
        head's socket). MLA attends in its latent space (absorbed projections): queries of ``kv_lora_rank +
        qk_rope_head_dim``, outputs of ``kv_lora_rank``."""
        if self.attention == "mla":
            return self.heads * (self.kv_lora_rank + self.qk_rope_head_dim), self.heads * (self.kv_lora_rank + 2)
        return self.heads * self.head_dim, self.heads * (self.head_dim + 2)

    def kv_bytes_per_token(self, dtype: str = "bf16") -> float:
        return self.layers * self.values_per_token_per_layer() * dtype_bytes(dtype)

    def kv_heads_per_socket(self, tp: int) -> int | None:
        """KV heads each rank holds under head-wise TP (None for MLA, whose latent is not split by head)."""
        check_tp(self, tp)
        if self.attention == "mla":
            return None
        return max(1, self.kv_heads // tp)

    def kv_bytes_per_token_per_socket(self, tp: int, dtype: str = "bf16") -> float:
        """Per socket: GQA shards its KV heads (replicated when tp > kv_heads); MLA's latent is whole on every socket."""
        heads = self.kv_heads_per_socket(tp)
        if heads is None:
            return self.kv_bytes_per_token(dtype)
        return self.layers * 2 * heads * self.head_dim * dtype_bytes(dtype)


def expected_active_experts(experts: int, per_token: int, tokens: int) -> float:
    """Expected number of distinct experts ``tokens`` tokens activate when each picks ``per_token`` of ``experts``
    uniformly at random (without replacement), independently of the others: an expert is missed by one token with
    probability ``1 - per_token/experts``, so ``E[distinct] = experts * (1 - (1 - per_token/experts) ** tokens)``.
    Real routers are not uniform (DeepSeek balances load across experts, not within a batch); skewed routing
    activates fewer distinct experts, so this is the bandwidth-heavy side."""
    if tokens < 0 or not 1 <= per_token <= experts:
        raise ValueError(f"need tokens >= 0 and 1 <= per_token <= experts, got {tokens}, {per_token}, {experts}")
    return experts * -math.expm1(tokens * math.log1p(-per_token / experts)) if per_token < experts else float(experts)


def check_tp(model: ModelGeometry, tp: int) -> None:
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive integer, got {tp!r}")
    if model.heads % tp:
        raise ValueError(f"tp={tp} does not divide {model.name}'s {model.heads} attention heads")
    if model.attention == "gqa" and tp > model.kv_heads and tp % model.kv_heads:
        raise ValueError(f"tp={tp} > {model.kv_heads} KV heads must be a multiple of them (to replicate each evenly)")
    if model.attention == "gqa" and tp <= model.kv_heads and model.kv_heads % tp:
        raise ValueError(f"tp={tp} does not divide {model.name}'s {model.kv_heads} KV heads")


PRESETS = {
    "llama31_8b": ModelGeometry("llama31_8b", layers=32, heads=32, hidden_size=4096, kv_heads=8, head_dim=128,
                                params=8.03e9),
    "llama31_70b": ModelGeometry("llama31_70b", layers=80, heads=64, hidden_size=8192, kv_heads=8, head_dim=128,
                                 params=70.6e9),
    "llama31_405b": ModelGeometry("llama31_405b", layers=126, heads=128, hidden_size=16384, kv_heads=8, head_dim=128,
                                  params=405.9e9),
    # gpt-oss-120b (config.json of openai/gpt-oss-120b): 36 layers alternating a 128-token sliding window and full
    # attention, 64 query / 8 KV heads of 64; 128 experts of 3 x 2880 x 2880 parameters, 4 per token; MXFP4 experts.
    "gpt_oss_120b": ModelGeometry("gpt_oss_120b", layers=36, heads=64, hidden_size=2880, kv_heads=8, head_dim=64,
                                  params=116.8e9, experts=128, experts_per_token=4, expert_params=3 * 2880 * 2880,
                                  sliding_layers=18, sliding_window=128),
    # DeepSeek-V3/R1 (config.json of deepseek-ai/DeepSeek-R1; arXiv 2412.19437): 256 routed experts of
    # 3 x 7168 x 2048 parameters, 8 per token, 1 shared, the first 3 of 61 layers dense, one MTP block.
    "deepseek_r1_671b": ModelGeometry("deepseek_r1_671b", layers=61, heads=128, hidden_size=7168, attention="mla",
                                      kv_lora_rank=512, qk_rope_head_dim=64, params=671e9, experts=256,
                                      experts_per_token=8, shared_experts=1, dense_layers=3,
                                      expert_params=3 * 7168 * 2048, mtp_layers=1),
}


def _moe_fields(get) -> dict:
    """Mixture-of-experts fields from a config: DeepSeek (``n_routed_experts``), Mixtral (``num_local_experts``),
    Qwen-MoE (``num_experts``)."""
    experts = get("n_routed_experts") or get("num_local_experts") or get("num_experts") or 0
    if not experts:
        return {}
    width = get("moe_intermediate_size") or get("intermediate_size") or 0
    shared = get("n_shared_experts")
    if shared is None:  # Qwen2-MoE: one shared expert of its own width
        shared = 1 if get("shared_expert_intermediate_size") else 0
    return {"experts": int(experts), "experts_per_token": int(get("num_experts_per_tok") or 1),
            "shared_experts": int(shared), "dense_layers": int(get("first_k_dense_replace") or 0),
            "expert_params": 3 * (get("hidden_size") or 0) * width, "mtp_layers": int(get("num_nextn_predict_layers") or 0)}


def from_hf_config(config, name: str | None = None, params: float = 0.0, active_params: float | None = None) -> ModelGeometry:
    """Geometry from a transformers config object (or its dict): MLA when it has ``kv_lora_rank``; its experts when
    it is a mixture of experts (then ``params`` is needed to price its weights; 0 prices the cache alone)."""
    get = config_reader(config)
    name = name or get("_name_or_path") or get("model_type") or "model"
    shape = attention_shape(config)
    sliding = sum(kind == "sliding_attention" for kind in (get("layer_types") or []))
    moe = {**_moe_fields(get), **({"sliding_layers": sliding, "sliding_window": get("sliding_window")} if sliding else {})}
    if moe.get("experts") and moe["experts"] * moe["expert_params"] * (shape.layers - moe["dense_layers"]) > params:
        # No parameter count to split: price the cache (and whatever params says) as a dense model.
        moe = {k: v for k, v in moe.items() if k in ("sliding_layers", "sliding_window")}
    hidden = get("hidden_size")
    if shape.attention == "mla":
        return ModelGeometry(name, layers=shape.layers, heads=shape.heads, hidden_size=hidden, attention="mla",
                             kv_lora_rank=shape.kv_lora_rank, qk_rope_head_dim=shape.qk_rope_head_dim, params=params,
                             active_params=active_params, **moe)
    return ModelGeometry(name, layers=shape.layers, heads=shape.heads, hidden_size=hidden, kv_heads=shape.kv_heads,
                         head_dim=shape.head_dim, params=params, active_params=active_params, **moe)


def resolve_model(model) -> ModelGeometry:
    """A preset name, a ModelGeometry, a transformers config (object or dict), a config.json path or a hub id."""
    if isinstance(model, ModelGeometry):
        return model
    if isinstance(model, str):
        if model in PRESETS:
            return PRESETS[model]
        path = Path(model).expanduser()
        if path.is_dir():
            path = path / "config.json"
        if path.is_file():
            return from_hf_config(json.loads(path.read_text()), name=str(model))
        if model.count("/") == 1 and not model.startswith((".", "/", "~")):
            from transformers import AutoConfig

            try:
                return from_hf_config(AutoConfig.from_pretrained(model), name=model)
            except Exception as error:
                raise ValueError(f"could not read the config of {model!r}: {error}") from error
        raise ValueError(f"unknown model {model!r}: give a preset ({sorted(PRESETS)}), a config.json path or a hub id")
    if isinstance(model, dict) or hasattr(model, "num_hidden_layers"):
        return from_hf_config(model)
    raise TypeError(f"cannot read a model geometry from {type(model).__name__}")


def kv_bytes_per_token(model, dtype: str = "bf16") -> float:
    """KV-cache bytes one token costs across all layers (whole model, before any parallelism).

    ``model``: a preset name (``llama31_8b``, ``llama31_70b``, ``llama31_405b``, ``deepseek_r1_671b``), a transformers
    config object or dict, or a path to a config.json (or a hub id when the hub is reachable).
    """
    return resolve_model(model).kv_bytes_per_token(dtype)
