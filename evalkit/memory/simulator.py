"""What a deployment needs per socket in SRAM, HBM and DDR, whether it fits, and what it decodes per second.

Placement model (each assumption a field of :class:`Deployment` or :class:`Hardware`, with its source in conf/):
  * weights: sharded evenly over the ``tp`` sockets, in HBM first (the part every step reads, then the routed experts
    of a mixture of experts), the overflow in DDR (none on a GPU);
  * KV cache: in HBM, ``batch x cached tokens x per-socket KV bytes per token``: GQA shards its KV heads over the
    sockets; an MLA latent is whole on every socket (``kv_sharding: head``) or split by token over them
    (``kv_sharding: sequence``: each socket attends over its share of every sequence, the partial results combined);
  * on-chip working set: the KV of one layer for the running batch, which must fit in ``sram_kv_share`` of the SRAM
    (the rest holds weight tiles and activations); a GPU (``sram_holds_kv: false``) reads KV from HBM instead;
  * ``hbm_reserve``: share of HBM kept free for activations, program and runtime buffers.

Decode model: one step reads the weights the batch needs once (the dense part, and in every MoE layer the distinct
experts the batch's tokens activate, :func:`~evalkit.memory.geometry.expected_active_experts`, each from the tier it
lives in) and the batch's whole KV cache from HBM, then sends what tensor parallelism needs between the sockets
(:mod:`~evalkit.memory.interconnect`: all-reduces of the activations, priced on the hardware's ``link_bandwidth`` and
``link_latency``). Step time = bytes / bandwidth per tier, summed, divided by the hardware's ``decode_efficiency`` (the
share of peak memory bandwidth decoding reaches), plus the communication; ``unlooped_slowdown`` times that without
kernel looping. Multi-token prediction (``mtp_tokens`` drafts per step, each accepted with ``mtp_acceptance`` given
the previous one was) runs the model on ``1 + mtp_tokens`` tokens per sequence and the MTP block once per draft; it
emits ``1 + a + a^2 + ...`` tokens per step. Tokens/s = batch x tokens per step / step time. Compute and the overlap
of tiers and links are not modelled: decoding is taken as bound by memory and links.
"""

from __future__ import annotations

import dataclasses
import math
import re

import pandas as pd

from evalkit.core import budget as budget_grammar

from . import interconnect
from .geometry import (
    ModelGeometry,
    check_tp,
    dtype_bytes,
    resolve_model,
)

