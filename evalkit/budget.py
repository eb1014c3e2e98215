"""The budget grammar, the one parser every part of evalkit reads budgets with (policies, memory pricing, reports).

A budget is ``Nx`` (a compression factor N >= 1, decimals allowed: ``2.5x``; the cache holds ``context // N``
tokens) or ``tokens_N`` (N >= 1 tokens). ``None``, ``"none"`` and ``"full"`` mean no budget: a full cache.
Pure Python, so that the memory simulator and the report need no torch.
"""

from __future__ import annotations

import math
import re

_BUDGET = re.compile(r"^(?:(?P<ratio>\d+(?:\.\d+)?)x|tokens_(?P<tokens>\d+))$")
FULL = (None, "none", "full")


def parse(budget) -> tuple[str, float] | None:
    """``("ratio", N)`` or ``("tokens", N)``; None for a full cache; ValueError for anything else."""
    if budget in FULL:
        return None
    match = _BUDGET.match(str(budget))
    if match is None:
        raise ValueError(f"budget must look like '4x', '2.5x' or 'tokens_4096', got {budget!r}")
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
    return int(context // value)


def factor(budget) -> float:
    """The compression factor: ``4x`` -> 4.0, a full cache -> 1.0, an absolute budget -> NaN."""
    parsed = parse(budget)
    if parsed is None:
        return 1.0
    return parsed[1] if parsed[0] == "ratio" else math.nan
