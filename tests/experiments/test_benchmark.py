"""The benchmark on a tiny GGUF model: every registered analysis has a case, runs on both sides,
and jaxdepth agrees with the PyTorch reference."""

import json
import os
import sys

import pytest

from conftest import write_tiny_gguf

pytest.importorskip("torch")
pytest.importorskip("accelerate")

EXPERIMENTS = os.path.join(os.path.dirname(__file__), "..", "..", "experiments")
sys.path.insert(0, os.path.abspath(EXPERIMENTS))

import benchmark  # noqa: E402

from jaxdepth.lab.registry import default_analyses  # noqa: E402


def test_every_analysis_run_by_default_has_a_case():
    assert set(benchmark.CASES) == set(default_analyses())


def test_only_layer_skip_reads_the_split_positions():
    """The split positions belong to layer skip's prompts; a case with more prompts (the default
    10 for contributions against layer skip's 2) counts its FLOPs without them."""
    from benchmarking.cases import workload_flops
    from benchmarking.flops import forward_flops
    from jaxdepth.core.config import ModelConfig

    c = ModelConfig(
        model_type="llama",
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rope_theta=1e4,
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        qkv_bias=False,
    )
    splits = [[3, 5], [4]]
    assert workload_flops("contributions", c, [16] * 10, splits=splits) == pytest.approx(
        10 * forward_flops(c, 16, lm_head=False)
    )
    assert workload_flops("layer_skip", c, [16, 20], splits=splits) == pytest.approx(
        (1 + 3 * 2) * forward_flops(c, 16) + (1 + 3 * 1) * forward_flops(c, 20)
    )
    with pytest.raises(ValueError, match="split positions"):
        workload_flops("layer_skip", c, [16] * 10, splits=splits)


@pytest.mark.parity
@pytest.mark.slow(seconds=40)
def test_benchmark_agrees_with_the_reference_on_a_tiny_model(tiny_model, tmp_path, capsys):
    gguf_path = write_tiny_gguf(tiny_model("llama_gqa_untied"), str(tmp_path / "tiny.gguf"))
    data = tmp_path / "gsm8k.jsonl"
    rows = [
        dict(question=f"a cat has {n} legs and a bat has two.", answer=f"it is {n} plus two\n#### {n + 2}")
        for n in range(3)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "benchmark.json"
    code = benchmark.main(
        [
            "--model",
            gguf_path,
            "--data",
            str(data),
            "--prompts",
            "2",
            "--skip-prompts",
            "2",
            "--max-tokens",
            "40",
            "--ig-steps",
            "4",
            "--baseline-prompts",
            "2",
            # The matmul peak only scales the FLOP-rate columns, which are checked to exist, not
            # for their value: 256-wide squares instead of the default 2048 and 4096 (measured
            # before and after the timings, they took 108 s of the run's 136 s on 2 busy cores).
            "--peak-sizes",
            "256",
            "--out",
            str(out),
        ]
    )
    report = json.loads(out.read_text())
    failed = [f"{a['analysis']} {a['quantity']}: {a.get('note')}" for a in report["agreement"] if not a["ok"]]
    assert code == 0 and report["all_agree"], failed
    assert [r["analysis"] for r in report["rows"]] == default_analyses()
    # Each side's timing, FLOP count and agreement rows are there for every analysis.
    for row in report["rows"]:
        assert row["jax_run_s"] > 0 and row["ref_s"] > 0 and row["model_flops"] > 0
    assert {a["analysis"] for a in report["agreement"]} == set(default_analyses())
    assert "TOTAL" in capsys.readouterr().out
    # The adaptive IG preset ran on the IG workload, and the second extrapolation replaces only
    # IG's time, scaled by the measured adaptive time over the fixed rule's scaled to 256 steps.
    adaptive, fixed = report["adaptive_ig"], next(r for r in report["rows"] if r["analysis"] == "integrated_gradients")
    assert adaptive["evaluations"] > 0 and adaptive["layers"] == tiny_model("llama_gqa_untied").config.num_hidden_layers
    if adaptive["converged"] == adaptive["layers"]:  # the certificate bounds the gap
        assert adaptive["max_relative_gap"] <= adaptive["tolerance"]
    # milliseconds per gradient evaluation of each rule, from its time and its evaluations
    assert adaptive["ms_per_evaluation"] == pytest.approx(1e3 * adaptive["jax_run_s"] / adaptive["evaluations"])
    assert adaptive["fixed_ms_per_evaluation"] == pytest.approx(
        1e3 * fixed["jax_run_s"] / adaptive["fixed_evaluations"]
    )
    # the FLOP rates weigh each evaluation by the layers it crosses: per evaluation, the adaptive
    # rule's work is positive and at most the dearest layer's, which is under twice the mean over
    # all layers (the fixed rule's: an evaluation's cost falls linearly with its layer)
    assert sum(map(sum, adaptive["layer_evaluations"])) == adaptive["evaluations"]
    work_per_evaluation = adaptive["gflops_per_s"] * adaptive["ms_per_evaluation"]
    fixed_work = adaptive["fixed_gflops_per_s"] * adaptive["fixed_ms_per_evaluation"]  # the mean over all layers
    assert 0 < work_per_evaluation <= 2 * fixed_work
    share = adaptive["jax_run_s"] / (fixed["jax_run_s"] * 256 / 4)
    est, published = report["study_workload_estimate_adaptive_ig"], report["study_workload_estimate"]
    assert est["share_of_published_ig_time"] == pytest.approx(share)
    for ours, theirs in zip(est["rows"], published["rows"]):
        factor = share if ours["analysis"] == "integrated_gradients" else 1.0
        assert ours["jax_s"] == pytest.approx(theirs["jax_s"] * factor) and ours["ref_s"] == theirs["ref_s"]
