"""The IG accuracy experiment: the fixed rules read off shared nodes are the library's rules, and
end to end on a tiny checkpoint its table equals integrated gradients run rule by rule, the
adaptive rows meet their certificate, and a rerun reuses every cached evaluation."""

import json
import os
import sys

import numpy as np
import pytest

from conftest import save_tiny_checkpoint
from jaxdepth.analyses.ig import AdaptiveRule, Execution, FixedRule
from jaxdepth.analyses.ig.rules import INITIAL_INTERVALS, largest_call, quadrature, run_rule, summarise
from jaxdepth.analyses.integrated_gradients import ig_of_prompt, integrated_gradients_of_answers
from jaxdepth.core.batch import LengthBuckets
from jaxdepth.lab.case_study import ARITHMETIC_PROMPT
from jaxdepth.lab.sources import load
from jaxdepth.lab.prompts import encode

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "experiments"))
import ig_accuracy as experiment  # noqa: E402
from study_ig_paths import ig_inputs, path_points  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """The tiny checkpoint both end-to-end tests run on, built once (neither writes into it)."""
    return save_tiny_checkpoint(str(tmp_path_factory.mktemp("ig-accuracy") / "tiny"), context=256)


def test_shared_nodes_give_each_rule_its_own_nodes_and_weights():
    nodes, rules = experiment.fixed_nodes(64, 16)
    assert sorted(rules) == sorted(
        [("left", n) for n in (8, 16, 32, 64)]
        + [("midpoint", n) for n in (8, 16, 32)]
        + [("gauss", n) for n in (8, 16)]
    )
    assert len(nodes) == 64 + 8 + 16  # the grid once, Gauss-Legendre beside it
    for (rule, n), (index, weights) in rules.items():
        expected_nodes, expected_weights = quadrature(rule, n)
        np.testing.assert_allclose(nodes[index], expected_nodes, rtol=0, atol=1e-15)
        np.testing.assert_allclose(weights, expected_weights, rtol=0, atol=1e-15)


@pytest.mark.slow(seconds=12)
def test_shared_nodes_give_the_adaptive_rule_its_own_results_and_evaluate_each_node_once(tmp_path, checkpoint):
    model = load(checkpoint)
    p, config, L = model.params, model.config, model.config.num_layers
    prompt = encode(model.tokenizer, [ARITHMETIC_PROMPT]).prompt(0, LengthBuckets(4, geometric=False))
    x, b, inputs, f_input = ig_inputs(p, prompt, config)
    calls = []

    def evaluate(layer, alphas, grad, chunk):
        calls.append((layer, len(alphas)))
        return path_points(
            p, prompt, x, b, inputs, layer=layer, alphas=alphas, config=config, grad=grad, chunk_size=chunk
        )

    path = str(tmp_path / "shared.npz")
    shared = experiment.SharedNodes(path, evaluate, "this machine")
    run = lambda call, tolerance: summarise(
        run_rule(
            call,
            range(L),
            float(f_input),
            AdaptiveRule(tolerance=tolerance, max_evaluations=2048),
            largest=largest_call(config, prompt.tokens.shape[1]),
        )
    )

    def check_against_the_rule(result, tolerance):
        direct = ig_of_prompt(
            p, prompt, config, rule=AdaptiveRule(tolerance=np.full(L, tolerance), max_evaluations=2048)
        )
        direct = dict(
            evaluations=direct.evaluations[:, 0],
            converged=direct.converged[:, 0],
            attributions=direct.per_position[:, 0],
        )
        assert np.array_equal(result["evaluations"], direct["evaluations"])
        np.testing.assert_array_equal(result["converged"], direct["converged"])
        np.testing.assert_allclose(result["attributions"], direct["attributions"], rtol=1e-5, atol=1e-7)

    tight = run(shared, 0.001)  # tightest first, as the experiment runs them
    check_against_the_rule(tight, 0.001)
    assert len(shared.values) == tight["evaluations"].sum()  # every node evaluated once, held once
    held = len(shared.values)
    loose = run(shared, 0.01)
    check_against_the_rule(loose, 0.01)
    # The looser run evaluated only nodes the tighter one lacked: never its initial partition's.
    assert len(shared.values) - held <= loose["evaluations"].sum() - L * (2 * INITIAL_INTERVALS + 1)

    # Saved and read back: the same runs replay from the file and evaluate nothing.
    shared.save()
    calls.clear()
    again = experiment.SharedNodes(path, evaluate, "this machine")
    assert (again.evaluated, again.seconds, len(again.values)) == (shared.evaluated, shared.seconds, len(shared.values))
    elsewhere = experiment.SharedNodes(path, evaluate, "another machine")  # its times are not this one's
    assert (elsewhere.evaluated, elsewhere.seconds, len(elsewhere.values)) == (0, 0.0, len(shared.values))
    np.testing.assert_array_equal(run(again, 0.001)["attributions"], tight["attributions"])
    np.testing.assert_array_equal(run(again, 0.01)["attributions"], loose["attributions"])
    assert calls == []


