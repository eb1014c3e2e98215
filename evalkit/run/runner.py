"""One evaluation run, callable without Hydra: validate -> build model and policy -> lm-eval -> tidy tables.

The Hydra entry point (:mod:`evalkit.cli`) only composes the config and calls :func:`run`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import errno
import functools
import os
import time
from pathlib import Path

import pandas as pd

from evalkit.benchmark import task_of
from evalkit.compression.prefill_store import sharing_prefills
from evalkit.core.console import say, warn
from evalkit.core.errors import ConfigError, Interrupted, RunError, model_unavailable, one_line
from evalkit.lm.context_fit import truncation_rows
from evalkit.results import lm_eval_files, manifest, metrics_table, samples_table, trackers, write_table
from evalkit.results.progress import Progress
from evalkit.results.rows import group_rows, tidy_rows

from .digest import chat_template_sha, config_digest, git_output, identify, run_id_for, versions
from .pricing import memory_rows
from .results_dir import check_writable, completed_runs, hold, remove_unfinished_tables
from .spec import RunSpec, warn_unpriced_format
from .tasks import fitting, load_task, task_manager, task_object


@dataclasses.dataclass
class RunResult:
    run_id: str
    metrics: pd.DataFrame
    samples: pd.DataFrame
    paths: list[Path]


def budget_check(spec: RunSpec, samples: list[dict]) -> list[dict]:
    """Requests whose cache held more than the budget allows (beyond 1%): a loud line on stderr and the metric
    ``over_budget`` (their count), or, with ``strict_budget=true``, an error before any table is written (the
    generations stay in the progress file). Prompts shorter than the capacity are within it by definition."""
    flags = [s["over_budget"] for s in samples if s.get("over_budget") is not None]
    if spec.budget is None or not flags:
        return []
    over = sum(flags)
    if over:
        message = (f"{over} of {len(flags)} requests held more than budget {spec.budget} allows "
                   f"(prompt capacity {spec.policy.prompt_capacity()}, cache capacity {spec.policy.cache_capacity()}; "
                   "see the samples' over_budget, kept_prompt_tokens and peak_cache_tokens): the budget did not take "
                   "full effect")
        if spec.strict_budget:
            raise RunError(f"strict_budget: {message}")
        warn(message)
    return [{"subset": "all", "metric": "over_budget", "value": float(over), "stderr": None, "n": len(flags)}]


def run(spec: RunSpec, model=None, tokenizer=None, shared=None) -> RunResult | None:
    """Evaluate ``spec`` (a loaded model/tokenizer may be passed in; ``shared``: what the jobs of a sweep share,
    :class:`~evalkit.run.sweep_share.SweepShare`) and write its tables.

    With ``spec.resume`` (the default) a config whose tables read back whole is skipped (None is returned), one whose
    tables do not runs again (they are moved to ``damaged/``, see :mod:`.results_dir`) and an interrupted one
    continues from its progress file. Everything that can be checked before the model loads is checked first:
    the model and data sources, the results directory, the data rows. Ctrl-C raises :class:`Interrupted`. One
    process at a time runs a config in a results directory: a second one started beside it is refused (a lock on
    the config's progress file), and tables an interrupted attempt left without its metrics table go first.
    """
    if spec.resume and completed_runs(spec.results_dir, spec):
        return None
    check_writable(spec.results_dir)
    digest = config_digest(spec)
    progress_dir = spec.results_dir / ".progress"
    created = [path for path in (spec.results_dir, progress_dir) if not path.exists()]
    progress_dir.mkdir(parents=True, exist_ok=True)
    lock_path = progress_dir / f"{digest}.lock"
    with open(lock_path, "a+", encoding="utf-8") as lock:
        hold(lock, spec.results_dir)
        try:
            if spec.resume and completed_runs(spec.results_dir, spec):  # finished while this one waited to start
                return None
            remove_unfinished_tables(spec.results_dir, digest)
            return _run(spec, digest, model, tokenizer, shared)
        except KeyboardInterrupt:  # at any point: loading, generating, scoring or writing the tables
            raise Interrupted(len(Progress(progress_dir / f"{digest}.jsonl").done)) from None
        except OSError as error:
            if error.errno not in _NO_ROOM:
                raise
            remedy = "raise the file size limit (ulimit -f)" if error.errno == errno.EFBIG else "make room"
            raise RunError(f"{error.filename or spec.results_dir}: {os.strerror(error.errno)}; the tables and progress "
                           f"written before are intact: {remedy} and run the same command again to resume") from None
        finally:  # still holding the lock
            if not (progress_dir / f"{digest}.jsonl").exists():  # nothing left to resume: no trace of the lock
                with contextlib.suppress(OSError):
                    lock_path.unlink(missing_ok=True)
                    for path in reversed(created):
                        path.rmdir()  # only what this run made and left empty (a mistake writes nothing)


_NO_ROOM = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


def _run(spec: RunSpec, digest: str, model=None, tokenizer=None, shared=None) -> RunResult:
    model_folder = model_path(spec)  # first: a run its model's own limits refuse writes nothing
    progress_path = spec.results_dir / ".progress" / f"{digest}.jsonl"
    if not spec.resume:
        progress_path.unlink(missing_ok=True)
    progress = Progress(progress_path)
    if progress.resumed:
        say(f"resuming: {progress.resumed} generations already done ({progress_path})")
    warn_unpriced_format(spec)  # a KV format whose residual covers the cache is priced unquantized: said at the start
    started = dt.datetime.now(dt.timezone.utc)
    run_id = run_id_for(spec, started)
    task = task_of(spec.task, spec.task_options)
    configs = task.configs(spec.task_options, spec.bad_rows, model_folder)
    seed_everything(spec.seed)  # as lm-eval seeds before it builds tasks: data built at run time (RULER) is the same
    loaded = fitting(spec, configs, lambda: [load_task(config, spec.limit) for config in configs])  # bad data, too long
    built, skipped_rows = [built for built, _ in loaded], [row for _, skipped in loaded for row in skipped]
    if spec.threads:
        import torch

        torch.set_num_threads(spec.threads)
    loading = time.perf_counter()
    lm = load_lm(spec, progress, model, tokenizer, shared)
    say(f"  load: {spec.model_name} on {lm.device} in {time.perf_counter() - loading:.1f} s")
    flow = task.generation_flow()  # the task's own passes (LongBench-v2's chain of thought), if it has them
    evaluate = _evaluator(spec, lm)
    try:
        with sharing_prefills(shared.store) if shared else contextlib.nullcontext():
            outcome = flow(evaluate, configs[0], lm.request_stats, progress_path.with_suffix("")) if flow else None
            results, stats, reasoning = outcome or (evaluate(built), lm.request_stats, None)
    except KeyboardInterrupt:
        raise Interrupted(len(Progress(progress_path).done)) from None
    finally:
        lm.close()  # parallel=ray: its replicas stop
    metrics, samples = _rows(spec, task, results, stats, reasoning, lm, skipped_rows)
    config = {"run_id": run_id, **spec.flat_config(), **identify(spec), "config_digest": digest,
              "chat_template_sha": chat_template_sha(lm.tokenizer) if spec.apply_chat_template else None,
              **versions(), "started_at": started.isoformat()}
    # Samples, metrics, lm-eval's own files, then the manifest of them all: written last, it means the run is complete.
    samples_path = write_table(samples_table(samples, config), spec.results_dir, "samples", run_id)
    paths = [write_table(metrics_table(metrics, config), spec.results_dir, "metrics", run_id), samples_path]
    manifest.write(spec.results_dir, run_id, lm_eval_files.write(spec, run_id, results, stats, reasoning, lm.tokenizer))
    trackers.log_run(spec, run_id, *paths)  # logger=trackio | wandb: what the tables hold, to the tracker
    progress.remove()
    for kept in progress_path.parent.glob(f"{digest}-*"):  # what the task's own passes kept meanwhile
        kept.unlink()
    return RunResult(run_id, pd.DataFrame(metrics), pd.DataFrame(samples), paths)


def load_lm(spec: RunSpec, progress: Progress | None = None, model=None, tokenizer=None, shared=None):
    """The run's lm-eval model (its model loaded unless given, or the sweep's), or a one-line RunError saying why
    not. With ``parallel=ray`` its generations run on the run's replicas (each loads the model by this function)."""
    from evalkit.lm import EvalkitLM

    try:
        if model is None and shared is not None:
            model, tokenizer = shared.model_for(spec)
        lm = EvalkitLM(
            pretrained=spec.pretrained, model=model, tokenizer=tokenizer, policy=spec.policy,
            max_context=spec.max_context, batch_size=spec.batch_size, device=spec.device, dtype=spec.dtype,
            seed=spec.seed, apply_chat_template=spec.apply_chat_template, compression_scope=spec.compression_scope,
            progress=progress, fidelity_tokens=spec.fidelity_tokens, spec_prefill=spec.spec_prefill,
            revision=spec.revision, device_map=spec.device_map, compile=spec.compile,
            prefill_chunk=spec.prefill_chunk, prefill_chunk_mode=spec.prefill_chunk_mode,
            truncation=spec.task_options.get("truncation"))
        lm.mode, lm.history = spec.task_options.get("mode", "single"), spec.task_options.get("history", "own")
        lm.recompress = spec.recompress
    except OSError as error:
        raise RunError(model_unavailable(spec.pretrained, error)) from None
    except ValueError as error:  # a config error (a learned file's against the model's layers) stays one
        raise error if isinstance(error, ConfigError) else RunError(f"model {spec.pretrained}: {one_line(error)}") from None
    if spec.parallel is not None:
        from evalkit.lm.parallel.pool import ReplicaPool

        lm.use_replicas(ReplicaPool(spec, spec.parallel, lm.model.config, load_lm))
    return lm


