"""Fast KVzip (Kim et al., arXiv 2601.17668; kvpress ``FastKVzipPress``, layer-wise)."""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import ClassVar

import torch

from evalkit.method_settings import setting

from ..learned_weights import weights_file
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

    def prompt_slots(self, n: int, kv_heads: int) -> int:
        return min(n, kv_heads * self.capacity)  # one head may take its layer's whole budget

    def check_layers(self, num_layers: int) -> None:
        layers = len(_gates(self._source()))
        if layers != num_layers:
            raise ValueError(f"FastKVzip.gates {self.gates} has gates for {layers} layers, the model has {num_layers}")

    def _source(self) -> str:
        if not self.gates:
            raise ValueError("fastkvzip needs its learned gates: set method.gates to Jang-Hyun/Fast-KVzip:<model>/"
                             "q<group>_dim16_sink16.pt or a local .pt file")
        return self.gates

    def score(self, view: PrefillView) -> torch.Tensor:
        gate = _gates(self._source())[view.layer_idx]
        scores = _gate_scores(gate, view.hidden.float())
        if scores.shape[1] != view.keys.shape[1]:
            raise ValueError(f"FastKVzip.gates {self.gates} scores {scores.shape[1]} KV heads, the model has "
                             f"{view.keys.shape[1]}")
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


@functools.lru_cache(maxsize=4)
def _gates(source: str) -> list[dict]:
    import numpy as np

    repo, _, filename = source.partition(":") if ":" in source and not source.startswith(("/", ".")) else ("", "", "")
    path = weights_file(repo, filename, "fastkvzip") if repo else source
    # What the released files pickle besides tensors (numpy arrays), as kvpress allows them.
    allowed = [(np._core.multiarray._reconstruct, "numpy.core.multiarray._reconstruct"), np.ndarray, np.dtype,
               np.dtypes.Float64DType, np.dtypes.Float32DType]
    with torch.serialization.safe_globals(allowed):
        try:
            loaded = torch.load(str(path), weights_only=True, map_location="cpu")
        except FileNotFoundError:
            raise FileNotFoundError(f"fastkvzip: no gate file {source}") from None
    if not isinstance(loaded, dict) or not isinstance(loaded.get("module"), list):
        raise ValueError(f"fastkvzip: {source} is not a Fast-KVzip gate file (a dict with a 'module' list)")
    sink = re.search(r"sink(\d+)", str(source))
    for gate in loaded["module"]:
        if sink and gate["k_base"].shape[2] != int(sink.group(1)):
            raise ValueError(f"fastkvzip: {source} names sink {sink.group(1)}, its k_base has {gate['k_base'].shape[2]}")
    return loaded["module"]
