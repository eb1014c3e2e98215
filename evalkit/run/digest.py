"""A run's identity: what its outputs depend on beyond its config values, the digest over both (resume and sweeps
key on it) and the run id."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import subprocess
import uuid
from importlib import metadata
from pathlib import Path

from evalkit import identity, task_defs
from evalkit.paths import tasks_dir

from .errors import ConfigError, RunError, model_unavailable
from .spec import LM_EVAL, RunSpec
from .tasks import registry_yaml, task_members, task_with_options


def versions() -> dict:
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
        "git_revision": git_output("rev-parse", "HEAD", cwd=Path(__file__).parent),
    }


def identify(spec: RunSpec) -> dict:
    """What the run's outputs depend on beyond its config values, resolved (see :mod:`evalkit.identity`): the model
    (hub commit, or a fingerprint of the local files: weights, config, tokenizer, chat template), the speculative
    prefill draft, the dataset (hub commit or file fingerprint), the task's own definition, and the device class.

    Computed once per spec; a model or dataset path that does not exist is a :class:`RunError`.
    """
    if spec.identity is not None:
        return spec.identity
    from evalkit.models import resolve_device, resolve_pretrained

    def source(label: str, name: str, repo_type: str = "model", revision: str | None = None) -> str:
        try:
            return identity.source_identity(name, repo_type, revision)
        except (identity.MissingSource, FileNotFoundError) as error:
            raise RunError(f"{label}: {error}") from None

    members = task_members(spec.task, spec.task_options)  # the task, or an lm-eval group's tasks
    configs = [task_with_options(name, spec.task_options) for name in members]
    config = configs[0]
    dataset = config.get("dataset_kwargs") or {}
    data_source, generated = dataset.get("path"), None
    definition, label = task_defs.folders(spec.task) or [tasks_dir() / spec.task], "task.dataset.path"
    if spec.task_options.get("source") == LM_EVAL:  # lm-eval's own tasks: their YAML folders, data files or hub ids
        own = registry_yaml(spec.task)  # a group's own YAML (a tag has none)
        folders = {registry_yaml(name).parent for name in members} | ({own.parent} if own else set())
        # and what evalkit adds to a family (tasks/lm_eval/<folder>.py: prompts, scoring per length)
        hooks = {task_defs.family_file(folder.name) for folder in folders}
        definition = sorted(folders | {path for path in hooks if path.is_file()})
        files = dataset.get("data_files")
        files = list(files.values()) if isinstance(files, dict) else files
        hub = sorted({c.get("dataset_path") for c in configs if c.get("dataset_path")})
        data_source = ([str(f) for f in ([files] if isinstance(files, str) else files)] if files
                       else hub[0] if len(hub) == 1 else None)
        if len(hub) > 1 and not files:  # a group over several hub datasets: each one's commit
            generated = "; ".join(source("task", name, "dataset") for name in hub)
        label = "task.dataset.kwargs.data_files" if files else label
    elif not data_source:  # an evalkit task's own hooks (tasks/<name>/utils.py): its hub files, or built data's identity
        try:
            if task_defs.hook(spec.task, "dataset_sources"):
                data_source = task_defs.hook(spec.task, "dataset_sources")(dataset)
            if not data_source and task_defs.hook(spec.task, "dataset_identity"):
                generated = task_defs.hook(spec.task, "dataset_identity")(dataset)
        except ValueError as error:
            raise ConfigError(f"task.{error}") from None
    draft = (spec.spec_prefill or {}).get("draft_model")
    spec.identity = {
        "model_source": source("model.pretrained", _resolved(resolve_pretrained, spec.pretrained), revision=spec.revision),
        # The ids generation stops on (the generation config's and the tokenizer's EOS), as a JSON list.
        "stop_token_ids": json.dumps(_stop_ids(spec)),
        "draft_source": source("method.draft_model", _resolved(resolve_pretrained, draft)) if draft else None,
        "dataset_source": (source(label, data_source, "dataset", dataset.get("revision")) if data_source
                           else generated),
        # What runs: the task's YAML and code, not its documentation (a README edit does not make runs new).
        "task_definition": identity.fingerprint(definition, skip_suffixes=(".md",)),
        "device_class": resolve_device(spec.device).split(":")[0],
    }
    return spec.identity


def _stop_ids(spec: RunSpec) -> list[int]:
    from evalkit.models import stop_token_ids_of

    try:
        return stop_token_ids_of(spec.pretrained, spec.revision)
    except OSError as error:
        raise RunError(model_unavailable(spec.pretrained, error)) from None


def _resolved(resolve, name: str) -> str:
    try:
        return resolve(name)
    except FileNotFoundError as error:
        raise RunError(str(error)) from None


def config_digest(spec: RunSpec) -> str:
    """Identifies everything that can change a run's outputs (its config values and :func:`identify`): the same
    config restarted resumes; a sweep skips configs already done; any difference gives another digest."""
    ident = {**spec.flat_config(), **identify(spec)}
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:12]


def run_id_for(spec: RunSpec, started: dt.datetime) -> str:
    budget = spec.budget or "nobudget"
    return f"{started:%Y%m%dT%H%M%S}-{spec.task}-{spec.method}-{budget}-{config_digest(spec)}-{uuid.uuid4().hex[:6]}"


def completed_runs(results_dir: Path, spec: RunSpec) -> list[Path]:
    """Metrics files of earlier runs with this exact config (a metrics file is written last, only when complete)."""
    return sorted((Path(results_dir) / "metrics").glob(f"*-{config_digest(spec)}-*.parquet"))


def git_output(*args: str, cwd: Path | None = None) -> str | None:
    """What ``git ARGS`` prints in ``cwd`` (default: the working folder), or None; git's complaints stay off the
    terminal."""
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=5,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None


def chat_template_sha(tokenizer) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    return hashlib.sha256(str(template).encode()).hexdigest()[:16] if template else None

