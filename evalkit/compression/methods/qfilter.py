"""Q-Filters (Godey et al., arXiv 2503.02812; kvpress ``QFilterPress``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from ..learned_weights import bad_file, safetensors_tensor, weights_file
from ..views import PrefillView
from .base import PromptScoring


@dataclasses.dataclass
class QFilter(PromptScoring):
    """Keep the keys that project least onto a learned per-head direction: score ``-(f_l,h . k)``, the filters
    ``f`` ``[layers, kv_heads, head_dim]`` learned per model (kvpress ``QFilterPress.score``).

    ``filters``: the publishers' repository (``nthngdy/<model>_qfilt`` on the Hub, as kvpress derives it from the
    model's name, e.g. ``nthngdy/Llama-3.1-8B-Instruct_qfilt``) or a local folder holding its ``model.safetensors``
    (tensor ``q_filters``, the format of ``huggingface_hub.PyTorchModelHubMixin``). Needs no attention.
    """

    name: ClassVar[str] = "qfilter"
    latent_refusal: ClassVar[str] = "its filters are learned against per-head keys"
    filters: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.filters:  # what the file says alone is checked as the method is built, before any model loads
            self._filters()

    def prefill_queries(self) -> int:
        return 0

    def check_layers(self, num_layers: int) -> None:
        filters = self._filters()
        if filters.shape[0] != num_layers:
            raise bad_file("qfilter", self._file(), f"has filters for {filters.shape[0]} layers, the model has "
                                                    f"{num_layers}")

    def _file(self) -> str:
        return str(weights_file(self.filters, "model.safetensors", "qfilter"))

    def _filters(self) -> torch.Tensor:
        if not self.filters:
            raise ValueError("qfilter needs its learned filters: set method.filters to their Hub repository "
                             "(nthngdy/<model>_qfilt, e.g. nthngdy/Llama-3.1-8B-Instruct_qfilt) or a local folder")
        filters = safetensors_tensor(self.filters, "model.safetensors", "q_filters", "qfilter")
        if filters.dim() != 3 or 0 in filters.shape:
            raise bad_file("qfilter", self._file(), f"q_filters must be [layers, kv_heads, head_dim], got "
                                                    f"{list(filters.shape)}")
        return filters

    def score(self, view: PrefillView) -> torch.Tensor:
        layer = self._filters()[view.layer_idx]
        if layer.shape != (view.keys.shape[1], view.keys.shape[3]):
            raise bad_file("qfilter", self._file(), f"layer {view.layer_idx} has filters {list(layer.shape)} "
                                                    f"([kv_heads, head_dim]), the model's keys are "
                                                    f"[{view.keys.shape[1]}, {view.keys.shape[3]}]")
        return -(layer.to(view.keys.device, torch.float32)[None, :, None] * view.keys.float()).sum(dim=-1)
