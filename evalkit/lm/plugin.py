"""Makes ``lm_eval --model evalkit ...`` work: lm-eval's command line has no plugin mechanism, so the installed
``evalkit-lm-eval.pth`` imports this module when, and only when, the interpreter runs lm-eval's CLI (``lm_eval``,
``lm-eval`` or ``python -m lm_eval``). It registers evalkit's adapter lazily: ``evalkit.lm`` (torch, transformers)
is imported only when lm-eval asks for the model. Once it has, a mistake evalkit finds (a bad ``--model_args``) ends
the command with evalkit's one line, as evalkit's own command line says it (:func:`one_line_errors`).
"""

from __future__ import annotations

import os
import sys


def is_lm_eval_cli(argv: list[str]) -> bool:
    program = os.path.basename(argv[1]) if len(argv) > 1 else ""
    return program in ("lm_eval", "lm-eval") or argv[1:3] == ["-m", "lm_eval"]


def register() -> None:
    import lm_eval.models  # noqa: F401 (lm-eval's own models first: its registry loads them only while empty)
    from lm_eval.api.registry import model_registry

    model_registry.register("evalkit", target="evalkit.lm.model:EvalkitLM")


def one_line_errors(previous):
    """``sys.excepthook`` over ``previous``: once lm-eval has loaded evalkit's model, an error evalkit raises for its
    user (:class:`~evalkit.core.errors.ConfigError`, :class:`~evalkit.core.errors.RunError`: their message is one line) ends the
    process with that line on stderr and exit status 2; any other error (lm-eval's own: an unknown task) goes to
    ``previous`` as before."""

    def hook(kind, error, traceback):
        errors = sys.modules.get("evalkit.core.errors")
        if "evalkit.lm" in sys.modules and errors is not None and isinstance(error, (errors.ConfigError,
                                                                                     errors.RunError)):
            label = "config error" if isinstance(error, errors.ConfigError) else "error"
            print(f"evalkit: {label}: {error}", file=sys.stderr, flush=True)
            sys.exit(2)  # from an excepthook: the process exits with this status
        previous(kind, error, traceback)

    return hook


if is_lm_eval_cli(getattr(sys, "orig_argv", sys.argv)):
    register()
    sys.excepthook = one_line_errors(sys.excepthook)
