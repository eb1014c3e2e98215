"""Learned weights a method reads (Q-Filters, DuoAttention head patterns, ...), in their publishers' own file formats,
from a local folder or a Hugging Face Hub repository. A file that is missing, does not parse, or whose values do not
mean what its format says (a negative size, a NaN, a shape its config or the model disagrees with) is a
:class:`LearnedFileError`: one line naming the file and what is wrong, raised when the method is built (what the file
says alone) or when it meets the model (its layers at ``check_layers``, its heads and widths at the first prompt)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from evalkit.core.errors import ConfigError, one_line


class LearnedFileError(ConfigError):
    """A method's learned-weight file that cannot be used as it is; the message names the file and what is wrong."""


def bad_file(method: str, path: Path | str, what: str) -> LearnedFileError:
    return LearnedFileError(f"{method}: {path}: {what}")


def weights_file(source: str, filename: str, method: str) -> Path:
    """``filename`` of ``source``: a local folder, or a Hub repository id (downloaded to the Hub cache; offline, from
    it)."""
    folder = Path(source).expanduser()
    if folder.is_dir():
        path = folder / filename
        if not path.is_file():
            raise LearnedFileError(f"{method}: {folder} has no {filename}")
        return path
    if folder.exists() or source.startswith((".", "/", "~")) or source.count("/") != 1:
        raise LearnedFileError(f"{method}: {source!r} is neither a folder nor a Hugging Face repository id")
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(hf_hub_download(source, filename))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise LearnedFileError(f"{method}: cannot read {filename} of {source} ({first}); download it once online "
                               "or give a local folder") from None


def json_object(path: Path, method: str) -> dict:
    """The JSON object (a mapping) ``path`` holds."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise bad_file(method, path, "is not text (UTF-8 JSON)") from None
    except json.JSONDecodeError as error:
        raise bad_file(method, path, f"is not valid JSON: {error.msg} at line {error.lineno}, column "
                                     f"{error.colno}") from None
    if not isinstance(config, dict):
        raise bad_file(method, path, f"holds a JSON {type(config).__name__}, not an object of settings")
    return config


def whole_number(config: dict, key: str, path: Path, method: str, low: int = 0) -> int:
    """``config[key]``, which must be a whole number >= ``low``."""
    if key not in config:
        raise bad_file(method, path, f"has no {key}")
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise bad_file(method, path, f"{key} must be a whole number >= {low}, got {json.dumps(value)}")
    return value


def checked_tensor(tensor, name: str, path: Path, method: str, shape: tuple[int, ...] | None = None):
    """``tensor`` if it is of floating point, of ``shape`` (when given) and finite throughout."""
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise bad_file(method, path, f"{name} is a {type(tensor).__name__}, not a tensor")
    if not tensor.is_floating_point():
        raise bad_file(method, path, f"{name} holds {str(tensor.dtype).removeprefix('torch.')}, not floating point")
    if shape is not None and tuple(tensor.shape) != tuple(shape):
        raise bad_file(method, path, f"{name} has shape {list(tensor.shape)}, expected {list(shape)}")
    finite = torch.isfinite(tensor)
    if not bool(finite.all()):
        where = [int(i) for i in (~finite).nonzero()[0]]
        raise bad_file(method, path, f"{name} holds {float(tensor[tuple(where)])} at {where}; learned weights "
                                     "must be finite numbers")
    return tensor


def safetensors_file(path: Path, method: str) -> dict:
    """Every tensor of the safetensors file ``path``."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        raise bad_file(method, path, f"does not read as safetensors ({one_line(error)})") from None


@functools.lru_cache(maxsize=16)
def safetensors_tensor(source: str, filename: str, key: str, method: str):
    """One tensor of a safetensors file of ``source`` (cached: every layer reads it), floating point and finite."""
    from safetensors import SafetensorError, safe_open

    path = weights_file(source, filename, method)
    try:
        with safe_open(str(path), framework="pt") as handle:
            if key not in handle.keys():
                raise bad_file(method, path, f"holds no tensor {key!r} (it holds {sorted(handle.keys())})")
            tensor = handle.get_tensor(key)
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        if isinstance(error, LearnedFileError):
            raise
        raise bad_file(method, path, f"does not read as safetensors ({one_line(error)})") from None
    return checked_tensor(tensor, key, path, method)
