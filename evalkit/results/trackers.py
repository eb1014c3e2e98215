"""A finished run logged to an experiment tracker, offline (``logger=trackio`` or ``logger=wandb``): its config, the
values of its metrics table (scores and the measured costs, keyed ``<metric>/<subset>``), and its metrics and samples
tables as the tracker's Tables.

The run's tables are written first; the tracker is given what they hold, read back from them, in a child process
(``python -m evalkit.results.trackers``): trackio picks its store (TRACKIO_DIR) once, when it is imported, and a
tracker that fails there, or crashes, costs the run one warning line, never its tables. A run without a tracker
imports neither tracker.

- trackio: its local SQLite store in ``logger.dir`` (default ``<results_dir>/trackio``), project ``logger.project``,
  the run named by its run id, in group ``logger.group``.
- wandb: ``mode=offline``, its run folder under ``<logger.dir>/wandb/`` (default ``<results_dir>/wandb/``), with the
  same project, name and group.

The jobs of a sweep (``evalkit -m``) share one group, named after the sweep (its Hydra sweep folder) unless
``logger.group`` names one.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from evalkit.core.console import say, warn
from evalkit.core.errors import ConfigError, one_line

TRACKERS = ("trackio", "wandb")  # each the name of its package and of evalkit's extra that installs it
ANSWER = "evalkit-tracker:"  # the child's answer on stdout: this, then {"where": folder} or {"error": why}
TIMEOUT_S = 900  # a tracker still logging after this long is given up (the run's tables are written)
# Where trackio would log elsewhere than its local store: left out of its environment.
TRACKIO_REMOTE = ("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL", "TRACKIO_BUCKET_ID", "TRACKIO_DATASET_ID")


@dataclasses.dataclass(frozen=True)
class LoggerSettings:
    """The tracker a run logs to (see conf/logger/)."""

    name: str
    project: str = "evalkit"
    dir: str | None = None  # None: in the run's results_dir
    group: str | None = None  # None: no group (a single run), or the sweep's


def missing_tracker(name: str) -> str:
    return f"logger={name} needs {name}, which is not installed: pip install 'evalkit[{name}]'"


def logger_settings(section: dict | None) -> LoggerSettings | None:
    """The ``logger`` config section checked (None: no tracker); one line for a mistake, and for the tracker's
    package missing, before any model loads."""
    section = dict(section or {})
    name = section.pop("name", "none")
    if name == "none":
        return None
    if name not in TRACKERS:
        raise ConfigError(f"logger must be none, {' or '.join(TRACKERS)}, got {name!r}")
    known = {field.name for field in dataclasses.fields(LoggerSettings)} - {"name"}
    unknown = sorted(set(section) - known)
    if unknown:
        raise ConfigError(f"logger={name} has no setting {unknown[0]!r} (it has {', '.join(sorted(known))})")
    project = section.get("project", "evalkit")
    if not isinstance(project, str) or not project.strip():
        raise ConfigError(f"logger.project must be a name, got {project!r}")
    for key in ("dir", "group"):
        if section.get(key) is not None and (not isinstance(section[key], str) or not section[key].strip()):
            raise ConfigError(f"logger.{key} must be {'a folder' if key == 'dir' else 'a name'} or null, got "
                              f"{section[key]!r}")
    if not _installed(name):
        raise ConfigError(missing_tracker(name))
    return LoggerSettings(name, **section)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: its import made to fail (None in sys.modules)
        return False


def store(settings: LoggerSettings, results_dir: str | os.PathLike) -> Path:
    """The folder the tracker writes to: trackio's store (its TRACKIO_DIR), or the folder wandb makes ``wandb/`` in."""
    if settings.dir is not None:
        return Path(settings.dir).absolute()
    results = Path(results_dir).absolute()
    return results / "trackio" if settings.name == "trackio" else results


def log_run(spec, run_id: str, metrics_path: Path, samples_path: Path) -> Path | None:
    """Log run ``run_id`` (its tables written at these paths) to ``spec.logger``'s tracker; return where it went
    (trackio's store, wandb's offline run folder), or None: no tracker, or a failure, which is one warning line on
    stderr (the run's tables, written before, stay as they are)."""
    settings = spec.logger
    if settings is None:
        return None
    job = {**dataclasses.asdict(settings), "dir": str(store(settings, spec.results_dir)), "run_id": run_id,
           "metrics": str(Path(metrics_path).absolute()), "samples": str(Path(samples_path).absolute())}
    try:
        where = _in_child(job)
    except (Exception, KeyboardInterrupt) as error:  # noqa: BLE001 (whatever went wrong, the run itself is complete)
        reason = "interrupted" if isinstance(error, KeyboardInterrupt) else one_line(error)
        warn(f"logger={settings.name}: run {run_id} was not logged ({reason}); its tables are written")
        return None
    group = f", group {settings.group}" if settings.group else ""
    say(f"  logged to {settings.name}: project {settings.project}{group}, run {run_id} ({where})")
    return where


