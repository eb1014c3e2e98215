"""One evaluation run, callable without Hydra: validate -> build model and policy -> lm-eval -> tidy tables.

The Hydra entry point (:mod:`evalkit.cli`) only composes the config and calls :func:`run`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime as dt
import difflib
import errno
import fcntl
import functools
import hashlib
import json
import math
import os
import socket
import subprocess
import sys
import uuid
from importlib import metadata
from pathlib import Path

import pandas as pd
import torch

import evalkit.compression as ec
from evalkit import identity, memory
from evalkit.paths import tasks_dir
from evalkit.progress import Progress
from evalkit.results import metrics_table, samples_table, write_table
from evalkit.scoring import all_responses

# Each method's settings a config may give (its policy's fields but what the budget decides).
METHOD_PARAMS = {name: ec.method_params(name) for name in ec.POLICIES}


# conf/task/<name>.yaml beyond its name: `dataset` (arguments of the task's loader: hub id or path, release, ...),
# `generation` (overrides of the task's generation_kwargs), `repeats` (samples per prompt), `system_instruction`.
# `gen_prefix`: text the assistant turn starts with (AIME's "<think>\n" switch).
TASK_OPTION_KEYS = ("dataset", "generation", "repeats", "system_instruction", "gen_prefix")


class ConfigError(ValueError):
    """A run config that cannot run; the message is one line meant for the user."""


class RunError(RuntimeError):
    """A run that cannot go on (missing model, unwritable results dir, bad data); the message is one line."""


class Interrupted(RuntimeError):
    """Ctrl-C during a run; ``kept`` generations are in the progress file and a restart resumes from them."""

    def __init__(self, kept: int):
        super().__init__(f"interrupted: {kept} generations kept; run the same command again to resume" if kept else
                         "interrupted before any generation was kept; run the same command again to start")
        self.kept = kept


class InvalidCombination(ConfigError):
    """A method/budget pairing that does not exist (full with a budget, a compressing method without one).

    A sweep over methods x budgets meets these by construction; it skips them, a single run refuses them."""


@dataclasses.dataclass
class RunSpec:
    """What a run does, validated, before any model is loaded."""

    model_name: str
    pretrained: str
    max_context: int
    dtype: str
    apply_chat_template: bool
    task: str
    method: str
    budget: str | None
    policy: ec.Policy
    seed: int
    limit: int | None
    batch_size: int  # engine slots: sequences decoded together, a finished one's slot refilled at once
    device: str
    results_dir: Path
    task_options: dict = dataclasses.field(default_factory=dict)
    compression_scope: str = "prompt"
    prefill_chunk: int | None = None  # prefill this many tokens at a time (None: the whole prompt at once)
    prefill_chunk_mode: str = "exact"  # exact: compressed once at the end; compress: back to the budget every chunk
    memory: memory.Verdict | None = None
    spec_prefill: dict | None = None  # speculative prefill settings (draft_model, keep, ...) when method=spec_prefill
    decode_method: str | None = None  # the KV policy while decoding (the method itself unless spec_prefill)
    resume: bool = True
    strict_budget: bool = False  # a request that held more than the budget is an error, not a warning
    fidelity_tokens: int = 0
    revision: str | None = None  # hub revision of the model (branch, tag or commit)
    device_map: str | dict | None = None  # accelerate's device map: the model's layers spread over GPUs
    bad_rows: str = "error"  # error | skip: what a malformed data row does
    threads: int | None = None  # torch CPU threads of this job (None: torch's default, one per core)
    compile: str | None = None  # torch.compile backend of the engine's decode step (None: not compiled)
    own_deployment: str | None = None  # the deployment the model config chose for its model (model.deployment)
    identity: dict | None = None  # filled by identify(): resolved sources, fingerprints

    def flat_config(self) -> dict:
        params = dataclasses.asdict(self.policy)
        return {
            "model": self.model_name,
            "model_pretrained": self.pretrained,
            "apply_chat_template": self.apply_chat_template,
            "method": self.method,
            "budget": self.budget,
            "capacity": self.policy.cache_capacity(),
            "max_context": self.max_context,
            "window": params.get("window"),
            "kernel_size": params.get("kernel_size"),
            "pooling": params.get("pooling"),
            "gqa_reduce": params.get("gqa_reduce"),
            "sink": params.get("sink"),
            "recent": params.get("recent"),
            "task": self.task,
            "task_options": json.dumps(self.task_options, sort_keys=True, default=str),
            "compression_scope": self.compression_scope,
            "deployment": self.memory.deployment.name if self.memory else None,
            "hardware": self.memory.deployment.hardware.name if self.memory else None,
            "seed": self.seed,
            "fidelity_tokens": self.fidelity_tokens,
            "decode_method": self.decode_method or self.method,
            "draft_model": (self.spec_prefill or {}).get("draft_model"),
            "keep_fraction": (self.spec_prefill or {}).get("keep"),
            "limit": self.limit,
            "batch_size": self.batch_size,
            "compile": self.compile,
            "dtype": self.dtype,
            "device": self.device,
            "bad_rows": self.bad_rows,
            "policy_params": json.dumps(params, sort_keys=True, default=str),
            "spec_prefill": json.dumps(self.spec_prefill, sort_keys=True, default=str) if self.spec_prefill else None,
            # Only when set, so that earlier runs keep their config digest (the tables show it empty otherwise).
            **({"device_map": json.dumps(self.device_map, sort_keys=True)} if self.device_map is not None else {}),
            **({"prefill_chunk": self.prefill_chunk, "prefill_chunk_mode": self.prefill_chunk_mode}
               if self.prefill_chunk is not None else {}),
        }


RUN_KEYS = ("model", "method", "task", "hardware", "deployment", "budget", "results_dir", "seed", "limit", "batch_size",
            "compile", "fidelity_tokens", "resume", "strict_budget", "threads", "device", "bad_rows", "compression_scope",
            "prefill_chunk", "prefill_chunk_mode", "memory")
MODEL_KEYS = ("name", "pretrained", "max_context", "dtype", "apply_chat_template", "revision", "device_map",
              "deployment")


def check_known(section: dict, known, where: str = "") -> None:
    """Every key of ``section`` is one of ``known``; else one line naming the key and its nearest known spelling
    (``where``: the section's prefix, e.g. ``model.``)."""
    for key in section:
        if key not in known:
            near = difflib.get_close_matches(str(key), [str(k) for k in known], n=1, cutoff=0.6)
            hint = f"did you mean {where}{near[0]}?" if near else f"known: {', '.join(sorted(map(str, known)))}"
            raise ConfigError(f"unknown setting {where}{key}: {hint}")


def _require_bool(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    return value


def _require(section: dict, key: str, where: str):
    if section.get(key) is None:
        raise ConfigError(f"{where}.{key} is required")
    return section[key]


def validate(cfg: dict, method_explicit: bool = True) -> RunSpec:
    """Check a composed config (plain dict) and build the policy; raise ConfigError with one clear line."""
    check_known(cfg, RUN_KEYS)
    model, method_cfg, task = cfg.get("model") or {}, dict(cfg.get("method") or {}), cfg.get("task") or {}
    check_known(model, MODEL_KEYS, "model.")
    if isinstance(cfg.get("memory"), dict):
        check_known(cfg["memory"], ("enforce",), "memory.")
        _require_bool(cfg["memory"].get("enforce", False), "memory.enforce")
    if isinstance(cfg.get("budget"), dict):
        check_known(cfg["budget"], ("spec",), "budget.")
    budget_cfg = cfg.get("budget")
    budget = budget_cfg.get("spec") if isinstance(budget_cfg, dict) else budget_cfg
    budget = None if budget in (None, "none") else str(budget)
    method = method_cfg.pop("name", None)
    spec_prefill, label = None, method
    if method == "spec_prefill":
        spec_prefill = _spec_prefill_settings(method_cfg)
        method = spec_prefill.pop("then")
        method_explicit = True  # the decoding policy was chosen explicitly (`then`)
    if method not in METHOD_PARAMS:
        raise ConfigError(f"unknown method {method!r}; choose one of {sorted([*METHOD_PARAMS, 'spec_prefill'])}")
    if budget is None and method != "full":
        if method_explicit:
            raise InvalidCombination(f"method={method} needs a budget: add +budget=4x (or 2x, 8x, 16x, tokens_N)")
        method, method_cfg = "full", {}  # `evalkit task=X` with no budget is the full-cache baseline
    if budget is not None and method == "full":
        raise InvalidCombination("method=full takes no budget; drop +budget or pick a compressing method")
    check_known(method_cfg, METHOD_PARAMS[method], "method.")
    max_context = _require(model, "max_context", "model")
    if not isinstance(max_context, int) or max_context < 1:
        raise ConfigError(f"model.max_context must be a positive integer, got {max_context!r}")
    params = {key: value for key, value in method_cfg.items() if value is not None}
    try:
        policy = ec.policy_from_budget(method, budget, max_context, **params)
    except (ValueError, TypeError) as error:
        raise ConfigError(str(error)) from None
    for key in ("seed", "batch_size"):
        if not isinstance(cfg.get(key), int) or cfg[key] < (1 if key == "batch_size" else 0):
            raise ConfigError(f"{key} must be a {'positive' if key == 'batch_size' else 'non-negative'} integer, got {cfg.get(key)!r}")
    limit = cfg.get("limit")
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ConfigError(f"limit must be a positive integer or null, got {limit!r}")
    task_name = _require(task, "name", "task")
    if not (tasks_dir() / task_name).is_dir():
        available = sorted(p.name for p in tasks_dir().iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))
        raise ConfigError(f"unknown task {task_name!r}; available: {available}")
    options = {key: task.get(key) for key in TASK_OPTION_KEYS if task.get(key) is not None}
    check_known(task, ("name", *TASK_OPTION_KEYS), "task.")
    for key in ("dataset", "generation"):
        if not isinstance(options.get(key, {}), dict):
            raise ConfigError(f"task.{key} must be a mapping, got {options[key]!r}")
    path = options.get("dataset", {}).get("path")
    if path is not None and not isinstance(path, str):
        raise ConfigError(f"task.dataset.path must be a path or a hub id (text), got {path!r}")
    for key in ("max_gen_toks", "max_new_tokens"):
        value = options.get("generation", {}).get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"task.generation.{key} must be a positive integer, got {value!r}")
    if "repeats" in options and (not isinstance(options["repeats"], int) or options["repeats"] < 1):
        raise ConfigError(f"task.repeats must be a positive integer, got {options['repeats']!r}")
    apply_chat_template = _require_bool(model.get("apply_chat_template", False), "model.apply_chat_template")
    if task_name == "livecodebench":
        apply_chat_template = _livecodebench_style(options, apply_chat_template)
    scope = cfg.get("compression_scope", "prompt")
    if scope not in ("prompt", "context"):
        raise ConfigError(f"compression_scope must be prompt or context, got {scope!r}")
    prefill_chunk, chunk_mode = cfg.get("prefill_chunk"), cfg.get("prefill_chunk_mode", "exact")
    if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)
                                      or prefill_chunk < 1):
        raise ConfigError(f"prefill_chunk must be a positive integer of tokens or null, got {prefill_chunk!r}")
    # The mode is checked always; whether the method can take it, only when it applies (a chunk is set).
    refusal = ec.chunk_mode_refusal(policy if prefill_chunk is not None else ec.Full(), chunk_mode)
    if refusal:
        raise ConfigError(refusal)
    verdict = _price_deployment(cfg, budget if method != "full" else None, policy)
    fidelity_tokens = cfg.get("fidelity_tokens", 0)
    if not isinstance(fidelity_tokens, int) or fidelity_tokens < 0:
        raise ConfigError(f"fidelity_tokens must be a non-negative integer, got {fidelity_tokens!r}")
    bad_rows = cfg.get("bad_rows", "error")
    if bad_rows not in ("error", "skip"):
        raise ConfigError(f"bad_rows must be error or skip, got {bad_rows!r}")
    device = str(cfg.get("device", "auto"))
    _check_device(device)
    threads = cfg.get("threads")
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ConfigError(f"threads must be a positive integer or null, got {threads!r}")
    try:
        compile_with = ec.compile_backend(cfg.get("compile", False))
    except ValueError as error:
        raise ConfigError(str(error)) from None
    return RunSpec(
        spec_prefill=spec_prefill,
        decode_method=method,
        model_name=str(_require(model, "name", "model")),
        pretrained=str(_require(model, "pretrained", "model")),
        max_context=max_context,
        dtype=str(model.get("dtype", "float32")),
        apply_chat_template=apply_chat_template,
        task=task_name,
        method=label if spec_prefill else method,
        budget=budget,
        policy=policy,
        seed=cfg["seed"],
        limit=limit,
        batch_size=cfg["batch_size"],
        device=device,
        results_dir=Path(cfg.get("results_dir", "results")),
        task_options=options,
        compression_scope=scope,
        prefill_chunk=prefill_chunk,
        prefill_chunk_mode=chunk_mode,
        memory=verdict,
        resume=_require_bool(cfg.get("resume", True), "resume"),
        strict_budget=_require_bool(cfg.get("strict_budget", False), "strict_budget"),
        fidelity_tokens=fidelity_tokens,
        revision=model.get("revision"),
        device_map=_device_map(model.get("device_map")),
        bad_rows=bad_rows,
        threads=threads,
        compile=compile_with,
        own_deployment=model.get("deployment"),
    )


