"""KVzap (arXiv 2601.07891; kvpress ``KVzapPress``)."""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import ClassVar

import torch
from torch.nn import functional as F

from ..learned_weights import weights_file
from ..views import PrefillView
from .base import PromptScoring


@dataclasses.dataclass
class KVzap(PromptScoring):
    """Score every prompt token from the hidden state that made it: a learned surrogate of KVzip's score per layer,
    ``[d_model] -> [kv_heads]``, linear or a two-layer GELU MLP (kvpress ``KVzapPress.score``). Needs no attention.
    kvpress pairs it with a threshold (``threshold`` over ``kvzap``: DMSPress); alone it keeps ``capacity`` tokens.

    ``weights``: the publishers' repository (``nvidia/KVzap-{mlp,linear}-<model>`` on the Hub, as kvpress derives it,
    e.g. ``nvidia/KVzap-mlp-Llama-3.1-8B-Instruct``) or a local folder in its format (transformers'
    ``save_pretrained`` of kvpress' ``KVzapModel``: ``config.json`` with ``input_dim``, ``output_dim``,
    ``n_modules``, ``hidden_dim`` (null: linear), and ``model.safetensors`` with ``layers.<i>.weight``/``bias`` or
    ``layers.<i>.0.*`` and ``layers.<i>.2.*``).
    """

    name: ClassVar[str] = "kvzap"
    reads_hidden_states: ClassVar[bool] = True
    latent_refusal: ClassVar[str] = "its surrogates are learned against per-head keys"
    weights: str | None = None

    def prefill_queries(self) -> int:
        return 0

    def check_layers(self, num_layers: int) -> None:
        modules = _surrogate(self._source())[0]["n_modules"]
        if modules != num_layers:
            raise ValueError(f"KVzap.weights {self.weights} has surrogates for {modules} layers, the model has "
                             f"{num_layers}")

    def _source(self) -> str:
        if not self.weights:
            raise ValueError("kvzap needs its learned surrogates: set method.weights to their Hub repository "
                             "(nvidia/KVzap-mlp-<model>, e.g. nvidia/KVzap-mlp-Llama-3.1-8B-Instruct) or a local folder")
        return self.weights

    def score(self, view: PrefillView) -> torch.Tensor:
        config, tensors = _surrogate(self._source())
        if view.hidden is None:
            raise RuntimeError("kvzap scores from hidden states, and this prefill recorded none")
        if view.hidden.shape[-1] != config["input_dim"] or view.keys.shape[1] != config["output_dim"]:
            raise ValueError(f"KVzap.weights {self.weights} maps {config['input_dim']} features to "
                             f"{config['output_dim']} heads; the model has {view.hidden.shape[-1]} and "
                             f"{view.keys.shape[1]}")
        x = view.hidden.float()
        prefix = f"layers.{view.layer_idx}."

        def linear(name: str, x: torch.Tensor) -> torch.Tensor:
            weight, bias = (tensors[prefix + name + part].to(x.device, torch.float32) for part in ("weight", "bias"))
            return F.linear(x, weight, bias)

        out = linear("", x) if config.get("hidden_dim") is None else linear("2.", F.gelu(linear("0.", x)))
        return out.transpose(1, 2)  # [B, Hkv, n]


@functools.lru_cache(maxsize=4)
def _surrogate(source: str) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    config = json.loads(weights_file(source, "config.json", "kvzap").read_text())
    missing = [key for key in ("input_dim", "output_dim", "n_modules") if key not in config]
    if missing:
        raise ValueError(f"kvzap: {source}'s config.json has no {missing[0]} (not a KVzap model)")
    return config, load_file(str(weights_file(source, "model.safetensors", "kvzap")))
