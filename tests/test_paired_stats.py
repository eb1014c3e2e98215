"""evalkit/results/paired_stats.py and power.py against the references: McNemar's exact test against statsmodels'
``mcnemar(exact=True)``, the permutation test against ``scipy.stats.permutation_test``, the bootstrap interval against
``scipy.stats.bootstrap``, the adjustments against statsmodels' ``multipletests``; the unit chosen from the rows, and
what resampling turns instead of sessions does to an interval; the compact letters; the planned items' power in
simulation."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from scipy import stats
from statsmodels.stats.contingency_tables import mcnemar
from statsmodels.stats.multitest import multipletests

from evalkit.results.paired_stats import (
    adjust,
    bootstrap_interval,
    compact_letters,
    compare,
    mcnemar_exact,
    pair_items,
    sign_flip_p,
    unit_of,
    verdict,
)
from evalkit.results.power import connor_items, items_needed, mcnemar_power


def rows(scores, **columns) -> pd.DataFrame:
    """A run's sample rows: one per score, doc_id its position unless given."""
    frame = pd.DataFrame({"doc_id": range(len(scores)), "sample_id": [str(i) for i in range(len(scores))],
                          "repeat": 0, "subset": None, "score": np.asarray(scores, float)})
    for name, values in columns.items():
        frame[name] = values
    return frame


@pytest.mark.parametrize("lost, gained", [(0, 0), (2, 0), (5, 5), (14, 0), (3, 9), (40, 61), (700, 640), (1, 30)])
def test_mcnemar_exact_is_statsmodels(lost, gained):
    table = [[50, lost], [gained, 30]]  # rows: the baseline right / wrong; columns: the compared run right / wrong
    assert mcnemar_exact(lost, gained) == pytest.approx(mcnemar(table, exact=True).pvalue, rel=1e-9, abs=1e-300)


def test_a_binary_score_of_one_item_per_document_is_tested_with_mcnemar_on_the_discordant_pairs():
    rng = np.random.default_rng(1)
    baseline = rng.random(300) < 0.7
    compared = np.where(rng.random(300) < 0.15, ~baseline, baseline)
    result = compare(pair_items(rows(compared), rows(baseline)), 500)
    lost, gained = int((baseline & ~compared).sum()), int((~baseline & compared).sum())
    table = [[int((baseline & compared).sum()), lost], [gained, int((~baseline & ~compared).sum())]]
    assert (result.unit, result.test, result.lost, result.gained) == ("document", "McNemar exact", lost, gained)
    assert result.p_value == pytest.approx(mcnemar(table, exact=True).pvalue, rel=1e-9)
    assert result.delta == pytest.approx(compared.mean() - baseline.mean())


def test_the_permutation_test_is_scipys_exact_test_on_few_units_and_close_on_many():
    rng = np.random.default_rng(2)
    a, b = rng.normal(0.3, 1, 10), rng.normal(0, 1, 10)

    def mean_difference(x, y, axis=-1):
        return (x - y).mean(axis=axis)

    exact = stats.permutation_test((a, b), mean_difference, permutation_type="samples", vectorized=True,
                                   n_resamples=10_000)
    assert sign_flip_p(a - b, iterations=2000) == pytest.approx(exact.pvalue, rel=1e-12)  # 2**10 patterns: all
    a, b = rng.normal(0.15, 1, 200), rng.normal(0, 1, 200)
    sampled = stats.permutation_test((a, b), mean_difference, permutation_type="samples", vectorized=True,
                                     n_resamples=20_000, random_state=3)
    assert sign_flip_p(a - b, iterations=20_000) == pytest.approx(sampled.pvalue, abs=0.01)


def test_the_bootstrap_interval_is_scipys_percentile_interval_of_the_same_statistic():
    """Units of several items: the interval of sum(differences) / sum(items) over resampled units, as scipy's paired
    percentile bootstrap computes it (Monte Carlo: within a few thousandths)."""
    rng = np.random.default_rng(4)
    counts = rng.integers(1, 8, 60).astype(float)
    sums = np.array([rng.choice([-1.0, 0.0, 0.0, 1.0], int(n)).sum() for n in counts]) - 0.1 * counts

    def ratio(s, n, axis=-1):
        return s.sum(axis=axis) / n.sum(axis=axis)

    reference = stats.bootstrap((sums, counts), ratio, paired=True, vectorized=True, method="percentile",
                                n_resamples=40_000, random_state=5).confidence_interval
    low, high = bootstrap_interval(sums, counts, iterations=40_000, seed=6)
    assert (low, high) == pytest.approx((reference.low, reference.high), abs=0.006)
    assert low < sums.sum() / counts.sum() < high


