"""The errors evalkit raises for its user (a config that cannot run, a run that cannot go on): each message is one
line meant for the user."""

from __future__ import annotations

from pathlib import Path


class ConfigError(ValueError):
    """A run config that cannot run; the message is one line meant for the user."""


class RunError(RuntimeError):
    """A run that cannot go on (missing model, unwritable results dir, bad data); the message is one line."""


class Interrupted(RuntimeError):
    """Ctrl-C during a run; ``kept`` generations are in the progress file and a restart resumes from them."""

    def __init__(self, kept: int):
        super().__init__(f"interrupted: {kept} generations kept; run the same command again to resume" if kept else
                         "interrupted before any generation was kept; run the same command again to start")
        self.kept = kept


class InvalidCombination(ConfigError):
    """A method/budget pairing that does not exist (full with a budget, a compressing method without one).

    A sweep over methods x budgets meets these by construction; it skips them, a single run refuses them."""

def model_unavailable(pretrained: str, error: OSError) -> str:
    """One line for a model that cannot be loaded: for a hub id that is not cached here, where to put its weights."""
    is_path = pretrained.startswith(("/", ".", "~")) or Path(pretrained).exists()
    if is_path and not Path(pretrained).expanduser().exists():
        return f"model {pretrained}: no such file or folder"
    if is_path or ":" in pretrained:  # a local folder, or builtin:/gguf: (their loaders say what is missing)
        return f"model {pretrained}: {one_line(error)}"
    return (f"model {pretrained} is not in the local Hugging Face cache and the hub cannot be reached: run "
            f"`huggingface-cli download {pretrained}` where it can (HF_HOME sets the cache), or put the weights "
            f"(config.json, *.safetensors, tokenizer files) in a folder and set model.pretrained=/path/to/that/folder")


def one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text if len(text) <= 300 else text[:297] + "..."
