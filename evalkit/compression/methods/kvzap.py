"""KVzap (arXiv 2601.07891; kvpress ``KVzapPress``)."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import ClassVar, NamedTuple

import torch
from torch.nn import functional as F

from ..learned_weights import bad_file, checked_tensor, json_object, safetensors_file, weights_file, whole_number
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

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.weights:  # what the files say alone is checked as the method is built, before any model loads
            _surrogate(self.weights)

    def prefill_queries(self) -> int:
        return 0

    def check_layers(self, num_layers: int) -> None:
        modules = _surrogate(self._source()).config["n_modules"]
        if modules != num_layers:
            raise bad_file("kvzap", _surrogate(self._source()).config_file,
                           f"has surrogates for {modules} layers (n_modules), the model has {num_layers}")

    def _source(self) -> str:
        if not self.weights:
            raise ValueError("kvzap needs its learned surrogates: set method.weights to their Hub repository "
                             "(nvidia/KVzap-mlp-<model>, e.g. nvidia/KVzap-mlp-Llama-3.1-8B-Instruct) or a local folder")
        return self.weights

    def score(self, view: PrefillView) -> torch.Tensor:
        config, tensors, config_file = _surrogate(self._source())
        if view.hidden is None:
            raise RuntimeError("kvzap scores from hidden states, and this prefill recorded none")
        if view.hidden.shape[-1] != config["input_dim"] or view.keys.shape[1] != config["output_dim"]:
            raise bad_file("kvzap", config_file, f"maps {config['input_dim']} features to {config['output_dim']} "
                                                 f"heads; the model has {view.hidden.shape[-1]} features and "
                                                 f"{view.keys.shape[1]} KV heads")
        x = view.hidden.float()
        prefix = f"layers.{view.layer_idx}."

        def linear(name: str, x: torch.Tensor) -> torch.Tensor:
            weight, bias = (tensors[prefix + name + part].to(x.device, torch.float32) for part in ("weight", "bias"))
            return F.linear(x, weight, bias)

        out = linear("", x) if config.get("hidden_dim") is None else linear("2.", F.gelu(linear("0.", x)))
        return out.transpose(1, 2)  # [B, Hkv, n]


class Surrogates(NamedTuple):
    """KVzap's surrogates as ``save_pretrained`` writes them: ``config.json``'s sizes, ``model.safetensors``'
    tensors."""

    config: dict
    tensors: dict[str, torch.Tensor]
    config_file: Path


@functools.lru_cache(maxsize=4)
def _surrogate(source: str) -> Surrogates:
    """The surrogates of ``source``, checked: sizes that are whole numbers >= 1, exactly the tensors they describe
    (``layers.<i>.weight``/``bias``, or ``layers.<i>.0.*`` and ``layers.<i>.2.*`` with a ``hidden_dim``), each of
    its shape, floating point and finite."""
    config_path = weights_file(source, "config.json", "kvzap")
    config = json_object(config_path, "kvzap")
    missing = [key for key in ("input_dim", "output_dim", "n_modules") if key not in config]
    if missing:
        raise bad_file("kvzap", config_path, f"has no {missing[0]} (not a KVzap model)")
    sizes = {key: whole_number(config, key, config_path, "kvzap", low=1) for key in ("input_dim", "output_dim",
                                                                                     "n_modules")}
    hidden = config.get("hidden_dim")
    if hidden is not None:
        hidden = whole_number(config, "hidden_dim", config_path, "kvzap", low=1)
    inputs, outputs = sizes["input_dim"], sizes["output_dim"]
    shapes = {"": (outputs, inputs)} if hidden is None else {"0.": (hidden, inputs), "2.": (outputs, hidden)}
    expected = {}
    for layer in range(sizes["n_modules"]):
        for name, (rows, columns) in shapes.items():
            expected[f"layers.{layer}.{name}weight"] = (rows, columns)
            expected[f"layers.{layer}.{name}bias"] = (rows,)
    weights_path = weights_file(source, "model.safetensors", "kvzap")
    tensors = safetensors_file(weights_path, "kvzap")
    kind = "linear" if hidden is None else f"MLP (hidden_dim {hidden})"
    absent = [name for name in expected if name not in tensors]
    if absent:
        raise bad_file("kvzap", weights_path, f"holds no tensor {absent[0]!r} ({len(absent)} of the "
                                              f"{len(expected)} that {config_path.name}'s {sizes['n_modules']} "
                                              f"{kind} surrogates need are missing)")
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise bad_file("kvzap", weights_path, f"holds tensors {config_path.name}'s {sizes['n_modules']} {kind} "
                                              f"surrogates do not have: {extra[:3]}")
    for name, shape in expected.items():
        checked_tensor(tensors[name], name, weights_path, "kvzap", shape)
    return Surrogates({**config, **sizes, "hidden_dim": hidden}, tensors, config_path)
