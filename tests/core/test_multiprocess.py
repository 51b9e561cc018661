"""A real multi-process run: two processes on localhost (jax.distributed with a local
coordinator, CPU collectives, 4 host devices each) run `jaxdepth run` on a 2 x 4 global mesh,
the checkpoint restored straight onto it. Every analysis must equal a one-process run, and
process 0 alone writes."""

import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import model_dir, save_tiny_checkpoint
from jaxdepth.lab.cli import main
from jaxdepth.lab.registry import default_analyses
from jaxdepth.lab.results import load_result

TIMEOUT_S = 600  # the whole two-process run; the test kills both processes beyond it
ARGS = ["--dataset", "default", "--prompts", "2", "--detail-prompts", "1", "--ig-steps", "2", "--bootstrap", "50"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(model, out, port, process_id):
    # the session's XLA flags (its optimisation level: conftest.py) plus 4 host devices
    xla_flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()
    env = {**os.environ, "XLA_FLAGS": xla_flags, "JAX_PLATFORMS": "cpu"}
    command = [
        sys.executable,
        "-m",
        "jaxdepth.lab.cli",
        "run",
        "--model",
        model,
        *ARGS,
        "--out",
        out,
        "--mesh",
        "2x4",
        "--distributed",
        "--coordinator",
        f"127.0.0.1:{port}",
        "--num-processes",
        "2",
        "--process-id",
        str(process_id),
    ]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow(seconds=220)
def test_two_processes_equal_one_and_only_process_0_writes(tmp_path, capsys):
    model = save_tiny_checkpoint(str(tmp_path / "model"), context=1024)
    assert main(["run", "--model", model, *ARGS, "--out", str(tmp_path / "single")]) == 0
    capsys.readouterr()

    port = _free_port()
    start = time.perf_counter()
    procs = [_launch(model, str(tmp_path / f"out{i}"), port, i) for i in range(2)]
    try:
        outputs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
    finally:
        for p in procs:  # bounded: nothing outlives the test
            if p.poll() is None:
                p.kill()
                p.wait()
    seconds = time.perf_counter() - start
    print(f"two-process run: {seconds:.0f} s")
    for i, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"process {i}:\n{out[-4000:]}"
    assert "2 processes" in outputs[0] and "8 devices" in outputs[0], outputs[0][-2000:]

    # process 1 wrote nothing at all; process 0 wrote every result, figure and the table
    assert not (tmp_path / "out1").exists() or not any((tmp_path / "out1").rglob("*")), sorted(
        str(p) for p in (tmp_path / "out1").rglob("*")
    )
    folder, single = model_dir(tmp_path / "out0", model) / "default", model_dir(tmp_path / "single", model) / "default"
    assert (tmp_path / "out0" / "effective_depth_table.md").exists()
    figures = lambda root: sorted(p.name for p in (root / "figures").iterdir())  # noqa: E731
    assert figures(folder) == figures(single)
    for name in default_analyses():  # what the run, naming none, ran
        ours, reference = load_result(str(folder / f"{name}.npz")), load_result(str(single / f"{name}.npz"))
        for field, value in vars(reference).items():
            if isinstance(value, np.ndarray) and value.dtype.kind == "f":
                np.testing.assert_allclose(getattr(ours, field), value, rtol=1e-4, atol=1e-5, err_msg=f"{name}.{field}")
