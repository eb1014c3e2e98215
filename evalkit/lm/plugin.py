"""Makes ``lm_eval --model evalkit ...`` work: lm-eval's command line has no plugin mechanism, so the installed
``evalkit-lm-eval.pth`` imports this module when, and only when, the interpreter runs lm-eval's CLI (``lm_eval``,
``lm-eval`` or ``python -m lm_eval``). It registers evalkit's adapter lazily: ``evalkit.lm`` (torch, transformers)
is imported only when lm-eval asks for the model. Once it has, a mistake evalkit finds (a bad ``--model_args``) ends
the command with evalkit's one line, as evalkit's own command line says it (:func:`one_line_errors`). ``--model_args``
are checked as lm-eval's command starts, before its own lines and before the model's weights load
(:func:`check_first`), so that such a mistake is that one line alone.
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


def check_first() -> None:
    """lm-eval's ``run`` command, for ``--model evalkit``, checks the model's arguments first (:func:`check_model_args`),
    before its first line. Where lm-eval's command line is laid out otherwise, the model checks them as it is made."""
    try:
        from lm_eval._cli.harness import HarnessCLI
    except ImportError:
        return
    execute = HarnessCLI.execute

    def checked(self, args):
        if getattr(args, "command", None) == "run" and getattr(args, "model", None) == "evalkit":
            check_model_args(args.model_args or {})
        return execute(self, args)

    HarnessCLI.execute = checked


def check_model_args(model_args: dict | str) -> None:
    """What ``EvalkitLM.create_from_arg_string`` checks before the model loads, and then the model's own limits from
    its config alone (:func:`evalkit.models.limits.check_model_limits`): a ConfigError or RunError, one line."""
    import inspect

    from evalkit.config.method_config import policy_from_config
    from evalkit.lm.model import EvalkitLM
    from evalkit.lm.requests import check_model_arguments, model_arguments
    from evalkit.models.limits import check_model_limits, model_config

    text = model_args if isinstance(model_args, str) else ",".join(f"{k}={v}" for k, v in model_args.items())
    arguments = model_arguments(text, None, cuda_available=True)
    check_model_arguments(arguments, EvalkitLM.__init__)
    if arguments.get("pretrained") is None:
        return  # the model says what it needs
    pretrained = str(arguments["pretrained"])
    _, config = model_config(pretrained, arguments.get("revision"))
    max_context = int(arguments.get("max_context") or getattr(config, "max_position_embeddings", 0) or 0)
    if max_context < 1:
        return
    own = inspect.signature(EvalkitLM.__init__).parameters
    settings = {key: value for key, value in arguments.items() if key not in own}
    policy = policy_from_config({"name": arguments.get("method", "full"), **settings}, arguments.get("budget"),
                                max_context)
    check_model_limits(config, policy, max_context, pretrained)


if is_lm_eval_cli(getattr(sys, "orig_argv", sys.argv)):
    register()
    sys.excepthook = one_line_errors(sys.excepthook)
    check_first()
