"""Tiny learned-weight files in their publishers' formats, written by script for the tests: Q-Filters as
``huggingface_hub.PyTorchModelHubMixin`` saves them (``model.safetensors`` with ``q_filters``, ``config.json``) and a
DuoAttention pattern as duo-attention publishes it (``config.json``, ``full_attention_heads.tsv``)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

ROOT = Path(tempfile.mkdtemp(prefix="evalkit-learned-"))


def qfilters(layers: int = 2, kv_heads: int = 2, head_dim: int = 16, seed: int = 0) -> Path:
    from safetensors.torch import save_file

    folder = ROOT / f"qfilt-{layers}-{kv_heads}-{head_dim}-{seed}"
    if not folder.exists():
        folder.mkdir(parents=True)
        filters = torch.randn(layers, kv_heads, head_dim, generator=torch.Generator().manual_seed(seed))
        save_file({"q_filters": filters}, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps({"num_layers": layers, "num_kv_heads": kv_heads,
                                                        "kv_head_dim": head_dim}))
    return folder


def duo_pattern(scores: list[list[float]], sink: int = 4, recent: int = 16) -> Path:
    folder = ROOT / f"duo-{abs(hash(str(scores)))}-{sink}-{recent}"
    if not folder.exists():
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps({"sink_size": sink, "recent_size": recent}))
        (folder / "full_attention_heads.tsv").write_text("\n".join("\t".join(str(s) for s in row) for row in scores)
                                                        + "\n")
    return folder
