"""The IG accuracy experiment: the fixed rules read off shared nodes are the library's rules, and
end to end on a tiny checkpoint its table equals integrated gradients run rule by rule, the
adaptive rows meet their certificate, and a rerun reuses every cached evaluation."""

import json
import os
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import save_tiny_checkpoint
from jaxdepth.analyses.integrated_gradients import integrated_gradients, quadrature
from jaxdepth.lab.case_study import ARITHMETIC_PROMPT
from jaxdepth.lab.sources import load
from jaxdepth.lab.prompts import encode

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "experiments"))
import ig_accuracy as experiment  # noqa: E402


def test_shared_nodes_give_each_rule_its_own_nodes_and_weights():
    nodes, rules = experiment.fixed_nodes(64, 16)
    assert sorted(rules) == sorted([("left", n) for n in (8, 16, 32, 64)] + [("midpoint", n) for n in (8, 16, 32)]
                                   + [("gauss", n) for n in (8, 16)])
    assert len(nodes) == 64 + 8 + 16  # the grid once, Gauss-Legendre beside it
    for (rule, n), (index, weights) in rules.items():
        expected_nodes, expected_weights = quadrature(rule, n)
        np.testing.assert_allclose(nodes[index], expected_nodes, rtol=0, atol=1e-15)
        np.testing.assert_allclose(weights, expected_weights, rtol=0, atol=1e-15)


def test_table_equals_integrated_gradients_rule_by_rule_and_resumes(tmp_path):
    checkpoint = save_tiny_checkpoint(str(tmp_path / "tiny"), context=256)
    out = tmp_path / "out"
    argv = ["--model", checkpoint, "--max-steps", "16", "--gauss-max", "8", "--tolerances", "0.1,0.01",
            "--reference-tolerance", "0.001", "--budget", "2048", "--out", str(out), "--summaries", str(out)]
    assert experiment.main(argv) == 0
    report = json.loads((out / "ig_accuracy.json").read_text())
    (prompt,) = report["prompts"]
    rows = {(r["rule"], r["steps"]): r for r in prompt["rows"]}

    # Every fixed rule's gaps are those of the library's IG with that rule, at the same padding.
    model = load(checkpoint)
    batch = encode(model.tokenizer, [ARITHMETIC_PROMPT])
    one = batch.single(0, pad_to_multiple=4)
    for rule, steps in [("left", 16), ("midpoint", 8), ("gauss", 8)]:
        direct = integrated_gradients(model.params, one, model.config, steps=steps, rule=rule, progress=False)
        relative = np.abs(direct.gap[0]) / np.abs(direct.f_input[0] - direct.f_baseline[0])
        np.testing.assert_allclose(rows[(rule, steps)]["gap"], relative, rtol=1e-3, atol=1e-6)
        assert rows[(rule, steps)]["evaluations"] == steps * model.config.num_layers

    # The reference converged, and each converged adaptive run is within its tolerance.
    assert all(prompt["reference"]["converged"])
    for tolerance in (0.1, 0.01):
        row = rows[("adaptive", tolerance)]
        if row["note"].startswith(f"{model.config.num_layers}/"):
            assert max(row["gap"]) <= tolerance
    assert rows[("adaptive (reference)", 0.001)]["max_error"] == 0.0

    # A rerun reads every evaluation back instead of computing it.
    cached = {p: os.path.getmtime(p) for p in out.glob("*.npz")}
    assert len(cached) == 4  # the fixed-rule nodes and three adaptive runs
    summary = out / "arithmetic.json"
    os.remove(summary)  # the prompt's rows again, from the cached evaluations only
    assert experiment.main(argv) == 0
    assert {p: os.path.getmtime(p) for p in out.glob("*.npz")} == cached
    finished = os.path.getmtime(summary)
    assert experiment.main(argv) == 0  # the finished prompt is read back, not recomputed
    assert os.path.getmtime(summary) == finished
    assert json.loads((out / "ig_accuracy.json").read_text())["prompts"][0]["rows"] == prompt["rows"]
    assert (out / "ig_accuracy.png").stat().st_size > 0
