"""Style: ruff's lint and formatter (configured once, in pyproject.toml) pass on the repository."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ruff(*args: str) -> subprocess.CompletedProcess:
    try:
        import ruff  # noqa: F401  (the test extras install it)
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail("ruff is not installed (pip install -e '.[test]'); CI=true: a missing linter is a failure")
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=REPO, capture_output=True, text=True)


def test_ruff_lint_passes():
    result = ruff("check", "--no-cache", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_leaves_every_file_as_it_is():
    result = ruff("format", "--no-cache", "--check", ".")
    assert result.returncode == 0, result.stdout + result.stderr
