"""The result rows of a run: lm-eval's results and the adapter's per-request statistics as tidy metrics and sample
rows and the measured bytes."""

from __future__ import annotations

import json

import pandas as pd

from evalkit.benchmark.responses import all_responses


def doc_key(doc: dict) -> str:
    return str(doc.get("id", doc.get("_id")))


def tidy_rows(
    results: dict, task: str, stats: dict[tuple, dict], reasoning: dict[str, str] | None = None,
    hooks: dict | None = None,
) -> tuple[list[dict], list[dict]]:
    """Metrics and sample rows from lm-eval's results dict (with ``log_samples``) and the adapter's stats, keyed by
    request: ``(task, doc_id, repeat)`` (see :func:`evalkit.results.progress.stats_keys`); ``reasoning``: the first call's text per
    document, for two-call protocols; ``hooks``: an lm-eval task family's (:meth:`evalkit.benchmark.Task.family_hooks`)."""
    metrics, samples = task_rows(results, task, stats, reasoning, hooks)
    return metrics + summary_rows(samples), samples


def group_rows(results: dict, members: list[str], stats: dict[tuple, dict], hooks: dict[str, dict],
               aggregates: list[dict]) -> tuple[list[dict], list[dict]]:
    """The rows of a group (or tag) of lm-eval tasks run together: each task's metrics with the task as their subset
    (``niah_single_1``; a task's own subsets below it: ``niah_single_1/4096``), every sample with its task in its
    subset likewise, the statistics over all samples, and the group's aggregates (its ``aggregate_metric_list``, as
    lm-eval computes them: the mean over tasks, weighted by their sizes when ``weight_by_size``) with subset ``all``."""
    from lm_eval.api.metrics import aggregate_subtask_metrics, pooled_sample_stderr, unweighted_mean_stderr

    metrics, samples = [], []
    for name in members:
        task_metrics, task_samples = task_rows(results, name, stats, None, hooks.get(name))
        for row in task_metrics + task_samples:
            row["subset"] = name if row["subset"] in (None, "all") else f"{name}/{row['subset']}"
        metrics += task_metrics
        samples += task_samples
    for aggregate in aggregates:
        metric, kind = str(aggregate["metric"]), aggregate.get("filter_list", "none")
        parts = [row for row in metrics if row["subset"] in members and row["metric"] in (metric, f"{metric},{kind}")]
        if not parts:
            continue
        by_size = aggregate.get("weight_by_size", True)
        values, sizes, stderrs = [r["value"] for r in parts], [r["n"] for r in parts], [r["stderr"] for r in parts]
        stderr = None
        if None not in stderrs and all(size > 1 for size in sizes):
            stderr = float(pooled_sample_stderr(stderrs, sizes) if by_size else unweighted_mean_stderr(stderrs))
        metrics.append({"subset": "all", "metric": parts[0]["metric"], "stderr": stderr, "n": sum(sizes),
                        "value": float(aggregate_subtask_metrics(values, sizes, by_size))})
    return metrics + summary_rows(samples), samples


def task_rows(results: dict, task: str, stats: dict[tuple, dict], reasoning: dict[str, str] | None = None,
              hooks: dict | None = None) -> tuple[list[dict], list[dict]]:
    """One task's score metrics (overall and per subset) and its sample rows."""
    hooks = hooks or {}
    task_config = results.get("configs", {}).get(task, {})
    subset_fields = (task_config.get("metadata") or {}).get("subset_field") or []
    subset_fields = [subset_fields] if isinstance(subset_fields, str) else list(subset_fields)
    metric_names = [entry["metric"] for entry in task_config.get("metric_list", [])]
    # A task with several filters (gsm8k: strict-match, flexible-extract) logs each document once per filter: the
    # samples are the first filter's; the metrics keep every filter, named as lm-eval reports them (metric,filter).
    filters = list(dict.fromkeys(key.split(",", 1)[1] for key in results["results"][task] if "," in key
                                 and "_stderr" not in key))
    logged = results["samples"][task]
    if len(filters) > 1:
        logged = [sample for sample in logged if sample.get("filter", filters[0]) == filters[0]]
    samples = []
    for sample in logged:
        metric = metric_names[0] if metric_names else None
        if "sample_metric" in hooks:
            metric = hooks["sample_metric"](sample, metric_names)
        subset = "/".join(str(sample.get("doc", {}).get(f)) for f in subset_fields) or None
        if "sample_subset" in hooks:
            subset = hooks["sample_subset"](sample.get("doc") or {})
        predictions = all_responses(sample.get("filtered_resps") or sample.get("resps") or [])
        for repeat, prediction in enumerate(predictions):
            row_stats = stats.get((task, sample.get("doc_id"), repeat), {})
            samples.append(sample_row(sample, repeat, prediction, subset, metric, row_stats, reasoning))
    metrics = score_rows(results["results"][task], len({s["doc_id"] for s in samples}), len(filters) > 1, hooks)
    if subset_fields and samples:
        metrics += subset_rows(samples, subset_fields, metric_names[0])
    return metrics, samples


