"""The two tables every run writes, long format, one observation per row.

Layout under ``results_dir``::

    metrics/<run_id>.parquet   one row per run x task x subset x metric
    samples/<run_id>.parquet   one row per sample (per generation when n > 1)
    csv/metrics/<run_id>.csv, csv/samples/<run_id>.csv   the same tables as CSV

``pandas.read_parquet(f"{results_dir}/metrics")`` reads every run of a sweep at once. Each file is written to a
hidden temporary name in the same folder and renamed into place, so a reader never sees half a file and parallel
jobs (distinct run ids) never write the same file. Every row carries the run id and the flattened run config.
"""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from evalkit.paths import naming

# Fixed types, so that runs whose configs leave different fields empty still read back as one table.
CONFIG_COLUMNS: dict[str, pa.DataType] = {
    "run_id": pa.string(),
    "model": pa.string(),
    "model_pretrained": pa.string(),
    "model_source": pa.string(),  # hub:<id>@<commit> or local:sha256:<fingerprint of weights, config, tokenizer>
    "stop_token_ids": pa.string(),  # JSON list: the generation config's and the tokenizer's EOS ids
    "apply_chat_template": pa.bool_(),
    "chat_template_sha": pa.string(),
    "method": pa.string(),
    "budget": pa.string(),
    "capacity": pa.int64(),
    "max_context": pa.int64(),
    "window": pa.int64(),
    "kernel_size": pa.int64(),
    "pooling": pa.string(),
    "gqa_reduce": pa.string(),
    "sink": pa.int64(),
    "recent": pa.int64(),
    "task": pa.string(),
    "task_options": pa.string(),
    "compression_scope": pa.string(),
    "prefill_chunk": pa.int64(),  # tokens prefilled at a time; empty: the whole prompt at once
    "prefill_chunk_mode": pa.string(),  # exact | compress (compressed back to the budget after every chunk)
    "kv_bits": pa.int64(),  # quantized KV storage (KIVI); empty: the model's dtype
    "kv_group_size": pa.int64(),
    "kv_residual": pa.int64(),
    "deployment": pa.string(),
    "hardware": pa.string(),
    "seed": pa.int64(),
    "fidelity_tokens": pa.int64(),
    "decode_method": pa.string(),
    "draft_model": pa.string(),
    "keep_fraction": pa.float64(),
    "limit": pa.int64(),
    "batch_size": pa.int64(),  # engine slots
    "compile": pa.string(),  # torch.compile backend of the decode step; empty when not compiled
    "dtype": pa.string(),
    "device": pa.string(),
    "device_class": pa.string(),
    "device_map": pa.string(),  # JSON: accelerate's device map when the model was spread over devices
    "bad_rows": pa.string(),
    "policy_params": pa.string(),  # every field of the policy, JSON
    "spec_prefill": pa.string(),  # every speculative prefill setting, JSON
    "draft_source": pa.string(),
    "dataset_source": pa.string(),  # hub:<id>@<commit> or local:sha256:<fingerprint>
    "task_definition": pa.string(),  # fingerprint of the task's folder (YAML + hooks)
    "config_digest": pa.string(),  # over all of the above: what skip/resume compare
    "evalkit_version": pa.string(),
    "torch_version": pa.string(),
    "transformers_version": pa.string(),
    "lm_eval_version": pa.string(),
    "git_revision": pa.string(),
    "started_at": pa.string(),
}
METRIC_COLUMNS: dict[str, pa.DataType] = {
    "subset": pa.string(),
    "metric": pa.string(),
    "value": pa.float64(),
    "stderr": pa.float64(),
    "n": pa.int64(),
}
SAMPLE_COLUMNS: dict[str, pa.DataType] = {
    "doc_id": pa.int64(),
    "sample_id": pa.string(),
    "subset": pa.string(),
    "repeat": pa.int64(),
    "prediction": pa.string(),
    "reasoning": pa.string(),
    "target": pa.string(),
    "score": pa.float64(),
    "prompt_tokens": pa.int64(),
    "generated_tokens": pa.int64(),
    "hit_limit": pa.bool_(),  # the generation ran to its max_new_tokens (the task's limit), not to a stop
    "kept_prompt_tokens": pa.float64(),  # mean over layers and KV heads (per-layer and per-head budgets differ)
    "peak_cache_tokens": pa.float64(),
    "tokens_seen": pa.int64(),
    "realized_ratio": pa.float64(),
    "compression_ratio": pa.float64(),  # kvpress': the fraction of the compressed prompt tokens removed (realized)
    "truncated": pa.bool_(),
    "token_agreement": pa.float64(),
    "first_divergence": pa.int64(),
    "kl_mean": pa.float64(),
    "spec_kept_tokens": pa.int64(),
    "draft_seconds": pa.float64(),
    "prefill_seconds": pa.float64(),
    "decode_seconds": pa.float64(),  # from the first token to the engine sync that saw the request end
    "time_to_first_token_s": pa.float64(),  # from the start of the engine's stream: queueing + prefill
    "reserved_cache_tokens": pa.int64(),  # the cache size the engine reserved per slot
    # Bytes, measured on the engine's own tensors (see evalkit.compression.Engine): held at the peak, reserved by
    # the slot, what a full cache holds for the same tokens, and evalkit.memory's prediction of the held bytes.
    "kv_bytes_peak": pa.int64(),
    "kv_bytes_reserved": pa.int64(),
    "kv_bytes_full": pa.int64(),
    "kv_bytes_predicted": pa.float64(),
    "memory_ratio": pa.float64(),  # kv_bytes_full / kv_bytes_peak
    # the most bytes the request's keys and values held at once during its prefill (the prompt's before compression;
    # KVzip's reconstruction passes on top)
    "kv_bytes_prefill_peak": pa.int64(),
    # the memory-time product: the prefill's peak over its seconds, then the mean bytes held per decode step over the
    # decode seconds (byte-seconds)
    "kv_byte_seconds": pa.float64(),
    "over_budget": pa.bool_(),  # the cache held more than the budget allows (None: no budget)
}


