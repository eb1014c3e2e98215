"""How many items a comparison against the full cache needs (``evalkit-report plan``): the power of McNemar's exact
test, computed exactly (not simulated) from the rates of the discordant items.

    evalkit-report plan --baseline 0.6 --discordance 0.2 --delta 0.05   # the rates given
    evalkit-report plan results/ --delta 0.05                             # the rates of a pilot run's comparisons

A paired binary comparison is decided by its discordant items alone: those the full cache got right and the
compressed cache lost (rate ``(discordance + delta) / 2``) and those it gained (``(discordance - delta) / 2``). Of n
items, D ~ Binomial(n, discordance) are discordant, and given D the lost ones ~ Binomial(D, lost / discordance);
the test rejects where the rarer kind is at most the largest k with 2 P(Binomial(D, 1/2) <= k) <= alpha. The power is
that probability summed over D; the items needed are the fewest n where it reaches the power asked (searched by
bisection: the exact test's power saw-tooths by a point or so from one n to the next). Past 20,000 items it is
Connor's (1987) normal approximation, which the exact power meets there.
"""

from __future__ import annotations

import math
from pathlib import Path
from statistics import NormalDist

import numpy as np

from .outputs import OneLineParser, refusing
from .tables import ResultsError

EXACT_UP_TO = 20_000


def _log_factorials(n: int) -> np.ndarray:
    return np.concatenate([[0.0], np.cumsum(np.log(np.arange(1, n + 1)))])


def _binomial_pmf(n: int, p: float, log_factorials: np.ndarray, upto: int | None = None) -> np.ndarray:
    """P(Binomial(n, p) = k) for k = 0..upto (default n)."""
    k = np.arange((n if upto is None else upto) + 1)
    log_p = math.log(p) if p > 0 else -math.inf
    log_q = math.log1p(-p) if p < 1 else -math.inf
    with np.errstate(invalid="ignore"):  # 0 * -inf where p is 0 or 1: that term is 0
        exponent = np.where(k > 0, k * log_p, 0.0) + np.where(n - k > 0, (n - k) * log_q, 0.0)
    return np.exp(log_factorials[n] - log_factorials[k] - log_factorials[n - k] + exponent)


