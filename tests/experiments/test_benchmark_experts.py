"""experiments/benchmark_experts.py on the tiny shape: the rows the experts multiply lie between
the top-k minimum and 1.5 times it, far below every expert on every token, and the mixture
it times is transformers' block on the same weights' shapes (both sides run)."""

import os
import sys

EXPERIMENTS = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "experiments"))
sys.path.insert(0, EXPERIMENTS)

import benchmark_experts  # noqa: E402


def test_the_executed_flops_are_near_top_k_of_the_dense():
    rows = benchmark_experts.main(["--shapes", "tiny", "--tokens", "1", "7", "300", "--repeats", "1"])["rows"]
    for row in rows:
        assert row["minimum_gflop"] <= row["executed_gflop"] <= 1.5 * row["minimum_gflop"], row
        assert row["jaxdepth_s"] > 0
    one_token = rows[0]
    assert one_token["executed_gflop"] == one_token["minimum_gflop"]  # decoding reads exactly k experts
    config = benchmark_experts.layer_config("qwen3-30b-a3b")
    f = benchmark_experts.flops(config, 300)
    assert f["executed"] / f["dense"] < 1.5 * config.experts_per_token / config.num_experts
