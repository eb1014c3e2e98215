"""The two tables every run writes, long format, one observation per row.

Layout under ``results_dir``::

    metrics/<run_id>.parquet   one row per run x task x subset x metric
    samples/<run_id>.parquet   one row per sample (per generation when n > 1)
    csv/metrics/<run_id>.csv, csv/samples/<run_id>.csv   the same tables as CSV

``pandas.read_parquet(f"{results_dir}/metrics")`` reads every run of a sweep at once. Each file is written to a
hidden temporary name in the same folder and renamed into place, so a reader never sees half a file and parallel
jobs (distinct run ids) never write the same file. Every row carries the run id and the flattened run config.

:func:`read_table` reads a folder file by file and tells a damaged file (cut short, overwritten, another program's
table) from a run's table: :class:`DamagedTable` names it and says what is wrong, where pandas would raise on the
folder or read the file's rows as rows of no run. A run's tables are also held to its manifest (written last,
:mod:`.manifest`): one missing, short or changed since the run wrote it is damaged too, where it would read as whole.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from evalkit.core.errors import one_line
from evalkit.core.paths import naming

from . import manifest

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
    "task_mode": pa.string(),  # multi_request | multi_turn: a session task's queries over one context; empty: single
    "task_history": pa.string(),  # multi_turn: own | gold, what the chat kept of each answer
    # multi_turn: each_call | new_content, what the cache did with a later call's new content; empty: never (appended)
    "session_recompress": pa.string(),
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
    "task_definition": pa.string(),  # version=<the task's declared version> yaml=<fingerprint of its YAML files>
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
    "session_id": pa.string(),  # a session task's: the context the sample's query shares
    "turn": pa.int64(),  # its place among the session's queries, from 1
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
    # Sessions (task.mode=multi_request | multi_turn): the tokens this call ran through the model before its first
    # answer token, and the positions the session's cache served it instead (0 under task.mode=single).
    "prefill_tokens_computed": pa.int64(),
    "prefill_tokens_shared": pa.int64(),
    # session.recompress (the agent loop): the new content a call brought, and the tokens the cache held after the
    # call (mean over layers and heads; null outside a rule other than never)
    "new_content_tokens": pa.int64(),
    "cache_tokens_after": pa.float64(),
    "code_extractor": pa.string(),  # SCBench RepoQA's: tree-sitter (the official extraction) or fallback; else null
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
    "kv_quantized_tokens": pa.float64(),  # under kv_bits < 16: of the tokens held at the peak, those held quantized
    # a method that offloads (ShadowKV): the bytes it keeps on the device, and those it fetches from the host a step
    "kv_bytes_device": pa.int64(),
    "kv_bytes_fetched_step": pa.int64(),
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


# The columns every evalkit table of that name has had since the first release (later ones may be missing from old runs).
REQUIRED = {"metrics": ["run_id", "model", "task", "method", "budget", "started_at", *METRIC_COLUMNS],
            "samples": ["run_id", "doc_id", "sample_id", "subset", "repeat", "prediction", "target", "score"]}
DAMAGED = "damaged"  # <results_dir>/damaged/: where a rerun moves the tables of a run that did not read back


class ResultsError(ValueError):
    """A results directory that cannot be read as one, or an output that cannot be written; one line for the user."""


class DamagedTable(ResultsError):
    """A table file that does not read back as a table evalkit wrote: ``path`` and what is wrong (``reason``)."""

    def __init__(self, path: Path, reason: str, more: int = 0, recorded_in: Path | None = None):
        self.path, self.reason, self.recorded_in = Path(path), reason, recorded_in
        others = f" (and {more} more damaged file{'s' if more > 1 else ''} in {self.path.parent.name}/)" if more else ""
        remedy = f"move it out of {self.path.parent.name}/"
        if recorded_in is not None:  # held to its run's manifest: the run's files go, or none
            remedy = f"move the run's tables and {recorded_in} out of {recorded_in.parent.parent}"
        if re.search(r"-[0-9a-f]{12}-[0-9a-f]{6}$", self.path.stem):  # a run's table: its config can run again
            results_dir = (recorded_in or self.path).parent.parent
            remedy = (f"run its config again (evalkit moves the run's tables to {results_dir / DAMAGED}/ "
                      f"and redoes the run), or {remedy}")
        super().__init__(f"{self.path} is damaged ({reason}){others}: {remedy}")


def load_table(path: str | os.PathLike, name: str) -> pa.Table:
    """One table file, checked: it reads as Parquet and, for ``metrics`` and ``samples``, has the columns evalkit's
    tables have and a run id on every row; else :class:`DamagedTable`."""
    path = Path(path)
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as error:
        raise DamagedTable(path, _unreadable(path, error)) from None
    missing = [column for column in REQUIRED.get(name, []) if column not in table.column_names]
    if missing:
        plural = "s" if len(missing) > 1 else ""
        raise DamagedTable(path, f"not an evalkit {name} table: no column{plural} {', '.join(missing)}")
    declared = {**CONFIG_COLUMNS, **{"metrics": METRIC_COLUMNS, "samples": SAMPLE_COLUMNS}[name]} if (
        name in REQUIRED) else {}
    for field in table.schema:
        if field.name in declared and _kind(field.type) not in (_kind(declared[field.name]), "null"):
            raise DamagedTable(path, f"not an evalkit {name} table: its column {field.name} holds {field.type}, "
                                     f"not {declared[field.name]}")
    if name in REQUIRED and table["run_id"].null_count:
        raise DamagedTable(path, f"{table['run_id'].null_count} of its {len(table)} rows have no run_id")
    return table


def check_recorded(path: Path, record: dict, recorded_in: Path, name: str | None = None) -> None:
    """``path`` held to its run's manifest (``record``, read from ``recorded_in``): :class:`DamagedTable` where it is
    missing, short or changed since its run wrote it. For a Parquet table (``name``: metrics or samples), what
    :func:`load_table` finds wrong with a changed file is said first (cut short, another program's table)."""
    fault = manifest.fault(path, record)
    if fault is None:
        return
    if name is not None and path.exists():
        load_table(path, name)
    raise DamagedTable(path, fault, recorded_in=recorded_in)


def _kind(kind: pa.DataType) -> str:
    """What a column's type holds, as far as reading runs together goes: an int64 column of an older release joins a
    float64 one (kept_prompt_tokens), text joins no number."""
    if pa.types.is_string(kind) or pa.types.is_large_string(kind) or str(kind) == "string_view":
        return "text"
    if pa.types.is_integer(kind) or pa.types.is_floating(kind):
        return "number"
    return "bool" if pa.types.is_boolean(kind) else "null" if pa.types.is_null(kind) else str(kind)


def _unreadable(path: Path, error: Exception) -> str:
    if path.stat().st_size == 0:
        return "an empty file, not a Parquet table"
    text = one_line(error).split(f"{path}': ")[-1]  # pyarrow's message repeats the path
    if "magic bytes not found" in text:
        return "no Parquet footer: cut short, or not a Parquet file"
    return f"not a readable Parquet table: {text}"


def table_files(folder: Path) -> list[Path]:
    """The files of a table's folder that pandas and pyarrow read as the table (hidden ones and ``_*`` left out)."""
    return sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith((".", "_")))


