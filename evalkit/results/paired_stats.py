"""Paired statistics of two runs on the same items, at the unit that is independent: the session where the rows are
turns of one (``session_id``: the turns of a session share its context and are not independent), the problem where
a document was sampled several times (``repeat``: AIME's n samples of one problem), the document otherwise.

Every interval and test resamples that unit. A binary score with one item per unit is tested with McNemar's exact
test on the discordant pairs; anything else (scores that are not 0/1, units of several items) with a paired
permutation test that flips the sign of each unit's summed difference (exact where there are few units). The
delta's interval is the percentile interval of a paired bootstrap over units (the ratio of the resampled sums, so
that a unit weighs by its items as the score does). p-values of many comparisons are adjusted together (Holm, or
Benjamini-Hochberg), and :func:`compact_letters` groups configurations no test separates. Pure numpy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

ITEM_KEYS = ["subset", "doc_id", "sample_id", "repeat"]  # one generation of one document, the same in both runs
ALPHA = 0.05
ADJUSTMENTS = {"holm": "Holm", "bh": "Benjamini-Hochberg"}
VERDICTS = ("worse", "indistinguishable from the full cache", "better")
CHUNK = 256  # resamples drawn at a time (memory: CHUNK x units)


def _keyed(rows: pd.DataFrame) -> pd.DataFrame:
    """A run's scored rows with the item keys as text (a missing subset or session as ""), one row per item."""
    rows = rows.dropna(subset=["score"])
    frame = pd.DataFrame({key: rows[key] if key in rows else None for key in ITEM_KEYS}, index=rows.index)
    frame["subset"] = frame["subset"].fillna("").astype(str)
    frame["sample_id"] = frame["sample_id"].fillna("").astype(str)
    frame["repeat"] = frame["repeat"].fillna(0).astype(int)
    frame["session_id"] = rows["session_id"].fillna("").astype(str) if "session_id" in rows else ""
    frame["score"] = rows["score"].astype(float)
    return frame.groupby(ITEM_KEYS, as_index=False).agg(session_id=("session_id", "first"), score=("score", "mean"))


def pair_items(compared: pd.DataFrame, baseline: pd.DataFrame) -> pd.DataFrame:
    """The items both runs scored (matched on subset, doc_id, sample_id and repeat): their keys, ``session_id``,
    ``score`` (the compared run's), ``baseline`` (the baseline's) and ``unit_key`` (see :func:`unit_of`)."""
    joined = _keyed(compared).merge(_keyed(baseline), on=ITEM_KEYS, suffixes=("", "_baseline"))
    joined = joined.sort_values(["doc_id", "repeat", "subset", "sample_id"], ignore_index=True)
    joined = joined.rename(columns={"score_baseline": "baseline"})
    joined["session_id"] = joined["session_id"].where(joined["session_id"] != "", joined["session_id_baseline"])
    joined = joined.drop(columns="session_id_baseline")
    unit = unit_of(joined)
    if unit == "session":
        joined["unit_key"] = joined["session_id"].where(joined["session_id"] != "",
                                                        "doc " + joined["doc_id"].astype(str))
    else:
        joined["unit_key"] = joined["subset"] + "\x1f" + joined["doc_id"].astype(str)
    return joined


def unit_of(items: pd.DataFrame) -> str:
    """What is independent among ``items``: ``session`` where they carry a session, ``problem`` where a document
    has several repeats, ``document`` otherwise."""
    if "session_id" in items and items["session_id"].fillna("").astype(str).ne("").any():
        return "session"
    if len(items) and items.groupby(["subset", "doc_id"]).size().max() > 1:
        return "problem"
    return "document"


@dataclass(frozen=True)
class Comparison:
    """A compared run against its baseline on the items both scored."""

    unit: str
    units: int
    items: int
    delta: float  # mean score of the compared run - the baseline's, over the paired items
    low: float
    high: float
    test: str
    p_value: float
    lost: int  # items the baseline scored higher (got right) and the compared run lower (got wrong)
    gained: int

    def as_row(self) -> dict:
        return {"unit": self.unit, "paired_units": self.units, "paired_items": self.items, "delta": self.delta,
                "delta_low": self.low, "delta_high": self.high, "test": self.test, "p_value": self.p_value,
                "lost": self.lost, "gained": self.gained}


NO_ITEMS = Comparison("-", 0, 0, math.nan, math.nan, math.nan, "-", math.nan, 0, 0)


def compare(items: pd.DataFrame, iterations: int = 2000, seed: int = 0, interval: bool = True) -> Comparison:
    """The paired comparison of :func:`pair_items`' ``items``: delta, its 95% bootstrap interval over units
    (``interval=False``: none, NaN), and the test of no difference."""
    if items.empty:
        return NO_ITEMS
    unit = unit_of(items)
    codes, _ = pd.factorize(items["unit_key"])
    compared, baseline = items["score"].to_numpy(float), items["baseline"].to_numpy(float)
    sums = np.bincount(codes, weights=compared - baseline)
    counts = np.bincount(codes).astype(float)
    low, high = bootstrap_interval(sums, counts, iterations, seed) if interval else (math.nan, math.nan)
    lost, gained = int((compared < baseline).sum()), int((compared > baseline).sum())
    binary = bool(np.isin(compared, (0.0, 1.0)).all() and np.isin(baseline, (0.0, 1.0)).all())
    if binary and counts.max() == 1:
        test, p_value = "McNemar exact", mcnemar_exact(lost, gained)
    else:
        test, p_value = f"paired permutation over {unit}s", sign_flip_p(sums, iterations, seed)
    return Comparison(unit, len(sums), len(items), float(sums.sum() / counts.sum()), low, high, test, p_value,
                      lost, gained)