def _livecodebench_style(options: dict, apply_chat_template: bool) -> bool:
    """LiveCodeBench's ``prompt_style`` sets the system turn, the stop strings and whether the chat template wraps
    the prompt (the DeepSeek-R1 style is a raw prompt with R1's own tokens); explicit options win."""
    from evalkit.scoring.livecodebench import PROMPT_STYLES

    name = (options.get("dataset") or {}).get("prompt_style") or "generic"
    if name not in PROMPT_STYLES:
        raise ConfigError(f"task.dataset.prompt_style must be one of {sorted(PROMPT_STYLES)}, got {name!r}")
    style = PROMPT_STYLES[name]
    if "system_instruction" not in options and style.system_instruction:
        options["system_instruction"] = style.system_instruction
    generation = options.setdefault("generation", {})
    generation.setdefault("until", list(style.until))
    return apply_chat_template and style.chat_template


DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


def _device_map(value):
    """``model.device_map``: null (the whole model on ``device``), one of accelerate's strategies, or a mapping of
    module names to devices."""
    if value is None or value in DEVICE_MAPS:
        return value
    if isinstance(value, dict) and value and all(isinstance(k, str) for k in value):
        if {str(v) for v in value.values()} & {"meta", "disk"}:
            raise ConfigError("model.device_map offloads layers to meta/disk; evalkit keeps each layer's cache on "
                              "that layer's device, so every layer needs a GPU or cpu")
        return {k: (v if isinstance(v, int) else str(v)) for k, v in value.items()}
    raise ConfigError(f"model.device_map must be null, one of {list(DEVICE_MAPS)} or a mapping of module names to "
                      f"devices, got {value!r}")