@pytest.mark.parametrize("method, reference", [("holm", "holm"), ("bh", "fdr_bh")])
def test_the_adjustments_are_statsmodels(method, reference):
    p = np.array([0.001, 0.04, 0.03, 0.2, 0.012, 0.9, 0.049, 0.0001])
    assert adjust(p, method) == pytest.approx(multipletests(p, method=reference)[1], rel=1e-12)
    with_missing = adjust([0.01, np.nan, 0.04], method)
    assert np.isnan(with_missing[1]) and with_missing[[0, 2]] == pytest.approx(
        multipletests([0.01, 0.04], method=reference)[1])


def test_the_verdict_is_read_at_the_adjusted_level():
    assert verdict(-0.1, 0.01) == "worse" and verdict(0.1, 0.01) == "better"
    assert verdict(-0.3, 0.06) == "indistinguishable from the full cache"


def test_the_unit_is_chosen_from_the_rows():
    assert unit_of(pair_items(rows([1, 0, 1]), rows([1, 1, 1]))) == "document"
    repeats = rows([1, 0, 1, 1, 0, 0], doc_id=[0, 0, 0, 1, 1, 1], repeat=[0, 1, 2, 0, 1, 2],
                   sample_id=["0", "0", "0", "1", "1", "1"])
    paired = pair_items(repeats, repeats.assign(score=1.0))
    assert unit_of(paired) == "problem" and paired["unit_key"].nunique() == 2
    result = compare(paired, 200)
    assert (result.units, result.items, result.test) == (2, 6, "paired permutation over problems")
    turns = rows([1, 0, 1, 1], session_id=["s1", "s1", "s2", "s2"])
    assert unit_of(pair_items(turns, turns)) == "session"


def test_resampling_turns_as_if_independent_gives_a_visibly_too_narrow_interval():
    """40 sessions of 10 turns in which the compressed cache keeps or loses the whole session (its context): the
    interval over sessions is about sqrt(10) times the one over turns, the one that covers the truth."""
    rng = np.random.default_rng(7)
    sessions = np.repeat([f"s{i}" for i in range(40)], 10)
    kept = np.repeat(rng.random(40) < 0.7, 10)  # whole sessions lost or kept
    baseline = rows(np.ones(400), session_id=sessions)
    compared = rows(kept.astype(float), session_id=sessions)
    by_session = compare(pair_items(compared, baseline), 4000)
    as_turns = compare(pair_items(compared, baseline).assign(unit_key=lambda t: t["doc_id"].astype(str)), 4000)
    assert by_session.unit == "session" and (by_session.units, by_session.items) == (40, 400)
    assert by_session.test == "paired permutation over sessions"  # a unit of several items: no McNemar
    session_width, turn_width = by_session.high - by_session.low, as_turns.high - as_turns.low
    assert session_width > 2.5 * turn_width, (session_width, turn_width)
    assert as_turns.p_value < by_session.p_value


def test_compact_letters_group_what_no_test_separates():
    names = ["a", "b", "c", "d"]
    assert compact_letters(names, set()) == dict.fromkeys(names, "a")
    # a separated from c and d, b from d: a | ab | bc... -> a: a, b: ab, c: b... as Piepho's algorithm gives
    letters = compact_letters(names, {frozenset("ac"), frozenset("ad"), frozenset("bd")})
    assert letters == {"a": "a", "b": "ab", "c": "bc", "d": "c"}
    for x, y in [("a", "c"), ("a", "d"), ("b", "d")]:  # separated pairs share no letter, the others one
        assert not set(letters[x]) & set(letters[y])
    for x, y in [("a", "b"), ("b", "c"), ("c", "d")]:
        assert set(letters[x]) & set(letters[y])


def test_the_planned_items_reach_the_power_in_simulation():
    """--baseline 0.6 --discordance 0.2 --delta 0.05: at the planned n, 2000 simulated paired data sets (lost 12.5%,
    gained 7.5% of the items) reject no difference (McNemar exact, alpha 0.05) about 80% of the time."""
    n, how = items_needed(0.2, 0.05, baseline=0.6)
    assert how == "exact" and abs(n - connor_items(0.2, 0.05)) < 0.1 * n
    assert mcnemar_power(n, 0.2, 0.05) >= 0.8 > mcnemar_power(n - 60, 0.2, 0.05)
    rng = np.random.default_rng(8)
    cells = rng.multinomial(n, [0.125, 0.075, 0.8], size=2000)  # lost, gained, concordant
    lost, gained = cells[:, 0], cells[:, 1]
    p = np.minimum(1.0, 2 * stats.binom.cdf(np.minimum(lost, gained), lost + gained, 0.5))
    assert 0.75 <= (p < 0.05).mean() <= 0.85, (p < 0.05).mean()


def test_rates_no_paired_data_can_have_are_refused():
    with pytest.raises(ValueError, match="at most the discordance"):
        items_needed(0.02, 0.05)
    with pytest.raises(ValueError, match="cannot lose"):
        items_needed(0.9, 0.05, baseline=0.2)
