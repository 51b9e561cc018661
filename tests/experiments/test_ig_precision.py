"""The bf16 IG precision experiment: its float32 numbers are the study's IG of the prompt, its bf16
errors are finite, and a rerun reads every result back from the cache instead of computing it."""

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
import ig_precision as experiment  # noqa: E402

ROW = {
    "question": "Tom has 3 apples and buys 4 more. How many apples does he have?",
    "answer": "Tom has 3 + 4 = <<3+4=7>>7 apples.\n#### 7",
}


def test_float32_is_the_studys_ig_bf16_errors_are_finite_and_a_rerun_resumes(tmp_path, monkeypatch):
    checkpoint = save_tiny_checkpoint(str(tmp_path / "tiny"), context=256)
    data, out, cache = tmp_path / "gsm8k.jsonl", tmp_path / "report.json", tmp_path / "cache"
    data.write_text(json.dumps(ROW) + "\n")
    argv = [
        "--model",
        checkpoint,
        "--data",
        str(data),
        "--rows",
        "0",
        "--steps",
        "2",
        "--group",
        "2",
        "--cache",
        str(cache),
        "--out",
        str(out),
    ]
    assert experiment.main(argv) == 0
    report = json.loads(out.read_text())
    assert (report["model"], report["steps"], report["rule"]) == (checkpoint, 2, "left") and report["cpu"]
    row = report["prompts"]["gsm8k_row0"]

    model = load(checkpoint)
    L = model.config.num_layers
    batch = encode(model.tokenizer, [format_short(ROW)], context=256)
    assert row["tokens"] == int(batch.lengths[0])
    direct = integrated_gradients_of_answers(
        model.params, batch, model.config, rule=FixedRule("left", 2), execution=Execution(progress=False)
    )
    f32 = row["float32"]
    assert f32["f_input"] == pytest.approx(float(direct.f_input[0]), rel=1e-6)
    np.testing.assert_allclose(f32["f_baseline"], direct.f_baseline[0], rtol=1e-6)
    delta = np.abs(direct.f_input[0] - direct.f_baseline[0].astype(np.float64))
    # the chunk size follows the free memory at the time, and the chunking the float32 sums
    np.testing.assert_allclose(f32["gap"], np.abs(direct.gap[0]) / delta, rtol=1e-4, atol=1e-6)
    cached = np.load(experiment.cache_path(str(cache), checkpoint, batch.tokens[0, : row["tokens"]], 2, "float32"))
    np.testing.assert_allclose(cached["attributions"], direct.attributions[0, :, : row["tokens"]], rtol=1e-4, atol=1e-6)

    # bf16 against float32: finite errors of the right shapes, and the bf16 run's own F values.
    for key in ("attribution_error", "token_sum_error"):
        assert np.all(np.isfinite(row[key])) and len(row[key]) == (L if key == "attribution_error" else row["tokens"])
    assert row["max_attribution_error"] == max(row["attribution_error"]) > 0
    assert row["median_attribution_error"] == pytest.approx(np.median(row["attribution_error"]))
    assert np.isfinite(row["bfloat16"]["f_input"]) and np.all(np.isfinite(row["bfloat16"]["gap"]))
    assert row["bfloat16"]["f_input"] != f32["f_input"]  # it did run in bf16
    assert [g["layers"] for g in report["layer_groups"]] == ["0-1", "2-2"]
    assert report["layer_groups"][0]["max_error"] == max(row["attribution_error"][:2])

    # A rerun computes nothing: every result comes from the cache.
    def refuse(*args, **kwargs):
        raise AssertionError("recomputed a cached result")

    monkeypatch.setattr(experiment, "integrated_gradients_of_answers", refuse)
    out.unlink()
    assert experiment.main(argv) == 0
    assert json.loads(out.read_text()) == report
    with pytest.raises(AssertionError, match="recomputed"):  # other steps are other results
        experiment.main(argv[:-6] + ["--steps", "3"] + argv[-6:])


def test_bf16_matmuls_are_compared_with_the_cached_float32_run(tmp_path, monkeypatch):
    checkpoint = save_tiny_checkpoint(str(tmp_path / "tiny"), context=256)
    data, cache = tmp_path / "gsm8k.jsonl", tmp_path / "cache"
    data.write_text(json.dumps(ROW) + "\n")
    common = ["--model", checkpoint, "--data", str(data), "--rows", "0", "--steps", "2", "--cache", str(cache)]
    assert experiment.main([*common, "--out", str(tmp_path / "bf16.json")]) == 0
    float32 = json.loads((tmp_path / "bf16.json").read_text())["prompts"]["gsm8k_row0"]["float32"]
    computed = []
    real = experiment.integrated_gradients_of_answers
    monkeypatch.setattr(
        experiment, "integrated_gradients_of_answers", lambda p, *a, **k: computed.append(p) or real(p, *a, **k)
    )
    out = tmp_path / "mixed.json"
    assert experiment.main([*common, "--narrow", "bf16-matmuls", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    row = report["prompts"]["gsm8k_row0"]
    assert report["narrow"] == "bf16-matmuls" and row["float32"] == float32  # float32 read from the cache
    assert len(computed) == 1 and {x.dtype.name for x in computed[0]["layers"].values()} == {"bfloat16", "float32"}
    assert row["bf16-matmuls"]["f_input"] != float32["f_input"] and row["max_attribution_error"] > 0
