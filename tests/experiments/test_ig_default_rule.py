"""The default-rule experiment: each rule's row is that rule run through the study's own
functions on the prompt, and a rerun keeps what is saved instead of recomputing it."""

import json
import os
import sys

import numpy as np
import pytest

from conftest import save_tiny_checkpoint
from jaxdepth.analyses.ig import Execution, FixedRule
from jaxdepth.analyses.integrated_gradients import integrated_gradients_of_answers
from jaxdepth.lab.prompts import encode, format_short
from jaxdepth.lab.sources import load

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "experiments"))
import ig_default_rule as experiment  # noqa: E402

ROW = {
    "question": "Tom has 3 apples and buys 4 more. How many apples does he have?",
    "answer": "Tom has 3 + 4 = <<3+4=7>>7 apples.\n#### 7",
}


@pytest.mark.slow(seconds=30)
def test_each_rule_is_the_studys_rule_and_a_rerun_keeps_it(tmp_path):
    checkpoint = save_tiny_checkpoint(str(tmp_path / "tiny"), context=256)
    data, out = tmp_path / "gsm8k.jsonl", tmp_path / "race.json"
    data.write_text(json.dumps(ROW) + "\n")
    # --quiet-timeout 0: no waiting for a quiet machine (3 s before every run otherwise)
    argv = ["--model", checkpoint, "--data", str(data), "--rows", "0", "--out", str(out), "--quiet-timeout", "0"]
    assert experiment.main(argv) == 0
    report = json.loads(out.read_text())
    row = report["prompts"]["gsm8k_row0"]
    assert set(row["rules"]) == {"left-256", "adaptive-1%"} and report["cpu"]

    model = load(checkpoint)
    batch = encode(model.tokenizer, [format_short(ROW)], context=256)
    L = model.config.num_layers
    fixed = integrated_gradients_of_answers(
        model.params, batch, model.config, rule=FixedRule("left", 256), execution=Execution(progress=False)
    )
    spec = experiment.RULES["adaptive-1%"]
    adaptive = integrated_gradients_of_answers(
        model.params,
        batch,
        model.config,
        rule=experiment.rule_of(spec),
        execution=Execution(progress=False),
    )
    for name, result in (("left-256", fixed), ("adaptive-1%", adaptive)):
        gap = np.abs(result.gap[0]) / np.abs(result.f_input[0] - result.f_baseline[0])
        # the chunk size follows the free memory at the time, and the chunking the float32 sums
        assert row["rules"][name]["largest_relative_gap"] == pytest.approx(float(gap.max()), rel=1e-5), name
    assert row["rules"]["left-256"]["evaluations"] == 256 * L
    assert row["rules"]["adaptive-1%"]["evaluations"] == int(adaptive.evaluations.sum())
    assert row["rules"]["adaptive-1%"]["converged_layers"] == int(adaptive.converged.sum())
    assert row["tokens"] == int(batch.lengths[0])
    # per layer: the fixed rule's seconds (summing to at most its wall-clock), the adaptive rule's evaluations
    fixed_layers = row["rules"]["left-256"]["layer_seconds"]
    assert len(fixed_layers) == L and min(fixed_layers) > 0
    assert sum(fixed_layers) <= row["rules"]["left-256"]["seconds"]
    assert row["rules"]["adaptive-1%"]["layer_evaluations"] == adaptive.evaluations[0].tolist()
    # 256 evaluations at every layer cost what the fixed rule's layers took; the adaptive rule's
    # evaluations, what they would cost at those layers' speed
    same = experiment.layer_matched_seconds(row["rules"]["left-256"], {"layer_evaluations": [256] * L})
    assert same == pytest.approx(sum(fixed_layers))
    matched = experiment.layer_matched_seconds(row["rules"]["left-256"], row["rules"]["adaptive-1%"])
    assert min(fixed_layers) / 256 <= matched / adaptive.evaluations.sum() <= max(fixed_layers) / 256
    assert f"against {matched:.0f} s for the same evaluations" in experiment.markdown(report)

    before = out.read_text()
    assert experiment.main(argv) == 0  # everything saved: nothing runs again
    assert out.read_text() == before

    # A rule saved with other settings (an older budget) runs again; the other rule is kept.
    stale = json.loads(before)
    stale["prompts"]["gsm8k_row0"]["rules"]["adaptive-1%"]["settings"]["max_evaluations"] = 512
    stale["prompts"]["gsm8k_row0"]["rules"]["adaptive-1%"]["seconds"] = -1.0
    out.write_text(json.dumps(stale))
    assert experiment.main(argv) == 0
    again = json.loads(out.read_text())["prompts"]["gsm8k_row0"]["rules"]
    assert again["adaptive-1%"]["settings"] == spec and again["adaptive-1%"]["seconds"] > 0
    assert again["left-256"] == row["rules"]["left-256"]
    with pytest.raises(SystemExit):
        experiment.main(argv[:-2] + ["--rules", "adaptive-2%"])
    # another model's report is refused; another row text under the same name is measured anew
    with pytest.raises(SystemExit):
        experiment.main(["--model", "smollm2"] + argv[2:])
    # another text of the same token count and answer start (67 and 39): the row runs on the
    # programs already compiled instead of compiling them all again for another length
    other = dict(
        ROW,
        question="Tom has 5 apples and buys 2 more. How many apples does he have?",
        answer="Tom has 5 + 2 = <<5+2=7>>7 apples.\n#### 7",
    )
    data.write_text(json.dumps(other) + "\n")
    assert experiment.main(argv + ["--rules", "left-256"]) == 0
    renewed = json.loads(out.read_text())["prompts"]["gsm8k_row0"]
    assert set(renewed["rules"]) == {"left-256"} and other["question"] in renewed["prompt"]
