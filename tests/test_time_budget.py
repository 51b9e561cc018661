"""The time-budget plugin (tests/time_budget.py), run on a small suite of its own."""

from __future__ import annotations

import time

import pytest

pytest_plugins = ["pytester"]

SUITE = """
import pytest

@pytest.mark.slow(seconds=600)
def test_long():
    pass

@pytest.mark.slow(seconds=1)
def test_short():
    pass

def test_quick():
    pass
"""


@pytest.fixture
def suite(pytester):
    pytester.makepyfile(SUITE)
    pytester.makeini("[pytest]\nmarkers =\n    slow(seconds): slow\n")
    return pytester


def test_without_a_deadline_every_test_runs_the_slow_ones_last_shortest_first(suite, monkeypatch):
    monkeypatch.delenv("JAXDEPTH_TEST_DEADLINE", raising=False)
    result = suite.runpytest("-p", "time_budget", "-v")
    result.assert_outcomes(passed=3)
    order = [line.split("::")[1].split()[0] for line in result.outlines if "::test_" in line and "PASSED" in line]
    assert order == ["test_quick", "test_short", "test_long"]


def test_a_slow_test_that_does_not_fit_the_deadline_is_skipped_with_the_reason(suite, monkeypatch):
    monkeypatch.setenv("JAXDEPTH_TEST_DEADLINE", str(time.time() + 120))
    result = suite.runpytest("-p", "time_budget", "-rs")
    result.assert_outcomes(passed=2, skipped=1)
    result.stdout.fnmatch_lines(["*slow (about 600 s): does not fit the 1?? s left of CI's time budget*"])


def test_a_slow_test_without_its_seconds_is_refused_under_a_deadline(pytester, monkeypatch):
    pytester.makepyfile("import pytest\n\n@pytest.mark.slow\ndef test_unsized():\n    pass\n")
    pytester.makeini("[pytest]\nmarkers =\n    slow(seconds): slow\n")
    monkeypatch.setenv("JAXDEPTH_TEST_DEADLINE", str(time.time() + 120))
    result = pytester.runpytest("-p", "time_budget")
    assert "mark it slow(seconds=...)" in result.stdout.str() + result.stderr.str()
