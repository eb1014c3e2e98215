"""A run's config, checked: :func:`validate` turns a composed config (plain dict) into a :class:`RunSpec` before any
model loads, or raises :class:`~evalkit.core.errors.ConfigError` with one line."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING

from evalkit.benchmark import LM_EVAL, task_of
from evalkit.config import run_schema
from evalkit.config.method_config import check_known, method_settings, policy_from_config, spec_prefill_settings
from evalkit.core import budget as budget_grammar
from evalkit.core import schema
from evalkit.core.errors import ConfigError
from evalkit.lm.parallel import ParallelSettings, parallel_settings

from .session_mode import check_mode, check_recompress, session_refusal

if TYPE_CHECKING:  # torch and the compression code load with the first validate(), not with this module
    import evalkit.compression as ec
    from evalkit import memory
    from evalkit.results.trackers import LoggerSettings


# conf/task/<name>.yaml beyond its name: `dataset` (arguments of the task's loader: hub id or path, release, ...),
# `generation` (overrides of the task's generation_kwargs), `repeats` (samples per prompt), `system_instruction`.
# `gen_prefix`: text the assistant turn starts with (AIME's "<think>\n" switch).
# `source: lm_eval`: a task of lm-eval's own registry (conf/task/lm_eval.yaml), with `num_fewshot` and `metadata`.
# `mode`: single (each query a request of its own, the default) | multi_request | multi_turn, over a session task's
# shared context (evalkit.lm.sessions); `history`: own | gold, what a multi_turn chat keeps of each answer.
# `truncation`: left | middle cuts prompts too long for the context (counted); null refuses them. Each is declared
# with its kind and range in evalkit.config.run_schema.TASK.
TASK_OPTION_KEYS = tuple(key for key in run_schema.TASK if key != "name")


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
    kv_format: ec.KVFormat | None = None  # quantized KV storage (kv_bits < 16)
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
    # parallel=ray: the requests sharded over Ray replicas (None: one process). Not part of the config: the tables of
    # a run are the same however many replicas made them, and one run resumes another.
    parallel: ParallelSettings | None = None
    # logger=trackio | wandb: the finished run also logged to that tracker (None: none). Not part of the config
    # either: logging does not change what a run writes.
    logger: LoggerSettings | None = None
    # session.recompress: what a multi_turn session's cache does with a later call's new content (never: appended)
    recompress: str = "never"

    def flat_config(self) -> dict:
        params = self.policy.settings()
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
            **({"task_mode": self.task_options["mode"], "task_history": self.task_options.get("history", "own")}
               if self.task_options.get("mode", "single") != "single" else {}),
            **({"session_recompress": self.recompress} if self.recompress != "never" else {}),
            **({"kv_bits": self.kv_format.bits, "kv_group_size": self.kv_format.group_size,
                "kv_residual": self.kv_format.residual} if self.kv_format is not None else {}),
        }


RUN_KEYS = (*run_schema.RUN, *run_schema.GROUPS)
MODEL_KEYS = tuple(run_schema.MODEL)


def _checked(section: dict, keys: dict, prefix: str = "") -> None:
    """``section``'s keys known and its values within their declarations (:mod:`evalkit.config.run_schema`)."""
    check_known(section, keys, prefix)
    found = schema.check(section, keys, prefix)
    if found:
        raise ConfigError(found)


def _require(section: dict, key: str, where: str):
    if section.get(key) is None:
        raise ConfigError(f"{where}.{key} is required")
    return section[key]


