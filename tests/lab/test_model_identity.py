"""A model's results are keyed by what the model is (its files' fingerprint), not by its folder's
name: two models of one name never share a results folder, the table and the comparison show
them apart, the same model reached by another path finds its results, and results written
before the fingerprint existed still load."""

import os
import shutil

from conftest import results_folder, save_tiny_checkpoint
from jaxdepth.lab.cli import main
from jaxdepth.lab.depth_comparison import depth_profiles
from jaxdepth.lab.results import load_result
from jaxdepth.lab.sources import model_fingerprint
from jaxdepth.lab.table import collect

ANALYSES = ["--analyses", "contributions,logit_lens", "--prompts", "2", "--no-figures"]


def _two_models_named_tiny(tmp_path):
    """Two different models in folders of one base name, `a/tiny` (3 layers) and `b/tiny` (2)."""
    a = save_tiny_checkpoint(str(tmp_path / "a" / "tiny"), context=1024)
    b = save_tiny_checkpoint(str(tmp_path / "b" / "tiny"), context=1024, seed=1, num_layers=2)
    return a, b


def test_two_models_of_one_name_never_share_a_results_folder(tmp_path, monkeypatch, capsys):
    a, b = _two_models_named_tiny(tmp_path)
    out = tmp_path / "R"
    # each run names its model `tiny`, as a user in each model's parent folder would
    for parent in ("a", "b"):
        monkeypatch.chdir(tmp_path / parent)
        assert main(["run", "--model", "tiny", *ANALYSES, "--out", str(out)]) == 0
    capsys.readouterr()
    folders = {source: results_folder(out, source) for source in (a, b)}
    assert folders[a] != folders[b]
    subfolders = sorted(name for name in os.listdir(out) if os.path.isdir(out / name))
    assert subfolders == sorted(os.path.basename(os.path.dirname(f)) for f in folders.values())
    for source, layers in ((a, 3), (b, 2)):
        for name in ("contributions", "logit_lens"):
            result = load_result(os.path.join(folders[source], f"{name}.npz"))
            assert result.settings["identity"]["model_fingerprint"] == model_fingerprint(source)[:16]
            assert len(result.kl if name == "logit_lens" else result.mean_cosine) == layers, (source, name)
    rows = collect([str(out)], resamples=0)
    labels = {(r["model"], r["layers"]) for r in rows}
    # one name, two models: each named with its fingerprint's first digits
    assert labels == {(f"tiny [{model_fingerprint(s)[:8]}]", layers) for s, layers in ((a, 3), (b, 2))}
    profiles = depth_profiles([str(out)])
    assert sorted((p.model, p.num_layers) for p in profiles) == sorted(labels)


def test_the_same_model_by_another_path_finds_its_results(tmp_path, capsys):
    a, _ = _two_models_named_tiny(tmp_path)
    copy = str(tmp_path / "copy" / "tiny")
    shutil.copytree(a, copy)
    out = tmp_path / "R"
    assert main(["run", "--model", a, *ANALYSES, "--out", str(out)]) == 0
    capsys.readouterr()
    assert results_folder(out, copy) == results_folder(out, a)
    assert main(["run", "--model", copy, *ANALYSES, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "contributions: reusing" in printed and "logit_lens: reusing" in printed, printed


def test_results_written_before_fingerprints_still_load(tmp_path, capsys):
    """A results folder of an older version (`OUT/<name>/<dataset>/`, identities without a
    fingerprint) is read by `table` and `compare` as before, named as it recorded."""
    a, _ = _two_models_named_tiny(tmp_path)
    out = tmp_path / "R"
    assert main(["run", "--model", a, *ANALYSES, "--out", str(out)]) == 0
    capsys.readouterr()
    old = out / "old" / "tiny" / "default"
    os.makedirs(old)
    for name in ("contributions", "logit_lens"):
        result = load_result(os.path.join(results_folder(out, a), f"{name}.npz"))
        del result.settings["identity"]["model_fingerprint"]
        result.settings["identity"]["model"] = "tiny-before"
        result.save(str(old / f"{name}.npz"))
    rows = collect([str(out / "old")], resamples=0)
    assert {r["model"] for r in rows} == {"tiny-before"} and {r["fingerprint"] for r in rows} == {None}
    new = {r["method"]: r["ed"] for r in collect([str(out)], resamples=0) if r["model"] != "tiny-before"}
    assert {r["method"]: r["ed"] for r in rows} == new
    assert main(["table", str(out / "old"), "--out", str(tmp_path / "table")]) == 0
    assert "| tiny-before | default |" in capsys.readouterr().out


def test_a_fingerprint_reads_every_model_file_and_nothing_else(tmp_path):
    a, _ = _two_models_named_tiny(tmp_path)
    before = model_fingerprint(a)
    with open(os.path.join(a, "NOTES.md"), "w") as f:  # documentation changes nothing the model computes
        f.write("notes")
    os.makedirs(os.path.join(a, ".cache"))
    assert model_fingerprint(a) == before
    assert model_fingerprint(a, "bfloat16") != before  # another dtype is another model for its results
    params = [os.path.join(folder, n) for folder, _, names in os.walk(a) for n in names if "params" in folder]
    largest = max(params, key=os.path.getsize)
    data = bytearray(open(largest, "rb").read())
    data[len(data) // 2] ^= 1  # one bit of one weight file
    with open(largest, "wb") as f:
        f.write(bytes(data))
    assert model_fingerprint(a) != before
