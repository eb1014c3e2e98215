"""A sweep on the terminal: a header, one line per finished job and an overall bar, in place of each job's own header,
phases and table (those go to the job's log). :class:`SweepProgress` is the Hydra callback that conf/config.yaml
names; it also quiets Hydra's own launcher lines. The jobs of a launcher that runs them elsewhere (Ray, SLURM) print
their line where that launcher keeps their output, numbered as Hydra numbers them."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from hydra.experimental.callback import Callback

from evalkit.core import console

from .sweeper import planned, swept_keys


@dataclass
class Plan:
    """The sweep this process launches: its job count, the keys it varies, and what its jobs said so far."""

    total: int
    swept: list[str]
    bar: object = None  # the overall bar, where the jobs run in this process
    outcomes: dict[str, int] = field(default_factory=dict)

    @property
    def finished(self) -> int:
        return sum(self.outcomes.values())


_PLAN: list[Plan] = []  # the sweep running in this process (none in a job that runs elsewhere)


def sweep_jobs(config) -> list[list[str]]:
    """The overrides of each job the sweep of ``config`` launches, in Hydra's order: every combination of the
    sweeper's params and the command line's overrides (a later value of a key replaces an earlier one), less those
    that cannot run where the sweep's sweeper is evalkit's (:mod:`evalkit.run.sweeper`)."""
    return planned(config).jobs


class QuietHydra(Callback):
    """Hydra's launcher lines ("Launching N jobs locally", "#3 : ...") left out: each job says what it runs."""

    def on_multirun_start(self, config, **kwargs) -> None:
        for name in ("hydra", "hydra_plugins"):
            logging.getLogger(name).setLevel(logging.WARNING)


class SweepProgress(QuietHydra):
    """Hydra's callback for evalkit's multirun (it holds no state itself: Ray and submitit pickle it to their
    workers)."""

    def on_multirun_start(self, config, **kwargs) -> None:
        super().on_multirun_start(config, **kwargs)
        try:
            sweep = planned(config)
        except Exception:  # noqa: BLE001 (a sweep Hydra's parser reads only with its config loader: Hydra reports it)
            return
        if not sweep.jobs:  # none can run: the sweeper says so in one line
            return
        launcher = str(config.hydra.launcher.get("_target_", ""))
        here = launcher.endswith("BasicLauncher")
        plan = Plan(total=len(sweep.jobs), swept=swept_keys(sweep.jobs))
        varies = f" over {', '.join(plan.swept)}" if plan.swept else ""
        where = "" if here else f" on {launcher.rsplit('.', 1)[-1]}; each job's output under {config.hydra.sweep.dir}/"
        left_out = f"\n  {sweep.left_out_line()}" if sweep.left_out else ""
        console.say(f"evalkit: sweep of {plan.total} jobs{varies}{where}{left_out}\n  results: "
                    f"{config.get('results_dir')}/ (each job's libraries' log under logs/ there)")
        if here:
            from tqdm import tqdm

            plan.bar = tqdm(total=plan.total, desc="sweep", unit="job", file=console.stream(), dynamic_ncols=True)
        _PLAN[:] = [plan]

    def on_multirun_end(self, config, **kwargs) -> None:
        if not _PLAN:
            return
        plan = _PLAN.pop()
        if plan.bar is None:
            return
        plan.bar.close()
        said = ", ".join(f"{count} {outcome}" for outcome, count in plan.outcomes.items())
        console.say(f"sweep done: {plan.finished} of {plan.total} jobs ({said}); compare them: "
                    f"evalkit-report {config.get('results_dir')}")


def job_label(overrides: list[str], number: int) -> str:
    """The job's number and the values of the keys the sweep varies (every override where the sweep is elsewhere)."""
    if not _PLAN:
        return f"[#{number}] {' '.join(overrides)}"
    plan = _PLAN[0]
    shown = [o.lstrip("+~") for o in overrides if o.lstrip("+~").partition("=")[0] in plan.swept]
    width = len(str(plan.total))
    return f"[{plan.finished + 1:>{width}}/{plan.total}] {' '.join(shown)}"


def job_done(label: str, outcome: str, said: str) -> None:
    """The finished job's one line, ``label · said``, above the sweep's bar; ``outcome`` (ran, already done,
    skipped) is counted for the sweep's last line."""
    console.say(f"{label} · {said}")
    if _PLAN:
        plan = _PLAN[0]
        plan.outcomes[outcome] = plan.outcomes.get(outcome, 0) + 1
        if plan.bar is not None:
            plan.bar.update(1)
