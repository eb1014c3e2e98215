"""Learned weights a method reads (Q-Filters, DuoAttention head patterns, ...), in their publishers' own file formats,
from a local folder or a Hugging Face Hub repository. A missing file is one line naming what is missing and where it
was looked for."""

from __future__ import annotations

import functools
from pathlib import Path


def weights_file(source: str, filename: str, method: str) -> Path:
    """``filename`` of ``source``: a local folder, or a Hub repository id (downloaded to the Hub cache; offline, from
    it)."""
    folder = Path(source).expanduser()
    if folder.is_dir():
        path = folder / filename
        if not path.is_file():
            raise FileNotFoundError(f"{method}: {folder} has no {filename}")
        return path
    if folder.exists() or source.startswith((".", "/", "~")) or source.count("/") != 1:
        raise FileNotFoundError(f"{method}: {source!r} is neither a folder nor a Hugging Face repository id")
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(hf_hub_download(source, filename))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise FileNotFoundError(f"{method}: cannot read {filename} of {source} ({first}); download it once online "
                                "or give a local folder") from None


@functools.lru_cache(maxsize=16)
def safetensors_tensor(source: str, filename: str, key: str, method: str):
    """One tensor of a safetensors file of ``source`` (cached: every layer reads it)."""
    from safetensors import safe_open

    path = weights_file(source, filename, method)
    with safe_open(str(path), framework="pt") as handle:
        if key not in handle.keys():
            raise ValueError(f"{method}: {path} holds no tensor {key!r} (it holds {sorted(handle.keys())})")
        return handle.get_tensor(key)