_BYTES = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_SECONDS = {"s": 1, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def _quantity(value, units: dict, what: str, example: str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(\S+?)\s*", str(value))
        if not match or match.group(2) not in units:
            raise ValueError(f"cannot read a {what} from {value!r} (use e.g. {example})")
        number = float(match.group(1)) * units[match.group(2)]
    if number < 0 or math.isnan(number):
        raise ValueError(f"{what}s must be non-negative, got {value!r}")
    return number


def parse_bytes(value) -> float:
    """``"520MiB"``, ``"64GiB"``, ``"1.5TiB"``, ``"141GB"``, ``"1.6TB/s"`` (bytes per second) or a plain number."""
    units = {**_BYTES, **{f"{unit}/s": factor for unit, factor in _BYTES.items()}}
    return _quantity(value, units, "size", "520MiB, 64GiB, 1.6TB/s")


def parse_seconds(value) -> float:
    """``"0.6us"``, ``"600ns"``, ``"2ms"`` or a plain number of seconds."""
    return _quantity(value, _SECONDS, "time", "0.6us, 600ns, 2ms")


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One socket (or GPU) and its node. ``ddr`` 0: a single tier of HBM (GPUs). ``link_bandwidth``: bytes per second
    each way between a socket and the next on the ring tensor parallelism uses; ``link_latency``: seconds per hop."""

    name: str
    sram: float
    hbm: float
    ddr: float
    hbm_bandwidth: float
    ddr_bandwidth: float
    sockets_per_node: int
    link_bandwidth: float
    link_latency: float
    sram_holds_kv: bool = True  # SN40L streams each layer's KV through SRAM; a GPU reads it from HBM (no such limit)
    decode_efficiency: float = 1.0  # share of peak memory bandwidth a decode step reaches (kernel looping on SN40L)
    unlooped_slowdown: float = 1.0  # how much slower decoding is without kernel looping (1: not applicable)

    @classmethod
    def from_config(cls, cfg: dict) -> Hardware:
        name = cfg.get("name", "?")
        unknown = set(cfg) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"hardware {name} has unknown setting(s) {sorted(unknown)}")

        def setting(key, read, default=None):
            if key not in cfg and default is None:
                raise ValueError(f"hardware spec {name} lacks {key!r}")
            try:
                return read(cfg.get(key, default))
            except ValueError as error:
                raise ValueError(f"hardware {name}: {key}: {error}") from None

        return cls(
            name=setting("name", str), sram=setting("sram", parse_bytes), hbm=setting("hbm", parse_bytes),
            ddr=setting("ddr", parse_bytes, 0), hbm_bandwidth=setting("hbm_bandwidth", parse_bytes),
            ddr_bandwidth=setting("ddr_bandwidth", parse_bytes, 0), sockets_per_node=setting("sockets_per_node", int),
            link_bandwidth=setting("link_bandwidth", parse_bytes), link_latency=setting("link_latency", parse_seconds),
            sram_holds_kv=setting("sram_holds_kv", bool, True),
            decode_efficiency=setting("decode_efficiency", float, 1.0),
            unlooped_slowdown=setting("unlooped_slowdown", float, 1.0),
        )

    def __post_init__(self):
        if self.hbm <= 0 or self.hbm_bandwidth <= 0 or self.sockets_per_node < 1:
            raise ValueError(f"hardware {self.name}: hbm, hbm_bandwidth and sockets_per_node must be positive")
        if self.ddr > 0 and self.ddr_bandwidth <= 0:
            raise ValueError(f"hardware {self.name}: a DDR tier needs a positive ddr_bandwidth")
        if not self.link_bandwidth > 0 or not self.link_latency >= 0:
            raise ValueError(f"hardware {self.name}: need link_bandwidth > 0 and link_latency >= 0")
        if not 0 < self.decode_efficiency <= 1 or self.unlooped_slowdown < 1:
            raise ValueError(f"hardware {self.name}: need 0 < decode_efficiency <= 1 and unlooped_slowdown >= 1")


@dataclasses.dataclass(frozen=True)
class Deployment:
    model: ModelGeometry
    hardware: Hardware
    tp: int
    batch: int
    context: int
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    activation_dtype: str = "bf16"  # what the tensor-parallel collectives carry
    sram_kv_share: float = 0.5
    hbm_reserve: float = 0.05
    kv_sharding: str = "head"  # head: MLA's latent whole on every socket; sequence: split by token over the sockets
    kernel_looping: bool = True  # the decode loop fused into one kernel call (SN40L; arXiv 2410.23668)
    mtp_tokens: int = 0  # multi-token prediction: drafted tokens per step (DeepSeek-V3/R1 have one MTP block)
    mtp_acceptance: float = 0.85  # chance a draft is accepted given the previous one was
    name: str = "deployment"
    kv_format: object | None = None  # quantized KV (evalkit.compression.KVFormat): each token priced as it stores it

    def __post_init__(self):
        check_tp(self.model, self.tp)
        if self.tp > self.hardware.sockets_per_node:
            raise ValueError(f"tp={self.tp} needs more sockets than a {self.hardware.name} node has "
                             f"({self.hardware.sockets_per_node})")
        if not isinstance(self.batch, int) or self.batch < 1 or not isinstance(self.context, int) or self.context < 1:
            raise ValueError(f"batch and context must be positive integers, got {self.batch!r}, {self.context!r}")
        if not 0 < self.sram_kv_share <= 1 or not 0 <= self.hbm_reserve < 1:
            raise ValueError("need 0 < sram_kv_share <= 1 and 0 <= hbm_reserve < 1")
        dtype_bytes(self.weight_dtype), dtype_bytes(self.kv_dtype), dtype_bytes(self.activation_dtype)
        if self.tp > 1 and self.model.hidden_size is None:
            raise ValueError(f"tp={self.tp} needs {self.model.name}'s hidden_size to price its all-reduces")
        if self.kv_sharding not in ("head", "sequence"):
            raise ValueError(f"kv_sharding must be head or sequence, got {self.kv_sharding!r}")
        if not isinstance(self.mtp_tokens, int) or self.mtp_tokens < 0 or not 0 <= self.mtp_acceptance <= 1:
            raise ValueError("need an integer mtp_tokens >= 0 and 0 <= mtp_acceptance <= 1")
        if self.mtp_tokens and not self.model.mtp_layers:
            raise ValueError(f"mtp_tokens={self.mtp_tokens} but {self.model.name} has no multi-token-prediction block")

    @property
    def kv_bytes_per_token(self) -> float:
        """KV bytes one cached token costs each socket (under a quantized format: its codes and their share of the
        scales and minima; its residual of recent full-precision tokens, per sequence, is left out here)."""
        if self.kv_sharding == "sequence":
            full = self.model.kv_bytes_per_token(self.kv_dtype) / self.tp
        else:
            full = self.model.kv_bytes_per_token_per_socket(self.tp, self.kv_dtype)
        if self.kv_format is None or self.model.attention == "mla":
            return full
        dim, element = self.model.head_dim, dtype_bytes(self.kv_dtype)
        return full * self.kv_format.token_bytes(dim, dim, element) / (2 * dim * element)

    @property
    def tokens_per_step(self) -> float:
        """Tokens a decode step emits per sequence: 1, plus each draft while all before it were accepted."""
        return 1 + sum(self.mtp_acceptance ** i for i in range(1, self.mtp_tokens + 1))

    @property
    def slowdown(self) -> float:
        """How much slower the whole step runs for want of kernel looping (1 with it)."""
        return 1.0 if self.kernel_looping else self.hardware.unlooped_slowdown

    @property
    def efficiency(self) -> float:
        """The share of peak memory bandwidth the step's memory reads reach."""
        return self.hardware.decode_efficiency / self.slowdown

    @classmethod
    def from_config(cls, cfg: dict, hardware: dict | Hardware) -> Deployment:
        hardware = hardware if isinstance(hardware, Hardware) else Hardware.from_config(hardware)
        known = {f.name for f in dataclasses.fields(cls)} - {"model", "hardware"}
        unknown = set(cfg) - known - {"model"}
        if unknown:
            raise ValueError(f"deployment {cfg.get('name', '?')} has unknown setting(s) {sorted(unknown)}")
        if "model" not in cfg:
            raise ValueError(f"deployment {cfg.get('name', '?')} names no model")
        return cls(model=resolve_model(cfg["model"]), hardware=hardware, **{k: cfg[k] for k in known if k in cfg})


def capacity_for_budget(budget: str | None, context: int) -> int | None:
    """The cache capacity a budget means at this context (:mod:`evalkit.core.budget`'s grammar); None = full."""
    return budget_grammar.capacity(budget, context)


@dataclasses.dataclass(frozen=True)
class Verdict:
    deployment: Deployment
    capacity: int | None
    cached_tokens: int
    weights: float
    weights_hbm: float
    weights_ddr: float
    kv: float
    working_set: float
    fits_sram: bool
    fits_hbm: bool
    fits_ddr: bool
    max_batch: int
    onchip_ratio: float
    decode_tokens_per_s: float  # at the deployment's batch (NaN where weights fit no tier)
    step_seconds: float = math.nan
    active_experts: float = 0.0  # expected distinct routed experts per MoE layer and step (0: a dense model)
    read_hbm: float = 0.0  # bytes one decode step reads from HBM per socket (weights + KV)
    read_ddr: float = 0.0  # ... and from DDR (overflowed weights)
    comm_seconds: float = 0.0  # of step_seconds, the tensor-parallel communication (before any kernel-looping slowdown)

    @property
    def fits(self) -> bool:
        return self.fits_sram and self.fits_hbm and self.fits_ddr


def price(deployment: Deployment, capacity: int | None = None) -> Verdict:
    """Bytes per socket per tier for ``deployment`` with a cache of ``capacity`` tokens (None: the full context), and
    its decode speed at its batch."""
    d, hw, model = deployment, deployment.hardware, deployment.model
    if capacity is not None and (not isinstance(capacity, int) or capacity < 1):
        raise ValueError(f"capacity must be a positive integer or None, got {capacity!r}")
    tokens = d.context if capacity is None else min(capacity, d.context)
    # A hybrid model's sliding-window layers hold their window whatever the budget; the largest layer sets the
    # on-chip working set.
    per_sequence = model.held_tokens(tokens) * d.kv_bytes_per_token
    unit = dtype_bytes(d.weight_dtype) / d.tp  # bytes per parameter per socket
    mtp = model.mtp_layers if d.mtp_tokens else 0
    mtp_dense = mtp * model.dense_params / model.layers
    dense = (model.dense_params + mtp_dense) * unit  # read whatever the batch
    routed = (model.routed_params + mtp * model.experts * model.expert_params) * unit
    weights = dense + routed
    hbm_free = hw.hbm * (1 - d.hbm_reserve)
    kv = d.batch * per_sequence
    dense_hbm = max(0.0, min(dense, hbm_free - kv))
    routed_hbm = max(0.0, min(routed, hbm_free - kv - dense_hbm))
    weights_hbm = dense_hbm + routed_hbm
    weights_ddr = weights - weights_hbm
    sram_budget = hw.sram * d.sram_kv_share
    working_set = d.batch * tokens * d.kv_bytes_per_token / model.layers
    # Largest batch: KV within free HBM, weight overflow within DDR, one layer's KV within the SRAM share.
    limits = [hbm_free / per_sequence, (hbm_free + hw.ddr - weights) / per_sequence]
    if hw.sram_holds_kv:
        limits.append(sram_budget * model.layers / (tokens * d.kv_bytes_per_token))
    max_batch = max(0, math.floor(min(limits)))
    # One step: the dense part once (a dense model's read_params: all of it, or its active share), the experts the
    # batch activates (the model runs 1 + mtp_tokens tokens per sequence; the MTP block runs once per draft on the
    # batch), each tier in proportion to what it holds; and the batch's KV from HBM.
    routed_tokens = d.batch * (1 + d.mtp_tokens)
    drafted = d.mtp_tokens * mtp * model.active_experts(d.batch) * model.expert_params
    dense_read = (model.always_read_params + d.mtp_tokens * mtp_dense) * unit
    routed_read = (model.routed_step_params(routed_tokens) + drafted) * unit
    share = lambda part, whole: part / whole if whole else 1.0  # noqa: E731
    read_hbm = dense_read * share(dense_hbm, dense) + routed_read * share(routed_hbm, routed) + kv
    read_ddr = dense_read + routed_read + kv - read_hbm
    reads = read_hbm / hw.hbm_bandwidth + (read_ddr / hw.ddr_bandwidth if read_ddr > 0 and hw.ddr_bandwidth else 0.0)
    if read_ddr > 1e-6 * read_hbm and not hw.ddr_bandwidth:
        reads = math.nan  # weights that fit no tier (a GPU without DDR): no estimate rather than a wrong one
    comm = interconnect.step_seconds(d)
    step = (reads / hw.decode_efficiency + comm) * d.slowdown
    return Verdict(
        deployment=d, capacity=capacity, cached_tokens=tokens, weights=weights, weights_hbm=weights_hbm,
        weights_ddr=weights_ddr, kv=kv, working_set=working_set,
        fits_sram=working_set <= sram_budget or not hw.sram_holds_kv,
        fits_hbm=kv <= hbm_free, fits_ddr=weights_ddr <= hw.ddr, max_batch=max_batch,
        onchip_ratio=d.context / tokens, decode_tokens_per_s=d.batch * d.tokens_per_step / step, step_seconds=step,
        active_experts=model.active_experts(routed_tokens), read_hbm=read_hbm, read_ddr=max(0.0, read_ddr),
        comm_seconds=comm,
    )


def best_throughput(deployment: Deployment, capacity: int | None = None) -> tuple[int, float]:
    """The batch (up to the largest that fits) with the most tokens per second at ``capacity``, and that rate;
    ``(0, nan)`` when not even one sequence fits. Spilling experts to DDR can make a larger batch slower, so every
    batch is tried."""
    largest = price(deployment, capacity).max_batch
    best = (0, math.nan)
    for batch in range(1, largest + 1):
        rate = price(dataclasses.replace(deployment, batch=batch), capacity).decode_tokens_per_s
        if not math.isnan(rate) and (math.isnan(best[1]) or rate > best[1]):
            best = (batch, rate)
    return best


def throughput_table(deployment: Deployment, budgets=("full", "2x", "4x", "8x", "16x"), batches=None) -> pd.DataFrame:
    """Decode tokens/s over budgets x batches, one row each: ``fits`` False (and NaN tokens/s) past the largest batch
    that fits. ``batches`` default: powers of two up to the largest batch any budget fits, plus each budget's largest
    and best batch."""
    plans = {str(b): capacity_for_budget(str(b), deployment.context) for b in budgets}
    limits = {b: price(deployment, c).max_batch for b, c in plans.items()}
    bests = {b: best_throughput(deployment, c) for b, c in plans.items()}
    if batches is None:
        top = max([1, *limits.values()])
        batches = {2**i for i in range(int(math.log2(top)) + 1)} | set(limits.values()) | {b for b, _ in bests.values()}
    rows = []
    for budget, capacity in plans.items():
        for batch in sorted(int(b) for b in batches if int(b) >= 1):
            verdict = price(dataclasses.replace(deployment, batch=batch), capacity)
            fits = batch <= limits[budget]
            rows.append({
                "model": deployment.model.name, "hardware": deployment.hardware.name, "tp": deployment.tp,
                "context": deployment.context, "budget": budget, "capacity": verdict.cached_tokens, "batch": batch,
                "fits": fits, "tokens_per_s": verdict.decode_tokens_per_s if fits else math.nan,
                "step_ms": verdict.step_seconds * 1e3 if fits else math.nan,
                "comm_ms": verdict.comm_seconds * 1e3 if fits else math.nan, "active_experts": verdict.active_experts,
                "read_hbm_bytes": verdict.read_hbm, "read_ddr_bytes": verdict.read_ddr,
                "max_batch": limits[budget], "best_batch": bests[budget][0], "best_tokens_per_s": bests[budget][1],
                "weight_dtype": deployment.weight_dtype, "kv_sharding": deployment.kv_sharding,
                "kernel_looping": deployment.kernel_looping, "mtp_tokens": deployment.mtp_tokens,
                "tokens_per_step": deployment.tokens_per_step, "efficiency": deployment.efficiency,
            })
    return pd.DataFrame(rows)


ASSUMPTIONS = (
    "weights sharded over tp sockets, HBM first (always-read part, then routed experts) then DDR; KV cache in HBM; "
    "on-chip working set = one layer's KV for the batch within sram_kv_share of SRAM; hbm_reserve of HBM kept free; "
    "decode step = bytes read / bandwidth per tier (dense weights once, the distinct experts the batch activates under "
    "uniform routing, the batch's whole KV) / decode_efficiency, plus tensor-parallel communication on a ring of tp "
    "sockets (two activation all-reduces per layer, the embedding's and the sampling's; attention split by token also "
    "gathers queries and scatters partial outputs) at link_bandwidth and link_latency per hop; no compute or overlap"
)


def report(deployment: Deployment, budget: str | None = None) -> pd.DataFrame:
    """Per-socket report of ``deployment`` at ``budget`` (None/"full", "4x", "tokens_N"): one row per memory tier."""
    verdict = price(deployment, capacity_for_budget(budget, deployment.context))
    d, hw = deployment, deployment.hardware
    hbm_free = hw.hbm * (1 - d.hbm_reserve)
    tiers = [
        ("sram", hw.sram * d.sram_kv_share, 0.0, verdict.working_set, verdict.fits_sram),
        ("hbm", hbm_free, verdict.weights_hbm, verdict.kv, verdict.fits_hbm),
        ("ddr", hw.ddr, verdict.weights_ddr, 0.0, verdict.fits_ddr),
    ]
    common = {
        "model": d.model.name, "hardware": hw.name, "tp": d.tp, "batch": d.batch, "context": d.context,
        "budget": budget or "full", "capacity": verdict.cached_tokens, "weight_dtype": d.weight_dtype,
        "kv_dtype": d.kv_dtype, "kv_bits": d.kv_format.bits if d.kv_format is not None else 16,
        "fits": verdict.fits, "max_batch": verdict.max_batch,
        "onchip_ratio": verdict.onchip_ratio, "decode_tokens_per_s": verdict.decode_tokens_per_s,
        "kv_sharding": d.kv_sharding, "kernel_looping": d.kernel_looping, "mtp_tokens": d.mtp_tokens,
    }
    return pd.DataFrame([
        {**common, "tier": tier, "available_bytes": available, "weights_bytes": weights, "kv_bytes": kv,
         "used_bytes": weights + kv, "headroom_bytes": available - weights - kv, "tier_fits": fits}
        for tier, available, weights, kv, fits in tiers
    ])


def sweep(deployment: Deployment, budgets=("full", "2x", "4x", "8x", "16x"), batches=(1,)) -> pd.DataFrame:
    """:func:`report` over budgets and batch sizes, one table."""
    frames = [report(dataclasses.replace(deployment, batch=int(b)), budget) for budget in budgets for b in batches]
    return pd.concat(frames, ignore_index=True)