def _check_device(device: str) -> None:
    """A device this machine has, or one line saying why not (before any model loads)."""
    import torch

    if device in ("auto", "cpu"):
        return
    kind, _, index = device.partition(":")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device={device} but CUDA is not available on this machine (torch {torch.__version__}); "
                              "use device=cpu or device=auto")
        if index and (not index.isdigit() or int(index) >= torch.cuda.device_count()):
            raise ConfigError(f"device={device} but this machine has {torch.cuda.device_count()} CUDA device(s)")
        return
    if kind == "mps" and not index:
        if not torch.backends.mps.is_available():
            raise ConfigError("device=mps but MPS is not available on this machine")
        return
    raise ConfigError(f"device must be auto, cpu, cuda, cuda:N or mps, got {device!r}")


# SpecPrefill's own settings, with its defaults; the draft is named by draft_model, the decoding policy by `then`.
SPEC_PREFILL_FIELDS = {f.name: f.default for f in dataclasses.fields(ec.SpecPrefill) if f.name not in ("draft", "draft_tokenizer")}


def _spec_prefill_settings(method_cfg: dict) -> dict:
    """Pop speculative prefill's own settings from ``method_cfg`` (what remains configures the decoding policy)."""
    settings = {key: method_cfg.pop(key, default) for key, default in SPEC_PREFILL_FIELDS.items()}
    try:
        ec.SpecPrefill(draft=None, draft_tokenizer=None, **settings)
    except (ValueError, TypeError) as error:
        raise ConfigError(f"method.{error}") from None
    draft_model, then = method_cfg.pop("draft_model", None), method_cfg.pop("then", None) or "full"
    if not draft_model:
        raise ConfigError("method=spec_prefill needs method.draft_model=<hub id, local path or builtin:NAME>")
    return {**settings, "draft_model": draft_model, "then": then}


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


