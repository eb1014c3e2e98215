"""What a run's budget costs on a deployment (the simulated memory verdict) and its rows in the metrics table."""

from __future__ import annotations

import dataclasses
import math

import torch

import evalkit.compression as ec
from evalkit import memory
from evalkit.core.errors import ConfigError


def deployed_capacity(policy: ec.Policy, budget: str | None, deployment: memory.Deployment) -> int | None:
    """Tokens per sequence, per layer and KV head on average, that ``policy`` holds at the deployment's context with
    ``budget``: the budget's capacity, or for per-layer budgets (PyramidKV) the mean of its layer budgets there."""
    capacity = memory.capacity_for_budget(budget, deployment.context)
    if capacity is None or policy.cache_capacity() is not None or not policy.per_head:
        return capacity
    scaled = dataclasses.replace(policy, capacity=capacity)
    layers = deployment.model.layers
    budgets = [int(scaled.layer_budget(layer, layers, torch.tensor([deployment.context]))[0]) for layer in range(layers)]
    return math.ceil(sum(budgets) / layers)


def price_deployment(cfg: dict, budget: str | None, policy: ec.Policy) -> memory.Verdict | None:
    """Price the run's budget on the deployment named by the run (``deployment=NAME``) or, if none, on the one its
    model config chose for it (``model.deployment``); no deployment, no memory rows. With memory.enforce, refuse what
    does not fit."""
    chosen = cfg.get("deployment") or (cfg.get("model") or {}).get("deployment")
    if not chosen:
        return None
    try:
        deployment = memory.load_deployment(chosen, hardware=cfg.get("hardware"))
        if policy.kv_format is not None:  # quantized KV: priced as the format stores it
            deployment = dataclasses.replace(deployment, kv_format=policy.kv_format)
        verdict = memory.price(deployment, deployed_capacity(policy, budget, deployment))
    except ValueError as error:
        raise ConfigError(f"deployment: {error}") from None
    if (cfg.get("memory") or {}).get("enforce") and not verdict.fits:
        tiers = [name for name, ok in (("SRAM", verdict.fits_sram), ("HBM", verdict.fits_hbm), ("DDR", verdict.fits_ddr)) if not ok]
        raise ConfigError(
            f"memory: budget {budget or 'full'} does not fit {deployment.name} on {deployment.hardware.name} "
            f"(tp={deployment.tp}, batch={deployment.batch}, context={deployment.context}): over {', '.join(tiers)}; "
            f"largest batch that fits: {verdict.max_batch}"
        )
    return verdict


def memory_rows(verdict: memory.Verdict) -> list[dict]:
    """The deployment verdict as metrics rows (subset ``memory``), per socket."""
    values = {
        "fits": float(verdict.fits), "max_batch": verdict.max_batch, "onchip_ratio": verdict.onchip_ratio,
        "cached_tokens": verdict.cached_tokens, "kv_bytes_per_socket": verdict.kv,
        "sram_working_set_bytes": verdict.working_set, "hbm_weights_bytes": verdict.weights_hbm,
        "ddr_weights_bytes": verdict.weights_ddr, "decode_tokens_per_s_estimate": verdict.decode_tokens_per_s,
    }
    # The throughput this budget allows: the best over the batches that fit (see evalkit-mem's throughput table).
    best_batch, best_rate = memory.best_throughput(verdict.deployment, verdict.capacity)
    values.update({"decode_step_ms_estimate": verdict.step_seconds * 1e3, "best_batch": best_batch,
                   "best_tokens_per_s_estimate": best_rate})
    return [{"subset": "memory", "metric": name, "value": float(value), "stderr": None, "n": 1} for name, value in values.items()]

