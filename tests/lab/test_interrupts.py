"""Ctrl-C ends `jaxdepth run` with status 130 and one line, whenever it lands: while XLA compiles
(where an interrupt once crashed the interpreter's exit with a segmentation fault, or was
swallowed by a garbage-collection callback and the run went on), between analyses, as a result
is written; what finished stays, and the same command again resumes and completes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import model_dir, save_tiny_checkpoint
from jaxdepth.core.atomic import LOCK_NAME, OWNER_NAME, TEMP_PREFIX
from test_durable_results import AS_FROM_A_SHELL

ANALYSES = "contributions,logit_lens,layer_skip"
# (text the command prints, seconds after it, how many Ctrl-C): the first analyses'
# compilations, layer skip's first compilation (where most interrupts crashed or were lost), a
# later one of its programs, and an impatient double Ctrl-C there
MOMENTS = [
    ("loaded ", 0.0, 1),
    ("layer skip (layer, future)", 0.0, 1),
    ("layer skip (layer, future)", 0.2, 1),
    ("layer skip (layer, future)", 0.5, 1),
    ("layer skip (attn, future)", 0.1, 1),
    ("layer skip (attn, future)", 0.1, 2),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny") / "model"), context=1024)


def _command(tiny, out, cache):
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "JAXDEPTH_TESTS_XLA_CACHE")}
    env.update(JAXDEPTH_CACHE=str(cache), PYTHONUNBUFFERED="1")
    # every run compiles anew: its interrupt lands in a compilation, not in a read of the cache
    args = ["run", "--model", tiny, "--analyses", ANALYSES, "--prompts", "2", "--no-figures"]
    args += ["--no-compilation-cache", "--bootstrap", "0", "--out", str(out)]
    return [sys.executable, "-c", AS_FROM_A_SHELL, "-m", "jaxdepth.lab.cli", *args], env


def _interrupt_at(command, env, marker: str, delay: float, times: int) -> tuple[int, str]:
    """Start `command`, send it SIGINT `delay` seconds after `marker` shows in what it prints (and
    again, `times` in all, 20 ms apart); its exit status and what it printed (stdout and stderr)."""
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    seen = b""
    try:
        while marker.encode() not in seen:
            chunk = os.read(child.stdout.fileno(), 65536)
            if not chunk:
                raise AssertionError(f"ended (exit {child.wait()}) before {marker!r}:\n{seen.decode()[-2000:]}")
            seen += chunk
        time.sleep(delay)
        for _ in range(times):
            child.send_signal(signal.SIGINT)
            time.sleep(0.02)
        seen += child.stdout.read()
        child.wait(timeout=120)
    finally:
        child.kill()
        child.wait()
    return child.returncode, seen.decode(errors="replace")


@pytest.mark.slow(seconds=90)
def test_ctrl_c_ends_a_run_with_130_and_one_line_whenever_it_lands_and_a_rerun_completes(tiny, tmp_path):
    out = tmp_path / "out"
    command, env = _command(tiny, out, tmp_path / "cache")
    folder = model_dir(out, tiny) / "default"
    saved = {}  # result file -> its modification time when first seen: never rewritten after
    for marker, delay, times in MOMENTS:
        status, printed = _interrupt_at(command, env, marker, delay, times)
        where = f"interrupted {times}x {delay} s after {marker!r}: exit {status}\n{printed[-3000:]}"
        assert status == 130, where
        for noise in ("Traceback", "KeyboardInterrupt", "Exception ignored", "Fatal Python error"):
            assert noise not in printed, where
        said = [line for line in printed.replace("\r", "\n").splitlines() if "interrupted" in line]
        # before its first result a run leaves no folder (made by its lock, and empty: removed)
        listing = os.listdir(folder) if folder.exists() else []
        expected = (
            f"interrupted: what was finished is saved in {folder}; the same command again resumes from there"
            if folder.exists()
            else "interrupted before any results were written: nothing is saved"
        )
        assert said == [expected], where
        left = [n for n in listing if not n.startswith(TEMP_PREFIX) and n not in (LOCK_NAME, OWNER_NAME)]
        if times == 1:  # a second Ctrl-C may end the process before its clean-up: the rerun tidies
            assert left == listing, (listing, where)
        for name in left:
            saved.setdefault(name, os.stat(folder / name).st_mtime_ns)
    assert "contributions.npz" in saved, "no interrupt landed after the first result was written"
    rerun = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "contributions: reusing" in rerun.stdout, rerun.stdout
    assert {f"{a}.npz" for a in ANALYSES.split(",")} <= set(os.listdir(folder))
    assert {name: os.stat(folder / name).st_mtime_ns for name in saved} == saved  # reused, not written again
    assert not [n for n in os.listdir(folder) if n.startswith(TEMP_PREFIX) or n in (LOCK_NAME, OWNER_NAME)]
