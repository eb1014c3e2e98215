"""The fast tier answers in minutes: with EVALKIT_FAST_TEST_LIMIT_S set (.ci/run sets 20), a fast-tier test whose own
run (its call, not the shared fixtures it sets up) takes longer fails, naming the way out. A test that needs more is
made cheaper, or joins the slow tier with its reason: ``@pytest.mark.slow(reason="...")``."""

from __future__ import annotations

import os

import pytest

LIMIT = pytest.StashKey[float]()


def pytest_configure(config):
    config.stash[LIMIT] = float(os.environ.get("EVALKIT_FAST_TEST_LIMIT_S") or "inf")  # read once, at the start


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    limit = item.config.stash[LIMIT]
    if report.when == "call" and report.passed and report.duration > limit and item.get_closest_marker("slow") is None:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} took {report.duration:.1f} s, over the fast tier's {limit:g} s "
                           "(EVALKIT_FAST_TEST_LIMIT_S): make it cheaper, or mark it @pytest.mark.slow(reason=...)")