# A request's statistics (the adapter's), copied into its sample row in this order.
STAT_COLUMNS = ("prompt_tokens", "generated_tokens", "hit_limit", "kept_prompt_tokens", "peak_cache_tokens", "tokens_seen",
                "realized_ratio", "compression_ratio", "truncated", "token_agreement", "first_divergence", "kl_mean", "spec_kept_tokens",
                "draft_seconds", "prefill_seconds", "decode_seconds", "time_to_first_token_s", "reserved_cache_tokens",
                "prefill_tokens_computed", "prefill_tokens_shared", "new_content_tokens", "cache_tokens_after")


def sample_row(sample: dict, repeat: int, prediction, subset: str | None, metric: str | None, row_stats: dict,
               reasoning: dict[str, str] | None) -> dict:
    """One generation's row: lm-eval's logged sample (its ``repeat``-th response) and its request's statistics."""
    doc = sample.get("doc", {})
    kept = row_stats.get("kept_prompt_tokens")
    stat_values = {column: row_stats.get(column) for column in STAT_COLUMNS}
    stat_values["kept_prompt_tokens"] = sum(kept) / len(kept) if kept else None  # mean over layers and heads
    return {
        "doc_id": sample.get("doc_id"),
        "sample_id": str(doc.get("id", sample.get("doc_id"))),
        "session_id": None if doc.get("session_id") is None else str(doc["session_id"]),  # a session task's
        "turn": doc.get("turn"),
        "subset": subset,
        "repeat": repeat,
        "prediction": prediction if isinstance(prediction, str) else json.dumps(prediction, default=str),
        "reasoning": reasoning.get(doc_key(doc)) if reasoning else None,
        "target": str(sample.get("target")),
        "score": float(sample[metric]) if metric in sample else None,
        **stat_values,
        **{column: row_stats.get(column) for column in BYTE_COLUMNS},
        "over_budget": row_stats.get("over_budget"),
        "code_extractor": doc.get("code_extractor"),  # RepoQA's: the function extraction that scored it
    }


def score_rows(scores: dict, n: int, by_filter: bool, hooks: dict) -> list[dict]:
    """lm-eval's overall scores of a task (``metric,filter`` keys) as metrics rows over its ``n`` documents, named
    with their filter where the task has several (``by_filter``)."""
    metrics = []
    for key, value in scores.items():
        if "," not in key or "_stderr" in key or not isinstance(value, (int, float)):
            continue
        metric_name = key.split(",")[0]
        if "metric_applies" in hooks and not hooks["metric_applies"](metric_name, value):
            continue
        stderr = scores.get(key.replace(metric_name, f"{metric_name}_stderr", 1))
        metrics.append({"subset": "all", "metric": key if by_filter else metric_name, "value": float(value),
                        "stderr": float(stderr) if isinstance(stderr, (int, float)) else None, "n": n})
    return metrics


