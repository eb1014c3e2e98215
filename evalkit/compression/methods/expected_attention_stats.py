"""ExpectedAttention from precomputed query statistics (Devoto et al., "Expected Attention", arXiv 2510.00636, 2025;
kvpress 0.5.5 ``ExpectedAttentionStatsPress``)."""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import torch

from ..learned_weights import bad_file, json_object, safetensors_tensor, weights_file, whole_number
from ..views import PrefillView
from .expected_attention import ExpectedAttention, average_future_rotation

METHOD = "expected_attention_stats"
HUB_HINT = ("alessiodevoto/exp_att_stats_<model with / as _>_kmfoda_booksum_100_1000_4, e.g. "
            "alessiodevoto/exp_att_stats_meta-llama_Llama-3.1-8B-Instruct_kmfoda_booksum_100_1000_4")


@dataclasses.dataclass
class ExpectedAttentionStats(ExpectedAttention):
    """ExpectedAttention whose query mean ``mu`` and covariance ``S`` per layer and query head are read from a file
    (measured once on a calibration set) instead of the prompt's own queries: as kvpress'
    ``ExpectedAttentionStatsPress``, ``R mu`` and ``R S R^T`` with ``R`` RoPE averaged over the ``n_future_positions``
    after the prompt, then ExpectedAttention's score (softmax over the keys after the first ``sink``, mean over each KV
    group, ``(score + epsilon) * ||v||`` when ``use_vnorm``; the covariance term when ``use_covariance``).

    ``stats``: a Hub repository or local folder as kvpress' ``ExpectedAttentionStats`` (``PyTorchModelHubMixin``)
    saves it: ``config.json`` (``num_layers``, ``num_heads``: the query heads, ``head_dim``, ...) and
    ``model.safetensors`` with ``query_mean`` ``[layers, heads, head_dim]`` and ``query_cov`` ``[layers, heads,
    head_dim, head_dim]``. kvpress finds the repository from the model's name when no folder is given; here it is
    named (a method does not know its model). Differences from kvpress: the statistics and products are fp32 (kvpress
    casts the statistics to the model's dtype); future positions start at each prompt's own length (kvpress: the
    padded batch's); the sink is forced kept rather than scored ``max + 1``. Reads no query: chunked prefill keeps none.
    """

    name: ClassVar[str] = "expected_attention_stats"
    stats: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.stats:  # what the file says alone is checked as the method is built, before any model loads
            query_stats(self.stats)

    def prefill_queries(self) -> int:
        return 0

    def check_layers(self, num_layers: int) -> None:
        mean, _ = self._stats()
        if mean.shape[0] != num_layers:
            raise bad_file(METHOD, stats_path(self.stats), f"has statistics for {mean.shape[0]} layers, the model has "
                                                           f"{num_layers}")

    def _stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.stats:
            raise ValueError(f"{METHOD} needs its query statistics: set method.stats to their Hub repository "
                             f"({HUB_HINT}) or a local folder")
        return query_stats(self.stats)

    def score(self, view: PrefillView) -> torch.Tensor:
        mean, covariance = self._stats()
        keys = view.keys.float()
        dim = keys.shape[-1]
        q_heads = view.query.shape[1]
        layer = view.layer_idx
        if mean.shape[0] <= layer or mean.shape[1:] != (q_heads, dim):
            raise bad_file(METHOD, stats_path(self.stats), f"query_mean is {list(mean.shape)}, the model's layer "
                                                           f"{layer} has {q_heads} query heads of {dim}")
        mean, covariance = (t[layer].to(keys.device, torch.float32) for t in (mean, covariance))
        # RoPE's cos and sin come in the dtype of the tensor handed to the rotary: fp32, not a bf16 model's
        fp32 = dataclasses.replace(view, query=view.query[:, :, :0].float())
        rotation = average_future_rotation(fp32, self.n_future_positions)  # [B, D, D]
        mean = torch.einsum("hd,bed->bhe", mean, rotation)  # R mu, [B, Hq, D]
        if self.use_covariance:
            covariance = torch.einsum("bij,hjk,blk->bhil", rotation, covariance, rotation)  # R S R^T
        return self.expected_scores(view, keys, mean, covariance)

def stats_path(source: str) -> str:
    return str(weights_file(source, "model.safetensors", METHOD))


@functools.lru_cache(maxsize=8)
def query_stats(source: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(query_mean [L, H, D], query_cov [L, H, D, D])`` of kvpress' statistics ``source``, checked against its
    ``config.json`` and each other (cached: every layer reads them)."""
    config_path = weights_file(source, "config.json", METHOD)
    config = json_object(config_path, METHOD)
    shape = tuple(whole_number(config, key, config_path, METHOD, low=1) for key in ("num_layers", "num_heads",
                                                                                       "head_dim"))
    path = weights_file(source, "model.safetensors", METHOD)
    mean = safetensors_tensor(source, "model.safetensors", "query_mean", METHOD)
    covariance = safetensors_tensor(source, "model.safetensors", "query_cov", METHOD)
    if tuple(mean.shape) != shape:
        raise bad_file(METHOD, path, f"query_mean has shape {list(mean.shape)}, its config.json says "
                                     f"[num_layers, num_heads, head_dim] = {list(shape)}")
    if tuple(covariance.shape) != (*shape, shape[-1]):
        raise bad_file(METHOD, path, f"query_cov has shape {list(covariance.shape)}, expected "
                                     f"{[*shape, shape[-1]]} ([num_layers, num_heads, head_dim, head_dim])")
    return mean.float(), covariance.float()
