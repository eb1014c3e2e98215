"""The former home of a run (kept for one release): everything now lives in :mod:`evalkit.run` and
:mod:`evalkit.results.rows`; import from there."""

from evalkit.results.rows import BYTE_COLUMNS, byte_rows, tidy_rows  # noqa: F401
from evalkit.run import *  # noqa: F403
from evalkit.run import __all__  # noqa: F401
from evalkit.run.spec import _device_map  # noqa: F401