def subset_rows(samples: list[dict], subset_fields: list[str], metric: str) -> list[dict]:
    """The task's metric per subset (each of its ``subset_fields``): the mean over documents of their mean score,
    unscored documents out of the denominator."""
    metrics = []
    frame = pd.DataFrame(samples)
    parts = frame["subset"].str.split("/", expand=True)
    for position, _field in enumerate(subset_fields):
        for subset, group in frame.groupby(parts[position]):
            per_doc = group.groupby("doc_id")["score"].mean().dropna()
            if per_doc.empty:
                continue
            stderr = float(per_doc.std(ddof=1) / len(per_doc) ** 0.5) if len(per_doc) > 1 else None
            metrics.append({"subset": subset, "metric": metric, "value": float(per_doc.mean()), "stderr": stderr,
                            "n": len(per_doc)})
    return metrics


def summary_rows(samples: list[dict]) -> list[dict]:
    """What the samples measured, over all of them: KV bytes, realized compression, fidelity."""
    frame = pd.DataFrame(samples)
    metrics = byte_rows(frame)
    for column, name in (("realized_ratio", "realized_ratio_mean"), ("token_agreement", "token_agreement_mean"),
                         ("kl_mean", "kl_mean")):
        values = frame[column].dropna() if column in frame else pd.Series(dtype=float)
        if len(values):
            stderr = float(values.std(ddof=1) / len(values) ** 0.5) if len(values) > 1 and name != "realized_ratio_mean" else None
            metrics.append({"subset": "all", "metric": name, "value": float(values.mean()), "stderr": stderr, "n": len(values)})
    return metrics


# kv_quantized_tokens: of the tokens held at the peak, those priced at kv_bits (empty at 16 bits; see
# evalkit.compression.engine.accounting); a sample column once the samples table declares it, a metric row always.
# kv_bytes_device, kv_bytes_fetched_step: a method that offloads to the host (ShadowKV), what stays on the device and
# what a decode step fetches; absent for the others.
BYTE_COLUMNS = ("kv_bytes_peak", "kv_bytes_reserved", "kv_bytes_full", "kv_bytes_predicted", "memory_ratio",
                "kv_bytes_prefill_peak", "kv_byte_seconds", "kv_quantized_tokens", "kv_bytes_device",
                "kv_bytes_fetched_step")


def byte_rows(frame: pd.DataFrame) -> list[dict]:
    """The run's measured KV bytes as metrics rows: means of held (peak), full and reserved bytes, the realized memory
    ratio (full / held), ``memory_freed`` (the share of requests whose slot reserves fewer bytes than a full cache
    holds for their tokens: derived from the bytes, so a method that only masks shows 0), and the simulator's largest
    relative error against the measurement (``kv_bytes_predicted_error_max``)."""
    if "kv_bytes_peak" not in frame or frame["kv_bytes_peak"].isna().all():
        return []
    measured = frame.dropna(subset=["kv_bytes_peak"])
    rows = {"kv_bytes_peak_mean": measured["kv_bytes_peak"].mean(), "kv_bytes_full_mean": measured["kv_bytes_full"].mean(),
            "kv_bytes_reserved_mean": measured["kv_bytes_reserved"].mean(),
            "memory_ratio_mean": measured["memory_ratio"].mean(),
            "memory_freed": (measured["kv_bytes_reserved"] < measured["kv_bytes_full"]).mean()}
    if "kv_bytes_prefill_peak" in measured and measured["kv_bytes_prefill_peak"].notna().any():
        rows["kv_bytes_prefill_peak_max"] = measured["kv_bytes_prefill_peak"].max()
    # kv_bits < 16; an offloading method's
    for column in ("kv_quantized_tokens", "kv_bytes_device", "kv_bytes_fetched_step"):
        if column in measured and measured[column].notna().any():
            rows[f"{column}_mean"] = measured[column].mean()
    predicted = measured.dropna(subset=["kv_bytes_predicted"])
    if len(predicted):
        error = (predicted["kv_bytes_predicted"] - predicted["kv_bytes_peak"]).abs() / predicted["kv_bytes_peak"]
        rows["kv_bytes_predicted_error_max"] = error.max()
    return [{"subset": "all", "metric": name, "value": float(value), "stderr": None, "n": len(measured)}
            for name, value in rows.items()]