def _evaluator(spec: RunSpec, lm):
    """``evaluate(config)``: lm-eval's evaluation of a task config (or of the tasks already built) with ``lm``,
    seeded and configured as the run says."""
    import lm_eval
    import lm_eval.evaluator

    # lm-eval asks git for a commit hash with the child's stderr on ours ("fatal: not a git repository" outside a
    # checkout); the same question, asked quietly (the run's own identity records evalkit's revision).
    lm_eval.evaluator.get_git_commit_hash = functools.partial(git_output, "describe", "--always")

    def evaluate(config) -> dict:
        return lm_eval.simple_evaluate(
            model=lm,
            tasks=[task_object(config)] if isinstance(config, dict) else config,
            task_manager=task_manager(),
            system_instruction=spec.task_options.get("system_instruction"),
            limit=spec.limit,
            log_samples=True,
            apply_chat_template=spec.apply_chat_template,
            random_seed=spec.seed,
            numpy_random_seed=spec.seed,
            torch_random_seed=spec.seed,
            fewshot_random_seed=spec.seed,
            bootstrap_iters=1000,
        )

    return evaluate


def _rows(spec: RunSpec, task, results: dict, stats: dict, reasoning, lm, skipped_rows: list) -> tuple[list, list]:
    """The run's metric and sample rows: the task's (one task, or a group's members), then what the run measured
    and checked (throughput, context marks, budget, skipped rows, the memory verdict)."""
    members = task.members()  # the task, or an lm-eval group's tasks
    if members == [spec.task]:
        metrics, samples = tidy_rows(results, spec.task, stats, reasoning, task.family_hooks(spec.task))
    else:
        hooks = {name: task.family_hooks(name) for name in members}
        metrics, samples = group_rows(results, members, stats, hooks, task.aggregates())
    metrics += lm.throughput.rows()
    metrics += context_check(spec, lm.context_unmarked, len(samples))
    metrics += budget_check(spec, samples) + truncation_rows(samples)  # held over budget; prompts cut as asked
    if skipped_rows:
        metrics.append({"subset": "all", "metric": "rows_skipped", "value": float(len(skipped_rows)), "stderr": None,
                        "n": len(skipped_rows)})
    if spec.memory is not None:
        metrics += memory_rows(spec.memory)
    return metrics, samples


