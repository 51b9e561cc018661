"""Gradients at every site from one pass against jax.grad taken one layer at a time; gradient x
activation and attribution patching against their formulas; the exact scalar erasure against
one-at-a-time forwards; attribution patching is first-order exact for a small erasure."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdepth.analyses import attribution, erasure
from jaxdepth.core import sites
from jaxdepth.core.batch import make_batch
from jaxdepth.core.model import forward, random_params, residual_stream

from tiny_qwen import CONFIG  # the tiny Qwen2 every analysis test runs on

L = CONFIG.num_layers


# Compare at full float32 matmul precision (as the references compute).
pytestmark = pytest.mark.usefixtures("highest_precision")


@pytest.fixture(scope="module")
def params():
    return random_params(CONFIG, 1, scale=0.2)


@pytest.fixture(scope="module")
def one():
    rng = np.random.default_rng(0)
    return make_batch([rng.integers(0, 97, 21).tolist(), rng.integers(0, 97, 30).tolist()], [14, 20]).single(0)


def arrays(one):
    positions, real = one.answer_positions(0)
    return jnp.asarray(one.tokens), jnp.asarray(one.valid), jnp.asarray(positions), jnp.asarray(real)


def objective(one):
    """F of the full logits [1, T, V]."""
    tokens, _, positions, real = arrays(one)
    return lambda logits: attribution.answer_probability(tokens, positions, real)(logits[:, positions])


@pytest.mark.parametrize("site", ["resid_pre", "head_out", "attn_out", "mlp_hidden", "mlp_out", "delta", "resid_post"])
def test_site_gradients_equal_grad_one_layer_at_a_time(params, one, site):
    tokens, valid, _, _ = arrays(one)
    metric = objective(one)
    skip = sites.skip("delta", 1, jnp.ones(tokens.shape[1]))  # gradients under an intervention, as the model ran
    g = jax.jit(
        lambda p: attribution.site_gradients(p, tokens, CONFIG, metric, (site,), valid=valid, interventions=skip)
    )(params)
    rows = L + (site == "resid_pre")
    assert g.gradients[site].shape == (rows,) + sites.site_shape(site, CONFIG, 1, tokens.shape[1])
    clean = metric(forward(params, tokens, CONFIG, valid=valid, interventions=skip))
    assert float(g.value) == pytest.approx(float(clean), abs=1e-6)
    for layer in range(rows):
        # Reference: add a vector at that site of that one layer (no probe, no remat) and
        # differentiate with respect to the vector.
        def f(vector):
            iv = sites.add(site, layer, vector, jnp.ones(tokens.shape))
            return metric(forward(params, tokens, CONFIG, valid=valid, interventions=[skip, iv]))

        zero = jnp.zeros(g.gradients[site].shape[1:])
        expected = np.asarray(jax.jit(jax.grad(f))(zero))
        np.testing.assert_allclose(
            np.asarray(g.gradients[site][layer]), expected, rtol=1e-4, atol=1e-7, err_msg=f"{site} layer {layer}"
        )
    assert np.abs(np.asarray(g.gradients[site])).max() > 1e-3  # not a vacuous comparison of zeros


def test_site_gradients_with_and_without_remat_agree(params, one):
    """Recomputing each layer in the backward (what long prompts get) changes no gradient."""
    tokens, valid, _, _ = arrays(one)
    run = lambda remat: jax.jit(
        lambda p: attribution.site_gradients(
            p, tokens, CONFIG, objective(one), ("resid_pre", "mlp_hidden"), valid=valid, remat=remat
        )
    )(params)
    stored, recomputed = run(False), run(True)
    for site in ("resid_pre", "mlp_hidden"):
        np.testing.assert_allclose(
            np.asarray(stored.gradients[site]), np.asarray(recomputed.gradients[site]), rtol=1e-5, atol=1e-7
        )  # float32 sums in another order, as above
    assert np.abs(np.asarray(stored.gradients["mlp_hidden"])).max() > 1e-3


def test_site_activations_are_the_forward_values(params, one):
    tokens, valid, _, _ = arrays(one)
    g = jax.jit(
        lambda p: attribution.site_gradients(
            p, tokens, CONFIG, objective(one), ("resid_pre", "resid_post"), valid=valid
        )
    )(params)
    hs = np.asarray(residual_stream(params, tokens, CONFIG, valid=valid))
    # Two differently fused float32 programs over 4 layers: compared at the residual's scale
    # (elementwise relative errors of entries near 0 measure only the rounding of the larger ones).
    np.testing.assert_allclose(np.asarray(g.activations["resid_pre"]), hs, rtol=0, atol=4e-6 * np.abs(hs).max())
    # h_{l+1} is both layer l's resid_post and layer l+1's resid_pre: the same gradient.
    np.testing.assert_allclose(
        np.asarray(g.gradients["resid_post"]), np.asarray(g.gradients["resid_pre"][1:]), rtol=1e-5, atol=1e-8
    )


def test_patching_and_grad_x_act_follow_their_formulas(params, one):
    tokens, valid, positions, real = arrays(one)
    baseline = np.asarray(erasure.mean_residuals(params, make_batch([one.tokens[0, :21].tolist()], [14]), CONFIG))
    f, gxa, patch = attribution.residual_attribution(
        params, tokens, valid, positions, real, jnp.asarray(baseline), CONFIG
    )
    g = jax.jit(lambda p: attribution.site_gradients(p, tokens, CONFIG, objective(one), valid=valid))(params)
    grad, h = np.asarray(g.gradients["resid_pre"][:, 0]), np.asarray(g.activations["resid_pre"][:, 0])
    np.testing.assert_allclose(np.asarray(gxa), (grad * h).sum(-1), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(patch), (grad * (baseline[:, None] - h)).sum(-1), rtol=1e-5, atol=1e-7)
    # Nothing after the last answer-predicting position can move F: exact zeros.
    last = int(one.lengths[0]) - 2
    assert np.all(np.asarray(patch)[:, last + 1 :] == 0.0) and np.all(np.asarray(gxa)[:, last + 1 :] == 0.0)


@jax.jit
def _answer_probability(params, tokens, valid, positions, real, interventions):
    logits = forward(params, tokens, CONFIG, valid=valid, interventions=interventions)
    return attribution.answer_probability(tokens, positions, real)(logits[:, positions])


def test_exact_scalar_erasure_equals_one_at_a_time(params, one):
    batch = make_batch([one.tokens[0, :21].tolist()], [14])
    baseline = erasure.mean_residuals(params, batch, CONFIG)
    result = erasure.residual_erasure(
        params, batch, CONFIG, baseline, effect="answer_probability_change", progress=False, blocks=2
    )
    assert result.settings["effect"] == "answer_probability_change"
    tokens, valid, positions, real = arrays(one)
    clean = float(_answer_probability(params, tokens, valid, positions, real, None))
    T = tokens.shape[1]
    for l in range(L + 1):
        for t in range(21):
            iv = sites.replace("resid_pre", l, np.arange(T) == t, baseline[l])
            exact = float(_answer_probability(params, tokens, valid, positions, real, iv)) - clean
            assert result.effects[0, l, t] == pytest.approx(exact, abs=2e-6), (l, t)
    assert np.all(result.effects[0, :, 20:] == 0.0)  # after the last answer prediction: exact zeros
    assert np.abs(result.effects).max() > 1e-3


def test_attribution_patching_is_first_order_exact(params, one):
    """An erasure that moves h_l[t] by a small step changes F by the estimate, up to second order."""
    batch = make_batch([one.tokens[0, :21].tolist()], [14])
    hs = np.asarray(residual_stream(params, jnp.asarray(batch.tokens), CONFIG, valid=jnp.asarray(batch.valid)))
    t = 12
    direction = np.random.default_rng(1).standard_normal(hs.shape[-1]).astype(np.float32)
    relative = []
    for eps in (1e-2, 1e-3):
        baseline = hs[:, 0, t] + eps * direction  # erasing position t moves it by eps * direction
        est = attribution.attribution_patching(params, batch, CONFIG, baseline, progress=False)
        exact = erasure.residual_erasure(
            params, batch, CONFIG, baseline, effect="answer_probability_change", progress=False
        )
        e, x = est.patching[0, :L, t], exact.effects[0, :L, t]
        assert np.abs(x).min() > 0  # every boundary's erasure moves F
        relative.append(np.abs(e - x).max() / np.abs(x).max())
    # The error of a first-order estimate is second order: ten times smaller steps, about ten
    # times smaller relative error (measured: 5.8% at 1e-2, 0.8% at 1e-3).
    assert relative[1] < 0.02 and relative[1] < relative[0] / 4, relative


@pytest.mark.parametrize(
    "metric, dtype",
    [(lambda logits: jnp.argmax(logits[0, -1]), "int32"), (lambda logits: logits[0, -1, 3] > logits[0, -1, 4], "bool")],
)
def test_site_gradients_refuse_a_metric_that_is_not_floating(params, one, metric, dtype):
    """An argmax or an accuracy has a zero gradient: refused by name of its dtype."""
    tokens, valid, _, _ = arrays(one)
    with pytest.raises(ValueError, match=f"returns {dtype} values: a metric must be floating point"):
        attribution.site_gradients(params, tokens, CONFIG, metric, valid=valid)
