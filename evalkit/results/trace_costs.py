"""What a generative run's traces cost, from its samples: how long they ran, how often they hit the generation
limit, correct answers per generated token and KV byte-seconds per correct answer; and against the full-cache run of
the same configuration, the length ratio, the byte-second ratio and whether it held less per step yet spent more in
total (a compressed cache can lengthen reasoning: arXiv 2512.12008)."""

from __future__ import annotations

import math

import pandas as pd

# The summary columns (the ratios only where a run has its full-cache baseline).
TRACE = ("generated_tokens_mean", "hit_limit_share", "accuracy_per_1k_tokens", "kv_byte_seconds_per_correct",
         "length_ratio", "kv_byte_seconds_ratio", "spent_more_in_total")


def trace_costs(samples: pd.DataFrame) -> dict:
    """What a run's generations cost: their mean length, the share that ran to the generation limit, correct answers
    per thousand generated tokens, and KV byte-seconds (measured per sample) per correct answer (NaN where the run
    generated nothing or scored no sample)."""
    out = dict.fromkeys(TRACE[:4], math.nan)
    if "generated_tokens" not in samples or samples["generated_tokens"].isna().all():
        return out
    generated = samples["generated_tokens"].dropna()
    out["generated_tokens_mean"] = float(generated.mean())
    if "hit_limit" in samples and samples["hit_limit"].notna().any():
        out["hit_limit_share"] = float(samples["hit_limit"].dropna().astype(bool).mean())
    if "kv_byte_seconds" in samples and samples["kv_byte_seconds"].notna().any():
        out["kv_byte_seconds_total"] = float(samples["kv_byte_seconds"].sum())
    correct = samples["score"].dropna().sum() if "score" in samples else 0.0
    if generated.sum() and "score" in samples and samples["score"].notna().any():
        out["accuracy_per_1k_tokens"] = float(1000 * correct / generated.sum())
    if correct and "kv_byte_seconds" in samples and samples["kv_byte_seconds"].notna().any():
        out["kv_byte_seconds_per_correct"] = float(samples["kv_byte_seconds"].sum() / correct)
    return out


def against_full(row: dict, baseline: pd.DataFrame) -> dict:
    """A run's traces (its summary ``row``) against its full-cache baseline's samples: the length ratio, the ratio
    of total KV byte-seconds, and whether it held less per step (``kv_bytes_peak``) yet spent more byte-seconds in
    total."""
    base = trace_costs(baseline)
    spent = baseline["kv_byte_seconds"].sum() if "kv_byte_seconds" in baseline else 0.0
    ratio = row.get("kv_byte_seconds_total", math.nan) / spent if spent else math.nan
    base_peak = baseline["kv_bytes_peak"].mean() if "kv_bytes_peak" in baseline else math.nan
    length = row["generated_tokens_mean"] / base["generated_tokens_mean"] if base["generated_tokens_mean"] else math.nan
    spent_more = None if math.isnan(ratio) else bool(row.get("kv_bytes_peak", math.nan) < base_peak and ratio > 1)
    return {"length_ratio": length, "kv_byte_seconds_ratio": ratio, "spent_more_in_total": spent_more}


def point_label(point: pd.Series) -> str:
    """A plotted configuration's label: its budget, and for generations its mean trace length against the full
    cache's."""
    ratio = point.get("length_ratio")
    return str(point["budget"]) if ratio is None or pd.isna(ratio) else f"{point['budget']} (len x{ratio:.2f})"
