"""Optional dependencies: a missing one is one sentence saying what to install, not a traceback
from inside another library."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = [
    "MissingDependencyError",
    "require",
]


class MissingDependencyError(ImportError):
    """An optional package that this code path needs is not installed."""


def require(module: str, *, purpose: str, install: str) -> ModuleType:
    """Import `module`, or raise MissingDependencyError naming `purpose` and the `install` command."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingDependencyError(
            f"{purpose} needs the package {module!r}, which is not installed: {install}"
        ) from None
