"""A result file that cannot be read is named: `run` says which file it recomputes and keeps the
unreadable one aside; `table` and `compare` name the file and what to do, without a traceback,
for a truncated archive, random bytes, a missing array and a result of another format."""

import io
import json
import os
import shutil

import numpy as np
import pytest

from conftest import results_folder, save_tiny_checkpoint
from jaxdepth.core.saved_result import UnreadableResultError, load_saved
from jaxdepth.lab.cli import main
from jaxdepth.lab.results import load_result

ANALYSES = ["--analyses", "contributions,logit_lens", "--prompts", "2", "--no-figures"]


def _truncated(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _random_bytes(data: bytes) -> bytes:
    return np.random.default_rng(0).integers(0, 256, len(data), dtype=np.uint8).tobytes()


def _rewritten(data: bytes, change) -> bytes:
    """The archive `data` with its arrays and header (a dict) changed by `change(arrays, meta)`."""
    with np.load(io.BytesIO(data)) as archive:
        arrays = {k: archive[k] for k in archive.files}
    meta = json.loads(arrays.pop("__meta__").tobytes().decode())
    change(arrays, meta)
    out = io.BytesIO()
    np.savez(out, **arrays, __meta__=np.frombuffer(json.dumps(meta).encode(), np.uint8))
    return out.getvalue()


def _array_missing(data: bytes) -> bytes:
    return _rewritten(data, lambda arrays, meta: arrays.pop("kl"))


def _older_format(data: bytes) -> bytes:
    def change(arrays, meta):
        arrays["kl_old_name"] = arrays.pop("kl")

    return _rewritten(data, change)


DAMAGES = {
    "truncated": (_truncated, "cut short"),
    "random bytes": (_random_bytes, "not an .npz archive"),
    "an array missing": (_array_missing, "missing kl"),
    "another format": (_older_format, "fields this version does not know: kl_old_name"),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny model and a results folder of its contributions and logit lens."""
    root = tmp_path_factory.mktemp("unreadable")
    model = save_tiny_checkpoint(str(root / "model"), context=1024)
    assert main(["run", "--model", model, *ANALYSES, "--out", str(root / "R")]) == 0
    return model, root / "R"


@pytest.mark.parametrize("damage", DAMAGES)
def test_an_unreadable_result_is_named_by_table_compare_and_loading(saved, tmp_path, capsys, damage):
    model, clean = saved
    out = tmp_path / "R"
    shutil.copytree(clean, out)
    path = os.path.join(results_folder(out, model), "logit_lens.npz")
    spoil, reason = DAMAGES[damage]
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(spoil(data))
    with pytest.raises(UnreadableResultError, match=reason) as raised:
        load_saved(path)
    assert raised.value.path == path
    capsys.readouterr()
    for command in (
        ["table", str(out), "--out", str(tmp_path / "table")],
        ["compare", str(out), "--out", str(tmp_path / "c")],
    ):
        assert main(command) == 2, command
        err = capsys.readouterr().err
        assert err.startswith(f"error: {path} cannot be read as a result: ") and reason in err, err
        assert "run the command that wrote it again" in err and "Traceback" not in err, err


@pytest.mark.parametrize("damage", ["truncated", "random bytes"])
def test_run_says_which_file_it_recomputes_and_keeps_the_unreadable_one(saved, tmp_path, capsys, damage):
    model, clean = saved
    out = tmp_path / "R"
    shutil.copytree(clean, out)
    path = os.path.join(results_folder(out, model), "logit_lens.npz")
    with open(path, "rb") as f:
        data = f.read()
    spoiled = DAMAGES[damage][0](data)
    with open(path, "wb") as f:
        f.write(spoiled)
    capsys.readouterr()
    assert main(["run", "--model", model, *ANALYSES, "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert f"recomputing {path}: " in printed.err and f"kept as {path}.unreadable" in printed.err, printed.err
    assert "contributions: reusing" in printed.out and "logit_lens: reusing" not in printed.out
    with open(f"{path}.unreadable", "rb") as f:
        assert f.read() == spoiled
    recomputed, original = load_result(path), load_result(os.path.join(results_folder(clean, model), "logit_lens.npz"))
    np.testing.assert_array_equal(recomputed.kl, original.kl)
