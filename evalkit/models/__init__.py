"""Models: where a name points (hub id, local folder, ``builtin:NAME``, ``gguf:PATH``), the device, loading with the
weights checked against the config, and the ids generation stops on, read from a checkpoint's files."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

import evalkit.compression as ec
from evalkit.models import gguf as gguf_models
from evalkit.models.tokenizer_probe import check_tokenizer

ASSETS = Path(__file__).parents[1] / "assets"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_pretrained(pretrained: str) -> str:
    """``builtin:NAME`` is a model shipped in evalkit/assets; ``gguf:PACKAGE/FILE.gguf`` a GGUF file in an installed
    package, converted once to a float checkpoint (:mod:`evalkit.models.gguf`); anything else is a hub id or a local
    path."""
    if pretrained.startswith(gguf_models.PREFIX):
        return gguf_models.converted(pretrained)
    if pretrained.startswith("builtin:"):
        path = ASSETS / pretrained.removeprefix("builtin:")
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"no built-in model at {path} (train it with `python -m evalkit.models.train_tiny --out {path}`)")
        return str(path)
    return pretrained


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def load_model(pretrained: str, dtype: str = "float32", device: str = "auto", attn_implementation: str = "sdpa",
               revision: str | None = None, device_map: str | dict | None = None):
    """Model and tokenizer from a hub id (at ``revision``), a local path or ``builtin:NAME``; left padding for
    batched prompts; a tokenizer that loses a probe text is refused (:mod:`evalkit.models.tokenizer_probe`).
    ``device_map`` (accelerate's: ``"auto"``, ``"balanced"``, or a dict of module names to devices) spreads the layers
    over the machine's GPUs instead of putting the model on ``device``; each layer's compressed cache then lives on
    that layer's device."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    path = resolve_pretrained(pretrained)
    tokenizer = AutoTokenizer.from_pretrained(path, revision=revision)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    check_tokenizer(tokenizer, pretrained, path)  # a tokenizer_class that does not fit its vocabulary, before the weights
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(AutoConfig.from_pretrained(path, revision=revision)), None)
    if attn_implementation == "sdpa" and not getattr(model_class, "_supports_sdpa", True):
        attn_implementation = "eager"  # e.g. gpt-oss, whose learned attention sinks sdpa does not compute
    check_weight_files(path)
    placement = {"device_map": device_map} if device_map is not None else {}
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], attn_implementation=attn_implementation,
                                                       revision=revision, output_loading_info=True, **placement)
    check_loaded_weights(pretrained, info)
    if device_map is None:
        model = model.to(resolve_device(device))
    else:
        ec.model_spec.layer_devices(model)  # refuses layers offloaded to meta/disk
    return model.eval(), tokenizer


def check_weight_files(path: str) -> None:
    """Every safetensors file of a local checkpoint has a readable header (a truncated or overwritten file is named,
    before any weight loads)."""
    from safetensors import SafetensorError, safe_open

    folder = Path(path)
    if not folder.is_dir():
        return
    for file in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as handle:
                handle.keys()
        except (SafetensorError, OSError) as error:
            raise ValueError(f"{file}: not a readable safetensors file ({error})") from None


def check_loaded_weights(pretrained: str, info: dict) -> None:
    """A checkpoint whose weights do not match its config (layers it lacks would run with random weights) is an
    error before anything runs, naming what is missing or unexpected."""
    problems = []
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        keys = sorted(str(k) for k in info.get(kind) or ())
        if keys:
            shown = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
            problems.append(f"{len(keys)} {kind.replace('_keys', '')} weight(s) ({shown})")
    if problems:
        raise ValueError(f"the weights of {pretrained} do not match its config: {'; '.join(problems)}")


def stop_token_ids_of(pretrained: str, revision: str | None = None) -> list[int]:
    """:func:`evalkit.compression.stop_token_ids` of a checkpoint from its files (generation config, else the model
    config, and tokenizer), without loading its weights."""
    from transformers import GenerationConfig

    path = resolve_pretrained(pretrained)
    try:
        generation = GenerationConfig.from_pretrained(path, revision=revision)
    except OSError:  # no generation_config.json: transformers derives one from the model config
        generation = GenerationConfig.from_model_config(AutoConfig.from_pretrained(path, revision=revision))
    model = type("Checkpoint", (), {"generation_config": generation})
    return ec.stop_token_ids(model, AutoTokenizer.from_pretrained(path, revision=revision))


def load_spec_prefill(settings: dict, dtype: str = "float32", device: str = "auto"):
    """Speculative prefill with its draft model loaded: ``settings`` are :class:`evalkit.compression.SpecPrefill`'s,
    the draft named by ``draft_model`` (a hub id or path)."""
    settings = dict(settings)
    draft, draft_tokenizer = load_model(str(settings.pop("draft_model")), dtype=dtype, device=device,
                                        attn_implementation="eager")
    return ec.SpecPrefill(draft=draft, draft_tokenizer=draft_tokenizer, **settings)
