"""The depth-against-difficulty experiment end to end on a tiny checkpoint: MATH-layout rows of
two levels, one cached layer-skip result per level split at the answer start, the summary and the
figure written, and a rerun that reuses every result."""

import csv
import json
import os
import sys

import numpy as np

from conftest import model_dir, save_tiny_checkpoint
from jaxdepth.analyses.effective_depth import depth_score
from jaxdepth.lab.results import load_result

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "experiments"))
import depth_vs_difficulty as experiment  # noqa: E402


def _math_rows(path):
    rows = [
        {
            "problem": f"What is {a} + {b}?",
            "level": f"Level {level}",
            "type": "Prealgebra",
            "solution": f"We add the two: {a} + {b} = {a + b}, so it is $\\boxed{{{a + b}}}$.",
        }
        for level, (a, b) in [(1, (3, 4)), (3, (12, 9)), (1, (5, 8)), (3, (7, 30))]
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_depth_against_two_math_levels_and_resume(tmp_path, capsys):
    checkpoint = save_tiny_checkpoint(str(tmp_path / "tiny"), context=1024)
    out = tmp_path / "out"
    args = [
        "--model",
        checkpoint,
        "--dataset",
        "math",
        "--data",
        _math_rows(tmp_path / "math.jsonl"),
        "--prompts",
        "2",
        "--resamples",
        "50",
        "--out",
        str(out),
    ]
    assert experiment.main(args) == 0
    printed = capsys.readouterr().out
    assert "Level 2: no prompt of this difficulty" in printed
    folder = model_dir(out, checkpoint)
    summary = json.loads((folder / "math_depth_vs_difficulty.json").read_text())
    groups = summary["groups"]
    assert [g["difficulty"] for g in groups] == [1, 3] and [g["label"] for g in groups] == ["Level 1", "Level 3"]
    for group in groups:
        result = load_result(str(folder / group["group"] / "layer_skip.npz"))
        assert result.settings["identity"]["skip_split"] == "answer_start"
        assert result.split_positions.shape == (2, 1) and (result.split_positions > 0).all()
        assert group["depth_score"] == depth_score(result.part("layer").later)
        assert group["measured_prompts"] == 2 and group["low"] <= group["high"]
        assert len(group["layer_effect"]) == group["num_layers"] == 3
    with open(folder / "math_depth_vs_difficulty.csv") as f:
        rows = list(csv.DictReader(f))
    assert [float(r["depth_score"]) for r in rows] == [g["depth_score"] for g in groups]
    for ext in ("png", "pdf"):
        assert (folder / f"math_depth_vs_difficulty.{ext}").stat().st_size > 5000
    saved = {g["group"]: (folder / g["group"] / "layer_skip.npz").stat().st_mtime_ns for g in groups}

    assert experiment.main(args) == 0
    printed = capsys.readouterr().out
    assert printed.count("layer_skip: reusing") == 2
    for name, mtime in saved.items():
        assert (folder / name / "layer_skip.npz").stat().st_mtime_ns == mtime, f"{name} was recomputed"
    again = json.loads((folder / "math_depth_vs_difficulty.json").read_text())["groups"]
    np.testing.assert_array_equal([g["depth_score"] for g in again], [g["depth_score"] for g in groups])


def test_bad_arguments_are_refused(tmp_path, capsys):
    assert (
        experiment.main(["--dataset", "math", "--data", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path)]) == 2
    )
    assert "dataset file not found" in capsys.readouterr().err
    rows = _math_rows(tmp_path / "math.jsonl")
    assert experiment.main(["--dataset", "math", "--data", rows, "--levels", "5", "--out", str(tmp_path)]) == 2
    assert "no math prompt of difficulty [5]" in capsys.readouterr().err
    assert experiment.group_name("mquake", None, 3) == "mquake_3hops"
    assert experiment.group_name("math", "geometry", 2) == "math-geometry_level2"
