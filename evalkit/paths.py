"""Where conf/ and tasks/ are: the checkout's top-level folders, or their copies inside an installed wheel."""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def _find(name: str) -> Path:
    for candidate in (_PACKAGE.parent / name, _PACKAGE / f"_{name}"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"evalkit cannot find its {name}/ folder (looked beside and inside {_PACKAGE})")


def conf_dir() -> Path:
    return _find("conf")


def tasks_dir() -> Path:
    return _find("tasks")