def _price_deployment(cfg: dict, budget: str | None, policy: ec.Policy) -> memory.Verdict | None:
    """Price the run's budget on the deployment named by the run (``deployment=NAME``) or, if none, on the one its
    model config chose for it (``model.deployment``); no deployment, no memory rows. With memory.enforce, refuse what
    does not fit."""
    chosen = cfg.get("deployment") or (cfg.get("model") or {}).get("deployment")
    if not chosen:
        return None
    try:
        deployment = memory.load_deployment(chosen, hardware=cfg.get("hardware"))
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


def task_with_options(task: str, options: dict, bad_rows: str = "error") -> dict:
    """The task's lm-eval YAML as a dict, with the run's dataset/generation/repeats options applied."""
    from lm_eval.tasks._yaml_loader import load_yaml

    config = load_yaml(tasks_dir() / task / f"{task}.yaml", resolve_func=True)
    config["dataset_kwargs"] = {**(config.get("dataset_kwargs") or {}), **options.get("dataset", {}), "bad_rows": bad_rows}
    config["generation_kwargs"] = {**(config.get("generation_kwargs") or {}), **options.get("generation", {})}
    if "repeats" in options:
        config["repeats"] = options["repeats"]
    if options.get("gen_prefix"):
        config["gen_prefix"] = options["gen_prefix"]
    return config


def _versions() -> dict:
    def version(package: str) -> str | None:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return None

    return {
        "evalkit_version": version("evalkit"),
        "torch_version": version("torch"),
        "transformers_version": version("transformers"),
        "lm_eval_version": version("lm_eval") or version("lm-eval"),
        "git_revision": _git("rev-parse", "HEAD", cwd=Path(__file__).parent),
    }


