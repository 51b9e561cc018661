"""The study's IG measured end to end (`experiments/benchmark_study_ig.py`) on a tiny GGUF model:
both sides run layer by layer, agree, and an interrupted run resumes from the finished layers."""

import json
import os
import sys

import pytest

from conftest import write_tiny_gguf

pytest.importorskip("torch")
pytest.importorskip("accelerate")

EXPERIMENTS = os.path.join(os.path.dirname(__file__), "..", "..", "experiments")
sys.path.insert(0, os.path.abspath(EXPERIMENTS))

import benchmark_study_ig  # noqa: E402


@pytest.mark.parity
@pytest.mark.slow(seconds=40)
def test_both_sides_agree_and_a_rerun_resumes(tiny_model, tmp_path, capsys):
    gguf_path = write_tiny_gguf(tiny_model("llama_gqa_untied"), str(tmp_path / "tiny.gguf"))
    data = tmp_path / "gsm8k.jsonl"
    rows = [dict(question=f"a cat has {n} legs.", answer=f"it is {n} legs\n#### {n}") for n in range(10)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    state = tmp_path / "state"
    args = ["--model", gguf_path, "--data", str(data), "--steps", "8", "--state", str(state)]
    assert benchmark_study_ig.main([*args, "--layers", "0", "--sides", "jaxdepth"]) == 0
    first = json.loads((state / "jaxdepth.json").read_text())["layers"]
    assert list(first) == ["0"]
    assert benchmark_study_ig.main(args) == 0  # every layer, both sides: layer 0 of jaxdepth is kept
    summary = json.loads((state / "summary.json").read_text())
    kept = json.loads((state / "jaxdepth.json").read_text())["layers"]
    assert kept["0"] == first["0"]
    layers = tiny_model("llama_gqa_untied").config.num_hidden_layers
    assert summary["jaxdepth"]["layers_done"] == summary["reference"]["layers_done"] == layers
    assert summary["speedup"] > 0 and summary["max_relative_difference"] < 1e-3
    # bf16 weight matrices: a side of its own against the same reference (nothing rerun there)
    reference = (state / "reference.json").read_text()
    assert benchmark_study_ig.main([*args, "--sides", "jaxdepth", "--dtype", "bf16-matmuls"]) == 0
    mixed = json.loads((state / "summary-bf16-matmuls.json").read_text())
    assert (state / "reference.json").read_text() == reference
    assert json.loads((state / "jaxdepth.json").read_text())["layers"] == kept  # float32's side untouched
    assert mixed["jaxdepth-bf16-matmuls"]["layers_done"] == layers and mixed["speedup"] > 0
    assert 0 < mixed["max_relative_difference"] < 0.1  # bf16 rounding, not another computation
    with pytest.raises(SystemExit, match="another run"):  # other steps: not the same measurement
        benchmark_study_ig.main(["--model", gguf_path, "--data", str(data), "--steps", "4", "--state", str(state)])