def precheck(cfg: dict, method_explicit: bool = True, sweeping: bool = False) -> dict:
    """Everything about a composed config that needs neither torch nor a model (keys, the budget's grammar, the
    method's settings against their declarations, numbers, the task and its options, the device's spelling, settings
    that would take no effect): the CLI answers these mistakes at once, before the libraries load. Returns the values
    read, normalised, with ``warnings`` (lines to say before the run: what a sweep's job ignores, ``sweeping``);
    raises ConfigError with one line."""
    check_known(cfg, RUN_KEYS)
    _checked({key: value for key, value in cfg.items() if key in run_schema.RUN}, run_schema.RUN)
    model = cfg.get("model") or {}
    _checked(model, run_schema.MODEL, "model.")
    _checked(cfg.get("memory") or {}, run_schema.MEMORY, "memory.")
    _checked(cfg.get("session") or {}, run_schema.SESSION, "session.")
    for group, keys in (("parallel", run_schema.PARALLEL), ("logger", run_schema.LOGGER)):
        if isinstance(cfg.get(group), dict):
            _checked(cfg[group], keys, f"{group}.")
    budget = cfg.get("budget")
    if isinstance(budget, dict):  # the group form of earlier configs: {spec: 4x}
        check_known(budget, ("spec",), "budget.")
        budget = budget.get("spec")
    budget = None if budget in budget_grammar.FULL else str(budget)
    try:
        budget_grammar.parse(budget)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    method_settings(cfg.get("method") or {}, budget, method_explicit)
    max_context = _require(model, "max_context", "model")
    task_name, options = _checked_task(cfg.get("task") or {})
    recompress = check_recompress(cfg.get("session") or {}, options, task_name)
    return {
        "budget": budget, "max_context": max_context, "task": task_name, "options": options, "recompress": recompress,
        "warnings": _checked_kv_settings(cfg, sweeping),
        "apply_chat_template": model.get("apply_chat_template", False),
        **_checked_run_settings(cfg),
        "model_name": str(_require(model, "name", "model")),
        "pretrained": str(_require(model, "pretrained", "model")),
    }


def _checked_task(task: dict) -> tuple[str, dict]:
    """The task's name and its options (``TASK_OPTION_KEYS``), checked against their declarations: the task's own
    (``task.*``, :data:`evalkit.config.run_schema.TASK`), its dataset options (declared beside its code) and
    ``task.generation``."""
    task_name = _require(task, "name", "task")
    if task_name == "???":  # conf/task/lm_eval.yaml leaves the name to the command line
        raise ConfigError("task.name is required: the lm-eval task to run (task=lm_eval task.name=gsm8k)")
    if not isinstance(task_name, str):
        raise ConfigError(f"task.name must be a task's name, got {task_name!r}")
    if task.get("source") not in (None, LM_EVAL):
        raise ConfigError(f"task.source must be lm_eval (a task of lm-eval's registry) or absent, got {task['source']!r}")
    options = {key: task.get(key) for key in TASK_OPTION_KEYS if task.get(key) is not None}
    task_of(task_name, options).check()
    _checked(task, run_schema.TASK, "task.")
    check_mode(task_name, options)
    dataset = options.get("dataset", {})
    declared = run_schema.REGISTRY_DATASET if task.get("source") == LM_EVAL else run_schema.dataset_keys(task_name)
    if declared is None:
        raise ConfigError(f"task {task_name} declares no dataset options (tasks/<folder>/schema.py: DATASET)")
    _checked(dataset, declared, "task.dataset.")
    generation = options.get("generation", {})
    _checked(generation, run_schema.GENERATION, "task.generation.")
    return task_name, options


def _checked_run_settings(cfg: dict) -> dict:
    """The run's own settings beyond model, method and task (their kinds and ranges checked already), read, and
    what holds between them."""
    device = str(cfg.get("device", "auto"))
    kind, _, index = device.partition(":")
    if device not in ("auto", "cpu", "mps") and not (kind == "cuda" and (not index or index.isdigit())):
        raise ConfigError(f"device must be auto, cpu, cuda, cuda:N or mps, got {device!r}")
    return {
        "limit": cfg.get("limit"), "scope": cfg.get("compression_scope", "prompt"),
        "prefill_chunk": cfg.get("prefill_chunk"), "fidelity_tokens": cfg.get("fidelity_tokens", 0),
        "bad_rows": cfg.get("bad_rows", "error"), "device": device, "threads": cfg.get("threads"),
        "resume": cfg.get("resume", True), "strict_budget": cfg.get("strict_budget", False),
        "parallel": parallel_settings(_without_unused("parallel", cfg.get("parallel"), "single", {"replicas": 1},
                                                      "parallel=ray to shard the run over Ray replicas",
                                                      "one process runs the whole evaluation")),
        "logger": _logger_settings(cfg.get("logger")),
    }


