"""The adaptive integrated-gradients rule on a tiny random model: it reaches its tolerance and
agrees with a 16,384-step fixed rule, one layer's refinement leaves the others untouched, and a
spent budget is reported (that new tolerances and prompts reuse the compiled computations is
tested with the IG experiments' pieces, tests/experiments/test_study_ig_paths.py)."""

import jax
import numpy as np
import pytest

from jaxdepth.analyses import integrated_gradients as ig
from jaxdepth.analyses.ig import rules as aig
from jaxdepth.analyses.ig.engine import Execution
from jaxdepth.analyses.ig.rules import AdaptiveRule, FixedRule
from jaxdepth.core.batch import LengthBuckets, make_batch
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.model import random_params

# Weights at scale 1 make the path of layer 0 strongly nonlinear (its integrand is peaked), so
# the rule must refine there well beyond its initial partition.
CONFIG = ModelConfig(
    model_type="qwen2",
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
    qkv_bias=True,
)
TOLERANCE = 1e-3
REFERENCE_STEPS = 16384

QUIET = Execution(progress=False)

pytestmark = pytest.mark.usefixtures("highest_precision")


@pytest.fixture(scope="module")
def params():
    return random_params(CONFIG, 1, scale=1.0)


def _prompt(seed: int):
    """A 14-token prompt (padded length 16) whose answer is its last 5 tokens."""
    return make_batch([np.random.default_rng(seed).integers(0, 97, 14).tolist()], [9])


@pytest.fixture(scope="module")
def batch():
    return _prompt(0)


@pytest.fixture(scope="module")
def adaptive(params, batch):
    with jax.default_matmul_precision("highest"):  # module scope: the fixture of that name is per test
        return adaptive_ig(params, batch, CONFIG, tolerance=TOLERANCE)


def adaptive_ig(params, batch, config, target="layer", **rule):
    """The studies' IG with the adaptive rule (`rule`: its options), with a budget the tolerances
    here need (the default, the fixed rule's 256 steps, is not enough for layer 0 at 1e-3)."""
    rule.setdefault("max_evaluations", 2048)
    return ig.integrated_gradients_of_answers(
        params, batch, config, rule=AdaptiveRule(**rule), target=target, execution=QUIET
    )


def _delta(result):
    """|F(x) - F(b)| per layer `[P, L]`."""
    return np.abs(result.f_input[:, None] - result.f_baseline.astype(np.float64))


def _scale(result):
    """What the tolerance is relative to `[P, L]`: |F(x) - F(b)|, or the floor where F moves less."""
    return np.maximum(np.maximum(_delta(result), aig.FLOOR_SHARE * np.abs(result.f_input[:, None])), aig.ATOL)


def test_adaptive_reaches_the_tolerance_and_equals_a_fine_fixed_rule(params, batch, adaptive):
    """Every layer converges with |gap| <= bound <= tol scale (scale = |F(x) - F(b)|, or the floor
    where F moves less), and per layer and token |IG_adaptive - IG_16384| <= tol scale (midpoint
    rule, whose own gap is < tol / 100 |F(x) - F(b)|)."""
    delta, scale = _delta(adaptive), _scale(adaptive)
    assert adaptive.converged.all()
    assert np.all(np.abs(adaptive.gap) <= adaptive.bound * (1 + 1e-5) + 1e-7)
    assert np.all(adaptive.bound <= TOLERANCE * scale)
    np.testing.assert_array_equal(adaptive.floored, delta < scale)
    # not vacuous: layer 0 needed many more nodes than the 17 of its initial partition
    assert adaptive.evaluations[0, 0] > 3 * (2 * aig.INITIAL_INTERVALS + 1)
    assert np.all(adaptive.evaluations <= 2048)

    fixed = ig.integrated_gradients_of_answers(
        params,
        batch,
        CONFIG,
        rule=FixedRule("midpoint", REFERENCE_STEPS),
        execution=Execution(chunk_size=512, progress=False),
    )
    assert np.all(np.abs(fixed.gap) < TOLERANCE / 100 * delta)
    np.testing.assert_allclose(adaptive.f_baseline, fixed.f_baseline, atol=1e-6)
    difference = np.abs(adaptive.attributions - fixed.attributions).max(axis=-1)
    assert np.all(difference <= TOLERANCE * scale), difference / scale


def test_one_layers_refinement_leaves_the_other_layers_bit_identical(params, batch, adaptive):
    """A tighter tolerance on layer 0 alone refines layer 0 and changes nothing else."""
    tight = adaptive_ig(params, batch, CONFIG, tolerance=[TOLERANCE / 100, TOLERANCE, TOLERANCE])
    assert tight.evaluations[0, 0] > adaptive.evaluations[0, 0]
    assert np.abs(tight.gap[0, 0]) <= TOLERANCE / 100 * _scale(tight)[0, 0]
    for name in ("attributions", "gap", "f_baseline", "evaluations", "converged", "bound"):
        np.testing.assert_array_equal(getattr(tight, name)[:, 1:], getattr(adaptive, name)[:, 1:], err_msg=name)
    assert tight.settings["tolerance"] == [TOLERANCE / 100, TOLERANCE, TOLERANCE]


def test_spent_budget_is_reported_as_not_converged(params, batch):
    """A budget too small for the tolerance: converged False exactly where the certified bound
    misses the target, never more evaluations than the budget."""
    budget = 9
    result = adaptive_ig(params, batch, CONFIG, tolerance=1e-6, max_evaluations=budget)
    target = 1e-6 * _scale(result)
    assert not result.converged.all()
    np.testing.assert_array_equal(result.converged, result.bound <= target)
    assert np.all(result.evaluations <= budget)
    assert np.any(np.abs(result.gap[~result.converged]) > 1e-6 * _delta(result)[~result.converged])
    assert result.settings["max_evaluations"] == budget


