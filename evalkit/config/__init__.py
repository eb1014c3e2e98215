"""A run's config: composed from conf/ as the ``evalkit`` command composes it (here), a method's settings and their
schema (:mod:`.method_schema`) and the policy they make (:mod:`.method_config`).

The run config as the ``evalkit`` command composes it, for Python callers (notebooks, tests): Hydra's composition
of conf/ with the command line's overrides, as a plain dict for :func:`evalkit.run.validate`.

``budget`` is a plain key (``budget=4x``, ``budget=tokens_4096``); the appending form ``+budget=4x`` of earlier
releases is accepted everywhere a command line is, and ``~budget`` means no budget. Importing this module registers
the ``${evalkit_methods:}`` resolver the presets use and ``${task_default:KEY}``, with which conf/task/ reads a task's
defaults from its own YAML instead of repeating them.
"""

from __future__ import annotations

from omegaconf import OmegaConf

from evalkit.core.paths import conf_dir


def registered_methods() -> str:
    """Every method evalkit knows (the compression registry), comma-separated: ``${evalkit_methods:}`` in a preset's
    sweep, so that a new method joins the grids without an edit. Loads torch (a sweep's start pays it once)."""
    import evalkit.compression as ec

    return ",".join(sorted(ec.POLICIES, key=lambda name: (name != "full", name)))


def task_default(key: str, *, _root_) -> object:
    """``${task_default:generation_kwargs.temperature}``: the value at the dotted ``key`` of the task's own lm-eval
    YAML (``tasks/<task.name>/<task.name>.yaml``, its includes merged), so a default lives once, where the official
    protocol is written; conf/task/ names the option a user overrides and documents it. Reads YAML only (no torch)."""
    from evalkit.benchmark import FolderTask

    name = _root_.task.name
    value = FolderTask(name).definition()
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(f"task {name}: its YAML (tasks/{name}/{name}.yaml) has no {key!r} for ${{task_default:{key}}}")
        value = value[part]
    return value


OmegaConf.register_new_resolver("evalkit_methods", registered_methods, replace=True)
OmegaConf.register_new_resolver("task_default", task_default, replace=True)


def normalize_overrides(overrides: list[str]) -> list[str]:
    """The command line's overrides with ``+budget=X`` read as ``budget=X`` and ``~budget`` as ``budget=null``
    (``budget`` has a default, so Hydra itself would refuse to append it)."""
    out = []
    for override in overrides:
        if override.startswith("+budget=") and not override.startswith("++"):
            override = override[1:]
        elif override in ("~budget", "~budget=null"):
            override = "budget=null"
        out.append(override)
    return out


def compose(*overrides: str) -> dict:
    """The run config for ``overrides`` (e.g. ``compose("budget=4x", "task=needle")``), resolved, as a plain dict."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = hydra_compose("config", overrides=normalize_overrides(list(overrides)))
    return OmegaConf.to_container(cfg, resolve=True)
