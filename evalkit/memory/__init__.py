"""What a KV cache costs: simulated per socket on SN40L or a GPU (here and :mod:`.simulator`), measured by a run
(:mod:`.measure`), and the two held to each other per request (:mod:`.request_cost`).

Simulated memory budget checker: what a compressed (or full) KV cache needs per socket on SN40L or a GPU.

    from evalkit import memory
    memory.kv_bytes_per_token("llama31_8b")                     # 131072.0 (bf16)
    memory.deployment_report("deepseek_r1_tp16_128k", budget="4x")  # pandas DataFrame, one row per tier

Pure Python (no torch). Hardware specs live in conf/hardware/, deployments in conf/deployment/.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from evalkit.core.paths import conf_dir

from .geometry import PRESETS, ModelGeometry, kv_bytes_per_token, resolve_model
from .simulator import (
    ASSUMPTIONS,
    Deployment,
    Hardware,
    best_throughput,
    capacity_for_budget,
    parse_bytes,
    parse_seconds,
    price,
    report,
    sweep,
    throughput_table,
)

__all__ = [
    "ASSUMPTIONS", "PRESETS", "Deployment", "Hardware", "ModelGeometry", "best_throughput", "capacity_for_budget",
    "deployment_report", "kv_bytes_per_token", "load_deployment", "load_hardware", "parse_bytes", "parse_seconds",
    "price", "report", "resolve_model", "sweep", "throughput_table",
]


def _conf(group: str, name: str) -> dict:
    path = Path(conf_dir()) / group / f"{name}.yaml"
    if not path.is_file():
        available = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise ValueError(f"unknown {group} {name!r}; available: {available}")
    return yaml.safe_load(path.read_text())


def load_hardware(name_or_config) -> Hardware:
    return Hardware.from_config(_conf("hardware", name_or_config) if isinstance(name_or_config, str) else name_or_config)


def load_deployment(name_or_config, hardware=None, **overrides) -> Deployment:
    """A deployment from conf/deployment/<name>.yaml (or a dict); its ``hardware`` unless another is given."""
    cfg = dict(_conf("deployment", name_or_config) if isinstance(name_or_config, str) else name_or_config)
    cfg.update(overrides)
    hardware_cfg = hardware if hardware is not None else cfg.pop("hardware", None)
    cfg.pop("hardware", None)
    if hardware_cfg is None:
        raise ValueError(f"deployment {cfg.get('name', '?')} names no hardware")
    return Deployment.from_config(cfg, load_hardware(hardware_cfg))


def deployment_report(deployment="deepseek_r1_tp16_128k", budget: str | None = None, **overrides):
    """The per-socket report (pandas DataFrame, one row per tier: sram, hbm, ddr) of a deployment at a budget.

    ``deployment``: a name in conf/deployment/, a dict, or a :class:`Deployment`; ``overrides`` change its fields
    (``tp=8``, ``batch=4``, ``context=32768``, ``hardware="h200_141g"``...).
    """
    if not isinstance(deployment, Deployment):
        hardware = overrides.pop("hardware", None)
        deployment = load_deployment(deployment, hardware=hardware, **overrides)
    return report(deployment, budget)