def test_sublayer_target_converges_to_the_fixed_rule(params, batch):
    """IG with respect to a_l: the same certificate, and agreement with the fixed rule (the
    comparison as for the layer target)."""
    result = adaptive_ig(params, batch, CONFIG, tolerance=TOLERANCE, target="attn")
    assert result.converged.all() and result.settings["target"] == "attn"
    delta, scale = _delta(result), _scale(result)
    assert np.all(np.abs(result.gap) <= TOLERANCE * scale)
    fixed = ig.integrated_gradients_of_answers(
        params,
        batch,
        CONFIG,
        rule=FixedRule("midpoint", REFERENCE_STEPS),
        target="attn",
        execution=Execution(chunk_size=512, progress=False),
    )
    assert np.all(np.abs(fixed.gap) < TOLERANCE / 100 * delta)
    assert np.all(np.abs(result.attributions - fixed.attributions).max(axis=-1) <= TOLERANCE * scale)


def test_initial_partition_follows_the_variation_of_f():
    alphas = np.linspace(0, 1, 33)
    step = (alphas > 0.3).astype(float)  # F jumps between 9/32 and 10/32
    ends = aig.initial_partition(alphas, step, 8)
    assert ends[0] == 0 and ends[-1] == 1 and np.all(np.diff(ends) > 0)
    assert np.all(ends * 4096 == np.round(ends * 4096))  # on the 2^-12 grid
    inside = np.sum((ends > 9 / 32) & (ends < 10 / 32))
    assert inside >= 3  # half the intervals go where F moves
    np.testing.assert_array_equal(aig.initial_partition(alphas, np.zeros(33), 8), np.linspace(0, 1, 9))


def test_splits_take_the_largest_errors_and_stop_at_float32_resolution():
    errors, can = np.array([0.1, -0.5, 0.02, 0.3]), np.ones(4, bool)
    assert aig.choose_splits(errors, can, 0.0, target=0.3, max_splits=10) == [1, 3]  # rest 0.12 <= 0.15
    assert aig.choose_splits(errors, can, 0.0, target=0.3, max_splits=1) == [1]
    # the unsplittable -0.5 stays: every other interval is split
    assert aig.choose_splits(errors, np.array([True, False, True, True]), 0.0, 0.3, 10) == [3, 0, 2]
    assert aig.choose_splits(errors, can, 0.0, target=2.0, max_splits=10) == []
    assert aig.splittable(0.5, 0.5 + 2.0**-22) and not aig.splittable(0.5, 0.5 + 2.0**-23)
    # rounded up to a multiple with the next largest errors, within the budget
    assert aig.choose_splits(errors, can, 0.0, target=0.3, max_splits=10, multiple=3) == [1, 3, 0]
    assert aig.choose_splits(errors, can, 0.0, target=0.3, max_splits=2, multiple=4) == [1, 3]


def test_call_sizes_fill_wide_calls_and_pad_only_below_the_smallest():
    assert aig.call_sizes(23, 32) == [16, 8]  # the first round: one padding slot
    assert aig.call_sizes(56, 32) == [32, 16, 8]
    assert aig.call_sizes(8, 32) == [8] and aig.call_sizes(3, 32) == [8]
    assert aig.call_sizes(64, 16) == [16, 16, 16, 16]
    assert aig.call_sizes(10, 4) == [4, 4, 4]  # memory allows fewer than 8: calls of what fits
    for n in range(1, 200):
        sizes = aig.call_sizes(n, 32)
        assert all(s in (8, 16, 32) for s in sizes) and sum(sizes) - n == (-n) % 8  # padding < 8


# Tiny weights: every layer's path moves F by a few 1e-7, about what float32 resolves of F's own
# size, as on random weights of a real model's shape.
FLAT = ModelConfig(
    model_type="qwen2",
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
    qkv_bias=True,
)


def test_a_path_where_f_barely_moves_is_certified_at_the_floor_within_the_fixed_rules_budget():
    """With |F(x) - F(b)| tiny, a tolerance of 1e-4 of it asks for less than float32 resolves:
    without the floor the rule spends its budget and certifies nothing; with it (1e-4 of a tenth
    of F(x)), every layer converges, is reported as floored, and no layer costs more than the
    fixed rule's steps."""
    params = random_params(FLAT, 2, scale=0.002)
    prompt = _prompt(3).prompt(0, LengthBuckets(4, geometric=False))
    with jax.default_matmul_precision("highest"):
        floored = ig.ig_of_prompt(params, prompt, FLAT, rule=AdaptiveRule(tolerance=1e-4, max_evaluations=64))
        bare = ig.ig_of_prompt(
            params, prompt, FLAT, rule=AdaptiveRule(tolerance=1e-4, max_evaluations=64, floor_share=0.0)
        )
    delta = np.abs(floored.f_input[0] - floored.f_baseline[:, 0].astype(np.float64))
    assert np.all(delta < 1e-3 * abs(floored.f_input[0])), delta  # F barely moves: the case of the floor
    assert floored.converged.all() and floored.floored.all()
    assert np.all(floored.bound <= 1e-4 * aig.FLOOR_SHARE * abs(floored.f_input[0]))
    assert np.all(floored.evaluations <= 64) and np.all(bare.evaluations <= 64)
    assert not bare.converged.any() and not bare.floored.any()
    assert bare.evaluations.sum() > floored.evaluations.sum()