def identify(spec: RunSpec) -> dict:
    """What the run's outputs depend on beyond its config values, resolved (see :mod:`evalkit.identity`): the model
    (hub commit, or a fingerprint of the local files: weights, config, tokenizer, chat template), the speculative
    prefill draft, the dataset (hub commit or file fingerprint), the task's own definition, and the device class.

    Computed once per spec; a model or dataset path that does not exist is a :class:`RunError`.
    """
    if spec.identity is not None:
        return spec.identity
    from evalkit.lm import resolve_device, resolve_pretrained

    def source(label: str, name: str, repo_type: str = "model", revision: str | None = None) -> str:
        try:
            return identity.source_identity(name, repo_type, revision)
        except (identity.MissingSource, FileNotFoundError) as error:
            raise RunError(f"{label}: {error}") from None

    dataset = task_with_options(spec.task, spec.task_options).get("dataset_kwargs") or {}
    data_source = dataset.get("path") or (lcb_release_sources(dataset["release"]) if dataset.get("release") else None)
    if spec.task == "needle":  # built at run time from the Python docs: their version is the data's identity
        from evalkit.scoring import needle

        generated = needle.source()
    draft = (spec.spec_prefill or {}).get("draft_model")
    spec.identity = {
        "model_source": source("model.pretrained", _resolved(resolve_pretrained, spec.pretrained), revision=spec.revision),
        # The ids generation stops on (the generation config's and the tokenizer's EOS), as a JSON list.
        "stop_token_ids": json.dumps(_stop_ids(spec)),
        "draft_source": source("method.draft_model", _resolved(resolve_pretrained, draft)) if draft else None,
        "dataset_source": (source("task.dataset.path", data_source, "dataset", dataset.get("revision")) if data_source
                           else generated if spec.task == "needle" else None),
        "task_definition": identity.fingerprint([tasks_dir() / spec.task]),
        "device_class": resolve_device(spec.device).split(":")[0],
    }
    return spec.identity


def _stop_ids(spec: RunSpec) -> list[int]:
    from evalkit.lm import stop_token_ids_of

    try:
        return stop_token_ids_of(spec.pretrained, spec.revision)
    except OSError as error:
        raise RunError(_model_unavailable(spec.pretrained, error)) from None


def _resolved(resolve, name: str) -> str:
    try:
        return resolve(name)
    except FileNotFoundError as error:
        raise RunError(str(error)) from None


def lcb_release_sources(release: str) -> list[str]:
    from evalkit.scoring.livecodebench import release_sources

    try:
        return release_sources(release)
    except ValueError as error:
        raise ConfigError(f"task.dataset.release: {error}") from None


def config_digest(spec: RunSpec) -> str:
    """Identifies everything that can change a run's outputs (its config values and :func:`identify`): the same
    config restarted resumes; a sweep skips configs already done; any difference gives another digest."""
    ident = {**spec.flat_config(), **identify(spec)}
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _run_id(spec: RunSpec, started: dt.datetime) -> str:
    budget = spec.budget or "nobudget"
    return f"{started:%Y%m%dT%H%M%S}-{spec.task}-{spec.method}-{budget}-{config_digest(spec)}-{uuid.uuid4().hex[:6]}"


def completed_runs(results_dir: Path, spec: RunSpec) -> list[Path]:
    """Metrics files of earlier runs with this exact config (a metrics file is written last, only when complete)."""
    return sorted((Path(results_dir) / "metrics").glob(f"*-{config_digest(spec)}-*.parquet"))