def _in_child(job: dict) -> Path:
    """Log ``job`` in a child process (its environment: the tracker offline, trackio's store chosen); where it went,
    or a RuntimeError saying why not."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # trackio asks the hub who the user is; nothing goes out
    if job["name"] == "trackio":
        env = {key: value for key, value in env.items() if key not in TRACKIO_REMOTE} | {"TRACKIO_DIR": job["dir"]}
    else:
        env |= {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    done = subprocess.run([sys.executable, "-m", __name__, json.dumps(job)], env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    said = [json.loads(line[len(ANSWER):]) for line in done.stdout.splitlines() if line.startswith(ANSWER)]
    if said and "error" in said[-1]:
        raise RuntimeError(said[-1]["error"])
    if done.returncode != 0 or not said:  # a crash: the last words on its stderr
        raise RuntimeError((done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1])
    return Path(said[-1]["where"])


def tracked(metrics_path: str | os.PathLike, samples_path: str | os.PathLike) -> tuple[dict, dict, list, list]:
    """What a tracker is given, read from a run's tables: its config (the config columns, the same on every row), the
    metric values (``<metric>/<subset>``: scores, measured costs), and the rows of both tables without the config
    columns."""
    import pyarrow.parquet as pq

    from .tables import CONFIG_COLUMNS

    def without_config(rows: list[dict]) -> list[dict]:
        return [{key: value for key, value in row.items() if key not in CONFIG_COLUMNS} for row in rows]

    metrics, samples = (pq.read_table(path).to_pylist() for path in (metrics_path, samples_path))
    config = {key: value for key, value in metrics[0].items() if key in CONFIG_COLUMNS}
    values = {f"{row['metric']}/{row['subset']}": row["value"] for row in metrics if row["value"] is not None}
    return config, values, without_config(metrics), without_config(samples)


def _to_trackio(job: dict, config: dict, values: dict, metrics: list, samples: list) -> Path:
    import trackio
    from trackio.sqlite_storage import SQLiteStorage

    run = trackio.init(project=job["project"], name=job["run_id"], group=job["group"], config=config,
                       auto_log_gpu=False, auto_log_cpu=False, embed=False)
    run.log({**values, "metrics_table": trackio.Table(data=metrics), "samples_table": trackio.Table(data=samples)})
    run.finish()
    if not SQLiteStorage.get_log_count(job["project"], run=run.name, run_id=run.id):  # trackio warns, not raises
        raise RuntimeError(f"trackio's store {job['dir']} holds no log of run {run.name}")
    return Path(job["dir"])


def _to_wandb(job: dict, config: dict, values: dict, metrics: list, samples: list) -> Path:
    import wandb

    Path(job["dir"]).mkdir(parents=True, exist_ok=True)
    settings = wandb.Settings(silent=True, console="off", save_code=False, x_disable_stats=True)
    run = wandb.init(mode="offline", dir=job["dir"], project=job["project"], group=job["group"],
                     name=job["run_id"], config=config, settings=settings)
    folder = Path(run.dir).parent  # <dir>/wandb/offline-run-<time>-<id>
    tables = {name: wandb.Table(columns=list(rows[0]) if rows else [], data=[list(row.values()) for row in rows])
              for name, rows in (("metrics_table", metrics), ("samples_table", samples))}
    run.log({**values, **tables})
    run.finish()
    if not any(path.stat().st_size for path in folder.glob("run-*.wandb")):
        raise RuntimeError(f"wandb wrote no run file in {folder}")
    return folder


def main(argv: list[str] | None = None) -> None:
    """The child process: log the run that ``argv[0]`` (JSON) describes. Its answer is one line on stdout, ``ANSWER``
    and where the run went or why it did not; the tracker's own messages (at exit too) go to stderr."""
    job = json.loads((argv if argv is not None else sys.argv[1:])[0])
    out, sys.stdout = sys.stdout, sys.stderr
    log = _to_trackio if job["name"] == "trackio" else _to_wandb
    try:
        answer = {"where": str(log(job, *tracked(job["metrics"], job["samples"])))}
    except Exception as error:  # noqa: BLE001 (said to the run, which warns)
        answer = {"error": f"{type(error).__name__}: {one_line(error)}"}
    print(ANSWER + json.dumps(answer), file=out, flush=True)
    if "error" in answer:
        sys.exit(1)


if __name__ == "__main__":
    main()