def context_check(spec: RunSpec, unmarked: int, requests: int) -> list[dict]:
    """``compression_scope=context`` compresses what precedes the task's end-of-context mark; a prompt without one
    (a task that does not mark its context) is compressed whole, as under ``prompt``. Counted in the metric
    ``context_unmarked`` and said on stderr, never silently."""
    if spec.compression_scope != "context":
        return []
    if unmarked:
        warn(f"compression_scope=context, but {unmarked} of {requests} requests of task {spec.task} "
             "do not say where their context ends: they were compressed whole, as with compression_scope=prompt "
             "(a task says it with its doc_to_question hook)")
    return [{"subset": "all", "metric": "context_unmarked", "value": float(unmarked), "stderr": None, "n": requests}]


def seed_everything(seed: int) -> None:
    """The seeds lm-eval's ``simple_evaluate`` sets (Python, NumPy, torch), set before the task is built."""
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def model_path(spec: RunSpec) -> str:
    """Where the run's model (and its tokenizer) is: a hub id or local path as given; a built-in or GGUF model's
    folder. Its config (no weights) allows the run first (:mod:`evalkit.models.limits`), or a one-line error says why."""
    from evalkit.models.limits import checked_model_path

    return checked_model_path(spec.pretrained, spec.policy, spec.max_context, spec.revision)


