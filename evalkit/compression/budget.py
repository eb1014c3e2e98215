"""Budgets: the user-facing size of a compressed cache (``4x``, ``tokens_4096``)."""

from __future__ import annotations

import dataclasses

from evalkit import budget as budget_grammar

from .adakv import AdaKV
from .base import Policy
from .decoding_snapkv import DecodingSnapKV
from .expected_attention import ExpectedAttention
from .full import Full
from .h2o import H2O
from .knorm import KNorm
from .observed_attention import ObservedAttention
from .pyramidkv import PyramidKV
from .random_baseline import Random
from .snapkv import SnapKV
from .snapstream import SnapStream
from .streaming_llm import StreamingLLM
from .tova import TOVA

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (Full, StreamingLLM, SnapKV, SnapStream, KNorm, Random, ObservedAttention, ExpectedAttention, TOVA,
                PyramidKV, AdaKV, H2O, DecodingSnapKV)
}


def budget_capacity(budget: str, max_context: int) -> int:
    """Cache capacity in tokens: ``"4x"`` is ``max_context // 4``; ``"tokens_4096"`` is 4096 (:mod:`evalkit.budget`'s
    grammar)."""
    capacity = budget_grammar.capacity(str(budget), max_context)
    if capacity is None or capacity < 1:
        raise ValueError(f"budget {budget!r} at max_context {max_context} leaves no cache")
    return capacity


def method_params(method: str) -> tuple[str, ...]:
    """The settings of ``method`` a config may give (everything but what the budget decides)."""
    cls = POLICIES[method]
    from_budget = {"capacity"} | ({"window"} if cls is StreamingLLM else set())
    return tuple(field.name for field in dataclasses.fields(cls) if field.name not in from_budget)


def policy_from_budget(method: str, budget: str | None, max_context: int, **params) -> Policy:
    """Build the policy ``method`` sized by ``budget`` against ``max_context``.

    ``full`` takes no budget. ``streaming_llm`` spends the capacity on ``sink`` + ``window`` (window = capacity - sink);
    every other method takes it as its ``capacity`` (the prompt capacity of growing methods such as SnapKV, the
    whole cache of fixed-size ones such as SnapStream, H2O or TOVA).
    """
    if method not in POLICIES:
        raise ValueError(f"unknown method {method!r}; choose from {sorted(POLICIES)}")
    cls = POLICIES[method]
    if cls is Full:
        if budget is not None:
            raise ValueError("method 'full' takes no budget")
        return Full(**params)
    if budget is None:
        raise ValueError(f"method {method!r} needs a budget (e.g. '4x' or 'tokens_4096')")
    capacity = budget_capacity(budget, max_context)
    if cls is StreamingLLM:
        sink = params.pop("sink", 4)
        if "window" in params:
            raise ValueError("streaming_llm's window comes from the budget (capacity - sink); do not set both")
        if capacity <= sink:
            raise ValueError(f"budget {budget!r} gives capacity {capacity}, not more than sink={sink}")
        return StreamingLLM(sink=sink, window=capacity - sink, **params)
    return cls(capacity=capacity, **params)
