"""Budgets: the user-facing size of a compressed cache (``4x``, ``tokens_4096``)."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

from evalkit.core import budget as budget_grammar

from .base import REGISTRY, Policy

# Every module of this package is imported, so that each method's file registers its class (Policy.__init_subclass__):
# a new method is its file, nothing else to list.
for _module in pkgutil.iter_modules([str(Path(__file__).parent)]):
    importlib.import_module(f"{__package__}.{_module.name}")

POLICIES: dict[str, type[Policy]] = REGISTRY  # every method by name


def budget_capacity(budget: str, max_context: int) -> int:
    """Cache capacity in tokens: ``"4x"`` is ``max_context // 4``; ``"tokens_4096"`` is 4096 (:mod:`evalkit.core.budget`'s
    grammar)."""
    capacity = budget_grammar.capacity(str(budget), max_context)
    if capacity is None or capacity < 1:
        raise ValueError(f"budget {budget!r} at max_context {max_context} leaves no cache")
    return capacity


def method_params(method: str) -> tuple[str, ...]:
    """The settings of ``method`` a config may give (everything but what the budget decides)."""
    return POLICIES[method].config_settings()


def policy_from_budget(method: str, budget: str | None, max_context: int, **params) -> Policy:
    """Build the policy ``method`` sized by ``budget`` against ``max_context`` (a ``removed_R`` budget: sized again
    for every prompt, see :meth:`Policy.for_prompt`; prompt methods only).

    ``full`` takes no budget. Each method's ``from_config`` says what the capacity becomes: ``streaming_llm`` spends it
    on ``sink`` + ``window`` (window = capacity - sink); every other method takes it as its ``capacity`` (the prompt capacity of growing methods such as SnapKV, the
    whole cache of fixed-size ones such as SnapStream, H2O or TOVA).
    """
    if method not in POLICIES:
        raise ValueError(f"unknown method {method!r}; choose from {sorted(POLICIES)}")
    cls = POLICIES[method]
    if not cls.takes_budget:
        if budget is not None:
            raise ValueError(f"method {method!r} takes no budget")
        return cls.from_config(None, **params)
    if budget is None:
        raise ValueError(f"method {method!r} needs a budget (e.g. '4x' or 'tokens_4096')")
    policy = cls.from_config(budget_capacity(budget, max_context), **params)
    removed = budget_grammar.removed(budget)
    if removed is not None:
        if policy.cache_capacity() is not None or "capacity" not in policy.budget_fields:
            raise ValueError(f"budget {budget} removes a fraction of each prompt (kvpress' compression_ratio); "
                             f"{method} keeps a cache of a fixed size: give it Nx or tokens_N")
        policy.removed = removed
    return policy
