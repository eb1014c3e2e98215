"""Fast KVzip (Kim et al., arXiv 2601.17668; kvpress ``FastKVzipPress``, layer-wise)."""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path
from typing import ClassVar

import torch

from evalkit.core.method_settings import setting

from ..learned_weights import LearnedFileError, bad_file, checked_tensor, weights_file
from ..views import PrefillView
from .adakv import pooled_counts
from .base import PromptScoring


@dataclasses.dataclass
class FastKVzip(PromptScoring):
    """KVzip's importance predicted by learned gates from each token's hidden state, per layer and KV head (kvpress
    ``FastKVzipGate``: ``sigmoid``-like ``1 / (1 + sum_s exp(k_base_s q - k q - b))`` with RMS-normed 16-wide gate
    queries and keys, averaged over the group), the first ``sink`` tokens and the last ``max(1, int(n *
    window_ratio))`` kept. Each layer keeps its ``kv_heads * capacity`` best tokens across its heads (kvpress'
    ``layerwise=True``; its default pools the whole model's scores, which needs every layer scored before any is
    compressed). kvpress masks; here the pruned tokens leave the cache.

    ``gates``: a ``.pt`` file as its publishers release them (``Jang-Hyun/Fast-KVzip`` on the Hub,
    ``<model>/q<group>_dim16_sink16.pt``: ``{"module": [one state dict per layer]}``), as ``REPO:FILE`` or a path.
    """

    name: ClassVar[str] = "fastkvzip"
    per_head: ClassVar[bool] = True
    reads_hidden_states: ClassVar[bool] = True
    latent_refusal: ClassVar[str] = "its gates are learned against per-head keys"
    gates: str | None = None
    sink: int = setting(4, low=0)
    window_ratio: float = setting(0.02, low=0, high=1)

    def prefill_queries(self) -> int:
        return 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.gates:  # what the file says alone is checked as the method is built, before any model loads
            _gates(self.gates)

    def prompt_slots(self, n: int, kv_heads: int) -> int:
        return min(n, kv_heads * self.capacity)  # one head may take its layer's whole budget

    def check_layers(self, num_layers: int) -> None:
        layers = len(_gates(self._source()))
        if layers != num_layers:
            raise bad_file("fastkvzip", self.gates, f"has gates for {layers} layers, the model has {num_layers}")

    def _source(self) -> str:
        if not self.gates:
            raise ValueError("fastkvzip needs its learned gates: set method.gates to Jang-Hyun/Fast-KVzip:<model>/"
                             "q<group>_dim16_sink16.pt or a local .pt file")
        return self.gates

    def score(self, view: PrefillView) -> torch.Tensor:
        gate = _gates(self._source())[view.layer_idx]
        heads, features = gate["k_base"].shape[0], gate["k_proj.weight"].shape[1]
        if (heads, features) != (view.keys.shape[1], view.hidden.shape[-1]):
            raise bad_file("fastkvzip", self.gates, f"gates map {features} features to {heads} KV heads, the model "
                                                    f"has {view.hidden.shape[-1]} features and {view.keys.shape[1]} "
                                                    "KV heads")
        scores = _gate_scores(gate, view.hidden.float())
        # kvpress' window, scored 1.0 (above any gate's score): each row's last max(1, int(n * window_ratio)) tokens
        real = view.key_valid.sum(dim=1, keepdim=True)
        rank = view.key_valid.long().cumsum(dim=1) - 1
        window = (rank >= real - (real * self.window_ratio).long().clamp(min=1)) & view.key_valid
        return scores.masked_fill(window[:, None], float("inf"))

    def allocate(self, scores: torch.Tensor, budget: torch.Tensor, layer_idx: int = 0) -> torch.Tensor:
        return pooled_counts(scores, budget)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))  # Qwen3RMSNorm


def _gate_scores(gate: dict, hidden: torch.Tensor) -> torch.Tensor:
    """``FastKVzipGate.forward`` over a batch: ``[B, n, d_model]`` -> ``[B, kv_heads, n]``."""
    gate = {name: weight.to(hidden.device, torch.float32) for name, weight in gate.items()}
    width = gate["q_norm.weight"].shape[-1]
    heads = gate["k_proj.weight"].shape[0] // width
    batch, n, _ = hidden.shape
    queries = torch.nn.functional.linear(hidden, gate["q_proj.weight"].float(), gate["q_proj.bias"].float())
    keys = torch.nn.functional.linear(hidden, gate["k_proj.weight"].float())
    queries = _rms(queries.view(batch, n, heads, -1, width), gate["q_norm.weight"].float())  # [B, n, H, G, w]
    keys = _rms(keys.view(batch, n, heads, 1, width), gate["k_norm.weight"].float())  # [B, n, H, 1, w]
    logit = (keys * queries).sum(-1) / width ** 0.5 + gate["b"].float()[:, 0]  # [B, n, H, G]
    base = torch.einsum("hsw,bnhgw->bnhsg", gate["k_base"].float()[:, 0], queries) / width ** 0.5  # [B, n, H, S, G]
    score = 1 / (1 + (base - logit[:, :, :, None]).exp().sum(dim=3))  # [B, n, H, G]
    return score.mean(-1).transpose(1, 2)


GATE_KEYS = ("q_proj.weight", "q_proj.bias", "k_proj.weight", "q_norm.weight", "k_norm.weight", "k_base", "b")
GATE_SIZES = {"G": "query group", "w": "gate width", "S": "sink", "H": "KV heads", "d": "features"}


