"""experiments/benchmark_generation.py end to end on a small workload: transformers' generate
with the benchmark's hooks (a dropped layer's input returned, two layers exchanged) continues
every prompt exactly as jaxdepth's vmapped layer orders do."""

import json
import os
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("accelerate")  # transformers reads the GGUF file with it

EXPERIMENTS = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "experiments"))
sys.path.insert(0, EXPERIMENTS)

import benchmark_generation  # noqa: E402


@pytest.mark.parity
@pytest.mark.slow(seconds=100)
def test_hooks_and_orders_continue_alike(smollm2, tmp_path):
    out = tmp_path / "report.json"
    # the last two drops and the first two swaps, so that both hooks are exercised
    names = [name for name, _ in benchmark_generation.configurations(smollm2.config.num_layers, 0)]
    assert len(names) == 2 * smollm2.config.num_layers - 1 and names[0] == "drop 0" and names[-1].startswith("swap")
    only = "drop 28,drop 29,swap 0-1,swap 1-2"
    code = benchmark_generation.main(
        ["--only", only, "--prompts", "3", "--new", "6", "--chunk", "4", "--out", str(out)]
    )
    assert code == 0
    report = json.loads(out.read_text())
    assert report["configurations"] == ["drop 28", "drop 29", "swap 0-1", "swap 1-2"]
    assert report["identical_continuations"]["fraction"] == 1.0
    assert report["jaxdepth"]["seconds"] > 0 and report["reference"]["seconds"] > 0
