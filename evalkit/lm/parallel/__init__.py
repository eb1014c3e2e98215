"""Data-parallel runs: one run's requests sharded over engine replicas on Ray (``parallel=ray``).

Only :class:`ParallelSettings` lives here; Ray is imported by :mod:`evalkit.lm.parallel.pool`, where a run asks for it.
"""

from __future__ import annotations

import dataclasses

from evalkit.core.errors import ConfigError

RAY_MISSING = "parallel=ray needs Ray, which is not installed: pip install 'evalkit[ray]'"


@dataclasses.dataclass(frozen=True)
class ParallelSettings:
    """How a run is spread over Ray replicas (see conf/parallel/ray.yaml)."""

    replicas: int
    address: str | None = None
    cpus_per_replica: int | None = None
    gpus_per_replica: float | None = None
    max_restarts: int = 3


def parallel_settings(section: dict | None) -> ParallelSettings | None:
    """The ``parallel`` config section checked (None: a single-process run); one line for a mistake, and for Ray
    missing where the section asks for it."""
    section = dict(section or {})
    name = section.pop("name", "single")
    if name == "single":
        return None
    if name != "ray":
        raise ConfigError(f"parallel must be single or ray, got {name!r}")
    known = {field.name for field in dataclasses.fields(ParallelSettings)}
    unknown = sorted(set(section) - known)
    if unknown:
        raise ConfigError(f"parallel=ray has no setting {unknown[0]!r} (it has {', '.join(sorted(known))})")
    for key, low in (("replicas", 1), ("max_restarts", 0), ("cpus_per_replica", 1)):
        value = section.get(key)
        if (value is not None or key == "replicas") and (isinstance(value, bool) or not isinstance(value, int)
                                                         or value < low):
            raise ConfigError(f"parallel.{key} must be an integer >= {low}{' or null' if key != 'replicas' else ''}, "
                              f"got {value!r}")
    gpus = section.get("gpus_per_replica")
    if gpus is not None and (isinstance(gpus, bool) or not isinstance(gpus, int | float) or gpus < 0):
        raise ConfigError(f"parallel.gpus_per_replica must be a number >= 0 or null, got {gpus!r}")
    address = section.get("address")
    if address is not None and not isinstance(address, str):
        raise ConfigError(f"parallel.address must be a Ray address (auto, host:port, ray://host:port) or null, got "
                          f"{address!r}")
    try:
        import ray  # noqa: F401
    except ImportError:
        raise ConfigError(RAY_MISSING) from None
    return ParallelSettings(**section)
