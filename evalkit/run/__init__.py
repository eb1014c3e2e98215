"""One evaluation run: its config checked (:mod:`.spec`), its identity (:mod:`.digest`), its memory price
(:mod:`.pricing`), its lm-eval task (:mod:`.tasks`) and the run itself (:mod:`.runner`)."""

from .digest import completed_runs, config_digest, identify, lcb_release_sources
from .errors import ConfigError, Interrupted, InvalidCombination, RunError
from .pricing import deployed_capacity, memory_rows
from .runner import RunResult, remove_unfinished_tables, run, summary
from .spec import METHOD_PARAMS, MODEL_KEYS, RUN_KEYS, TASK_OPTION_KEYS, RunSpec, check_known, validate
from .tasks import task_with_options

__all__ = [
    "METHOD_PARAMS", "MODEL_KEYS", "RUN_KEYS", "TASK_OPTION_KEYS", "ConfigError", "Interrupted", "InvalidCombination",
    "RunError", "RunResult", "RunSpec", "check_known", "completed_runs", "config_digest", "deployed_capacity",
    "identify", "lcb_release_sources", "memory_rows", "remove_unfinished_tables", "run", "summary",
    "task_with_options", "validate",
]
