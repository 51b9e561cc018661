"""Results on disk are durable: one run at a time per results folder, for every command that
writes one (a second one is refused at once, told who holds it; the lock's files go when the run
ends), a run killed with SIGKILL, even mid-write, resumes cleanly, and a command interrupted
with Ctrl-C ends on one line saying what is saved."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import model_dir, save_tiny_checkpoint
from jaxdepth.lab.mapping_study import mapping_folder
from jaxdepth.core import atomic
from jaxdepth.core.atomic import LOCK_NAME, OWNER_NAME, TEMP_PREFIX, FolderBusyError, folder_lock, locked_folders
from jaxdepth.lab.case_study import case_prompt
from jaxdepth.lab.cli import main

# A tiny model and two prompts; `sleeper` is an analysis that stops inside an atomic write.
SETUP = textwrap.dedent("""
    import dataclasses, os, sys, time
    import numpy as np
    from jaxdepth.core.atomic import atomic_write
    from jaxdepth.core.batch import make_batch
    from jaxdepth.core.config import ModelConfig
    from jaxdepth.core.model import random_params
    from jaxdepth.lab.loaded_model import Model
    from jaxdepth.lab.registry import Analysis, register
    from jaxdepth.core.saved_result import SavedResult
    from jaxdepth.lab.study import StudyPrompts, StudyRun, model_results_key, result_folder, run_study

    CONFIG = ModelConfig(model_type="llama", vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=4, head_dim=8, rope_theta=1e4, rms_norm_eps=1e-6,
                         max_position_embeddings=64, tie_word_embeddings=True, qkv_bias=False)
    model = Model(params=random_params(CONFIG, 0), config=CONFIG, tokenizer=None, source="tiny")
    batch = make_batch([list(range(1, 20)), list(range(3, 15))], [10, 8])
    toy, quiet = StudyPrompts("toy", batch), StudyRun(progress=False)

    @dataclasses.dataclass
    class Nothing(SavedResult):
        settings: dict

    def sleep_mid_write(inputs):
        folder = result_folder(sys.argv[1], model_results_key(model, "tiny")[0], "toy")
        with atomic_write(os.path.join(folder, "partial.bin")) as f:
            f.write(b"half")
            print("writing", flush=True)
            time.sleep(120)
        return Nothing(settings={})

    register(Analysis(name="sleeper", result_type=Nothing, identity=lambda s: {}, run=sleep_mid_write,
                      figures=lambda *a: {}, summary=lambda r: []))
