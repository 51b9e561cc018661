"""The IG experiments' pieces (`experiments/study_ig_paths.py`) are the studies' own compiled
computations: with every call size compiled through them up front, the adaptive rule of the
studies compiles nothing more for a new tolerance or a new prompt (the tiny model, prompts and
runs of tests/analyses/test_adaptive_ig.py)."""

import os
import sys

import numpy as np
import pytest

from jaxdepth.analyses.ig import path as ig_path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "analyses"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "experiments"))
import study_ig_paths as paths  # noqa: E402
from test_adaptive_ig import CONFIG, TOLERANCE, _prompt, adaptive_ig  # noqa: E402
from test_adaptive_ig import adaptive, batch, params  # noqa: E402, F401 (the adaptive IG tests' fixtures)

pytestmark = pytest.mark.usefixtures("highest_precision")


def test_new_tolerance_or_prompt_does_not_recompile(params, batch, adaptive):
    """After a first run, a new tolerance (other node placements, other round sizes) and a new
    prompt of the same padded length reuse every compiled computation (with the optional
    forward grid too)."""
    functions = (ig_path.path_points, paths.ig_inputs)
    for f in functions:  # count this test's compilations only, not those of earlier tests in the process
        f.clear_cache()
    # Every call size a run may use, compiled up front: which sizes a run uses depends on its rounds.
    prompt = batch.prompt(0)  # padded as the study pads it, with the backward it chooses
    backward = ig_path.choose_backward("auto", CONFIG, prompt.tokens.shape[1])
    x, b, inputs, _ = paths.ig_inputs(
        params, prompt, CONFIG, baseline="channel_mean", interventions=None, target="layer"
    )  # as the rule calls it
    for size in (8, 16, 32):
        paths.path_points(
            params,
            prompt,
            x,
            b,
            inputs,
            layer=0,
            alphas=np.linspace(0, 1, size),
            config=CONFIG,
            chunk_size=size,
            backward=backward,
        )
    first = adaptive_ig(params, batch, CONFIG, tolerance=TOLERANCE, grid_points=33)
    assert first.converged.all()
    before = [f._cache_size() for f in functions]
    assert before == [3 + 1, 1]  # the three call sizes and the forward grid
    other = adaptive_ig(params, batch, CONFIG, tolerance=0.05, grid_points=33)
    assert other.evaluations.sum() < first.evaluations.sum()  # really other nodes
    new_prompt = _prompt(1)
    assert new_prompt.tokens.shape == batch.tokens.shape and not np.array_equal(new_prompt.tokens, batch.tokens)
    for grid_points in (0, 33):
        adaptive_ig(params, new_prompt, CONFIG, tolerance=TOLERANCE / 10, grid_points=grid_points)
    assert [f._cache_size() for f in functions] == before  # nothing compiled per round, tolerance or prompt
