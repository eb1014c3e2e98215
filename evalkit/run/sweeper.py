"""A sweep's jobs, less those that cannot run. Hydra's basic sweeper makes every combination of a sweep's values, and a
preset sweeps method x budget x ...: some of those pairs do not exist (the full cache with a budget, a compressing
method without one), and each such job used to start only to be refused. :func:`runnable` composes every job's config
as Hydra composes it and puts it through the check its own start runs (:func:`~evalkit.run.spec.precheck`, then
:func:`~evalkit.run.spec.validate`, as :func:`evalkit.cli.evaluate` calls them): the jobs that check refuses are left
out before any job starts, counted on the sweep's first lines, and the sweep runs the rest.

The presets select it as Hydra's sweeper (``defaults: [override /hydra/sweeper: evalkit]``, the config
conf/hydra/sweeper/evalkit.yaml): Hydra takes a sweeper only from the ``hydra_plugins`` package, so its class is
there (``hydra_plugins/evalkit_sweeper/``: the basic sweeper launching :func:`batches`). Imports stay light here (the
plugin loads with every Hydra start); the check loads torch when it runs.
"""

from __future__ import annotations

import copy
import dataclasses

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

from evalkit.core.errors import ConfigError, InvalidCombination

# Hydra's name for the sweeper (the plugin's class), as conf/hydra/sweeper/evalkit.yaml gives it.
TARGET = "hydra_plugins.evalkit_sweeper.evalkit_sweeper.EvalkitSweeper"


def method_was_chosen(overrides: list[str]) -> bool:
    """Whether the user picked the method (otherwise a run without budget is the full-cache baseline)."""
    return any(o.lstrip("+~").split("=", 1)[0] in ("method", "method.name") for o in overrides)


def swept_keys(jobs: list[list[str]]) -> list[str]:
    """The keys whose value differs between jobs, in the order they appear."""
    values: dict[str, set[str]] = {}
    for job in jobs:
        for override in job:
            key, _, value = override.partition("=")
            values.setdefault(key.lstrip("+~"), set()).add(value)
    return [key for key, seen in values.items() if len(seen) > 1]


@dataclasses.dataclass
class Sweep:
    """The jobs a sweep runs (each its overrides, in Hydra's order) and those left out, each with the error its start
    would have refused it with."""

    jobs: list[list[str]]
    left_out: list[tuple[list[str], ConfigError]] = dataclasses.field(default_factory=list)

    def left_out_line(self) -> str | None:
        """What was left out, in one line (None: nothing): the pairs that do not exist counted, any other refusal
        said with the values its job was swept with."""
        if not self.left_out:
            return None
        pairs = sum(isinstance(error, InvalidCombination) for _, error in self.left_out)
        varied = swept_keys([*self.jobs, *(job for job, _ in self.left_out)])
        refused = [f"{' '.join(o.lstrip('+~') for o in job if o.lstrip('+~').partition('=')[0] in varied)}: {error}"
                   for job, error in self.left_out if not isinstance(error, InvalidCombination)]
        parts = [f"{pairs} method/budget {'pair that does' if pairs == 1 else 'pairs that do'} not exist (a budget "
                 "for a method that takes none, or none for one that needs it)"] if pairs else []
        parts += [f"refused: {said}" for said in refused[:3]] + ([f"{len(refused) - 3} more refused"] * (len(refused) > 3))
        return f"left out: {'; '.join(parts)}"


