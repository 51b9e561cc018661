"""A results folder on a read-only file system can be read: a rerun whose results all exist
reuses them (its figures and table not written, and said so), `table` and `compare` read it,
and a run that would have to compute something is refused before computing, naming the folder.

The folder is made read-only as a file system: a bind mount with `ro`, in a mount namespace of
the command's own (`unshare`), so that nothing outside the test sees it."""

import shutil
import subprocess
import sys

import pytest

from conftest import results_folder, save_tiny_checkpoint
from jaxdepth.lab.cli import main

ANALYSES = ["--analyses", "contributions,logit_lens", "--prompts", "2"]


def _on_read_only(folder, *command) -> subprocess.CompletedProcess:
    """Run `python -m jaxdepth.lab.cli COMMAND` with `folder` mounted read-only over itself."""
    script = 'mount --bind -o ro "$0" "$0" && exec "$@"'
    args = ["unshare", "-rm", "sh", "-c", script, str(folder), sys.executable, "-m", "jaxdepth.lab.cli", *command]
    return subprocess.run(args, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def read_only_capable(tmp_path_factory):
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) to mount a folder read-only")
    folder = str(tmp_path_factory.mktemp("probe"))
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", 'mount --bind -o ro "$0" "$0" && echo ok', folder], capture_output=True
    )
    if probe.stdout.strip() != b"ok":
        pytest.skip(f"mount namespaces are not allowed here: {probe.stderr.decode()[-300:]}")


def test_a_read_only_results_folder_can_be_read(read_only_capable, tmp_path, capsys):
    model = save_tiny_checkpoint(str(tmp_path / "model"), context=1024)
    out = tmp_path / "R"
    assert main(["run", "--model", model, *ANALYSES, "--out", str(out)]) == 0
    capsys.readouterr()

    rerun = _on_read_only(out, "run", "--model", model, *ANALYSES, "--out", str(out))
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "contributions: reusing" in rerun.stdout and "logit_lens: reusing" in rerun.stdout
    assert "| model | dataset |" in rerun.stdout  # the table, printed
    assert f"figures not written: {results_folder(out, model)} is read-only" in rerun.stderr
    assert f"the effective-depth table not written: {out} is read-only" in rerun.stderr

    table = _on_read_only(out, "table", str(out), "--out", str(tmp_path / "table"))
    assert table.returncode == 0 and "| model | dataset |" in table.stdout, table.stderr[-3000:]
    compare = _on_read_only(out, "compare", str(out), "--out", str(tmp_path / "comparison"))
    assert compare.returncode == 0, compare.stderr[-3000:]

    more = _on_read_only(out, "run", "--model", model, *ANALYSES[:2], "--prompts", "3", "--out", str(out))
    assert more.returncode == 2, more.stderr[-3000:]
    assert f"error: {results_folder(out, model)} is read-only: " in more.stderr and "Traceback" not in more.stderr
    assert "another --out folder" in more.stderr
