"""``evalkit-mem``: the memory table of a deployment over budgets and batch sizes, and its decode throughput over
budgets x batches (up to the largest batch each budget fits), printed, written and plotted.

    evalkit-mem                                        # DeepSeek-R1 TP16 128k on SN40L
    evalkit-mem deployment=llama31_8b_tp1_128k hardware=h200_141g batches=[1,8,32]
    evalkit-mem -m deployment=deepseek_r1_tp16_128k,llama31_70b_tp8_128k hardware=sn40l,h200_141g
    evalkit-mem deployment=llama31_8b_tp1_128k kv_bits=4  # the KV cache in KIVI's 4-bit format
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import sys
import uuid
from pathlib import Path

import hydra
import pandas as pd
import pyarrow as pa
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from evalkit.core.paths import conf_dir
from evalkit.memory import ASSUMPTIONS, load_deployment, sweep, throughput_table
from evalkit.results import write_table


def per_socket(frame):
    """One row per budget and batch: HBM (the weights' first tier and the KV cache) used of free, the weights spilled
    to DDR, whether one layer's working set fits on chip, and the verdict; each tier's own row is in the table
    written."""
    sram, hbm, ddr = (frame[frame["tier"] == tier].reset_index(drop=True) for tier in ("sram", "hbm", "ddr"))
    return pd.DataFrame({
        "budget": hbm["budget"], "batch": hbm["batch"], "capacity": hbm["capacity"],
        "hbm_used_GiB": (hbm["used_bytes"] / 2**30).round(3), "hbm_free_GiB": (hbm["available_bytes"] / 2**30).round(3),
        "ddr_used_GiB": (ddr["used_bytes"] / 2**30).round(3), "working_set_on_chip": sram["tier_fits"],
        "fits": hbm["fits"], "max_batch": hbm["max_batch"], "onchip_ratio": hbm["onchip_ratio"],
        "decode_tokens_per_s": hbm["decode_tokens_per_s"]})


def table(cfg: dict):
    deployment = load_deployment(cfg["deployment"], hardware=cfg["hardware"])
    if cfg.get("kv_bits", 16) != 16:  # quantized KV: each token priced as the format stores it
        from evalkit.compression.kv_format import KVFormat

        fmt = KVFormat(cfg["kv_bits"], cfg.get("kv_group_size", 32), cfg.get("kv_residual", 128))
        deployment = dataclasses.replace(deployment, kv_format=fmt)
    return deployment, sweep(deployment, budgets=[str(b) for b in cfg["budgets"]], batches=list(cfg["batches"]))


def kv_storage(deployment) -> str:
    fmt = deployment.kv_format
    return deployment.kv_dtype if fmt is None else (f"{fmt.bits}-bit (KIVI, groups of {fmt.group_size}, scales in "
                                                    f"{deployment.kv_dtype})")


def throughput_grid(frame) -> str:
    """Tokens/s with batches as rows and budgets as columns; "-" where the batch does not fit."""
    grid = frame.pivot(index="batch", columns="budget", values="tokens_per_s")[list(dict.fromkeys(frame["budget"]))]
    text = grid.apply(lambda column: column.map(lambda v: "-" if v != v else f"{v:,.0f}"))
    best = frame.groupby("budget", sort=False).first()
    footer = "\n".join(f"  {b}: {r.best_tokens_per_s:,.0f} tok/s at batch {r.best_batch} (largest that fits: "
                        f"{r.max_batch})" if r.max_batch else f"  {b}: does not fit, not even a batch of 1"
                        for b, r in best.iterrows())
    return f"{text.to_string()}\nbest per budget:\n{footer}"


def plot_throughput(frame, deployment, path):
    """Throughput vs batch, one line per budget, each line ending at its largest batch (an x past it: does not fit)."""
    # Hydra's job logging prints INFO records on stdout; matplotlib's are chatter ("generated new fontManager" on a
    # first run, when it builds its font cache). Its warnings and errors still print.
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for budget, rows in frame.groupby("budget", sort=False):
        fitting = rows[rows["fits"]]
        line = axes.plot(fitting["batch"], fitting["tokens_per_s"], marker="o", markersize=3, label=budget)[0]
        beyond = rows[~rows["fits"]]
        if len(beyond) and len(fitting):
            axes.plot(beyond["batch"].iloc[0], fitting["tokens_per_s"].iloc[-1], marker="x", markersize=9,
                      color=line.get_color(), linestyle="none")
    axes.set_xscale("log", base=2)
    axes.set_xlabel("batch (sequences decoded together)")
    axes.set_ylabel("decode tokens/s (node)")
    axes.set_title(f"{deployment.model.name} on {deployment.hardware.name}, tp={deployment.tp}, "
                   f"context {deployment.context} (x: does not fit)", fontsize=9)
    axes.grid(alpha=0.3)
    axes.legend(title="budget")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


@hydra.main(config_path=str(conf_dir()), config_name="memory", version_base="1.3")
def _main(cfg: DictConfig) -> None:
    plain = OmegaConf.to_container(cfg, resolve=True)
    hydra_cfg = HydraConfig.get()
    sweeping = hydra_cfg.mode == RunMode.MULTIRUN
    if sweeping:  # each job's tables under its own title (Hydra's launcher lines are quiet)
        print(f"\n[#{hydra_cfg.job.num}] {' '.join(hydra_cfg.overrides.task)}")
    try:
        deployment, frame = table(plain)
    except ValueError as error:
        if sweeping:  # one impossible pairing must not end the sweep
            print(f"evalkit-mem: skipped in this sweep: {error}")
            return
        print(f"evalkit-mem: config error: {error}", file=sys.stderr)
        sys.exit(2)
    run_id = f"{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%S}-{deployment.name}-{deployment.hardware.name}-{uuid.uuid4().hex[:6]}"
    frame.insert(0, "run_id", run_id)
    path = write_table(pa.Table.from_pandas(frame, preserve_index=False), plain["results_dir"], "memory", run_id)
    print(f"{deployment.name} on {deployment.hardware.name}: model {deployment.model.name}, tp={deployment.tp}, "
          f"context={deployment.context}, weights {deployment.weight_dtype}, KV {kv_storage(deployment)}; per socket")
    print(per_socket(frame).to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    speed = throughput_table(deployment, budgets=[str(b) for b in plain["budgets"]])
    speed.insert(0, "run_id", run_id)
    speed_path = write_table(pa.Table.from_pandas(speed, preserve_index=False), plain["results_dir"], "throughput",
                             run_id)
    plot_path = Path(plain["results_dir"]) / "plots" / "throughput" / f"{run_id}.png"
    plot_path.parent.mkdir(parents=True, exist_ok=True)
    plot = plot_throughput(speed, deployment, plot_path)
    hw = deployment.hardware
    links = (f"links {hw.link_bandwidth / 1e9:,.0f} GB/s each way and {hw.link_latency * 1e6:.2f} us a hop"
             if deployment.tp > 1 else "no links (one socket)")
    print(f"\ndecode tokens/s (whole node, {deployment.weight_dtype} weights, KV split by {deployment.kv_sharding}, "
          f"kernel looping {'on' if deployment.kernel_looping else 'off'}, efficiency {deployment.efficiency:.2f}, "
          f"{links}, {deployment.tokens_per_step:.2f} tokens per step):")
    print(throughput_grid(speed))
    print(f"assumptions: {ASSUMPTIONS}\nwritten: {path} (CSV copy under csv/memory/), {speed_path}, {plot}")


def main() -> None:
    _main()


if __name__ == "__main__":
    main()