def product(config) -> list[list[str]]:
    """The overrides of each job, as Hydra's basic sweeper makes them: the sweeper's params, then the command line's
    overrides (a later value of a key replaces an earlier one), every combination."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    import evalkit.config  # noqa: F401 (the resolvers a preset's params use: ${evalkit_methods:})

    params = [f"{key}={value}" for key, value in (config.hydra.sweeper.get("params") or {}).items()]
    overrides = OverridesParser.create().parse_overrides([*params, *config.hydra.overrides.task])
    return BasicSweeper.split_arguments(overrides, None)[0]


def refusal(plain: dict, overrides: list[str]) -> ConfigError | None:
    """The error a job's start refuses its config (``plain``: composed and resolved) with, or None: the checks
    :func:`evalkit.cli.evaluate` runs before the run, with the same arguments."""
    from .spec import precheck, validate

    explicit = method_was_chosen(overrides)
    try:
        validate(plain, method_explicit=explicit, checked=precheck(plain, explicit, sweeping=True))
    except ConfigError as error:
        return error
    return None


def job_configs(config, jobs: list[list[str]], loader):
    """Each job's config as Hydra composes it for the job (less its ``hydra`` node), resolved to plain values:
    ``(job, config)``, or ``(job, None)`` where Hydra cannot compose it (Hydra says why when it launches the job).

    Hydra composes a job in two steps: the config groups its overrides choose (``method=snapkv``), then its other
    overrides set on the result (``budget=4x``), in their order. The first step is done once per choice of groups
    (``loader.load_sweep_config``) and the second with Hydra's own code, so that a grid of 540 jobs composes its
    groups 135 times instead of 540."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf, open_dict

    import evalkit.config  # noqa: F401 (the resolvers conf/ uses)

    parser, composed = OverridesParser.create(), {}
    for job in jobs:
        try:
            parsed = parser.parse_overrides(list(job))
            # Hydra's own rule (hydra._internal.defaults_list.Overrides): a group override names an existing group
            # and is no dict; every other override is set on the composed config.
            is_group = [loader.repository.group_exists(o.key_or_group) and not isinstance(o.value(), dict)
                        for o in parsed]
            chosen = tuple(o.input_line for o, group in zip(parsed, is_group) if group)
            if chosen not in composed:
                composed[chosen] = loader.load_sweep_config(config, list(chosen))
                with open_dict(composed[chosen]):
                    del composed[chosen]["hydra"]
            cfg = copy.deepcopy(composed[chosen])
            ConfigLoaderImpl._apply_overrides_to_config([o for o, group in zip(parsed, is_group) if not group], cfg)
            plain = OmegaConf.to_container(cfg, resolve=True)
        except Exception:  # noqa: BLE001 (Hydra's composition errors are many kinds; Hydra reports them at launch)
            plain = None
        yield list(job), plain


_CHECKED: dict[tuple, Sweep] = {}  # a sweep checked in this process: its header and its sweeper check it once


def runnable(config, jobs: list[list[str]], loader) -> Sweep:
    """``jobs`` less those whose config the job's own start would refuse (:func:`refusal`); a job Hydra cannot
    compose stays, for Hydra to report."""
    key = (str(config.hydra.job.config_name), tuple(config.hydra.overrides.hydra), tuple(map(tuple, jobs)))
    if key not in _CHECKED:
        sweep = Sweep(jobs=[])
        for job, plain in job_configs(config, jobs, loader):
            error = refusal(plain, job) if plain is not None else None
            if error is None:
                sweep.jobs.append(job)
            else:
                sweep.left_out.append((job, error))
        _CHECKED[key] = sweep
    return _CHECKED[key]


def selected(config) -> bool:
    """Whether ``config`` (a sweep's, with its ``hydra`` node) sweeps with this sweeper."""
    return str(config.hydra.sweeper.get("_target_", "")) == TARGET


def planned(config) -> Sweep:
    """The jobs the sweep of ``config`` launches: those :func:`runnable` keeps where ``config`` selects this sweeper,
    every combination otherwise."""
    jobs = product(config)
    if not selected(config):
        return Sweep(jobs=jobs)
    from hydra.core.global_hydra import GlobalHydra

    return runnable(config, jobs, GlobalHydra.instance().config_loader())


def batches(config, overrides, max_batch_size: int | None, loader) -> list[list[list[str]]]:
    """What the sweeper launches: the basic sweeper's jobs (``overrides``: parsed, the params' then the command line's)
    less those :func:`runnable` leaves out, in batches of ``max_batch_size`` as the basic sweeper makes them. A sweep
    none of whose jobs can run is one line, ``evalkit: config error: ...``, and exit status 2."""
    import sys

    (jobs,) = BasicSweeper.split_arguments(overrides, None)
    sweep = runnable(config, jobs, loader)
    if not sweep.jobs:
        print(f"evalkit: config error: no job of this sweep can run: {sweep.left_out[0][1]}", file=sys.stderr,
              flush=True)
        sys.exit(2)
    return list(BasicSweeper.split_overrides_to_chunks(sweep.jobs, max_batch_size))
