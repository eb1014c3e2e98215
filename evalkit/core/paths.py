"""Where conf/ and tasks/ are: the checkout's top-level folders, or their copies inside an installed wheel."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parents[1]  # the evalkit package


_MARKERS = {"conf": "config.yaml", "tasks": "kv_retrieval"}


def _find(name: str) -> Path:
    # An installed wheel carries its own copy; otherwise this is a checkout (an editable install included).
    for candidate in (_PACKAGE / f"_{name}", _PACKAGE.parent / name):
        if (candidate / _MARKERS[name]).exists():
            return candidate
    raise FileNotFoundError(f"evalkit cannot find its {name}/ folder (looked beside and inside {_PACKAGE})")


def conf_dir() -> Path:
    return _find("conf")


def tasks_dir() -> Path:
    return _find("tasks")


@contextlib.contextmanager
def naming(path: str | os.PathLike):
    """An OSError raised inside names ``path`` where the code that raised it named no file (pyarrow's and pandas'
    writers, writes to an open handle), so that a full disk says which file it stopped."""
    try:
        yield
    except OSError as error:
        if error.filename is not None or error.errno is None:
            raise
        raise OSError(error.errno, os.strerror(error.errno), str(path)) from error