def bootstrap_interval(sums: np.ndarray, counts: np.ndarray, iterations: int = 2000, seed: int = 0,
                       level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of sum(differences) / sum(items) over units drawn with replacement (``sums``: each
    unit's summed difference, ``counts``: its items)."""
    rng = np.random.default_rng(seed)
    draws = []
    for start in range(0, iterations, CHUNK):
        chosen = rng.integers(0, len(sums), size=(min(CHUNK, iterations - start), len(sums)))
        draws.append(sums[chosen].sum(axis=1) / counts[chosen].sum(axis=1))
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(np.concatenate(draws), [tail, 100 - tail])
    return float(low), float(high)


def sign_flip_p(sums: np.ndarray, iterations: int = 2000, seed: int = 0) -> float:
    """Two-sided p-value of a paired permutation test: under no difference the two runs' scores of a unit are
    exchangeable, so each unit's summed difference is as likely negated. Every sign pattern where there are at most
    ``iterations`` of them, else ``iterations`` random ones (the observed statistic counted once); as
    ``scipy.stats.permutation_test(..., permutation_type="samples")`` computes it."""
    observed = float(sums.sum())
    units = len(sums)
    if 2**units <= iterations:
        patterns = 1 - 2 * ((np.arange(2**units)[:, None] >> np.arange(units)) & 1)
        null, extra = patterns @ sums, 0
    else:
        rng = np.random.default_rng(seed)
        null = np.concatenate([rng.choice((-1.0, 1.0), size=(min(CHUNK, iterations - start), units)) @ sums
                               for start in range(0, iterations, CHUNK)])
        extra = 1
    gap = max(1e-14, abs(1e-14 * observed))
    below = ((null <= observed + gap).sum() + extra) / (len(null) + extra)
    above = ((null >= observed - gap).sum() + extra) / (len(null) + extra)
    return float(min(1.0, 2 * min(below, above)))


def mcnemar_exact(lost: int, gained: int) -> float:
    """McNemar's exact test: under no difference each discordant pair is lost or gained with probability 1/2; the
    two-sided p-value is twice the binomial tail of the rarer kind (at most 1)."""
    discordant = lost + gained
    if discordant == 0:
        return 1.0
    tail = sum(math.comb(discordant, k) for k in range(min(lost, gained) + 1))
    return min(1.0, 2 * tail / 2**discordant)


def adjust(p_values, method: str = "holm") -> np.ndarray:
    """p-values adjusted for their number (missing ones stay missing): Holm's step-down (family-wise error) or
    Benjamini-Hochberg's step-up (false discovery rate)."""
    p = np.asarray(p_values, dtype=float)
    adjusted = np.full_like(p, np.nan)
    present = np.flatnonzero(~np.isnan(p))
    m = len(present)
    if m == 0:
        return adjusted
    order = present[np.argsort(p[present], kind="stable")]
    ranked = p[order]
    if method == "holm":
        values = np.maximum.accumulate(np.minimum(1.0, (m - np.arange(m)) * ranked))
    elif method == "bh":
        values = np.minimum.accumulate(np.minimum(1.0, m / np.arange(1, m + 1) * ranked)[::-1])[::-1]
    else:
        raise ValueError(f"unknown p-value adjustment {method!r}: {' or '.join(ADJUSTMENTS)}")
    adjusted[order] = values
    return adjusted


def verdict(delta: float, p_adjusted: float, alpha: float = ALPHA) -> str:
    """worse / better than the baseline where the adjusted p-value is below ``alpha``, else indistinguishable."""
    if math.isnan(p_adjusted):
        return "-"
    if p_adjusted < alpha:
        return VERDICTS[0] if delta < 0 else VERDICTS[2]
    return VERDICTS[1]


def compact_letters(names: list[str], separated: set[frozenset]) -> dict[str, str]:
    """A compact letter display (Piepho's insert-and-absorb): configurations sharing a letter are not separated by
    any test of ``separated`` (pairs of names). ``names`` in the order letters are given (best first)."""
    groups = [list(names)]
    for pair in separated:
        first, second = tuple(pair)
        split = []
        for group in groups:
            if first in group and second in group:
                split += [[n for n in group if n != first], [n for n in group if n != second]]
            else:
                split.append(group)
        groups = [g for i, g in enumerate(split) if g and not any(
            set(g) < set(h) or (set(g) == set(h) and j < i) for j, h in enumerate(split))]
    groups.sort(key=lambda g: min(names.index(n) for n in g))
    letters = {name: "" for name in names}
    for index, group in enumerate(groups):
        for name in group:
            letters[name] += _letter(index)
    return letters


def _letter(index: int) -> str:
    return "abcdefghijklmnopqrstuvwxyz"[index % 26] + ("'" * (index // 26))
