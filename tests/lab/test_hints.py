"""The command's hints are said once per user and machine, not on every run."""

from __future__ import annotations

import argparse
import os
import time

from conftest import save_tiny_checkpoint
from jaxdepth.core import compilation
from jaxdepth.lab import cli


def test_the_amx_hint_is_printed_on_the_first_run_only(tmp_path, monkeypatch, capsys):
    model = save_tiny_checkpoint(str(tmp_path / "model"), context=64)
    monkeypatch.setenv("JAXDEPTH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(compilation, "cpu_multiplies_bf16_fast", lambda: True)  # this CPU may lack AMX
    args = argparse.Namespace(model=model, dtype="float32")
    printed = []
    for _ in range(3):
        cli._load_model(args, None, time.perf_counter())
        printed.append(capsys.readouterr().out)
    assert ["this CPU has AMX" in out for out in printed] == [True, False, False], printed
    assert os.listdir(tmp_path / "cache" / "hints") == ["amx"]  # nothing half-written beside it

    monkeypatch.setenv("JAXDEPTH_CACHE", str(tmp_path / "another user's cache"))
    cli._load_model(args, None, time.perf_counter())
    assert "this CPU has AMX" in capsys.readouterr().out
