"""The test tiers, as a pytest plugin (`pytest_plugins` in conftest.py): the order the tests run
in, and what each tier spent.

Every test runs in every run; nothing is skipped for time. A test that takes minutes is marked
`slow(seconds=N)`, N its time on 2 cores: the mark documents it and selects it
(`pytest -m "not slow"` leaves the slow tier out). The slow tests run first, longest first, so
that `pytest -n 2` hands the longest ones out before the quick ones fill the gaps (a long test
started last would keep one worker busy while the other idles). The run ends with the ten slowest
tests and each tier's total, so that growth is seen when it happens.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

SLOWEST_SHOWN = 10


def slow_seconds(item) -> float | None:
    """The seconds of an item's `slow` mark; None for a quick test."""
    marker = item.get_closest_marker("slow")
    if marker is None:
        return None
    if "seconds" not in marker.kwargs:
        raise pytest.UsageError(f"{item.nodeid}: mark it slow(seconds=...), how long it takes on 2 cores")
    return float(marker.kwargs["seconds"])


def pytest_collection_modifyitems(config, items):
    # stable: the quick tests keep their order (a module's tests share its fixtures)
    items.sort(key=lambda item: -(slow_seconds(item) or -1.0))


class TierReport:
    """Sums each test's setup, call and teardown seconds by tier, from the reports every test
    process sends (with `-n`, the workers' reports reach the controlling process)."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.tier: dict[str, str] = {}

    def pytest_runtest_logreport(self, report):
        self.seconds[report.nodeid] += report.duration
        if report.when == "setup":
            self.tier[report.nodeid] = "slow" if "slow" in report.keywords else "quick"

    def pytest_terminal_summary(self, terminalreporter):
        if not self.seconds:
            return
        write = terminalreporter.write_line
        terminalreporter.section("time by test (setup + call + teardown, seconds)")
        for nodeid, seconds in sorted(self.seconds.items(), key=lambda kv: -kv[1])[:SLOWEST_SHOWN]:
            write(f"{seconds:8.1f}  {nodeid}")
        for tier in ("quick", "slow"):
            tests = [n for n, t in self.tier.items() if t == tier]
            total = sum(self.seconds[n] for n in tests)
            write(f"{tier} tier: {total:.0f} s in all (summed over the test processes), tests: {len(tests)}")


def pytest_configure(config):
    config.pluginmanager.register(TierReport(), "jaxdepth-tier-report")
