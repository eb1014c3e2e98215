"""A run's identity: what its outputs depend on beyond its config values, the digest over both (resume and sweeps
key on it) and the run id."""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import json
import subprocess
import uuid
from importlib import metadata
from pathlib import Path

from evalkit.benchmark import Task, task_of
from evalkit.core import identity
from evalkit.core.errors import RunError, model_unavailable

from .spec import RunSpec


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
    """What the run's outputs depend on beyond its config values, resolved (see :mod:`evalkit.core.identity`): the model
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

    task = task_of(spec.task, spec.task_options)
    data = task.data_origin(task.configs(spec.task_options))
    if data.source:  # files or a hub id
        dataset = source(data.label, data.source, "dataset", data.revision)
    else:  # a group over several hub datasets (each one's commit), or data built at run time
        dataset = "; ".join(source("task", hub, "dataset") for hub in data.hubs) if data.hubs else data.built
    draft = (spec.spec_prefill or {}).get("draft_model")
    spec.identity = {
        "model_source": source("model.pretrained", _resolved(resolve_pretrained, spec.pretrained), revision=spec.revision),
        # The ids generation stops on (the generation config's and the tokenizer's EOS), as a JSON list.
        "stop_token_ids": json.dumps(_stop_ids(spec)),
        "draft_source": source("method.draft_model", _resolved(resolve_pretrained, draft)) if draft else None,
        "dataset_source": dataset,
        "task_definition": task_definition(task),
        "device_class": resolve_device(spec.device).split(":")[0],
    }
    return spec.identity


def task_definition(task: Task) -> str:
    """What the task does: ``version=<its declared version> yaml=<fingerprint of its YAML files>`` (the task's YAML
    and those it includes), not its code's bytes: an edit that keeps its prompts and scores keeps its runs' identity,
    and one that changes them bumps ``metadata.version`` (tests/test_task_versions.py holds every shipped task to it).
    A task of lm-eval's registry declares no version of evalkit's: its folders are fingerprinted whole, code included
    (documentation and schema.py aside)."""
    fingerprint = identity.fingerprint(task.definition_paths(), skip_suffixes=(".md",), skip_names=("schema.py",))
    version = task.version()
    return fingerprint if version is None else f"version={version} yaml={fingerprint}"


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
    return _digest({**spec.flat_config(), **identify(spec)})


def _digest(ident: dict) -> str:
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:12]


# Each task's task_definition before tasks declared versions, and the one it had when they came.
EARLIER_DEFINITIONS = "task_definitions_before_versions.json"


def earlier_digest(spec: RunSpec) -> str | None:
    """The config digest this config had before tasks declared versions (their folders' bytes were their identity),
    where its task is still as it was then (its YAML and version as they came); None otherwise. Runs made then are
    runs of this config: :func:`evalkit.run.results_dir.completed_runs` renames them to its digest."""
    ident = identify(spec)
    recorded = _earlier_definitions().get(spec.task)
    if not isinstance(recorded, dict) or recorded.get("now") != ident["task_definition"]:
        return None
    return _digest({**spec.flat_config(), **ident, "task_definition": recorded["before"]})


@functools.cache
def _earlier_definitions() -> dict:
    from evalkit.core.paths import tasks_dir

    path = tasks_dir() / EARLIER_DEFINITIONS
    return json.loads(path.read_text()) if path.is_file() else {}


def run_id_for(spec: RunSpec, started: dt.datetime) -> str:
    budget = spec.budget or "nobudget"
    return f"{started:%Y%m%dT%H%M%S}-{spec.task}-{spec.method}-{budget}-{config_digest(spec)}-{uuid.uuid4().hex[:6]}"


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