def read_table(results_dir: str | os.PathLike, name: str = "metrics") -> pd.DataFrame:
    """Every run's rows of table ``name`` under ``results_dir``, as one DataFrame (columns a run lacks are empty in
    its rows). A file that does not read back whole, or that its run's manifest records and is missing, short or
    changed, is :class:`DamagedTable`, the first one named; a missing folder :class:`ResultsError`. A run without a
    manifest (written before manifests existed) is read as before."""
    folder = Path(results_dir) / name
    if not folder.is_dir():
        raise ResultsError(f"{Path(results_dir)} has no {name}/ folder: not an evalkit results directory")
    try:
        recorded = manifest.recorded(results_dir, name)
    except manifest.Unreadable as error:
        raise DamagedTable(error.path, error.reason) from None
    tables, damaged = [], []
    for path in table_files(folder):
        try:
            if path in recorded:
                check_recorded(path, *recorded.pop(path), name)
            tables.append((path, load_table(path, name)))
        except DamagedTable as error:
            damaged.append(error)
    damaged += [DamagedTable(path, manifest.fault(path, record), recorded_in=where)  # recorded, no longer there
                for path, (record, where) in recorded.items() if not path.exists()]
    if damaged:
        first = min(damaged, key=lambda error: error.path)
        raise DamagedTable(first.path, first.reason, len(damaged) - 1, first.recorded_in)
    if not tables:
        columns = {"metrics": METRIC_COLUMNS, "samples": SAMPLE_COLUMNS}.get(name)
        return _table([], {}, columns).to_pandas() if columns else pd.DataFrame()
    try:
        return pa.concat_tables([t for _, t in tables], promote_options="permissive").to_pandas()
    except (pa.ArrowTypeError, pa.ArrowInvalid):  # a column whose type no other file's joins: name that file
        for end in range(2, len(tables) + 1):
            try:
                pa.concat_tables([t for _, t in tables[:end]], promote_options="permissive")
            except (pa.ArrowTypeError, pa.ArrowInvalid) as error:
                raise DamagedTable(tables[end - 1][0], f"a column's type clashes with the other files': "
                                   f"{one_line(error)}") from None
        raise


def read_runs(results_dir: str | os.PathLike) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The metrics and samples tables of ``results_dir``, both checked (:func:`read_table`); a results directory
    without a run is :class:`ResultsError`."""
    metrics, samples = read_table(results_dir, "metrics"), read_table(results_dir, "samples")
    if metrics.empty:
        raise ResultsError(f"{Path(results_dir) / 'metrics'} holds no runs")
    return metrics, samples
