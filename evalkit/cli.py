"""``evalkit``: the Hydra entry point. Composition happens here; the work happens in :mod:`evalkit.run`.

    evalkit task=kv_retrieval                 # full-cache baseline
    evalkit +budget=4x task=kv_retrieval      # same run, SnapStream at 4x (budget=4x alike)
    evalkit -m +budget=2x,4x,8x method=snapkv,snapstream task=kv_retrieval
"""

from __future__ import annotations

import contextlib
import logging.config
import os
import signal
import sys
import time
from pathlib import Path

INTERRUPTED_EARLY = "evalkit: interrupted before the run started; nothing written"
# Hydra's `stdout` job logging (conf/config.yaml selects it), for a single run evaluated without @hydra.main.
JOB_LOGGING = {
    "version": 1, "disable_existing_loggers": False,
    "formatters": {"simple": {"format": "%(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "simple", "stream": "ext://sys.stdout"}},
    "root": {"level": "INFO", "handlers": ["console"]},
}


def _remember_interrupt(signum, frame) -> None:
    # Until the run starts (the libraries loading, Hydra composing), Ctrl-C is only remembered: raised inside an
    # import or a composition, a KeyboardInterrupt can be swallowed or turned into another error by a library's own
    # ``except``, and the run would go on as if it had not been pressed (or report a bogus mistake).
    global _INTERRUPTED
    _INTERRUPTED = True


def _stop_if_interrupted() -> None:
    """Ctrl-C remembered so far: the interrupted line and exit status 130, nothing written."""
    if _INTERRUPTED:
        print(INTERRUPTED_EARLY, file=sys.stderr, flush=True)
        sys.exit(130)


_INTERRUPTED = False
_PREVIOUS = signal.getsignal(signal.SIGINT)
if _PREVIOUS is signal.default_int_handler:  # not where SIGINT is ignored (nohup, a background job): keep that
    signal.signal(signal.SIGINT, _remember_interrupt)  # Ctrl-C's own action returns in _runner(), as the run starts
try:
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import DictConfig, OmegaConf

    from evalkit.config import normalize_overrides
    from evalkit.core import console
    from evalkit.core.console import say
    from evalkit.core.errors import ConfigError, Interrupted, RunError
    from evalkit.core.paths import conf_dir
    from evalkit.run.spec import precheck
    from evalkit.run.sweep_progress import job_done, job_label
    from evalkit.run.sweeper import method_was_chosen  # the sweeper checks a job's config as evaluate() does
except KeyboardInterrupt:
    _INTERRUPTED = True
_stop_if_interrupted()


def evaluate(cfg: DictConfig, overrides: list[str], sweeping: bool = False, job_number: int = 0) -> None:
    """One job. A mistake is one line on stderr and exit status 2 with nothing written; in a sweep the job is
    skipped with that line instead, so one bad pairing never stops the others. Ctrl-C exits 130, keeping what was
    generated for the next start to resume. A sweep's job (``job_number``: Hydra's) says one line when it ends."""
    log, made = None, []
    label, started = job_label(overrides, job_number) if sweeping else None, time.perf_counter()
    try:
        plain = OmegaConf.to_container(cfg, resolve=True)
        _stop_if_interrupted()
        explicit = method_was_chosen(overrides)
        checked = precheck(plain, explicit, sweeping)  # a mistake is answered before torch and transformers load
        for message in checked["warnings"]:
            console.warn(message)
        runner = _runner()
        spec = runner.validate(plain, method_explicit=explicit, checked=checked)
        shared = _sweep_share() if sweeping else None
        before = (shared.store.hits, shared.store.misses, shared.loads) if shared else None
        log = run_log(spec)
        made = [folder for folder in [log.parent, *log.parents] if not folder.exists()]  # deepest first
        if not sweeping:
            say(header(spec, log))
        with console.libraries_to_log(log, verbose=bool(plain.get("verbose")), quiet=sweeping):
            result = runner.run(spec, shared=shared)
    except (ConfigError, RunError) as error:
        kind = "config error" if isinstance(error, ConfigError) else "error"
        _discard(log, made)  # a mistake writes nothing
        if sweeping:
            job_done(label, "skipped", f"skipped in this sweep: {error}")
            return
        print(f"evalkit: {kind}: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    except Interrupted as interrupted:
        print(f"evalkit: {interrupted}", file=sys.stderr, flush=True)
        sys.exit(130)
    except KeyboardInterrupt:  # in validation, before the run began
        print(INTERRUPTED_EARLY, file=sys.stderr, flush=True)
        sys.exit(130)
    if result is None:
        done = runner.completed_runs(spec.results_dir, spec)
        if sweeping:
            job_done(label, "already done", f"already has results ({done[-1]}); resume=false runs it again")
        else:
            say(f"skipped: this config already has results ({done[-1]}); resume=false runs it again")
        return
    if not sweeping:
        say(runner.summary(result, spec))
        return
    hits, misses, loads = (now - then for now, then in zip((shared.store.hits, shared.store.misses, shared.loads),
                                                            before))
    model = "model loaded" if loads else "model shared"
    job_done(label, "ran", f"{runner.job_line(result, spec)} · {time.perf_counter() - started:.1f} s · {model}, "
                           f"{hits} of {hits + misses} prompt prefills replayed")


def header(spec, log) -> str:
    """The run's first lines: what runs, where, and where its results and its libraries' log go."""
    cache, prompt, context = spec.policy.cache_capacity(), spec.policy.prompt_capacity(), spec.max_context
    held = (f"cache {cache} of {context} tokens" if cache is not None else
            f"prompt kept to {prompt} of {context} tokens, the cache growing while decoding" if prompt is not None else
            f"cache not bounded by the budget; {context}-token context")
    budget = f" {spec.budget} ({held})" if spec.budget else " (full cache)"
    return (f"evalkit: {spec.model_name} · task {spec.task} · {spec.method}{budget} · device {spec.device}\n"
            f"  results: {spec.results_dir}/ (libraries' log: {log})")


def _discard(log: Path | None, made: list[Path]) -> None:
    """The run's log removed, and the folders it made (``made``, deepest first) where nothing else is in them."""
    if log is not None:
        with contextlib.suppress(OSError):  # e.g. results_dir lies under a file: there is nothing to remove
            log.unlink(missing_ok=True)
    for folder in made:
        with contextlib.suppress(OSError):
            folder.rmdir()


def run_log(spec) -> Path:
    """Where the run's libraries' output goes: ``<results_dir>/logs/<time>-<task>-<method>-<budget>.log``."""
    import datetime as dt

    stamp = dt.datetime.now().strftime("%Y%m%dT%H%M%S")
    return Path(spec.results_dir) / "logs" / f"{stamp}-{spec.task}-{spec.method}-{spec.budget or 'full'}.log"


_SWEEP: list = []  # this process's SweepShare, made by its first sweep job


def _sweep_share():
    """What the jobs of this sweep that run in this process share (the model, its prompts' prefills)."""
    if not _SWEEP:
        from evalkit.run.sweep_share import SweepShare

        _SWEEP.append(SweepShare())
    return _SWEEP[0]


def _runner():
    """:mod:`evalkit.run` with torch, transformers and lm-eval loaded (Ctrl-C remembered while they load); from here
    on Ctrl-C has its own action again: an interrupted run keeps what it generated."""
    import evalkit.compression  # noqa: F401  (torch and transformers: the seconds a start takes)
    import evalkit.run as runner

    if signal.getsignal(signal.SIGINT) is _remember_interrupt:
        signal.signal(signal.SIGINT, _PREVIOUS)
    _stop_if_interrupted()
    return runner


@hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")
def _main(cfg: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    sweeping = hydra_cfg.mode == RunMode.MULTIRUN
    if sweeping and "group" in cfg.get("logger", {}) and cfg.logger.group is None:
        cfg.logger.group = Path(str(hydra_cfg.sweep.dir)).name  # a tracker groups the sweep's jobs under its name
    evaluate(cfg, list(hydra_cfg.overrides.task), sweeping=sweeping, job_number=hydra_cfg.job.get("num") or 0)


def single_run(argv: list[str]) -> tuple[DictConfig | None, list[str], str | None]:
    """A single run's config, composed once: ``(config, overrides, None)``, or ``(None, [], error)`` with Hydra's
    composition error (an unknown group option or key, a malformed override) as one line. A sweep, a Hydra query or
    Hydra's own settings give ``(None, [], None)``: Hydra composes and reports those itself."""
    from hydra import compose, initialize_config_dir
    from hydra._internal.utils import get_args_parser

    args, _ = get_args_parser().parse_known_args(argv)
    if (args.multirun or args.cfg or args.info or args.shell_completion or args.help or args.hydra_help
            or args.config_path or args.config_name or args.config_dir
            or any(o.lstrip("+~").startswith("hydra.") for o in args.overrides)):
        return None, [], None
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            return compose("config", overrides=args.overrides), list(args.overrides), None
    except Exception as error:  # noqa: BLE001 (Hydra raises several kinds; each says what is wrong)
        return None, [], _one_line(error)


def _one_line(error: Exception) -> str:
    """A Hydra composition error as one line (with the available options where Hydra lists them, and the nearest of
    them to a misspelled option first: ``method=snapkvv: did you mean method=snapkv?``)."""
    import difflib
    import re

    text = str(error).split("Config search path:")[0].split("\nSee https://")[0]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(lines) > 1 and lines[1].startswith("Available options in"):
        missing = re.search(r"Could not find '(?:(.+)/)?([^/']+)'", lines[0])
        scores = {option: difflib.SequenceMatcher(None, missing[2], option).ratio() for option in lines[2:]} \
            if missing else {}
        best = max(scores.values(), default=0)
        near = [f"{missing[1] or ''}={option}" for option, score in scores.items() if score == best >= 0.6]
        hint = f"{missing[1] or ''}={missing[2]}: did you mean {' or '.join(near[:3])}? " if near else ""
        return f"{hint}{lines[0]}; {lines[1].rstrip(':')}: {', '.join(lines[2:])}"
    return " ".join(lines)


def without_unknown_options(argv: list[str]) -> list[str]:
    """A sweep's command line without the group options that do not exist (``method=nosuch,snapkv``): each is one
    line saying it is skipped, and the sweep runs the others, as it does for every other job it refuses. A sweep left
    with no option for a group is a config error. Any other command line is returned as it is."""
    from hydra import compose, initialize_config_dir
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep
    from hydra.errors import MissingConfigException

    args, _ = get_args_parser().parse_known_args(argv)
    if not args.multirun or not args.overrides:
        return argv
    try:
        overrides = OverridesParser.create().parse_overrides(args.overrides)
    except Exception:  # noqa: BLE001 (a malformed override: Hydra says so itself)
        return argv
    fixed = [o.input_line for o in overrides if not o.is_sweep_override()]
    argv = list(argv)
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        for override in overrides:
            if not override.is_sweep_override() or not isinstance(override.value(), ChoiceSweep):
                continue
            key = override.input_line.split("=", 1)[0]
            kept = []
            for value in override.sweep_string_iterator():
                try:
                    compose("config", overrides=[*fixed, f"{key}={value}"])
                except MissingConfigException as error:
                    line, choice = _one_line(error), f"{key.lstrip('+~')}={value}"
                    line = line if line.startswith(f"{choice}:") else f"{choice}: {line}"
                    print(f"evalkit: skipped in this sweep: {line}", flush=True)
                    continue
                except Exception:  # noqa: BLE001 (anything else is the job's to report)
                    pass
                kept.append(value)
            if not kept:
                print(f"evalkit: config error: no option of {key.lstrip('+~')} in this sweep exists", file=sys.stderr)
                sys.exit(2)
            argv[argv.index(override.input_line)] = f"{key}={','.join(kept)}"
    return argv


# Hydra launchers that an extra of evalkit installs: the packages (module, name) each needs, and the extra.
_RAY = (("hydra_plugins.hydra_ray_launcher", "hydra-ray-launcher"), ("ray", "ray"))
_SUBMITIT = (("hydra_plugins.hydra_submitit_launcher", "hydra-submitit-launcher"), ("submitit", "submitit"))
LAUNCHERS = {"ray": (_RAY, "ray"), "submitit_slurm": (_SUBMITIT, "slurm"), "submitit_local": (_SUBMITIT, "slurm")}


def _installed(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


def missing_launcher(argv: list[str]) -> str | None:
    """One line for a ``hydra/launcher=`` on the command line whose plugin is not installed (Hydra's own answer is a
    page that lists the launchers it found), or None."""
    for arg in argv:
        key, _, name = arg.lstrip("+~").partition("=")
        if key == "hydra/launcher" and name in LAUNCHERS:
            packages, extra = LAUNCHERS[name]
            missing = [package for module, package in packages if not _installed(module)]
            if missing:
                verb = "is" if len(missing) == 1 else "are"
                return f"hydra/launcher={name} needs {' and '.join(missing)}, which {verb} not installed: " \
                       f"pip install 'evalkit[{extra}]'"
    return None


def ray_cluster_overrides(argv: list[str]) -> list[str]:
    """``argv`` with the Ray launcher's object store size unset where it connects to a running cluster (an address
    given, or RAY_ADDRESS): hydra-ray-launcher 1.2 sets one for every ``ray.init``, which Ray refuses for a cluster
    it joins."""
    values = dict(arg.lstrip("+~").partition("=")[::2] for arg in argv if "=" in arg)
    joins = values.get("hydra.launcher.ray.init.address", "null") not in ("null", "") or os.environ.get("RAY_ADDRESS")
    if values.get("hydra/launcher") != "ray" or not joins or "hydra.launcher.ray.init.object_store_memory" in values:
        return argv
    return [*argv, "+hydra.launcher.ray.init.object_store_memory=null"]


def verbose_flag(argv: list[str]) -> list[str]:
    """``-v``/``--verbose`` as the override ``verbose=true``."""
    flags = ("-v", "--verbose")
    return [a for a in argv if a not in flags] + (["verbose=true"] if any(a in flags for a in argv) else [])


def main() -> None:
    try:
        sys.argv[1:] = verbose_flag(sys.argv[1:])
        sys.argv[1:] = normalize_overrides(sys.argv[1:])
        missing = missing_launcher(sys.argv[1:])
        if missing:
            print(f"evalkit: config error: {missing}", file=sys.stderr)
            sys.exit(2)
        sys.argv[1:] = ray_cluster_overrides(sys.argv[1:])
        cfg, overrides, error = single_run(sys.argv[1:])
        _stop_if_interrupted()
        if error:
            print(f"evalkit: config error: {error}", file=sys.stderr)
            sys.exit(2)
        if cfg is not None:  # what @hydra.main would do for it, without composing it again
            logging.config.dictConfig(JOB_LOGGING)
            evaluate(cfg, overrides)
            return
        sys.argv[1:] = without_unknown_options(sys.argv[1:])
        _stop_if_interrupted()
        _main()
    except KeyboardInterrupt:  # in Hydra's composition or launcher, outside any run
        print(INTERRUPTED_EARLY, file=sys.stderr, flush=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
