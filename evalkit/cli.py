"""``evalkit``: the Hydra entry point. Composition happens here; the work happens in :mod:`evalkit.runner`.

    evalkit task=kv_retrieval                 # full-cache baseline
    evalkit +budget=4x task=kv_retrieval      # same run, SnapStream at 4x
    evalkit -m +budget=2x,4x,8x method=snapkv,snapstream task=kv_retrieval
"""

from __future__ import annotations

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from evalkit.paths import conf_dir
from evalkit.runner import (
    ConfigError,
    Interrupted,
    RunError,
    completed_runs,
    run,
    summary,
    validate,
)


def method_was_chosen(overrides: list[str]) -> bool:
    """Whether the user picked the method (otherwise a run without budget is the full-cache baseline)."""
    return any(o.lstrip("+~").split("=", 1)[0] in ("method", "method.name") for o in overrides)


def evaluate(cfg: DictConfig, overrides: list[str], sweeping: bool = False) -> None:
    """One job. A mistake is one line on stderr and exit status 2 with nothing written; in a sweep the job is
    skipped with that line instead, so one bad pairing never stops the others. Ctrl-C exits 130, keeping what was
    generated for the next start to resume."""
    try:
        plain = OmegaConf.to_container(cfg, resolve=True)
        spec = validate(plain, method_explicit=method_was_chosen(overrides))
        result = run(spec)
    except (ConfigError, RunError) as error:
        kind = "config error" if isinstance(error, ConfigError) else "error"
        if sweeping:
            print(f"evalkit: skipped in this sweep: {error}", flush=True)
            return
        print(f"evalkit: {kind}: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    except Interrupted as interrupted:
        print(f"evalkit: {interrupted}", file=sys.stderr, flush=True)
        sys.exit(130)
    except KeyboardInterrupt:
        print("evalkit: interrupted before any generation; nothing written", file=sys.stderr, flush=True)
        sys.exit(130)
    if result is None:
        done = completed_runs(spec.results_dir, spec)
        print(f"skipped: this config already has results ({done[-1]}); resume=false runs it again")
        return
    print(summary(result, spec))


@hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")
def _main(cfg: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    evaluate(cfg, list(hydra_cfg.overrides.task), sweeping=hydra_cfg.mode == RunMode.MULTIRUN)


def composition_error(argv: list[str]) -> str | None:
    """Hydra's own composition errors (an unknown group option or key, a malformed override) as one line, for a
    single run; None when the command line composes (or is a sweep or a Hydra query, which Hydra reports itself)."""
    from hydra import compose, initialize_config_dir
    from hydra._internal.utils import get_args_parser

    args, _ = get_args_parser().parse_known_args(argv)
    if args.multirun or args.cfg or args.info or args.shell_completion or args.help or args.hydra_help:
        return None
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            compose("config", overrides=args.overrides)
    except Exception as error:  # noqa: BLE001 (Hydra raises several kinds; each says what is wrong)
        text = str(error).split("Config search path:")[0].split("\nSee https://")[0]
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        if len(lines) > 1 and lines[1].startswith("Available options in"):
            return f"{lines[0]}; {lines[1].rstrip(':')}: {', '.join(lines[2:])}"
        return " ".join(lines)
    return None


def main() -> None:
    error = composition_error(sys.argv[1:])
    if error:
        print(f"evalkit: config error: {error}", file=sys.stderr)
        sys.exit(2)
    _main()


if __name__ == "__main__":
    main()
