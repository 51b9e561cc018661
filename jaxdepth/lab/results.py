"""Loading analysis results saved on disk, as their own types, with every built-in result type
known (the result types and their saving live in `jaxdepth.core.saved_result`)."""

from __future__ import annotations

from typing import Any

from jaxdepth.core.saved_result import load_saved

__all__ = [
    "load_result",
    "RESULT_FORMAT",
]


# Part of every study result's cache identity: bumped when result types gain fields, so a rerun
# recomputes results saved without them (per-prompt curves, since 2) instead of reusing them.
RESULT_FORMAT = 2


def load_result(path: str) -> Any:
    """Load any result written by `SavedResult.save`, as its own type: a built-in one (their
    modules are imported here), or any other, a plugin's included, whose module the file records
    and Python can import (installed, or on `sys.path`). A type that cannot be found raises a
    ValueError (`jaxdepth.core.saved_result.UnknownResultTypeError`) naming it and its module."""
    import jaxdepth.lab.registry  # noqa: F401  (a result type registers itself when its module is imported)

    return load_saved(path)
