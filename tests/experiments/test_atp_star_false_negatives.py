"""The AtP* false-negative report: its rates are `missed_nodes` of the exact and estimated node
sizes, it counts only the nodes after the shared prefix, and a rerun reads the exact effects
back from its cache."""

import json
import os
import sys

import numpy as np
import pytest

EXPERIMENTS = os.path.join(os.path.dirname(__file__), "..", "..", "experiments")
sys.path.insert(0, os.path.abspath(EXPERIMENTS))

import atp_star_false_negatives as report_script  # noqa: E402

from jaxdepth.analyses.edges.atp_star import NodeAttribution  # noqa: E402


def test_rates_are_the_share_of_the_largest_exact_nodes_missed():
    rng = np.random.default_rng(0)
    exact = rng.normal(size=(60, 2))  # [n, B]
    nodes = np.stack([np.arange(60) // 20, np.arange(60) % 20], axis=1)  # (layer, position)
    right = np.abs(exact).T.reshape(2, 3, 20)
    shuffled = right.reshape(2, 60)[:, rng.permutation(60)].reshape(2, 3, 20)
    estimates = {
        name: NodeAttribution(f_clean=np.zeros(2), f_corrupt=np.zeros(2), qk_fix=True, grad_drop=True, mlps=m)
        for name, m in (("AtP*", right), ("AtP", shuffled))
    }
    row = report_script.compare(estimates, {"mlps": (nodes, exact)})["mlps"]
    assert row["AtP*"]["missed_at_10"] == 0.0 and row["AtP*"]["largest_missed_effect"] == 0.0
    size = np.abs(exact).mean(axis=1)
    true = set(np.argsort(-size)[:10])
    found = set(np.argsort(-np.abs(shuffled.reshape(2, 60)).mean(axis=0))[:10])
    assert row["AtP"]["missed_at_10"] == len(true - found) / 10 > 0
    assert row["AtP"]["largest_missed_effect"] == max(size[i] for i in true - found)


@pytest.mark.slow(seconds=30)
def test_the_report_runs_on_the_embedded_model_and_resumes(smollm2, tmp_path, capsys):
    argv = [
        "--pairs",
        "1",
        "--kinds",
        "mlps",
        "--cache",
        str(tmp_path / "exact.npz"),
        "--out",
        str(tmp_path / "r.json"),
    ]
    assert report_script.main(argv) == 0
    assert "exact patching of" in capsys.readouterr().out
    report = json.load(open(tmp_path / "r.json"))
    assert report["kinds"]["mlps"]["nodes"] == 30 * (report["length"] - report["from_position"])
    assert 0 <= report["kinds"]["mlps"]["AtP*"]["missed_at_10"] <= 1
    assert report_script.main(argv) == 0
    assert "exact patching of" not in capsys.readouterr().out  # the exact effects came from the cache
    assert json.load(open(tmp_path / "r.json"))["kinds"] == report["kinds"]
