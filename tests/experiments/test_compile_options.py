"""The compile-options comparison runs every workload under an option set and refuses unknown
option sets (its timings are what it reports, not what the test checks)."""

import os
import sys

import numpy as np
import pytest

EXPERIMENTS = os.path.join(os.path.dirname(__file__), "..", "..", "experiments")
sys.path.insert(0, os.path.abspath(EXPERIMENTS))

import compile_options  # noqa: E402

from jaxdepth.core.config import ModelConfig  # noqa: E402
from jaxdepth.core.model import random_params  # noqa: E402

TINY = ModelConfig(
    model_type="llama",
    vocab_size=61,
    hidden_size=16,
    intermediate_size=32,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=8,
    rope_theta=1e4,
    rms_norm_eps=1e-6,
    max_position_embeddings=128,
    tie_word_embeddings=True,
    qkv_bias=False,
)


def test_every_workload_is_timed_under_the_library_options():
    row = compile_options.measure(
        compile_options.OPTION_SETS["ynn_dot"], random_params(TINY), np.random.default_rng(0), config=TINY
    )
    assert list(row) == ["matmul GFLOP/s", "forward 1x64 s", "forward 8x64 s", "IG 16 steps x 16 tokens s"]
    assert all(np.isfinite(v) and v > 0 for v in row.values())


def test_unknown_option_sets_are_refused(capsys):
    with pytest.raises(SystemExit):
        compile_options.main(["fastest"])
    assert "unknown option sets ['fastest']" in capsys.readouterr().err
