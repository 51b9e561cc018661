"""experiments/benchmark_linear_attention.py on its tiny shape: every form is timed at every
length (jaxdepth's two, transformers' where torch is installed)."""

import os
import sys

EXPERIMENTS = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "experiments"))
sys.path.insert(0, EXPERIMENTS)

import benchmark_linear_attention  # noqa: E402


def test_the_quick_benchmark_times_every_form_at_every_length():
    rows = benchmark_linear_attention.main(["--quick", "--repeats", "1"])
    lengths = benchmark_linear_attention.SHAPES["tiny"]["lengths"]
    methods = {row["method"] for row in rows}
    assert {"jaxdepth chunked (64)", "jaxdepth recurrent"} <= methods
    assert {row["T"] for row in rows} == set(lengths) and len(rows) == len(lengths) * len(methods)
    assert all(row["seconds"] > 0 and row["per_1k"] == 1000 * row["seconds"] / row["T"] for row in rows)
