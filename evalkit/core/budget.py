"""The budget grammar, the one parser every part of evalkit reads budgets with (policies, memory pricing, reports).

A budget is ``Nx`` (a compression factor N >= 1, decimals allowed: ``2.5x``; the cache holds ``context // N``
tokens), ``tokens_N`` (N >= 1 tokens) or ``removed_R`` (kvpress' ``compression_ratio``, 0 <= R < 1: each prompt keeps
``int(n * (1 - R))`` of its own ``n`` tokens; at ``context`` tokens, the most any prompt keeps). ``None``, ``"none"``
and ``"full"`` mean no budget: a full cache.
Pure Python, so that the memory simulator and the report need no torch.
"""

from __future__ import annotations

import math
import re

_BUDGET = re.compile(r"^(?:(?P<ratio>\d+(?:\.\d+)?)x|tokens_(?P<tokens>\d+)|removed_(?P<removed>\d+(?:\.\d+)?))$")
FULL = (None, "none", "full")


def parse(budget) -> tuple[str, float] | None:
    """``("ratio", N)``, ``("tokens", N)`` or ``("removed", R)``; None for a full cache; ValueError for anything
    else."""
    if budget in FULL:
        return None
    match = _BUDGET.match(str(budget))
    if match is None:
        raise ValueError(f"budget must look like '4x', '2.5x', 'tokens_4096' or 'removed_0.75' (kvpress' "
                         f"compression_ratio), got {budget!r}")
    if match["removed"] is not None:
        if float(match["removed"]) >= 1:
            raise ValueError(f"budget {budget!r} removes every token: the fraction removed must be below 1")
        return "removed", float(match["removed"])
    if match["tokens"] is not None:
        if int(match["tokens"]) < 1:
            raise ValueError(f"budget {budget!r} holds no tokens")
        return "tokens", int(match["tokens"])
    if float(match["ratio"]) < 1:
        raise ValueError(f"budget ratio must be >= 1, got {budget!r}")
    return "ratio", float(match["ratio"])


def capacity(budget, context: int) -> int | None:
    """Cache capacity in tokens at ``context``: ``"4x"`` is ``context // 4``, ``"tokens_4096"`` is 4096; None for a
    full cache."""
    parsed = parse(budget)
    if parsed is None:
        return None
    kind, value = parsed
    if kind == "tokens":
        return int(value)
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise ValueError(f"max_context must be a positive integer, got {context!r}")
    return int(context * (1 - value)) if kind == "removed" else int(context // value)


def removed(budget) -> float | None:
    """The fraction of each prompt a ``removed_R`` budget removes (kvpress' ``compression_ratio``); None for the
    other budgets."""
    parsed = parse(budget)
    return parsed[1] if parsed is not None and parsed[0] == "removed" else None


def factor(budget) -> float:
    """The compression factor: ``4x`` -> 4.0, ``removed_0.75`` -> 4.0 (of each prompt), a full cache -> 1.0, an
    absolute budget -> NaN."""
    parsed = parse(budget)
    if parsed is None:
        return 1.0
    kind, value = parsed
    return value if kind == "ratio" else 1 / (1 - value) if kind == "removed" else math.nan
