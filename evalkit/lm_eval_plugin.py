"""Makes ``lm_eval --model evalkit ...`` work: lm-eval's command line has no plugin mechanism, so the installed
``evalkit-lm-eval.pth`` imports this module when, and only when, the interpreter runs lm-eval's CLI (``lm_eval``,
``lm-eval`` or ``python -m lm_eval``). It registers evalkit's adapter lazily: ``evalkit.lm`` (torch, transformers)
is imported only when lm-eval asks for the model.
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

    model_registry.register("evalkit", target="evalkit.lm:EvalkitLM")


if is_lm_eval_cli(getattr(sys, "orig_argv", sys.argv)):
    register()
