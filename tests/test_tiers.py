"""The tiers plugin (tests/tiers.py), run on a small suite of its own."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

SUITE = """
import time
import pytest

@pytest.mark.slow(seconds=1)
def test_short():
    pass

def test_quick():
    pass

@pytest.mark.slow(seconds=600)
def test_long():
    time.sleep(0.2)
"""


@pytest.fixture
def suite(pytester):
    pytester.makepyfile(SUITE)
    pytester.makeini("[pytest]\nmarkers =\n    slow(seconds): slow\n")
    return pytester


def test_every_test_runs_the_slow_ones_first_longest_first(suite):
    result = suite.runpytest("-p", "tiers", "-v")
    result.assert_outcomes(passed=3)
    order = [line.split("::")[1].split()[0] for line in result.outlines if "::test_" in line and "PASSED" in line]
    assert order == ["test_long", "test_short", "test_quick"]


def test_the_run_ends_with_the_slowest_tests_and_each_tiers_total(suite):
    result = suite.runpytest("-p", "tiers")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(
        [
            "*time by test (setup + call + teardown, seconds)*",
            "*0.[2-9]  test_*.py::test_long",
            "*",
            "*",
            "quick tier: 0 s in all*, tests: 1",
            "slow tier: 0 s in all*, tests: 2",
        ]
    )


def test_a_slow_test_without_its_seconds_is_refused(pytester):
    pytester.makepyfile("import pytest\n\n@pytest.mark.slow\ndef test_unsized():\n    pass\n")
    pytester.makeini("[pytest]\nmarkers =\n    slow(seconds): slow\n")
    result = pytester.runpytest("-p", "tiers")
    assert "mark it slow(seconds=...)" in result.stdout.str() + result.stderr.str()