def rejection_power(most: int, lost_share: float, alpha: float) -> np.ndarray:
    """For D = 0..most discordant items: the probability that McNemar's exact test rejects, the lost ones drawn
    with probability ``lost_share`` each."""
    factorials = _log_factorials(most)
    power = np.zeros(most + 1)
    for discordant in range(1, most + 1):
        half = _binomial_pmf(discordant, 0.5, factorials, discordant // 2)
        bound = int((2 * np.cumsum(half) <= alpha * (1 + 1e-12)).sum()) - 1  # the largest k that rejects
        if bound < 0:
            continue
        power[discordant] = (_binomial_pmf(discordant, lost_share, factorials, bound).sum()
                             + _binomial_pmf(discordant, 1 - lost_share, factorials, bound).sum())
    return power


def mcnemar_power(n: int, discordance: float, delta: float, alpha: float = 0.05,
                  conditional: np.ndarray | None = None) -> float:
    """The power of McNemar's exact two-sided test on ``n`` paired items where a share ``discordance`` is discordant
    and the scores differ by ``delta``."""
    lost_share = (discordance + abs(delta)) / (2 * discordance)
    conditional = rejection_power(n, lost_share, alpha) if conditional is None else conditional[: n + 1]
    return float(_binomial_pmf(n, discordance, _log_factorials(n)) @ conditional)


def connor_items(discordance: float, delta: float, alpha: float = 0.05, power: float = 0.8) -> int:
    """Connor's (1987) normal approximation of the items McNemar's test needs."""
    normal = NormalDist()
    z_alpha, z_beta = normal.inv_cdf(1 - alpha / 2), normal.inv_cdf(power)
    root = z_alpha * math.sqrt(discordance) + z_beta * math.sqrt(discordance - delta**2)
    return math.ceil(root**2 / delta**2)


def check_rates(discordance: float, delta: float, baseline: float | None = None) -> None:
    """A ValueError (one line) for rates no paired binary data can have."""
    if not 0 < abs(delta) <= discordance <= 1:
        raise ValueError(f"the change ({abs(delta):g}) must be above 0 and at most the discordance ({discordance:g}, "
                         "which must be at most 1): every changed item is a discordant one")
    lost, gained = (discordance + abs(delta)) / 2, (discordance - abs(delta)) / 2
    if baseline is not None and (lost > baseline + 1e-12 or gained > 1 - baseline + 1e-12):
        raise ValueError(f"a baseline of {baseline:g} cannot lose {lost:g} of its items and gain {gained:g}: "
                         "the discordance is too high for it")


def items_needed(discordance: float, delta: float, alpha: float = 0.05, power: float = 0.8,
                 baseline: float | None = None) -> tuple[int, str]:
    """The fewest items at which McNemar's exact test reaches ``power``, and how it was found ("exact" or
    "normal approximation")."""
    check_rates(discordance, delta, baseline)
    first_guess = connor_items(discordance, abs(delta), alpha, power)
    if first_guess > EXACT_UP_TO:
        return first_guess, "normal approximation"
    lost_share = (discordance + abs(delta)) / (2 * discordance)
    high = max(20, int(first_guess * 1.3) + 20)
    conditional = rejection_power(high, lost_share, alpha)
    while mcnemar_power(high, discordance, delta, alpha, conditional) < power:
        high *= 2
        if high > 2 * EXACT_UP_TO:
            return first_guess, "normal approximation"
        conditional = rejection_power(high, lost_share, alpha)
    low = 0
    while high - low > 1:
        middle = (low + high) // 2
        if mcnemar_power(middle, discordance, delta, alpha, conditional) >= power:
            high = middle
        else:
            low = middle
    return high, "exact"


def independent_discordance(baseline: float, delta: float) -> float:
    """The discordance of two runs whose errors are independent: a baseline right with ``baseline``, the other run
    with ``baseline - delta``."""
    other = baseline - abs(delta)
    return baseline * (1 - other) + other * (1 - baseline)


def plan_line(discordance: float, delta: float, alpha: float, power: float, baseline: float | None) -> str:
    items, how = items_needed(discordance, delta, alpha, power, baseline)
    start = f"from a baseline of {baseline:g}, " if baseline is not None else ""
    return (f"a change of {abs(delta):g} {start}with {discordance:.3g} of the items discordant (lost "
            f"{(discordance + abs(delta)) / 2:.3g}, gained {(discordance - abs(delta)) / 2:.3g}): {items} items for "
            f"{power:.0%} power (McNemar exact, two-sided alpha {alpha:.3g}, {how})")


def main(argv: list[str]) -> None:
    parser = OneLineParser(prog="evalkit-report plan",
                           description="items needed to tell a compressed cache from the full cache (McNemar)")
    parser.add_argument("results_dir", type=Path, nargs="?", help="a pilot run's results: its rates per comparison")
    parser.add_argument("--baseline", type=_share, help="the full cache's accuracy (0-1)")
    parser.add_argument("--discordance", type=_share,
                        help="the share of items the two caches score differently (default: independent errors)")
    parser.add_argument("--delta", type=_share, default=0.05, help="the change in accuracy to detect (default 0.05)")
    parser.add_argument("--alpha", type=_share, default=0.05)
    parser.add_argument("--power", type=_share, default=0.8)
    parser.add_argument("--comparisons", type=int, default=None,
                        help="comparisons in the report: alpha is divided by them (Holm's strictest step); default 1, "
                             "or a pilot's own count")
    args = parser.parse_args(argv)
    with refusing("evalkit-report plan"):
        if args.results_dir is not None:
            print("\n".join(pilot_plan(args.results_dir, args.delta, args.alpha, args.power, args.comparisons)))
            return
        alpha = args.alpha / max(1, args.comparisons or 1)
        if args.discordance is None and args.baseline is None:
            raise ResultsError("give --discordance (and --baseline), or a pilot run's results directory")
        discordance = args.discordance
        if discordance is None:
            discordance = independent_discordance(args.baseline, args.delta)
        try:
            print(f"evalkit-report plan: {plan_line(discordance, args.delta, alpha, args.power, args.baseline)}")
        except ValueError as error:
            raise ResultsError(str(error)) from None


def pilot_plan(results_dir: Path, delta: float, alpha: float, power: float,
               comparisons: int | None = None) -> list[str]:
    """A line per comparison of a pilot run's report: the items its observed rates need to detect ``delta`` (the
    discordance raised to ``delta`` where the pilot saw fewer discordant items), ``alpha`` divided by
    ``comparisons`` (default: the report's own count, as its adjustment divides it at its strictest step)."""
    from .summary import labels, summarize
    from .tables import read_runs

    table = summarize(*read_runs(results_dir), iterations=200)
    compared = table[table["test"].notna() & table["test"].ne("-")] if "test" in table else table.iloc[:0]
    if compared.empty:
        raise ResultsError(f"{results_dir} has no run with its full-cache baseline to plan from")
    comparisons = len(compared) if comparisons is None else comparisons
    alpha /= max(1, comparisons)
    lines = [f"evalkit-report plan: {len(compared)} comparison{'s' if len(compared) > 1 else ''} in {results_dir}, "
             f"to detect a change of {delta:g} (alpha split over {comparisons})"]
    for label, row in zip(labels(table, compared.index), compared.itertuples()):
        if row.test != "McNemar exact":
            lines.append(f"  {label}: not planned ({row.test}: McNemar counts independent 0/1 items)")
            continue
        discordance = max((row.lost + row.gained) / row.paired_items, delta)
        lines.append(f"  {label}: {plan_line(discordance, delta, alpha, power, None)}")
    return lines


def _share(text: str) -> float:
    import argparse

    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"a share between 0 and 1, got {text!r}")
    return value