@pytest.mark.slow(seconds=20)
def test_table_equals_integrated_gradients_rule_by_rule_and_resumes(tmp_path, checkpoint):
    out = tmp_path / "out"
    argv = [
        "--model",
        checkpoint,
        "--max-steps",
        "16",
        "--gauss-max",
        "8",
        "--tolerances",
        "0.1,0.01",
        "--reference-tolerance",
        "0.001",
        "--budget",
        "2048",
        "--out",
        str(out),
        "--summaries",
        str(out),
    ]
    assert experiment.main(argv) == 0
    report = json.loads((out / "ig_accuracy.json").read_text())
    (prompt,) = report["prompts"]
    rows = {(r["rule"], r["steps"]): r for r in prompt["rows"]}

    # Every fixed rule's gaps are those of the library's IG with that rule, at the same padding.
    model = load(checkpoint)
    batch = encode(model.tokenizer, [ARITHMETIC_PROMPT])
    one = batch.single(0, LengthBuckets(4, geometric=False))
    for rule, steps in [("left", 16), ("midpoint", 8), ("gauss", 8)]:
        direct = integrated_gradients_of_answers(
            model.params, one, model.config, rule=FixedRule(rule, steps), execution=Execution(progress=False)
        )
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
    assert len(cached) == 5  # the fixed-rule nodes, the adaptive runs' shared nodes and three adaptive runs
    summary = out / "arithmetic.json"
    os.remove(summary)  # the prompt's rows again, from the cached evaluations only
    assert experiment.main(argv) == 0
    assert {p: os.path.getmtime(p) for p in out.glob("*.npz")} == cached
    finished = os.path.getmtime(summary)
    assert experiment.main(argv) == 0  # the finished prompt is read back, not recomputed
    assert os.path.getmtime(summary) == finished
    assert json.loads((out / "ig_accuracy.json").read_text())["prompts"][0]["rows"] == prompt["rows"]
    assert (out / "ig_accuracy.png").stat().st_size > 0
    assert prompt["device"] == experiment.device_description()  # the times' machine

    # --only-finished: the table of the finished prompts, computing nothing; an unfinished one is left out.
    data = tmp_path / "gsm8k.jsonl"
    data.write_text(
        json.dumps(
            {
                "question": "Tom has 3 apples and buys 4 more. How many apples does he have?",
                "answer": "Tom has 3 + 4 = <<3+4=7>>7 apples.\n#### 7",
            }
        )
        + "\n"
    )
    gsm8k = ["--data", str(data), "--rows", "0", "--only-finished"]
    assert experiment.main(argv + gsm8k) == 0
    assert not (out / "gsm8k_row0.json").exists()
    assert [p["prompt"] for p in json.loads((out / "ig_accuracy.json").read_text())["prompts"]] == ["arithmetic"]
    assert {p: os.path.getmtime(p) for p in out.glob("*.npz")} == cached
    assert experiment.main(argv + gsm8k + ["--no-arithmetic"]) == 1  # nothing finished: nothing written