def _without_unused(group: str, section: dict | None, default: str, takes: dict, add: str, instead: str) -> dict | None:
    """A config group's ``section``, where it names another option than ``default`` or sets nothing beyond ``takes``
    (the default option's own values); else one line for the setting given beside the default option, which would
    take no effect (``parallel.replicas=4`` without ``parallel=ray``, ``+logger.project=x`` without a logger):
    ``add`` says what takes it, ``instead`` what the default option does."""
    if (section or {}).get("name", default) != default:
        return section
    for key, value in (section or {}).items():
        if key != "name" and value is not None and (key not in takes or value != takes[key]):
            raise ConfigError(f"{group}.{key}={value} takes no effect with {group}={default} (the default: {instead}); "
                              f"add {add}, or leave {group}.{key} out")
    return section


def _logger_settings(section: dict | None) -> LoggerSettings | None:
    """The ``logger`` section checked (None: no tracker; then nothing of the trackers' code is imported)."""
    if (section or {}).get("name", "none") == "none":
        _without_unused("logger", section, "none", {}, "logger=trackio or logger=wandb to log the run",
                        "the run is logged to no tracker")
        return None
    from evalkit.results.trackers import logger_settings

    return logger_settings(section)


KV_FORMAT_KEYS = ("kv_group_size", "kv_residual")  # settings of a quantized KV format (kv_bits < 16)


@functools.lru_cache(maxsize=1)
def _config_defaults() -> dict:
    """conf/config.yaml's own top-level values (the KV format's defaults among them), read as YAML."""
    from omegaconf import OmegaConf

    from evalkit.core.paths import conf_dir

    return OmegaConf.to_container(OmegaConf.load(conf_dir() / "config.yaml"))


def _checked_kv_settings(cfg: dict, sweeping: bool) -> list[str]:
    """``kv_bits``, ``kv_group_size`` and ``kv_residual`` are integers whatever ``kv_bits`` is. At ``kv_bits=16`` (no
    quantization) a group size or residual other than conf/config.yaml's would take no effect: one line, or, in a
    sweep (where a fixed residual beside ``kv_bits=16,4`` is meant for the quantized jobs), a warning returned."""
    if cfg.get("kv_bits", 16) != 16:
        return []
    unused = [f"{name}={cfg[name]}" for name in KV_FORMAT_KEYS
              if cfg.get(name) is not None and cfg[name] != _config_defaults().get(name)]
    if not unused:
        return []
    said = f"{' and '.join(unused)} {'takes' if len(unused) == 1 else 'take'} no effect at kv_bits=16 (no quantization)"
    if sweeping:
        return [f"{said}: this job runs unquantized"]
    raise ConfigError(f"{said}: add kv_bits=2, 4 or 8 to quantize the cache, or leave {' and '.join(unused)} out")