def tidy_rows(
    results: dict, task: str, stats: dict[tuple, dict], reasoning: dict[str, str] | None = None
) -> tuple[list[dict], list[dict]]:
    """Metrics and sample rows from lm-eval's results dict (with ``log_samples``) and the adapter's stats, keyed by
    request: ``(task, doc_id, repeat)`` (see :func:`evalkit.lm.stats_keys`); ``reasoning``: the first call's text per
    document, for two-call protocols."""
    task_config = results.get("configs", {}).get(task, {})
    subset_fields = (task_config.get("metadata") or {}).get("subset_field") or []
    subset_fields = [subset_fields] if isinstance(subset_fields, str) else list(subset_fields)
    metric_names = [entry["metric"] for entry in task_config.get("metric_list", [])]
    samples = []
    for sample in results["samples"][task]:
        predictions = all_responses(sample.get("filtered_resps") or sample.get("resps") or [])
        metric = metric_names[0] if metric_names else None
        for repeat, prediction in enumerate(predictions):
            row_stats = stats.get((task, sample.get("doc_id"), repeat), {})
            kept = row_stats.get("kept_prompt_tokens")
            samples.append(
                {
                    "doc_id": sample.get("doc_id"),
                    "sample_id": str(sample.get("doc", {}).get("id", sample.get("doc_id"))),
                    "subset": "/".join(str(sample.get("doc", {}).get(f)) for f in subset_fields) or None,
                    "repeat": repeat,
                    "prediction": prediction if isinstance(prediction, str) else json.dumps(prediction, default=str),
                    "reasoning": reasoning.get(_doc_key(sample.get("doc", {}))) if reasoning else None,
                    "target": str(sample.get("target")),
                    "score": float(sample[metric]) if metric in sample else None,
                    "prompt_tokens": row_stats.get("prompt_tokens"),
                    "generated_tokens": row_stats.get("generated_tokens"),
                    "kept_prompt_tokens": sum(kept) / len(kept) if kept else None,  # mean over layers and heads
                    "peak_cache_tokens": row_stats.get("peak_cache_tokens"),
                    "tokens_seen": row_stats.get("tokens_seen"),
                    "realized_ratio": row_stats.get("realized_ratio"),
                    "truncated": row_stats.get("truncated"),
                    "token_agreement": row_stats.get("token_agreement"),
                    "first_divergence": row_stats.get("first_divergence"),
                    "kl_mean": row_stats.get("kl_mean"),
                    "spec_kept_tokens": row_stats.get("spec_kept_tokens"),
                    "draft_seconds": row_stats.get("draft_seconds"),
                    "prefill_seconds": row_stats.get("prefill_seconds"),
                    "decode_seconds": row_stats.get("decode_seconds"),
                    "time_to_first_token_s": row_stats.get("time_to_first_token_s"),
                    "reserved_cache_tokens": row_stats.get("reserved_cache_tokens"),
                    **{column: row_stats.get(column) for column in BYTE_COLUMNS},
                    "over_budget": row_stats.get("over_budget"),
                }
            )
    n = len({s["doc_id"] for s in samples})
    metrics = []
    for key, value in results["results"][task].items():
        if "," not in key or "_stderr" in key or not isinstance(value, (int, float)):
            continue
        name = key.split(",")[0]
        stderr = results["results"][task].get(key.replace(name, f"{name}_stderr", 1))
        metrics.append({"subset": "all", "metric": name, "value": float(value),
                        "stderr": float(stderr) if isinstance(stderr, (int, float)) else None, "n": n})
    if subset_fields and samples:
        frame = pd.DataFrame(samples)
        parts = frame["subset"].str.split("/", expand=True)
        for position, _field in enumerate(subset_fields):
            for subset, group in frame.groupby(parts[position]):
                per_doc = group.groupby("doc_id")["score"].mean().dropna()  # unscored: out of the denominator
                if per_doc.empty:
                    continue
                stderr = float(per_doc.std(ddof=1) / len(per_doc) ** 0.5) if len(per_doc) > 1 else None
                metrics.append({"subset": subset, "metric": metric_names[0], "value": float(per_doc.mean()),
                                "stderr": stderr, "n": len(per_doc)})
    frame = pd.DataFrame(samples)
    metrics += byte_rows(frame)
    for column, name in (("realized_ratio", "realized_ratio_mean"), ("token_agreement", "token_agreement_mean"),
                         ("kl_mean", "kl_mean")):
        values = frame[column].dropna() if column in frame else pd.Series(dtype=float)
        if len(values):
            stderr = float(values.std(ddof=1) / len(values) ** 0.5) if len(values) > 1 and name != "realized_ratio_mean" else None
            metrics.append({"subset": "all", "metric": name, "value": float(values.mean()), "stderr": stderr, "n": len(values)})
    return metrics, samples


def _budget_check(spec: RunSpec, samples: list[dict]) -> list[dict]:
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
        print(f"evalkit: WARNING: {message}", file=sys.stderr, flush=True)
    return [{"subset": "all", "metric": "over_budget", "value": float(over), "stderr": None, "n": len(flags)}]


BYTE_COLUMNS = ("kv_bytes_peak", "kv_bytes_reserved", "kv_bytes_full", "kv_bytes_predicted", "memory_ratio")


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
    predicted = measured.dropna(subset=["kv_bytes_predicted"])
    if len(predicted):
        error = (predicted["kv_bytes_predicted"] - predicted["kv_bytes_peak"]).abs() / predicted["kv_bytes_peak"]
        rows["kv_bytes_predicted_error_max"] = error.max()
    return [{"subset": "all", "metric": name, "value": float(value), "stderr": None, "n": len(measured)}
            for name, value in rows.items()]


@dataclasses.dataclass
class RunResult:
    run_id: str
    metrics: pd.DataFrame
    samples: pd.DataFrame
    paths: list[Path]


def run(spec: RunSpec, model=None, tokenizer=None) -> RunResult | None:
    """Evaluate ``spec`` (a loaded model/tokenizer may be passed in) and write its tables.

    With ``spec.resume`` (the default) a config whose tables exist is skipped (None is returned) and an interrupted
    one continues from its progress file. Everything that can be checked before the model loads is checked first:
    the model and data sources, the results directory, the data rows. Ctrl-C raises :class:`Interrupted`. One
    process at a time runs a config in a results directory: a second one started beside it is refused (a lock on
    the config's progress file), and tables an interrupted attempt left without its metrics table go first.
    """
    if spec.resume and completed_runs(spec.results_dir, spec):
        return None
    _check_writable(spec.results_dir)
    digest = config_digest(spec)
    progress_dir = spec.results_dir / ".progress"
    created = [path for path in (spec.results_dir, progress_dir) if not path.exists()]
    progress_dir.mkdir(parents=True, exist_ok=True)
    lock_path = progress_dir / f"{digest}.lock"
    with open(lock_path, "a+", encoding="utf-8") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            raise RunError(f"this config is already running in {spec.results_dir} ({holder}); wait for it to finish "
                           "(its tables then make this run a skip) or use another results_dir") from None
        lock.seek(0)
        lock.truncate()
        lock.write(f"pid {os.getpid()} on {socket.gethostname()}")
        lock.flush()
        try:
            if spec.resume and completed_runs(spec.results_dir, spec):  # finished while this one waited to start
                return None
            remove_unfinished_tables(spec.results_dir, digest)
            return _run(spec, digest, model, tokenizer)
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


