"""Tiny learned-weight files in their publishers' formats, written by script for the tests: Q-Filters as
``huggingface_hub.PyTorchModelHubMixin`` saves them (``model.safetensors`` with ``q_filters``, ``config.json``) and a
DuoAttention pattern as duo-attention publishes it (``config.json``, ``full_attention_heads.tsv``) and KVzap's
surrogates as transformers' ``save_pretrained`` writes kvpress' ``KVzapModel`` (``config.json``,
``model.safetensors``)."""

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


def kvzap(layers: int = 2, input_dim: int = 64, kv_heads: int = 2, hidden_dim: int | None = None, seed: int = 0) -> Path:
    """KVzap's surrogates: per layer ``nn.Linear(input_dim, kv_heads)``, or ``Sequential(Linear(input_dim,
    hidden_dim), GELU(), Linear(hidden_dim, kv_heads))`` when ``hidden_dim`` is given."""
    from safetensors.torch import save_file

    folder = ROOT / f"kvzap-{layers}-{input_dim}-{kv_heads}-{hidden_dim}-{seed}"
    if not folder.exists():
        folder.mkdir(parents=True)
        generator = torch.Generator().manual_seed(seed)
        shapes = {"": (kv_heads, input_dim)} if hidden_dim is None else {"0.": (hidden_dim, input_dim),
                                                                        "2.": (kv_heads, hidden_dim)}
        tensors = {}
        for layer in range(layers):
            for name, (rows, columns) in shapes.items():
                tensors[f"layers.{layer}.{name}weight"] = torch.randn(rows, columns, generator=generator) / columns ** 0.5
                tensors[f"layers.{layer}.{name}bias"] = torch.randn(rows, generator=generator)
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps({
            "architectures": ["KVzapModel"], "model_type": "kvzap", "input_dim": input_dim, "output_dim": kv_heads,
            "n_modules": layers, "hidden_dim": hidden_dim}))
    return folder


def lukv_curve(layers: int = 2, kv_heads: int = 2, seed: int = 0) -> Path:
    """An LU-KV budget curve (``.npy``, ``[99, layers, kv_heads]``): per compression ratio, each head's prune ratio
    scattered around it."""
    import numpy as np

    path = ROOT / f"lukv-{layers}-{kv_heads}-{seed}.npy"
    if not path.exists():
        generator = torch.Generator().manual_seed(seed)
        ratios = torch.arange(1, 100).double()[:, None, None] / 100
        spread = (torch.rand(99, layers, kv_heads, generator=generator, dtype=torch.double) - 0.5) * 0.6
        np.save(path, (ratios + spread).clamp(0, 0.99).numpy().astype(np.float32))
    return path


def fastkvzip_gates(layers: int = 2, input_dim: int = 64, kv_heads: int = 2, group: int = 2, width: int = 16,
                    sink: int = 16, seed: int = 0) -> Path:
    """Fast-KVzip gates as its publishers release them: ``torch.save({"module": [state dict per layer]})`` of
    ``FastKVzipGate`` (q_proj with bias, k_proj, q_norm, k_norm, k_base ``[H, 1, sink, w]``, b ``[H, 1, G]``), in a
    file named as theirs (``q<group>_dim<w>_sink<sink>.pt``)."""
    path = ROOT / f"fastkvzip-{layers}-{input_dim}-{seed}" / f"q{group}_dim{width}_sink{sink}.pt"
    if not path.exists():
        path.parent.mkdir(parents=True)
        generator = torch.Generator().manual_seed(seed)

        def normal(*shape, scale=1.0):
            return torch.randn(*shape, generator=generator) * scale

        module = [{"q_proj.weight": normal(kv_heads * group * width, input_dim, scale=input_dim ** -0.5),
                   "q_proj.bias": normal(kv_heads * group * width, scale=0.1),
                   "k_proj.weight": normal(kv_heads * width, input_dim, scale=input_dim ** -0.5),
                   "q_norm.weight": 1 + normal(width, scale=0.1), "k_norm.weight": 1 + normal(width, scale=0.1),
                   "k_base": normal(kv_heads, 1, sink, width), "b": normal(kv_heads, 1, group)}
                  for _ in range(layers)]
        torch.save({"module": module}, path)
    return path


def headkv_scores(layers: int = 2, heads: int = 4, seed: int = 0, folder: Path | None = None) -> Path:
    """HeadKV's head scores as KVCache-Factory publishes them (``data/heads_score/<model>_retrieval_reasoning_heads
    .json``): one line of JSON, every query head (``"layer-head"``, layer by layer) to its scores on the probe
    samples; some heads score 0, as many do in the published files."""
    path = (folder or ROOT) / f"headkv-{layers}-{heads}-{seed}_retrieval_reasoning_heads.json"
    if not path.exists():
        generator = torch.Generator().manual_seed(seed)
        scores = torch.rand(layers, heads, 3, generator=generator, dtype=torch.float64) ** 3
        scores[torch.rand(layers, heads, generator=generator) < 0.2] = 0
        path.write_text(json.dumps({f"{layer}-{head}": scores[layer, head].tolist()
                                    for layer in range(layers) for head in range(heads)}))
    return path


