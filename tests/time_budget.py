"""CI's time budget, as a pytest plugin (`pytest_plugins` in conftest.py).

`.ci/run` sets JAXDEPTH_TEST_DEADLINE (a Unix time). The tests marked `slow(seconds=...)` run last,
shortest first, and one that expects to run past the deadline (its `seconds`, measured on 2
cores) is skipped, saying so, so that CI stays within its time however long the main command
took. With no deadline (a plain `pytest`), every test runs.
"""

from __future__ import annotations

import os
import time

import pytest


def _slow_seconds(item) -> tuple[int, float]:
    marker = item.get_closest_marker("slow")
    return (0, 0) if marker is None else (1, marker.kwargs.get("seconds", 0))


def pytest_collection_modifyitems(config, items):
    items.sort(key=_slow_seconds)  # stable: the quick tests keep their order


def pytest_runtest_setup(item):
    marker, deadline = item.get_closest_marker("slow"), os.environ.get("JAXDEPTH_TEST_DEADLINE")
    if marker is None or not deadline:
        return
    if "seconds" not in marker.kwargs:
        raise pytest.UsageError(f"{item.nodeid}: mark it slow(seconds=...), how long it takes on 2 cores")
    left = float(deadline) - time.time()
    if marker.kwargs["seconds"] > left:
        pytest.skip(
            f"slow (about {marker.kwargs['seconds']} s): does not fit the {max(left, 0):.0f} s left of "
            f"CI's time budget (JAXDEPTH_TEST_DEADLINE); run it with plain pytest"
        )
