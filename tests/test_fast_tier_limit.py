"""The fast tier's time limit per test (tests/fast_tier_limit.py) fails a fast test past it and spares a slow one."""

from __future__ import annotations

from pathlib import Path


def test_a_fast_test_over_the_limit_fails_and_a_slow_one_does_not(pytester, monkeypatch):
    pytester.makeini("[pytest]\nmarkers =\n    slow: the slow tier\n")
    pytester.makepyfile("""
        import time
        import pytest

        def test_quick():
            pass

        def test_lingers():
            time.sleep(0.3)

        @pytest.mark.slow(reason="sleeps")
        def test_lingers_in_the_slow_tier():
            time.sleep(0.3)
    """)
    monkeypatch.setenv("EVALKIT_FAST_TEST_LIMIT_S", "0.2")
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))  # where fast_tier_limit.py lives
    result = pytester.runpytest_subprocess("-p", "fast_tier_limit")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*test_lingers took 0.* s, over the fast tier's 0.2 s*mark it @pytest.mark.slow*"])