def job_line(result: RunResult, spec: RunSpec) -> str:
    """A finished run in a line (a sweep's job): its primary metric overall and its cache against the full one."""
    from evalkit.results.summary import primary_metric  # the metric the report pivots on

    overall = result.metrics[result.metrics["subset"] == "all"].set_index("metric")
    name = primary_metric(spec.task, result.metrics, spec.flat_config()["task_options"])
    name = name if name in overall.index else overall.index[0]
    value, stderr = overall.loc[[name], ["value", "stderr"]].iloc[0]
    error = f" ± {stderr:.4f}" if pd.notna(stderr) else ""
    ratio = overall["value"].get("memory_ratio_mean")
    cache = f"KV {ratio:.2f}x smaller" if spec.budget and pd.notna(ratio) else "full cache"
    return f"{name} {value:.4f}{error} · {cache}"


def summary(result: RunResult, spec: RunSpec) -> str:
    """A short table for the terminal."""
    head = (f"run {result.run_id}\nmodel={spec.model_name} task={spec.task} method={spec.method} "
            f"budget={spec.budget or '-'} capacity={spec.policy.cache_capacity() or 'all'}")
    is_memory = result.metrics["subset"] == "memory"
    per_replica = result.metrics["subset"].str.startswith("replica")  # parallel=ray: in the tables, not here
    table = result.metrics[~is_memory & ~per_replica][["subset", "metric", "value", "stderr", "n"]].to_string(index=False,
                                                                                             float_format="%.4f")
    if spec.memory is not None:
        v, d = spec.memory, spec.memory.deployment
        if d.name != spec.own_deployment:  # priced for the deployment's model, which need not be this one
            table += (f"\nnote: the memory rows price {d.model.name} on {d.name}, the deployment named for this run, "
                      f"not necessarily {spec.model_name} itself")
        best = result.metrics[is_memory].set_index("metric")["value"]["best_tokens_per_s_estimate"]
        table += (f"\nmemory on {d.name} ({d.hardware.name}, tp={d.tp}, batch={d.batch}, context={d.context}): "
                  f"{'fits' if v.fits else 'DOES NOT FIT'}; KV {v.kv / 2**30:.2f} GiB/socket, on-chip ratio "
                  f"{v.onchip_ratio:.1f}x, largest batch {v.max_batch}, ~{v.decode_tokens_per_s:.0f} tok/s at "
                  f"batch {d.batch}, ~{best:.0f} tok/s at best (bandwidth bound)")
    where = "\n".join(f"  {path}" for path in result.paths)
    return f"{head}\n{table}\nwritten (CSV copies under csv/):\n{where}"

