"""The studies' integrated gradients (METHODS §5) on a tiny random model: equal to the objective
integrated one layer at a time, the suffix gradient equal to jax.grad of a plain forward,
sublayer targets, the completeness gap, exact zeros, and the quadrature rules."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdepth.analyses import integrated_gradients as ig
from jaxdepth.core.loops import suffix_value_and_grad
from jaxdepth.analyses.ig.engine import Execution, prompt_reads
from jaxdepth.analyses.metrics import answer_probability, measure
from jaxdepth.analyses.ig.rules import RULE_VERSION, AdaptiveRule, FixedRule, as_rule, quadrature, rule_from_settings
from jaxdepth.core import sites
from jaxdepth.core.loops import run_layers
from jaxdepth.core.model import embed, forward, residual_stream
from jaxdepth.core.padding import ChosenLengths

from tiny_qwen import CONFIG, batch, deltas, params, probs  # noqa: F401  (fixtures)

# Compare at full float32 matmul precision (as the references compute).
pytestmark = pytest.mark.usefixtures("highest_precision")
QUIET = Execution(progress=False)


# ----------------------------------------------------------------------------- §5


@jax.jit
def _objective_arrays(params, tokens, valid, answer, layer, z):
    T = tokens.shape[1]
    iv = sites.replace("resid_pre", layer + 1, jnp.ones(T, jnp.float32), z)
    p = jax.nn.softmax(forward(params, tokens, CONFIG, valid=valid, interventions=iv), -1)[0]
    target = jnp.concatenate([tokens[0, 1:], tokens[0, -1:]])
    return jnp.sum(jnp.where(answer, p[jnp.arange(T), target], 0.0))


_objective_grad = jax.jit(jax.grad(_objective_arrays, argnums=5))


def _objective(params, one, layer, z, grad=False):
    """F: summed teacher-forced answer probabilities with h_{layer+1} set to z (or its gradient)."""
    args = (
        params,
        jnp.asarray(one.tokens),
        jnp.asarray(one.valid),
        jnp.asarray(one.answer_prediction_mask()[0]),
        layer,
        z,
    )
    return (_objective_grad if grad else _objective_arrays)(*args)


def test_integrated_gradients_equal_one_at_a_time(params, batch):
    steps = 6
    result = ig.integrated_gradients_of_answers(
        params, batch.select(slice(1, 2)), CONFIG, rule=FixedRule("midpoint", steps), execution=QUIET
    )
    chunked = ig.integrated_gradients_of_answers(
        params,
        batch.select(slice(1, 2)),
        CONFIG,
        rule=FixedRule("midpoint", steps),
        execution=Execution(progress=False, chunk_size=5),
    )
    np.testing.assert_allclose(chunked.attributions, result.attributions, rtol=1e-5, atol=1e-8)
    one = batch.single(1)
    hs = residual_stream(params, jnp.asarray(one.tokens), CONFIG, valid=jnp.asarray(one.valid))
    alphas, weights = quadrature("midpoint", steps)
    for layer in range(CONFIG.num_layers):
        x = hs[layer + 1]
        v = one.valid[0][:, None]
        b = (np.asarray(x[0]) * v).sum(0, keepdims=True) / v.sum()
        grads = [_objective(params, one, layer, b + a * (x - b), grad=True) for a in alphas]
        mean_grad = sum(w * g for w, g in zip(weights, grads))[0]
        expected = np.sum((np.asarray(x[0]) - b) * np.asarray(mean_grad), -1) * one.valid[0]
        np.testing.assert_allclose(result.attributions[0, layer, : len(expected)], expected, atol=1e-6)
        f_b = _objective(params, one, layer, jnp.broadcast_to(b, x.shape))
        assert result.f_baseline[0, layer] == pytest.approx(float(f_b), abs=1e-6)
    assert result.f_input[0] == pytest.approx(float(_objective(params, one, 0, hs[1])), abs=1e-6)


def test_padding_policies_give_the_same_attributions(params, batch, monkeypatch):
    """Each prompt at the length the cost chooses, at its length bucket or at lengths given: the
    same attributions (padded positions are masked), and the lengths really differ."""
    rule = FixedRule("left", 4)
    lengths = ig.ig_lengths(batch, CONFIG, rule, "cost")
    assert all(lengths.padded(n) >= n for n in batch.lengths)
    longest = ChosenLengths((int(batch.tokens.shape[1]),))  # every prompt at the batch's width
    runs = {
        name: ig.integrated_gradients_of_answers(params, batch, CONFIG, rule=rule, execution=QUIET, padding=padding)
        for name, padding in [("cost", "cost"), ("buckets", "buckets"), ("longest", longest)]
    }
    for name in ("buckets", "longest"):
        np.testing.assert_allclose(runs[name].attributions, runs["cost"].attributions, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(runs[name].gap, runs["cost"].gap, rtol=1e-4, atol=1e-6)
    shapes = lambda padding: {batch.prompt(i, padding).tokens.shape[1] for i in range(len(batch))}  # noqa: E731
    assert shapes(longest) != shapes(lengths) or shapes(batch.buckets) != shapes(lengths)
    # a device whose compilations cost nothing pads each prompt to its own length (rounded to 8)
    monkeypatch.setattr(ig.DeviceSpeed, "estimate", classmethod(lambda cls, platform=None: cls(1e9, 0.0)))
    own = ig.ig_lengths(batch, CONFIG, rule, "cost")
    assert [own.padded(n) for n in batch.lengths] == [-(-int(n) // 8) * 8 for n in batch.lengths]
    with pytest.raises(ValueError, match="padding must be one of"):
        ig.ig_lengths(batch, CONFIG, rule, "shortest")


@pytest.mark.parametrize("backward", ["recompute", "stored", 1, 2])
def test_suffix_gradient_equals_jax_grad_of_a_plain_forward(params, batch, backward):
    # Every backward (layer by layer recomputing each layer, from each layer's kept activations,
    # or the last 1 or 2 layers kept and the others recomputed) gives F and dF/dh_start of a
    # plain forward with h_start set, from every start (before, at and after the stored layers).
    one = batch.single(1)
    tokens, valid = jnp.asarray(one.tokens), jnp.asarray(one.valid)
    reads = prompt_reads(answer_probability, batch.prompt(1))  # F, the studies' metric, at the answer span
    objective = lambda h_last: measure(answer_probability, params, h_last, CONFIG, reads)[0]  # noqa: E731
    hs = residual_stream(params, tokens, CONFIG, valid=valid)
    for start in range(CONFIG.num_layers + 1):
        z = hs[start] * 1.3  # off the clean path, so nothing coincides by accident
        value, grad = jax.jit(
            lambda z, s: suffix_value_and_grad(params, z, s, CONFIG, objective, valid=valid, backward=backward)
        )(z, start)
        if start > 0:  # boundary `start` = the output of layer start - 1
            assert float(value) == pytest.approx(float(_objective(params, one, start - 1, z)), abs=1e-6)
            np.testing.assert_allclose(grad, _objective(params, one, start - 1, z, grad=True), atol=1e-6)
        else:  # from the embeddings: the whole stack
            full = jax.value_and_grad(lambda h: objective(run_layers(params, h, CONFIG, valid=valid)[0]))(z)
            assert float(value) == pytest.approx(float(full[0]), abs=1e-6)
            np.testing.assert_allclose(grad, full[1], atol=1e-6)


def _set_site(value, layer, data):
    at, z = data
    return jnp.where(layer == at, z, value)


@partial(jax.jit, static_argnames="site")
def _objective_at_site(params, tokens, valid, answer, layer, z, site):
    """F with the value at `site` of `layer` set to z, by a plain forward."""
    T = tokens.shape[1]
    iv = sites.Intervention(site, _set_site, (layer, z))
    p = jax.nn.softmax(forward(params, tokens, CONFIG, valid=valid, interventions=iv), -1)[0]
    target = jnp.concatenate([tokens[0, 1:], tokens[0, -1:]])
    return jnp.sum(jnp.where(answer, p[jnp.arange(T), target], 0.0))


_objective_at_site_grad = jax.jit(jax.grad(_objective_at_site, argnums=5), static_argnames="site")


@pytest.mark.parametrize("target,site", [("attn", "attn_out"), ("mlp", "mlp_out")])
def test_sublayer_integrated_gradients_equal_one_at_a_time(params, batch, target, site):
    steps = 5
    result = ig.integrated_gradients_of_answers(
        params, batch.select(slice(1, 2)), CONFIG, rule=FixedRule("midpoint", steps), target=target, execution=QUIET
    )
    assert result.settings["target"] == target
    one = batch.single(1)
    tokens, valid = jnp.asarray(one.tokens), jnp.asarray(one.valid)
    answer = jnp.asarray(one.answer_prediction_mask()[0])
    _, xs = run_layers(
        params,
        embed(params, tokens, CONFIG),
        CONFIG,
        valid=valid,
        tap=lambda r, _: r.attn if target == "attn" else r.mlp,
    )
    alphas, weights = quadrature("midpoint", steps)
    v = one.valid[0][:, None]
    for layer in range(CONFIG.num_layers):
        x = np.asarray(xs[layer])
        b = (x[0] * v).sum(0, keepdims=True) / v.sum()
        grads = [
            _objective_at_site_grad(params, tokens, valid, answer, layer, jnp.asarray(b + a * (x - b)), site)
            for a in alphas
        ]
        expected = np.sum((x[0] - b) * np.asarray(sum(w * g for w, g in zip(weights, grads))[0]), -1) * one.valid[0]
        np.testing.assert_allclose(result.attributions[0, layer, : len(expected)], expected, atol=1e-6)
        f_b = _objective_at_site(params, tokens, valid, answer, layer, jnp.broadcast_to(b, x.shape), site)
        assert result.f_baseline[0, layer] == pytest.approx(float(f_b), abs=1e-6)
    # completeness: the gap shrinks with the steps, as for the layer target
    gaps = [
        np.abs(
            ig.integrated_gradients_of_answers(
                params, batch.select(slice(0, 1)), CONFIG, rule=FixedRule(steps=n), target=target, execution=QUIET
            ).gap
        ).max()
        for n in (2, 8, 32)
    ]
    assert gaps[0] > 2 * gaps[1] > 4 * gaps[2] > 0, gaps


def test_ig_completeness_gap_shrinks_with_steps(params, batch):
    gaps = [
        np.abs(
            ig.integrated_gradients_of_answers(
                params, batch.select(slice(0, 1)), CONFIG, rule=FixedRule(steps=n), execution=QUIET
            ).gap
        ).max()
        for n in (2, 8, 32)
    ]
    assert gaps[0] > 2 * gaps[1] > 4 * gaps[2] > 0


def test_ig_zero_where_the_output_cannot_depend(params, batch):
    result = ig.integrated_gradients_of_answers(
        params, batch.select(slice(0, 1)), CONFIG, rule=FixedRule(steps=4), execution=QUIET
    )
    last_prediction = int(batch.lengths[0]) - 2
    # positions after the last answer prediction reach no measured output: exactly zero
    assert np.all(result.attributions[0, :, last_prediction + 1 :] == 0.0)
    assert np.any(result.attributions[0, :, : last_prediction + 1] != 0.0)
    # a model whose output ignores the residual (zero final norm): every layer's attribution is 0
    dead = {**params, "final_norm": jnp.zeros_like(params["final_norm"])}
    flat = ig.integrated_gradients_of_answers(
        dead, batch.select(slice(0, 1)), CONFIG, rule=FixedRule(steps=4), execution=QUIET
    )
    assert np.all(flat.attributions == 0.0) and np.all(flat.gap == 0.0)


def test_quadrature_rules_integrate_exactly():
    for rule, steps in (("left", 4), ("midpoint", 4), ("gauss", 3)):
        a, w = quadrature(rule, steps)
        assert np.isclose(w.sum(), 1.0)
    a, w = quadrature("left", 4)
    np.testing.assert_array_equal(a, [0, 0.25, 0.5, 0.75])
    a, w = quadrature("gauss", 3)
    assert np.isclose(np.sum(w * a**5), 1 / 6)  # exact for polynomials up to degree 5


def test_a_rules_settings_and_identity_are_those_results_were_saved_with():
    """The entries a rule writes into a result's settings and a study's cache identity are those
    saved before rules were values (cached results resume), read back as the same rule."""
    left = FixedRule()
    assert (left.settings(), left.identity(), str(left)) == (
        {"steps": 256, "rule": "left"},
        {"steps": 256, "rule": "left"},
        "left rule, 256 steps",
    )
    adaptive = AdaptiveRule(tolerance=0.05, max_evaluations=9)
    assert adaptive.settings() == {
        "rule": "adaptive",
        "tolerance": 0.05,
        "max_evaluations": 9,
        "atol": 1e-6,
        "grid_points": 0,
        "initial_intervals": 11,
        "floor_share": 0.1,
    }
    assert adaptive.identity() == {
        "rule": "adaptive",
        "tolerance": 0.05,
        "max_evaluations": 9,
        "rule_version": RULE_VERSION,
    }
    assert AdaptiveRule(grid_points=33).identity()["grid_points"] == 33  # a knob off its default counts
    assert str(adaptive) == "adaptive rule to 5%" and str(AdaptiveRule(tolerance=(0.1, 0.01))) == (
        "adaptive rule to per-layer tolerances"
    )
    assert AdaptiveRule(tolerance=[0.01] * 3).settings()["tolerance"] == 0.01  # one number when every layer's
    for rule in (left, FixedRule("gauss", 3), adaptive, AdaptiveRule(tolerance=[0.1, 0.01], floor_share=0.0)):
        assert rule_from_settings(rule.settings()) == rule and hash(rule_from_settings(rule.settings())) == hash(rule)
    assert rule_from_settings({"rule": "adaptive", "tolerance": 0.01}) == AdaptiveRule()  # older settings: defaults
    assert (as_rule("midpoint"), as_rule("adaptive")) == (FixedRule("midpoint"), AdaptiveRule())