def _table(rows: list[dict], config: dict, columns: dict[str, pa.DataType]) -> pa.Table:
    schema = pa.schema([(name, kind) for name, kind in {**CONFIG_COLUMNS, **columns}.items()])
    unknown = set(config) - set(CONFIG_COLUMNS)
    if unknown:
        raise ValueError(f"config fields without a column: {sorted(unknown)}")
    records = [{**config, **row} for row in rows]
    data = {field.name: [record.get(field.name) for record in records] for field in schema}
    return pa.Table.from_pydict(data, schema=schema)


def metrics_table(rows: list[dict], config: dict) -> pa.Table:
    return _table(rows, config, METRIC_COLUMNS)


def samples_table(rows: list[dict], config: dict) -> pa.Table:
    return _table(rows, config, SAMPLE_COLUMNS)


def _atomic(path: Path, write) -> None:
    """``write`` a temporary file beside ``path``, then rename it: ``path`` is the old file or the whole new one. An
    OSError names ``path`` (pyarrow's and pandas' name no file)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with naming(path):
            write(tmp)
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_table(table: pa.Table, results_dir: str | os.PathLike, name: str, run_id: str) -> Path:
    """Write ``table`` as ``<results_dir>/<name>/<run_id>.parquet`` and ``<results_dir>/csv/<name>/<run_id>.csv``."""
    parquet = Path(results_dir) / name / f"{run_id}.parquet"
    csv = Path(results_dir) / "csv" / name / f"{run_id}.csv"
    for path in (parquet, csv):
        path.parent.mkdir(parents=True, exist_ok=True)
    _atomic(csv, lambda tmp: table.to_pandas().to_csv(tmp, index=False))
    _atomic(parquet, lambda tmp: pq.write_table(table, tmp))  # last: a metrics parquet file marks a complete run
    return parquet


def read_table(results_dir: str | os.PathLike, name: str = "metrics") -> pd.DataFrame:
    """Every run's rows of table ``name`` under ``results_dir``, as one DataFrame."""
    return pd.read_parquet(Path(results_dir) / name)