@functools.lru_cache(maxsize=4)
def _gates(source: str) -> list[dict]:
    """The gates of ``source`` (``REPO:FILE`` or a path), checked: one state dict per layer with exactly
    ``FastKVzipGate``'s tensors, floating point and finite, of shapes that agree (``k_base [H, 1, S, w]``, ``b [H, 1,
    G]``, ``q_proj [H G w, d]`` with its bias, ``k_proj [H w, d]``, the norms ``[w]``), the same ``H`` and ``d`` in
    every layer, and ``G``, ``w`` and ``S`` as the file's name gives them (``q<G>_dim<w>_sink<S>.pt``)."""
    import numpy as np

    repo, _, filename = source.partition(":") if ":" in source and not source.startswith(("/", ".")) else ("", "", "")
    path = weights_file(repo, filename, "fastkvzip") if repo else Path(source).expanduser()
    if not path.is_file():
        raise LearnedFileError(f"fastkvzip: no gate file {source}" + (" (it is a folder)" if path.is_dir() else ""))
    # What the released files pickle besides tensors (numpy arrays), as kvpress allows them.
    allowed = [(np._core.multiarray._reconstruct, "numpy.core.multiarray._reconstruct"), np.ndarray, np.dtype,
               np.dtypes.Float64DType, np.dtypes.Float32DType]
    with torch.serialization.safe_globals(allowed):
        try:
            loaded = torch.load(str(path), weights_only=True, map_location="cpu")
        except Exception as error:  # a damaged file fails in many ways (unpickling, zip reading, EOF, OS)
            raise bad_file("fastkvzip", source, f"does not read as a torch.save file ({_load_failure(error)})") \
                from None
    if not isinstance(loaded, dict) or not isinstance(loaded.get("module"), list):
        raise bad_file("fastkvzip", source, "is not a Fast-KVzip gate file (a dict with a 'module' list)")
    if not loaded["module"]:
        raise bad_file("fastkvzip", source, "has gates for no layer (its 'module' list is empty)")
    named = {key: int(match.group(1)) for key, prefix in (("G", "q"), ("w", "dim"), ("S", "sink"))
             if (match := re.search(rf"(?:^|_){prefix}(\d+)(?:_|\.)", path.name))}  # q<G>_dim<w>_sink<S>.pt
    first = {}
    for layer, gate in enumerate(loaded["module"]):
        found = _layer_sizes(gate, layer, source)
        for given, reference in ((named, "its name gives"), (first, "module[0] has")):
            for key, size in given.items():
                if found[key] != size:
                    raise bad_file("fastkvzip", source, f"module[{layer}] has {GATE_SIZES[key]} {found[key]}, "
                                                        f"{reference} {size}")
        first = first or found
    return loaded["module"]


def _layer_sizes(gate, layer: int, source: str) -> dict:
    """One layer's gate checked (exactly ``FastKVzipGate``'s tensors, finite, of shapes that agree, no size 0): its
    sizes ``{"G", "w", "S", "H", "d"}``."""
    if not isinstance(gate, dict):
        raise bad_file("fastkvzip", source, f"module[{layer}] is a {type(gate).__name__}, not a state dict")
    absent = [key for key in GATE_KEYS if key not in gate]
    if absent:
        raise bad_file("fastkvzip", source, f"module[{layer}] has no {absent[0]} (a FastKVzipGate has "
                                            f"{list(GATE_KEYS)})")
    extra = sorted(set(gate) - set(GATE_KEYS))
    if extra:
        raise bad_file("fastkvzip", source, f"module[{layer}] holds {extra[:3]}, which a FastKVzipGate does not")
    for key in GATE_KEYS:
        checked_tensor(gate[key], f"module[{layer}].{key}", source, "fastkvzip")
    base, bias, k_proj = gate["k_base"], gate["b"], gate["k_proj.weight"]
    if base.dim() != 4 or base.shape[1] != 1 or bias.dim() != 3 or bias.shape[1] != 1 or k_proj.dim() != 2:
        raise bad_file("fastkvzip", source, f"module[{layer}]: k_base {list(base.shape)}, b {list(bias.shape)} "
                                            f"and k_proj.weight {list(k_proj.shape)} must be [H, 1, sink, w], "
                                            "[H, 1, G] and [H w, d]")
    heads, _, sink, width = base.shape
    group, features = bias.shape[2], k_proj.shape[1]
    expected = {"q_proj.weight": (heads * group * width, features), "q_proj.bias": (heads * group * width,),
                "k_proj.weight": (heads * width, features), "q_norm.weight": (width,), "k_norm.weight": (width,)}
    for key, shape in expected.items():
        if tuple(gate[key].shape) != shape:
            raise bad_file("fastkvzip", source, f"module[{layer}].{key} has shape {list(gate[key].shape)}; its "
                                                f"k_base [{heads}, 1, {sink}, {width}] and b [{heads}, 1, "
                                                f"{group}] make it {list(shape)}")
    found = {"G": group, "w": width, "S": sink, "H": heads, "d": features}
    empty = [GATE_SIZES[key] for key, size in found.items() if size == 0]
    if empty:  # sink 0 would score every token 1, whatever its hidden state
        raise bad_file("fastkvzip", source, f"module[{layer}] has {empty[0]} 0: its gates score nothing")
    return found


def _load_failure(error: BaseException) -> str:
    """Why ``torch.load`` failed, in one short line: the weights-only unpickler's reason (not its advice), or the
    first sentence of what the reader said."""
    text = " ".join(str(error).split())
    if "WeightsUnpickler error:" in text:
        reason = re.split(r" Check the documentation| Please use", text.split("WeightsUnpickler error:", 1)[1])[0]
        return f"the weights-only unpickler refused it: {reason.strip()}"
    first = re.split(r"(?<=\.) ", text, maxsplit=1)[0] if text else "no data"
    return f"cut short or damaged: {type(error).__name__}: {first}"
