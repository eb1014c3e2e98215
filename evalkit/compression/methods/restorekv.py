"""RestoreKV (arXiv 2608.01247; kvpress ``RestoreKVPress``): learned restore tokens on top of KVzip."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import re
from typing import ClassVar

import torch

from ..learned_weights import LearnedFileError, bad_file, checked_tensor, json_object, safetensors_file, weights_file
from .kvzip import KVzip

EMBEDDINGS = "restore_embeddings.safetensors"
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."  # PEFT's name for the model an adapter's modules are found under
LORA_KEY = re.compile(r"^base_model\.model\.(.+)\.lora_([AB])\.weight$")


@dataclasses.dataclass(frozen=True)
class RestoreFiles:
    """A RestoreKV adapter as its publishers release it: the restore tokens' embeddings ``[n, d_model]`` and a PEFT
    LoRA adapter, per module (its path under the causal LM) ``(A [r, in], B [out, r], scaling)``."""

    source: str
    embeddings: torch.Tensor
    lora: dict[str, tuple[torch.Tensor, torch.Tensor, float]]

    @property
    def tokens(self) -> int:
        return self.embeddings.shape[0]


@dataclasses.dataclass
class RestoreKV(KVzip):
    """KVzip, then ``n`` learned restore tokens (kvpress: 8) run once after the prompt, at the positions after it,
    over every layer's whole prompt with a LoRA adapter active for that pass only; their keys and values stay in the
    cache after the tokens KVzip keeps, in every layer and KV head. They come out of the same budget: KVzip keeps
    ``num_layers * kv_heads * (capacity - n)`` tokens (per layer with ``layerwise``), so that every layer and head
    holds ``capacity`` slots on average, and decoding goes on from the position after the restore tokens. A prompt
    that fits its capacity is kept whole, without restore tokens (kvpress at ``compression_ratio`` 0).

    ``adapter``: a folder or Hub repository holding ``restore_embeddings.safetensors`` (``restore_embeddings``) and a
    PEFT LoRA adapter (``adapter_config.json``, ``adapter_model.safetensors``), as ``higokri/RestoreKV-<model>``
    publishes them; unset, that repository of the model's name (as kvpress finds it). Differences from kvpress 0.5.5:
    the pruned tokens leave the cache instead of being masked; a capacity of ``n`` or less is refused (kvpress then
    keeps the restore tokens alone, over its budget).
    """

    name: ClassVar[str] = "restorekv"
    appends: ClassVar[bool] = True  # tokens of its own after the prompt (:mod:`..reconstruction`)
    variant: ClassVar[str] = ""  # the published repository's suffix
    adapter: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.adapter:  # what the files say alone is checked as the method is built, before any model loads
            restore_files(self.adapter, self.name)

    def _files(self, config=None) -> RestoreFiles:
        source = self.adapter or getattr(self, "resolved", None)
        if source is None:
            name = str(getattr(config, "name_or_path", "") or "").rstrip("/").split("/")[-1]
            source = self.resolved = f"higokri/RestoreKV-{name}{self.variant}"
        return restore_files(source, self.name)

    def check_model(self, config) -> None:
        """The adapter (unset: the one published for the model's name) read and held to the model's width, and the
        capacity to its restore tokens, before the model's weights load."""
        super().check_model(config)
        try:
            files = self._files(config)
        except LearnedFileError as error:
            if self.adapter:
                raise
            raise LearnedFileError(f"{self.name}: method.adapter=null names the adapter published for the model, "
                                   f"{self.resolved}, and " + str(error).removeprefix(f"{self.name}: ")) from None
        self._check_fit(files, config.hidden_size)

    def _check_fit(self, files: RestoreFiles, hidden: int) -> None:
        """The capacity leaves room beside the restore tokens, and their embeddings are the model's ``hidden`` wide."""
        if self.capacity <= files.tokens:
            raise ValueError(f"{self.name}: capacity {self.capacity} leaves no room beside its {files.tokens} restore "
                             f"tokens per layer and KV head; give it more than {files.tokens}")
        if files.embeddings.shape[1] != hidden:
            raise bad_file(self.name, files.source, f"{EMBEDDINGS} holds embeddings of width "
                                                    f"{files.embeddings.shape[1]}, the model's are {hidden} wide")

    def kept_context(self, real_len: torch.Tensor) -> torch.Tensor:
        over = real_len > self.capacity  # these rows take the restore tokens out of their budget
        if not bool(over.any()):
            return real_len.clamp(max=self.capacity)
        return torch.where(over, self.capacity - self._files().tokens, real_len)

    def appended_embeddings(self, model, n: int) -> torch.Tensor | None:
        """The embeddings ``[count, d_model]`` of the tokens appended after an ``n``-token prompt (None: none), in
        the model's dtype, on its input's device."""
        if n <= self.capacity:
            return None
        files = self._files(model.config)
        self._check_fit(files, model.config.hidden_size)
        weight = model.get_input_embeddings().weight
        return files.embeddings.to(weight.device, weight.dtype)

    @contextlib.contextmanager
    def appending(self, model):
        """The LoRA adapter active (each target's output plus ``B(A(x)) * scaling``, computed as PEFT does) while
        the appended tokens run."""
        files = self._files(model.config)
        handles = []
        try:
            for path, (down, up, scaling) in files.lora.items():
                module = _target(model, path, down, up, files.source, self.name)
                weight = module.weight
                lora = (down.to(weight.device), up.to(weight.device), scaling)
                handles.append(module.register_forward_hook(functools.partial(_add_lora, lora)))
            yield
        finally:
            for handle in handles:
                handle.remove()


@dataclasses.dataclass
class RestoreKVPlus(RestoreKV):
    """RestoreKV over KVzip+ (kvpress ``RestoreKVPress(kvzip_plus_normalization=True)``, adapters
    ``higokri/RestoreKV-<model>_plus``)."""

    name: ClassVar[str] = "restorekv_plus"
    normalized: ClassVar[bool] = True
    variant: ClassVar[str] = "_plus"


def _add_lora(lora: tuple, module, inputs, output: torch.Tensor) -> torch.Tensor:
    """PEFT's LoRA ``Linear.forward``: ``result + lora_B(lora_A(x)) * scaling`` in the adapter's dtype, then the
    base layer's."""
    down, up, scaling = lora
    x = inputs[0].to(down.dtype)
    return (output + torch.nn.functional.linear(torch.nn.functional.linear(x, down), up) * scaling).to(output.dtype)


def _target(model, path: str, down: torch.Tensor, up: torch.Tensor, source: str, method: str):
    """The model's linear layer ``path`` that an adapter's ``A`` and ``B`` fit."""
    try:
        module = model.get_submodule(path)
    except AttributeError:
        raise bad_file(method, source, f"{ADAPTER_WEIGHTS} adapts {path}, which the model has not") from None
    if not isinstance(module, torch.nn.Linear):
        raise bad_file(method, source, f"{ADAPTER_WEIGHTS} adapts {path}, a {type(module).__name__} in the model, "
                                       "not a linear layer")
    if (module.in_features, module.out_features) != (down.shape[1], up.shape[0]):
        raise bad_file(method, source, f"{ADAPTER_WEIGHTS} adapts {path} as {down.shape[1]} -> {up.shape[0]} "
                                       f"features; the model's is {module.in_features} -> {module.out_features}")
    return module


# Settings of adapter_config.json that change what the adapter computes, with the value a plain LoRA has.
PLAIN_LORA = {"use_dora": False, "fan_in_fan_out": False, "lora_bias": False, "bias": "none", "modules_to_save": None,
              "rank_pattern": {}, "alpha_pattern": {}}


@functools.lru_cache(maxsize=4)
def restore_files(source: str, method: str) -> RestoreFiles:
    """The restore tokens and LoRA adapter of ``source`` (a folder or Hub repository), checked: the embeddings a
    finite ``[n, d]`` matrix, the config a plain LoRA's (``peft_type`` LORA, ``r``, ``lora_alpha``; no DoRA, no
    trained biases, no per-module ranks), every module's ``lora_A [r, in]`` with its ``lora_B [out, r]``."""
    path = weights_file(source, EMBEDDINGS, method)
    tensors = safetensors_file(path, method)
    if "restore_embeddings" not in tensors:
        raise bad_file(method, path, f"holds no tensor 'restore_embeddings' (it holds {sorted(tensors)})")
    embeddings = checked_tensor(tensors["restore_embeddings"], "restore_embeddings", path, method)
    if embeddings.dim() != 2 or 0 in embeddings.shape:
        raise bad_file(method, path, f"restore_embeddings has shape {list(embeddings.shape)}, not [tokens, width]")
    rank, scaling = _lora_config(weights_file(source, ADAPTER_CONFIG, method), method)
    path = weights_file(source, ADAPTER_WEIGHTS, method)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in safetensors_file(path, method).items():
        match = LORA_KEY.match(key)
        if match is None:
            raise bad_file(method, path, f"holds {key}, which is not a LoRA A or B weight of a module under "
                                         f"{PREFIX[:-1]}")
        pairs.setdefault(match.group(1), {})[match.group(2)] = checked_tensor(tensor, key, path, method).float()
    if not pairs:
        raise bad_file(method, path, "holds no LoRA weights")
    lora = {}
    for module, pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise bad_file(method, path, f"has lora_{set('AB').difference(pair).pop()} of {module} missing")
        down, up = pair["A"], pair["B"]
        if down.dim() != 2 or up.dim() != 2 or down.shape[0] != rank or up.shape[1] != rank:
            raise bad_file(method, path, f"{module}: lora_A {list(down.shape)} and lora_B {list(up.shape)} must be "
                                         f"[r, in] and [out, r] with r = {rank} ({ADAPTER_CONFIG})")
        lora[module] = (down, up, scaling)
    return RestoreFiles(source, embeddings.float(), lora)


def _lora_config(path, method: str) -> tuple[int, float]:
    """``r`` and PEFT's ``scaling`` (``lora_alpha / r``; ``/ sqrt(r)`` with ``use_rslora``) of a plain LoRA's
    ``adapter_config.json``."""
    config = json_object(path, method)
    if config.get("peft_type") != "LORA":
        raise bad_file(method, path, f"peft_type is {config.get('peft_type')!r}; a RestoreKV adapter is a LORA one")
    for key, plain in PLAIN_LORA.items():
        value = config.get(key)
        if value is not None and value != plain and (isinstance(plain, str) or bool(value)):
            raise bad_file(method, path, f"{key} is {value!r}; evalkit applies plain LoRA adapters only "
                                         f"({key} {plain!r})")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise bad_file(method, path, f"r must be a whole number >= 1, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise bad_file(method, path, f"lora_alpha must be a number, got {alpha!r}")
    return rank, alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
