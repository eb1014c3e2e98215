"""One evaluation run: its config checked (:mod:`.spec`), its identity (:mod:`.digest`), its memory price
(:mod:`.pricing`), its lm-eval task (:mod:`.tasks`), what its results directory holds (:mod:`.results_dir`) and the
run itself (:mod:`.runner`); the errors it raises are :mod:`evalkit.core.errors`.

Names load with their module on first use, so that checking a config (:func:`precheck`) needs neither torch nor
transformers.
"""

from __future__ import annotations

import importlib

_HOMES = {
    "evalkit.core.errors": ("ConfigError", "Interrupted", "InvalidCombination", "RunError"),
    f"{__name__}.spec": ("MODEL_KEYS", "RUN_KEYS", "TASK_OPTION_KEYS", "RunSpec", "check_known",
                         "precheck", "validate"),
    f"{__name__}.digest": ("config_digest", "identify"),
    f"{__name__}.pricing": ("deployed_capacity", "memory_rows"),
    f"{__name__}.results_dir": ("completed_runs", "remove_unfinished_tables", "set_aside_damaged"),
    f"{__name__}.runner": ("RunResult", "job_line", "run", "summary"),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}
__all__ = sorted(_HOME_OF)


def __getattr__(name: str):
    if name not in _HOME_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME_OF[name]), name)


def __dir__():
    return sorted({*globals(), *__all__})