def expected_attention_stats(layers: int = 2, heads: int = 4, head_dim: int = 16, seed: int = 0) -> Path:
    """ExpectedAttention query statistics as kvpress' ``ExpectedAttentionStats`` (``PyTorchModelHubMixin``) saves them:
    ``config.json`` and ``model.safetensors`` (``query_mean [L, H, D]``, ``query_cov [L, H, D, D]``; H: query heads)."""
    from safetensors.torch import save_file

    folder = ROOT / f"eastats-{layers}-{heads}-{head_dim}-{seed}"
    if not folder.exists():
        folder.mkdir(parents=True)
        generator = torch.Generator().manual_seed(seed)
        mean = torch.randint(-16, 17, (layers, heads, head_dim), generator=generator) / 8
        factor = torch.randint(-8, 9, (layers, heads, head_dim, head_dim), generator=generator) / 4
        cov = 4 * factor @ factor.transpose(-1, -2) / head_dim  # exact sums: the same bytes on every CPU
        save_file({"query_mean": mean, "query_cov": cov.contiguous()}, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps({
            "dataset_name": "kmfoda/booksum", "head_dim": head_dim, "model_name": "tiny-llama", "n_sink": 4,
            "num_heads": heads, "num_layers": layers, "num_samples": 100, "sample_seq_len": 1000}, indent=2))
    return folder


def copy_of(source: Path) -> Path:
    """A copy of a learned file or folder in a folder of its own (same name), to damage without touching the
    original that other tests read."""
    import shutil

    target = Path(tempfile.mkdtemp(prefix="copy-", dir=ROOT)) / source.name
    if source.is_dir():
        shutil.copytree(source, target)
    else:
        shutil.copy(source, target)
    return target


ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
LLAMA_TARGETS = (*ATTENTION_TARGETS, "gate_proj", "up_proj", "down_proj")


def restorekv(layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
              intermediate: int = 96, tokens: int = 4, rank: int = 4, alpha: float = 8.0, seed: int = 0,
              targets: tuple[str, ...] = LLAMA_TARGETS) -> Path:
    """A RestoreKV adapter as ``higokri/RestoreKV-<model>`` publishes it, for a Llama of these sizes:
    ``restore_embeddings.safetensors`` (``restore_embeddings [tokens, hidden]``) and a PEFT LoRA adapter as
    ``save_pretrained`` writes it (``adapter_config.json``; ``adapter_model.safetensors`` with
    ``base_model.model.model.layers.<i>.<self_attn|mlp>.<target>.lora_A.weight [rank, in]`` and ``lora_B.weight
    [out, rank]``, B not zero so that the adapter changes what the restore tokens compute)."""
    from safetensors.torch import save_file

    folder = ROOT / (f"restorekv-{layers}-{hidden}-{heads}-{kv_heads}-{head_dim}-{intermediate}-{tokens}-{rank}-{alpha}-"
                     f"{seed}-{'_'.join(target.split('_')[0] for target in targets)}")
    if not folder.exists():
        folder.mkdir(parents=True)
        generator = torch.Generator().manual_seed(seed)
        shapes = {"q_proj": (heads * head_dim, hidden), "k_proj": (kv_heads * head_dim, hidden),
                  "v_proj": (kv_heads * head_dim, hidden), "o_proj": (hidden, heads * head_dim),
                  "gate_proj": (intermediate, hidden), "up_proj": (intermediate, hidden),
                  "down_proj": (hidden, intermediate)}
        tensors = {}
        for layer in range(layers):
            for target in targets:
                out, inp = shapes[target]
                block = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                name = f"base_model.model.model.layers.{layer}.{block}.{target}"
                tensors[f"{name}.lora_A.weight"] = torch.randn(rank, inp, generator=generator) / inp ** 0.5
                tensors[f"{name}.lora_B.weight"] = torch.randn(out, rank, generator=generator) * 0.05
        save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
        embeddings = torch.randn(tokens, hidden, generator=generator)
        save_file({"restore_embeddings": embeddings}, str(folder / "restore_embeddings.safetensors"))
        (folder / "adapter_config.json").write_text(json.dumps({
            "alpha_pattern": {}, "base_model_name_or_path": "tiny-llama", "bias": "none", "fan_in_fan_out": False,
            "inference_mode": True, "init_lora_weights": True, "layers_pattern": None, "layers_to_transform": None,
            "lora_alpha": alpha, "lora_dropout": 0.05, "modules_to_save": None, "peft_type": "LORA", "r": rank,
            "rank_pattern": {}, "revision": None, "target_modules": list(targets), "task_type": "CAUSAL_LM",
            "use_dora": False, "use_rslora": False}, indent=2))
    return folder