def validate(cfg: dict, method_explicit: bool = True, checked: dict | None = None) -> RunSpec:
    """Check a composed config (plain dict) and build the policy; raise ConfigError with one clear line. ``checked``:
    what :func:`precheck` returned for this config, where the caller ran it already."""

    from .pricing import price_deployment

    checked = checked or precheck(cfg, method_explicit)
    budget, max_context, options = checked["budget"], checked["max_context"], checked["options"]
    method_cfg = dict(cfg.get("method") or {})
    policy = policy_from_config(method_cfg, budget, max_context, method_explicit)
    method, label, spec_prefill = policy.name, method_cfg.pop("name", None), None
    if label == "spec_prefill":  # the draft's settings (the policy above is the decoding one, `then`)
        spec_prefill = spec_prefill_settings(method_cfg)
        del spec_prefill["then"]
    apply_chat_template = checked["apply_chat_template"]
    apply_chat_template = task_of(checked["task"], options).adjust_options(options, apply_chat_template)
    prefill_chunk, chunk_mode = checked["prefill_chunk"], cfg.get("prefill_chunk_mode", "exact")
    fmt = _kv_format(cfg, checked["scope"], spec_prefill)
    policy.kv_format = fmt
    compile_with = _checked_runtime(policy, prefill_chunk, chunk_mode, checked["device"], cfg.get("compile", False))
    verdict = price_deployment(cfg, budget if method != "full" else None, policy)
    model = cfg.get("model") or {}
    return session_refusal(RunSpec(
        spec_prefill=spec_prefill,
        decode_method=method,
        model_name=checked["model_name"],
        pretrained=checked["pretrained"],
        max_context=max_context,
        dtype=str(model.get("dtype", "float32")),
        apply_chat_template=apply_chat_template,
        task=checked["task"],
        method=label if spec_prefill else method,
        budget=budget,
        policy=policy,
        seed=cfg["seed"],
        limit=checked["limit"],
        batch_size=cfg["batch_size"],
        device=checked["device"],
        results_dir=Path(cfg.get("results_dir", "results")),
        task_options=options,
        compression_scope=checked["scope"],
        prefill_chunk=prefill_chunk,
        prefill_chunk_mode=chunk_mode,
        kv_format=fmt,
        memory=verdict,
        resume=checked["resume"],
        strict_budget=checked["strict_budget"],
        fidelity_tokens=checked["fidelity_tokens"],
        revision=model.get("revision"),
        device_map=_device_map(model.get("device_map")),
        bad_rows=checked["bad_rows"],
        threads=checked["threads"],
        compile=compile_with,
        own_deployment=model.get("deployment"),
        parallel=checked["parallel"],
        logger=checked["logger"],
        recompress=checked["recompress"],
    ))


def _kv_format(cfg: dict, scope: str, spec_prefill) -> ec.KVFormat | None:
    """``kv_bits`` (with its group size and residual) as a quantized KV format, or None at 16 bits."""
    import evalkit.compression as ec

    bits = cfg.get("kv_bits", 16)
    if bits == 16:
        return None
    if scope == "context":
        raise ConfigError("kv_bits < 16 takes compression_scope=prompt: the question prefilled on top of a compressed "
                          "context is not quantized as the format's residual rules say")
    if spec_prefill is not None:
        raise ConfigError("kv_bits < 16 does not combine with method=spec_prefill yet")
    try:
        return ec.KVFormat(bits, cfg.get("kv_group_size", 32), cfg.get("kv_residual", 128))
    except ValueError as error:
        raise ConfigError(str(error)) from None


def warn_unpriced_format(spec: RunSpec) -> None:
    """One warning line where the quantized KV format's full-precision residual covers what a request's cache holds
    (``kv_residual`` >= the cache's capacity per request: a 64-slot cache with the default 128): the generated tokens
    then stay at full precision for as long as the cache holds them, and only the kept prompt is quantized (what the
    rows price; ``kv_quantized_tokens`` counts it)."""
    fmt = spec.kv_format
    capacity = spec.policy.cache_capacity() or spec.max_context
    if fmt is None or fmt.residual < capacity:
        return
    below = (capacity - 1) // fmt.group_size * fmt.group_size
    remedy = f"kv_residual={below}" if below else f"a kv_group_size and a kv_residual below {capacity}"
    from evalkit.core.console import warn

    warn(f"kv_residual={fmt.residual} covers the whole cache ({capacity} tokens per request): generated tokens are "
         f"never quantized while it holds them, only the kept prompt is (kv_quantized_tokens counts what is); "
         f"{remedy} quantizes them too")


def _checked_runtime(policy, prefill_chunk: int | None, chunk_mode: str, device: str, compile_option):
    """The chunked prefill mode (always checked; whether the method takes it, only when a chunk is set), the device
    and the compile option (its backend, or None); a ConfigError otherwise."""
    import evalkit.compression as ec

    refusal = ec.chunk_mode_refusal(policy if prefill_chunk is not None else ec.Full(), chunk_mode)
    if refusal:
        raise ConfigError(refusal)
    _check_device(device)
    try:
        return ec.compile_backend(compile_option)
    except ValueError as error:
        raise ConfigError(str(error)) from None


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
