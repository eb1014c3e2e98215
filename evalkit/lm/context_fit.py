"""Prompts held to the model's context after they are built and tokenized, before anything generates: a prompt too
long for ``max_context`` (less the tokens it may generate) is refused in one line unless truncation was asked for
(``task.truncation=left|middle``, or the task protocol's own, LongBench's ``middle``); a cut prompt is then said on
the terminal and counted (the samples' ``truncated``, the metric ``prompts_truncated``)."""

from __future__ import annotations

from evalkit.core.console import warn
from evalkit.core.errors import ConfigError, RunError
from evalkit.lm.prompts import TRUNCATIONS
from evalkit.lm.requests import prepare_request


def asked_truncation(value) -> str | None:
    """``task.truncation`` (the lm-eval model's ``truncation`` argument) read: left, middle or None (refuse)."""
    if value not in (None, "", "null", *TRUNCATIONS):
        raise ConfigError(f"truncation must be left, middle or null, got {value!r}")
    return value if value in TRUNCATIONS else None


def prepare_fitting(lm, text: str, gen_kwargs: dict, key: str, question: str | None) -> dict:
    """:func:`evalkit.lm.requests.prepare_request` with ``truncation``: how the prompt may be cut where it is too long
    for the context, as ``task.truncation`` asks, else as the task's protocol says (LongBench); None: not at all."""
    asked = lm.truncation or gen_kwargs.get("truncation")
    prepared = prepare_request(lm, text, {**gen_kwargs, "truncation": asked} if asked else gen_kwargs, key, question)
    return {**prepared, "truncation": asked}


def check_fit(lm, texts: list[str], prepared: list[dict], task: str) -> None:
    """``prepared``: :func:`evalkit.lm.requests.prepare_request`'s requests of ``texts`` (the prompts as lm-eval
    rendered them). Raises RunError where prompts were cut without truncation asked for; else says how many were
    cut."""
    cut = [index for index, item in enumerate(prepared) if item["truncated"]]
    if not cut:
        return
    asked = [prepared[index]["truncation"] for index in cut if prepared[index]["truncation"]]
    if len(asked) == len(cut):
        how = ", ".join(sorted(set(asked)))
        warn(f"{len(cut)} of {len(prepared)} prompts of task {task} were cut to fit the {lm.max_context}-token context "
             f"(truncation {how}); the samples' truncated and the metric prompts_truncated count them")
        return
    lengths = [len(lm.prompts.tokenize(texts[index], None)[0]) for index in cut]
    reserve = max(prepared[index]["request"].max_new_tokens for index in cut)
    need = -(-(max(lengths) + reserve) // 1024) * 1024
    raise RunError(f"{len(cut)} of {len(prepared)} prompts of task {task} do not fit the {lm.max_context}-token context "
                   f"(model.max_context) with {reserve} tokens to generate (the longest is {max(lengths)} tokens): set "
                   f"model.max_context={need} where the model takes that many, or task.truncation=left or middle to "
                   "cut them (counted)")


def truncation_rows(samples: list[dict]) -> list[dict]:
    """The metric ``prompts_truncated``: how many prompts were cut (where any was)."""
    flags = [bool(s.get("truncated")) for s in samples if s.get("truncated") is not None]
    if not any(flags):
        return []
    return [{"subset": "all", "metric": "prompts_truncated", "value": float(sum(flags)), "stderr": None, "n": len(flags)}]
