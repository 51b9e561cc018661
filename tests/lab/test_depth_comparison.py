"""`jaxdepth compare`: the profiles read what each results folder holds (the effective depths as
the table computes them, the mean decision depth, the curves of the Jacobians), the figure and
the table are written, and a folder without any measure is refused."""

import os

import numpy as np
import pytest

from conftest import tiny_config
from jaxdepth.analyses.contributions import contributions
from jaxdepth.analyses.decision_depth import decision_depth
from jaxdepth.analyses.jacobians import layer_jacobians
from jaxdepth.analyses.logit_lens import logit_lens
from jaxdepth.core.batch import make_batch
from jaxdepth.core.model import random_params
from jaxdepth.lab.cli import main
from jaxdepth.lab.depth_comparison import depth_profiles
from jaxdepth.lab.results import load_result
from jaxdepth.lab.table import collect


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Two tiny models of 3 and 4 layers: one with every measure (its Jacobians in a second
    output folder, `elsewhere`), one with the studies' only."""
    root = tmp_path_factory.mktemp("compare")
    elsewhere = root / "elsewhere"
    rng = np.random.default_rng(0)
    for name, layers, measures in (("deep", 4, "all"), ("shallow", 3, "studies")):
        config = tiny_config(num_layers=layers)
        params = random_params(config, 1, scale=0.5)
        batch = make_batch([rng.integers(1, config.vocab_size, n).tolist() for n in (9, 6)], [5, 3])
        folder = root / "run" / name / "default"
        os.makedirs(folder)
        contributions(params, batch, config).save(str(folder / "contributions.npz"))
        logit_lens(params, batch, config).save(str(folder / "logit_lens.npz"))
        if measures == "all":
            decision_depth(params, batch, config).save(str(folder / "decision_depth.npz"))
            os.makedirs(elsewhere / name / "default")
            layer_jacobians(params, batch, config, tokens=2).save(str(elsewhere / name / "default" / "jacobians.npz"))
    return root


def test_the_profiles_read_what_each_folder_holds(results):
    found = depth_profiles([str(results / "run"), str(results / "elsewhere")])
    profiles = {p.model: p for p in found}  # the two folders of "deep" read as one profile
    assert len(found) == 2 and set(profiles) == {"deep", "shallow"} and profiles["deep"].num_layers == 4
    for p in profiles.values():
        table = {row["method"]: row["ratio"] for row in collect([str(results / "run" / p.model)], resamples=0)}
        rounded = {m: None if p.ratios[m] is None else round(p.ratios[m], 4) for m in table}
        assert rounded == table  # the table shows them rounded
    deep = profiles["deep"]
    decided = np.load(results / "run" / "deep" / "default" / "decision_depth.npz", allow_pickle=True)["depth"]
    # the summary's average: each prompt's mean over its positions, then the mean over prompts
    per_prompt = [row[row >= 0].mean() for row in decided]
    assert deep.ratios["decision"] == pytest.approx(np.mean(per_prompt) / 4)
    x, share = deep.curves["decided"].x, deep.curves["decided"].y
    assert share[-1] == 1.0 and np.all(np.diff(share) >= 0) and x[-1] == 1.0
    x, distance = deep.curves["layer_distance"].x, deep.curves["layer_distance"].y
    assert np.allclose(x, (np.arange(4) + 0.5) / 4) and np.all(distance > 0)
    shallow = profiles["shallow"]  # the studies' measures only: their curves
    assert "decision" not in shallow.ratios
    assert set(shallow.curves) == {"cosine", "norm_attn", "norm_mlp", "norm_layer", "kl", "overlap"}
    contributions = load_result(str(results / "run" / "shallow" / "default" / "contributions.npz"))
    lens = load_result(str(results / "run" / "shallow" / "default" / "logit_lens.npz"))
    np.testing.assert_array_equal(shallow.curves["cosine"].y, contributions.mean_cosine)
    np.testing.assert_array_equal(shallow.curves["norm_layer"].x, (np.arange(3) + 0.5) / 3)
    # at the boundaries h_0..h_L, h_L's lens the output itself (KL 0, overlap 1)
    np.testing.assert_array_equal(shallow.curves["kl"].x, np.arange(4) / 3)
    np.testing.assert_array_equal(shallow.curves["kl"].y, np.append(lens.kl, 0.0))
    np.testing.assert_array_equal(shallow.curves["overlap"].y, np.append(lens.overlap, 1.0))


def test_a_plugin_that_declares_a_reading_joins_the_table_and_the_comparison(results, tmp_path, monkeypatch):
    """The table and the comparison read what analyses declare, not file names: an analysis of
    one's own with a depth reading and `feeds_table` gives its rows and its curve."""
    import dataclasses

    from jaxdepth.analyses.effective_depth import EffectiveDepth
    from jaxdepth.analyses.suite import Analysis, DepthCurve, DepthReading
    from jaxdepth.core.saved_result import SavedResult
    from jaxdepth.lab import registry

    @dataclasses.dataclass
    class Halfway(SavedResult):
        curve: np.ndarray
        settings: dict

    def reading(r):
        L = len(r.curve)
        depth = EffectiveDepth(layer=L // 2, num_layers=L, rule="the middle layer")
        return DepthReading(
            num_layers=L,
            effective_depths={"halfway": depth},
            ratios={"halfway": ("halfway ED", depth.ratio)},
            curves={"halfway": DepthCurve("halfway", "value", (np.arange(L) + 0.5) / L, r.curve)},
        )

    entry = Analysis(
        name="halfway",
        result_type=Halfway,
        run=None,
        identity=lambda s: {},
        figures=lambda *a: {},
        summary=lambda r: [],
        feeds_table=True,
        depth=reading,
    )
    monkeypatch.setitem(registry.ANALYSES, "halfway", entry)
    folder = tmp_path / "run" / "plug" / "default"
    os.makedirs(folder)
    Halfway(curve=np.linspace(0, 1, 6), settings={}).save(str(folder / "halfway.npz"))
    (row,) = collect([str(tmp_path / "run")], resamples=0)
    assert (row["model"], row["method"], row["ed"], row["layers"]) == ("plug", "halfway", 3, 6)
    (profile,) = depth_profiles([str(tmp_path / "run")])
    assert profile.ratios == {"halfway": 4 / 6} and profile.labels == {"halfway": "halfway ED"}
    np.testing.assert_array_equal(profile.curves["halfway"].y, np.linspace(0, 1, 6))


def test_the_command_writes_the_figure_and_the_table(results, tmp_path, capsys):
    out = str(tmp_path / "cmp")
    assert main(["compare", str(results / "run"), str(results / "elsewhere"), "--out", out]) == 0
    assert all(os.path.getsize(f"{out}.{ext}") > 0 for ext in ("png", "pdf", "md"))
    printed = capsys.readouterr().out
    assert printed.count("| deep | default | 4 |") == 1 and "| shallow | default | 3 |" in printed
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["compare", str(empty), "--out", out]) == 2
    assert "no results" in capsys.readouterr().err
