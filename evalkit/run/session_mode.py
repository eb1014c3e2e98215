"""A run's task mode, checked: ``task.mode`` (single | multi_request | multi_turn), ``task.history`` (own | gold) and
``session.recompress`` (never | each_call | new_content), and what a session mode cannot be combined with yet. The
modes themselves: :mod:`evalkit.lm.sessions`; the recompression rules: :mod:`evalkit.compression.recompress`."""

from __future__ import annotations

from evalkit.benchmark import task_of
from evalkit.core.errors import ConfigError

MODES = ("single", "multi_request", "multi_turn")
HISTORIES = ("own", "gold")


def check_mode(task_name: str, options: dict) -> None:
    """``task.mode`` and ``task.history``: known values, a history only for a chat, and a session mode only for a
    task whose rows are sessions. The default mode is taken out of ``options`` (as earlier runs' digests had it)."""
    if options.get("mode") == "single":
        del options["mode"]
    mode, history = options.get("mode", "single"), options.get("history")
    if mode not in MODES:
        raise ConfigError(f"task.mode must be one of {', '.join(MODES)}, got {mode!r}")
    if history is not None and history not in HISTORIES:
        raise ConfigError(f"task.history must be own or gold, got {history!r}")
    if history is not None and mode != "multi_turn":
        raise ConfigError(f"task.history={history} takes no effect with task.mode={mode}: it says what a multi_turn "
                          "chat keeps of each answer; add task.mode=multi_turn, or leave task.history out")
    if options.get("truncation") is not None and mode != "single":
        raise ConfigError(f"task.truncation={options['truncation']} takes no effect with task.mode={mode}: a session "
                          "is never cut; leave task.truncation out, or use task.mode=single")
    if mode != "single" and not task_of(task_name, options).sessions():
        raise ConfigError(f"task.mode={mode} needs a task whose rows are sessions (one context, several queries: "
                          f"the scbench_* tasks); task {task_name} asks one query per context: use task.mode=single")


def check_recompress(session: dict, options: dict, task_name: str) -> str:
    """``session.recompress`` (its value checked already), read: a rule other than ``never`` only under
    ``task.mode=multi_turn``, where one chat's calls bring their content into one cache, and for a task whose calls
    bring new content (its ``doc_to_new_content`` hook: ``agent_loop``)."""
    rule, mode = session.get("recompress") or "never", options.get("mode", "single")
    if rule != "never" and mode != "multi_turn":
        why = ("each query continues its own copy of the context, so no call's content reaches a later one"
               if mode == "multi_request" else "each query is a request of its own, with no session's cache")
        raise ConfigError(f"session.recompress={rule} takes no effect with task.mode={mode}: it says what a multi_turn "
                          f"session's cache does with each call's new content, and here {why}; add "
                          "task.mode=multi_turn, or leave session.recompress out")
    hook = getattr(task_of(task_name, options), "hook", None)
    if rule != "never" and (hook is None or hook("doc_to_new_content") is None):
        raise ConfigError(f"session.recompress={rule} takes no effect with task {task_name}: its calls bring no new "
                          "content (a task with a doc_to_new_content hook does, e.g. agent_loop); leave "
                          "session.recompress out")
    return rule


def session_refusal(spec):
    """``spec``, or a ConfigError saying why its session mode cannot run with the rest of it: what shares one
    context's cache across calls is one process's sessions, prefilled whole, greedy."""
    mode = spec.task_options.get("mode", "single")
    if spec.recompress != "never" and spec.spec_prefill is not None:
        raise ConfigError(f"session.recompress={spec.recompress} does not combine with method=spec_prefill yet: the "
                          "draft's kept tokens keep their original positions, which a recompression does not take; "
                          "leave session.recompress out")
    if spec.recompress != "never":
        import evalkit.compression as ec

        refusal = ec.recompress_refusal(spec.policy, spec.recompress)
        if refusal:
            raise ConfigError(refusal)
    others = [(spec.prefill_chunk is not None, "prefill_chunk"), (spec.fidelity_tokens > 0, "fidelity_tokens"),
              ((spec.task_options.get("repeats") or 1) > 1, "task.repeats")]
    named = [name for given, name in others if given]
    if mode == "single" or not named:
        return spec
    raise ConfigError(f"task.mode={mode} does not combine with {' or '.join(named)} yet: a session's context is "
                      "prefilled whole, once, in this process; leave it out, or use task.mode=single")