def remove_unfinished_tables(results_dir: Path, digest: str) -> None:
    """Tables of config ``digest`` whose run never wrote its metrics table (written last: the mark of a complete
    run), and temporary files of an interrupted write: an attempt cut short while writing. They go before a rerun
    writes its own tables, so that no sample is counted twice."""
    complete = {p.stem for p in (results_dir / "metrics").glob(f"*-{digest}-*.parquet")}
    for folder in ("samples", "metrics", "csv/samples", "csv/metrics"):
        for path in (results_dir / folder).glob(f"*-{digest}-*"):
            if path.name.startswith(".") or path.stem not in complete:
                path.unlink(missing_ok=True)


def _run(spec: RunSpec, digest: str, model=None, tokenizer=None) -> RunResult:
    import lm_eval

    from evalkit.lm import EvalkitLM

    progress_path = spec.results_dir / ".progress" / f"{digest}.jsonl"
    if not spec.resume:
        progress_path.unlink(missing_ok=True)
    progress = Progress(progress_path)
    if progress.resumed:
        print(f"resuming: {progress.resumed} generations already done ({progress_path})", flush=True)
    started = dt.datetime.now(dt.timezone.utc)
    run_id = _run_id(spec, started)
    task_config = task_with_options(spec.task, spec.task_options, spec.bad_rows)
    task, skipped_rows = _load_task(task_config)  # bad data fails here, before the model loads
    if spec.threads:
        import torch

        torch.set_num_threads(spec.threads)
    try:
        lm = EvalkitLM(
            pretrained=spec.pretrained, model=model, tokenizer=tokenizer, policy=spec.policy,
            max_context=spec.max_context, batch_size=spec.batch_size, device=spec.device, dtype=spec.dtype,
            seed=spec.seed, apply_chat_template=spec.apply_chat_template, compression_scope=spec.compression_scope,
            progress=progress, fidelity_tokens=spec.fidelity_tokens, spec_prefill=spec.spec_prefill,
            revision=spec.revision, device_map=spec.device_map, compile=spec.compile,
            prefill_chunk=spec.prefill_chunk, prefill_chunk_mode=spec.prefill_chunk_mode,
        )
    except OSError as error:
        raise RunError(_model_unavailable(spec.pretrained, error)) from None
    except ValueError as error:
        raise RunError(f"model {spec.pretrained}: {_one_line(error)}") from None

    # lm-eval asks git for a commit hash with the child's stderr on ours ("fatal: not a git repository" outside a
    # checkout); the same question, asked quietly (the run's own identity records evalkit's revision).
    import lm_eval.evaluator

    lm_eval.evaluator.get_git_commit_hash = functools.partial(_git, "describe", "--always")

    def evaluate(config) -> dict:  # a task config, or the task already built from one
        return lm_eval.simple_evaluate(
            model=lm,
            tasks=[_task_object(config) if isinstance(config, dict) else config],
            task_manager=_task_manager(),
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

    try:
        stats, reasoning = lm.request_stats, None
        if (task_config.get("dataset_kwargs") or {}).get("cot"):
            task_config, stats, reasoning = _reasoning_pass(evaluate, task_config, lm.request_stats, progress_path)
        results = evaluate(task_config if reasoning is not None else task)
    except KeyboardInterrupt:
        raise Interrupted(len(Progress(progress_path).done)) from None
    if reasoning is not None:
        stats = _stats_of_reasoning_pass(results, spec.task, stats)
    metrics, samples = tidy_rows(results, spec.task, stats, reasoning)
    metrics += lm.throughput.rows()
    metrics += _budget_check(spec, samples)
    if skipped_rows:
        metrics.append({"subset": "all", "metric": "rows_skipped", "value": float(len(skipped_rows)), "stderr": None,
                        "n": len(skipped_rows)})
    if spec.memory is not None:
        metrics += memory_rows(spec.memory)
    config = {"run_id": run_id, **spec.flat_config(), **identify(spec), "config_digest": digest,
              "chat_template_sha": _chat_template_sha(lm.tokenizer) if spec.apply_chat_template else None,
              **_versions(), "started_at": started.isoformat()}
    # Samples first, metrics last (its parquet file after its CSV): a metrics parquet file means the run is complete.
    samples_path = write_table(samples_table(samples, config), spec.results_dir, "samples", run_id)
    paths = [write_table(metrics_table(metrics, config), spec.results_dir, "metrics", run_id), samples_path]
    progress.remove()
    progress_path.with_name(f"{progress_path.stem}-reasoning.jsonl").unlink(missing_ok=True)
    return RunResult(run_id, pd.DataFrame(metrics), pd.DataFrame(samples), paths)


def _git(*args: str, cwd: Path | None = None) -> str | None:
    """What ``git ARGS`` prints in ``cwd`` (default: the working folder), or None; git's complaints stay off the
    terminal."""
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=5,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None


def _model_unavailable(pretrained: str, error: OSError) -> str:
    """One line for a model that cannot be loaded: for a hub id that is not cached here, where to put its weights."""
    is_path = pretrained.startswith(("/", ".", "~")) or Path(pretrained).exists()
    if is_path or ":" in pretrained:  # a local folder, or builtin:/gguf: (their loaders say what is missing)
        return f"model {pretrained}: {_one_line(error)}"
    return (f"model {pretrained} is not in the local Hugging Face cache and the hub cannot be reached: run "
            f"`huggingface-cli download {pretrained}` where it can (HF_HOME sets the cache), or put the weights "
            f"(config.json, *.safetensors, tokenizer files) in a folder and set model.pretrained=/path/to/that/folder")


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text if len(text) <= 300 else text[:297] + "..."


def _check_writable(results_dir: Path) -> None:
    """The results directory can take the tables: checked before the model loads, so a bad path costs nothing. The
    check leaves nothing behind (folders it made are removed again)."""
    made = [p for p in [results_dir, *results_dir.parents] if not p.exists()]
    try:
        results_dir.mkdir(parents=True, exist_ok=True)
        probe = results_dir / f".write-check-{uuid.uuid4().hex[:8]}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise RunError(f"results_dir {results_dir} is not writable: {error.strerror or error}") from None
    finally:
        for folder in made:  # deepest first
            with contextlib.suppress(OSError):
                folder.rmdir()


def _chat_template_sha(tokenizer) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    return hashlib.sha256(str(template).encode()).hexdigest()[:16] if template else None


@functools.lru_cache(maxsize=1)
def _task_manager():
    """lm-eval's task index over evalkit's tasks only (indexing lm-eval's own thousands of tasks takes seconds)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(tasks_dir()), include_defaults=False)


def _task_object(config: dict):
    """The lm-eval task built from its config dict (dataset loaded)."""
    from lm_eval.tasks import get_task_dict

    (task,) = get_task_dict([config], _task_manager()).values()
    return task


def _load_task(config: dict):
    """The task with its data loaded and checked, and the rows it skipped (``bad_rows=skip``). A malformed file or
    row is a :class:`RunError` naming the file, the row and the field."""
    from evalkit.scoring.data import DataError, collecting_skipped_rows

    with collecting_skipped_rows() as skipped:
        try:
            task = _task_object(config)
        except DataError as error:
            raise RunError(f"data: {error}") from None
    return task, skipped


def _doc_key(doc: dict) -> str:
    return str(doc.get("id", doc.get("_id")))


def _reasoning_pass(evaluate, task_config: dict, request_stats: dict, progress_path: Path):
    """Two-call chain of thought (LongBench-v2's CoT protocol): first the reasoning over the whole prompt, then the
    answer call, which gets the reasoning and the question but not the document.

    Returns the answer pass's task config, the reasoning pass's statistics per document (the compression that
    matters happened on the document), and the reasoning per document.
    """
    first = copy.deepcopy(task_config)
    first["generation_kwargs"]["max_gen_toks"] = int(first["dataset_kwargs"].get("reasoning_max_gen_toks", 1024))
    task = task_config["task"]
    results = evaluate(first)
    reasoning, stats = {}, {}
    for sample in results["samples"][task]:
        key = _doc_key(sample["doc"])
        reasoning[key] = all_responses(sample.get("resps") or [])[0]
        stats[key] = request_stats.get((task, sample["doc_id"], 0), {})
    path = progress_path.with_name(f"{progress_path.stem}-reasoning.jsonl")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": k, "reasoning": v}) + "\n" for k, v in reasoning.items()))
    answer = copy.deepcopy(task_config)
    answer["dataset_kwargs"]["reasoning_file"] = str(path)
    return answer, stats, reasoning


def _stats_of_reasoning_pass(results: dict, task: str, stats_by_doc: dict) -> dict:
    """The answer pass's requests mapped to the reasoning pass's statistics of the same document."""
    return {(task, sample["doc_id"], 0): stats_by_doc.get(_doc_key(sample["doc"]), {}) for sample in results["samples"][task]}


def summary(result: RunResult, spec: RunSpec) -> str:
    """A short table for the terminal."""
    head = (f"run {result.run_id}\nmodel={spec.model_name} task={spec.task} method={spec.method} "
            f"budget={spec.budget or '-'} capacity={spec.policy.cache_capacity() or 'all'}")
    is_memory = result.metrics["subset"] == "memory"
    table = result.metrics[~is_memory][["subset", "metric", "value", "stderr", "n"]].to_string(index=False,
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