""")


def _start(script: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", SETUP + textwrap.dedent(script), *args], stdout=subprocess.PIPE, text=True
    )


def _wait_for(proc: subprocess.Popen, line: str) -> None:
    for got in proc.stdout:
        if got.strip() == line:
            return
    raise AssertionError(f"the child ended (exit {proc.wait()}) before printing {line!r}")


def test_a_second_run_on_the_same_folder_is_refused_at_once(tmp_path):
    folder = tmp_path / "tiny" / "toy"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent("""
        import sys
        from jaxdepth.core.atomic import folder_lock
        with folder_lock(sys.argv[1]):
            print("held", flush=True)
            sys.stdin.read()
    """),
            str(folder),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for(holder, "held")
        start = time.monotonic()
        with pytest.raises(FolderBusyError, match=rf"in use by process {holder.pid} on "):
            with folder_lock(str(folder)):
                pass
        assert time.monotonic() - start < 5, "refused after a wait, not at once"
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    with folder_lock(str(folder)):  # released when its holder ended
        pass


def test_a_study_run_is_refused_while_another_holds_its_folder(tmp_path):
    child = _start(
        """
        run_study(model, "tiny", toy, sys.argv[1], analyses=["sleeper"], run=quiet)
    """,
        str(tmp_path),
    )
    try:
        _wait_for(child, "writing")
        second = subprocess.run(
            [
                sys.executable,
                "-c",
                SETUP
                + textwrap.dedent("""
            run_study(model, "tiny", toy, sys.argv[1], analyses=["contributions"], run=quiet)
        """),
                str(tmp_path),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert second.returncode != 0 and f"is in use by process {child.pid}" in second.stderr, second.stderr[-2000:]
    finally:
        child.kill()
        child.wait()


def test_a_run_killed_with_sigkill_mid_write_resumes(tmp_path):
    child = _start(
        """
        run_study(model, "tiny", toy, sys.argv[1], analyses=["contributions", "sleeper"], run=quiet)
    """,
        str(tmp_path),
    )
    _wait_for(child, "writing")  # contributions saved; the sleeper is inside its atomic write
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    (model_folder,) = tmp_path.glob("tiny-*")  # the model's name and fingerprint
    folder = model_folder / "toy"
    assert (folder / "contributions.npz").exists() and not (folder / "partial.bin").exists()
    assert any(name.startswith(TEMP_PREFIX) for name in os.listdir(folder))  # what the kill left behind
    rerun = subprocess.run(
        [
            sys.executable,
            "-c",
            SETUP
            + textwrap.dedent("""
        run_study(model, "tiny", toy, sys.argv[1], analyses=["contributions", "logit_lens"], run=quiet)
    """),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "contributions: reusing" in rerun.stdout and "logit_lens: " in rerun.stdout
    assert (folder / "logit_lens.npz").exists()
    assert not any(name.startswith(TEMP_PREFIX) for name in os.listdir(folder)), os.listdir(folder)


def test_the_lock_files_go_when_the_run_ends_however_it_ends(tmp_path):
    folder = tmp_path / "tiny" / "toy"
    with folder_lock(str(folder)):
        assert sorted(os.listdir(folder)) == [LOCK_NAME, OWNER_NAME]
        assert f"process {os.getpid()} on " in (folder / OWNER_NAME).read_text()
    # the folders the lock made, empty again, go with it: a run that wrote nothing leaves nothing
    assert os.listdir(tmp_path) == []
    with pytest.raises(RuntimeError, match="an analysis failed"):
        with folder_lock(str(folder)):
            raise RuntimeError("an analysis failed")
    assert os.listdir(tmp_path) == []
    folder.mkdir(parents=True)
    (folder / LOCK_NAME).write_text("")  # left by a run killed outright: taken over, then removed
    with folder_lock(str(folder)):
        (folder / "result.npz").write_text("")
    assert os.listdir(folder) == ["result.npz"]  # a folder that holds a result stays


def test_a_refused_model_leaves_no_folder_behind(tmp_path, capsys):
    """An unsupported architecture is refused at the load, after the command held its folders:
    they were empty, and are gone with the lock."""
    import json

    from jaxdepth.lab.cli import main

    folder = tmp_path / "unsupported"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "rwkv", "architectures": ["RwkvForCausalLM"]}))
    (folder / "model.safetensors").write_bytes(b"")
    out = tmp_path / "out"
    assert main(["run", "--model", str(folder), "--analyses", "contributions", "--out", str(out)]) == 2
    assert "rwkv" in capsys.readouterr().err
    assert not out.exists(), sorted(str(p) for p in out.rglob("*"))


@pytest.mark.skipif(atomic.fcntl is None, reason="flock: POSIX only")
def test_a_lock_on_a_file_its_holder_removed_is_not_held(tmp_path, monkeypatch):
    """A run that opened the lock file just before its holder removed it and let go, and that then
    gets the lock on that removed file, does not hold the folder: a third run may hold the new one."""
    folder = tmp_path / "tiny" / "toy"
    folder.mkdir(parents=True)
    (folder / LOCK_NAME).write_text("")  # the file of a holder about to end
    flock, third = atomic.fcntl.flock, []

    def flock_after_the_holder_left(fd, operation):
        if not third:  # the holder removes its file and lets go; a third run creates and locks a new one
            os.remove(folder / LOCK_NAME)
            third.append(os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT))
            flock(third[0], operation)
        return flock(fd, operation)

    monkeypatch.setattr(atomic.fcntl, "flock", flock_after_the_holder_left)
    try:
        with pytest.raises(FolderBusyError, match="is in use by"):
            with folder_lock(str(folder)):
                pass
    finally:
        os.close(third[0])
    monkeypatch.undo()
    with folder_lock(str(folder)):  # the third run let go
        pass


def test_a_folder_held_by_this_process_may_be_locked_again_inside(tmp_path):
    folder = tmp_path / "tiny" / "toy"
    with locked_folders() as written:
        with folder_lock(str(folder)):
            with folder_lock(str(folder)):  # a study inside a command that holds its folder
                pass
            assert sorted(os.listdir(folder)) == [LOCK_NAME, OWNER_NAME]  # still held by the outer block
        assert not folder.exists()  # made by the lock, and empty: gone with it
    assert written == [str(folder)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny") / "model"), context=1024)


def _hold(*folders) -> subprocess.Popen:
    """A process that holds `folders` (`folder_lock`) until its standard input closes."""
    script = textwrap.dedent("""
        import contextlib, sys
        from jaxdepth.core.atomic import folder_lock
        with contextlib.ExitStack() as held:
            for folder in sys.argv[1:]:
                held.enter_context(folder_lock(folder))
            print("held", flush=True)
            sys.stdin.read()
    """)
    return subprocess.Popen(
        [sys.executable, "-c", script, *map(str, folders)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def test_every_command_that_writes_results_is_refused_while_another_holds_its_folder(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    _, case_name = case_prompt(question="1 + 1 = ", answer="2")
    commands = {
        model_dir(out, tiny) / "default": [
            ["run", "--model", tiny, "--prompts", "1", "--analyses", "contributions", "--no-figures"],
            ["tuned-lens", "--model", tiny, "--dataset", "default", "--train-rows", "3:6", "--eval-rows", "0:2"],
        ],
        model_dir(out, tiny) / case_name: [
            ["case", tiny, "--prompt", "1 + 1 = ", "--answer", "2", "--analyses", "erasure"]
        ],
        mapping_folder(str(out), model_dir(out, tiny).name, model_dir(out, tiny).name, "default"): [
            ["map", tiny, tiny, "--dataset", "default", "--prompts", "3", "--train-prompts", "2"]
        ],
        model_dir(out, tiny) / "circuit_addition2" / "eap-ig-inputs-left-16": [
            ["circuit", "--model", tiny, "--num-pairs", "2"]
        ],
    }
    holder = _hold(*commands)
    try:
        _wait_for(holder, "held")
        for args in (args for each in commands.values() for args in each):
            assert main([*args, "--out", str(out)]) == 2, args
            printed = capsys.readouterr()
            assert f"is in use by process {holder.pid} on " in printed.err, (args, printed.err)
            assert "loaded" not in printed.out, f"{args[0]} was refused only after loading the model"
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)


# Ctrl-C as a shell delivers it: the command starts with SIGINT neither ignored nor blocked,
# whatever this test process inherited or set (both pass through fork and exec, and Python turns
# SIGINT into KeyboardInterrupt only where it was not ignored when Python started). A wrapper
# resets them and execs the command, where `preexec_fn` would fork a multithreaded JAX process.
AS_FROM_A_SHELL = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}); "
    "os.execv(sys.executable, [sys.executable] + sys.argv[1:])"
)


def test_a_command_interrupted_with_ctrl_c_ends_on_one_line(tiny, tmp_path):
    out = tmp_path / "out"
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    here = f"this process: SIGINT handler {signal.getsignal(signal.SIGINT)}, blocked {blocked}"
    # a fresh compilation cache: the command is still compiling its first scores when interrupted
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "JAXDEPTH_TESTS_XLA_CACHE")}
    env.update(JAXDEPTH_CACHE=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    command = ["-m", "jaxdepth.lab.cli", "circuit", "--model", tiny, "--num-pairs", "2", "--out", str(out)]
    args = [sys.executable, "-c", AS_FROM_A_SHELL, *command]
    child = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        for line in child.stdout:
            if line.startswith("loaded "):
                break
        else:
            raise AssertionError(f"the command ended (exit {child.wait()}) before loading its model")
        child.send_signal(signal.SIGINT)
        stdout, stderr = child.communicate(timeout=300)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == 130, here + "\n" + stderr[:2000] + "\n...\n" + stderr[-1000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-2000:]
    said = [line for line in stderr.replace("\r", "\n").splitlines() if "interrupted" in line]
    # interrupted while its first scores compiled: nothing was written, and the folder its lock
    # made is gone with the lock (no lock file, no half-written file left)
    assert said == ["interrupted before any results were written: nothing is saved"], stderr[-2000:]
    assert not out.exists(), sorted(str(p) for p in out.rglob("*"))
