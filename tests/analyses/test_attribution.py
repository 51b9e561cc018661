"""Gradients at every site from one pass against jax.grad taken one layer at a time; gradient x
activation and attribution patching against their formulas; the exact scalar erasure against
one-at-a-time forwards; attribution patching is first-order exact for a small erasure."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdepth
from jaxdepth.analyses import attribution, erasure
from jaxdepth.analyses.metrics import answer_probability
from jaxdepth.core import sites
from jaxdepth.core.batch import PromptArrays, make_batch
from jaxdepth.core.execution import Execution
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


def prompt(one):
    """The prompt with its answers, as `site_gradients` reads them for `answer_probability`."""
    return PromptArrays(*arrays(one))


def objective(one):
    """F of the full logits [1, T, V], written out: the reference `answer_probability` meets."""
    tokens, _, positions, real = arrays(one)
    targets = tokens[0, jnp.minimum(positions + 1, tokens.shape[1] - 1)]

    def f(logits):
        probs = jax.nn.softmax(logits[0, positions].astype(jnp.float32), axis=-1)
        return jnp.sum(jnp.where(real, probs[jnp.arange(positions.shape[0]), targets], 0.0))

    return f


@pytest.mark.parametrize("site", ["resid_pre", "head_out", "attn_out", "mlp_hidden", "mlp_out", "delta", "resid_post"])
def test_site_gradients_equal_grad_one_layer_at_a_time(params, one, site):
    tokens, valid, _, _ = arrays(one)
    metric = objective(one)
    skip = sites.skip("delta", 1, jnp.ones(tokens.shape[1]))  # gradients under an intervention, as the model ran
    g = jax.jit(
        lambda p: attribution.site_gradients(p, prompt(one), CONFIG, answer_probability, (site,), interventions=skip)
    )(params)
    rows = L + (site == "resid_pre")
    assert g.gradients[site].shape == (rows,) + sites.site_shape(site, CONFIG, 1, tokens.shape[1])
    clean = metric(forward(params, tokens, CONFIG, valid=valid, interventions=skip))
    assert g.value.shape == (1,) and float(g.value[0]) == pytest.approx(float(clean), abs=1e-6)
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
    run = lambda backward: jax.jit(
        lambda p: attribution.site_gradients(
            p,
            prompt(one),
            CONFIG,
            answer_probability,
            ("resid_pre", "mlp_hidden"),
            execution=Execution(backward=backward),
        )
    )(params)
    stored, recomputed = run("stored"), run("recompute")
    for site in ("resid_pre", "mlp_hidden"):
        np.testing.assert_allclose(
            np.asarray(stored.gradients[site]), np.asarray(recomputed.gradients[site]), rtol=1e-5, atol=1e-7
        )  # float32 sums in another order, as above
    assert np.abs(np.asarray(stored.gradients["mlp_hidden"])).max() > 1e-3


def test_site_activations_are_the_forward_values(params, one):
    tokens, valid, _, _ = arrays(one)
    g = jax.jit(
        lambda p: attribution.site_gradients(p, prompt(one), CONFIG, answer_probability, ("resid_pre", "resid_post"))
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
    g = jax.jit(lambda p: attribution.site_gradients(p, prompt(one), CONFIG, answer_probability))(params)
    grad, h = np.asarray(g.gradients["resid_pre"][:, 0]), np.asarray(g.activations["resid_pre"][:, 0])
    np.testing.assert_allclose(np.asarray(gxa), (grad * h).sum(-1), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(patch), (grad * (baseline[:, None] - h)).sum(-1), rtol=1e-5, atol=1e-7)
    # Nothing after the last answer-predicting position can move F: exact zeros.
    last = int(one.lengths[0]) - 2
    assert np.all(np.asarray(patch)[:, last + 1 :] == 0.0) and np.all(np.asarray(gxa)[:, last + 1 :] == 0.0)


@jax.jit
def _answer_probability(params, tokens, valid, positions, real, interventions):
    logits = forward(params, tokens, CONFIG, valid=valid, interventions=interventions)
    targets = tokens[0, jnp.minimum(positions + 1, tokens.shape[1] - 1)]
    probs = jax.nn.softmax(logits[0, positions].astype(jnp.float32), axis=-1)
    return jnp.sum(jnp.where(real, probs[jnp.arange(positions.shape[0]), targets], 0.0))


def test_exact_scalar_erasure_equals_one_at_a_time(params, one):
    batch = make_batch([one.tokens[0, :21].tolist()], [14])
    baseline = erasure.mean_residuals(params, batch, CONFIG)
    result = erasure.residual_erasure(
        params, batch, CONFIG, baseline, erasure.Erasure(effect="answer_probability_change", blocks=2)
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
        est = attribution.attribution_patching(params, batch, CONFIG, baseline)
        exact = erasure.residual_erasure(
            params, batch, CONFIG, baseline, erasure.Erasure(effect="answer_probability_change")
        )
        e, x = est.patching[0, :L, t], exact.effects[0, :L, t]
        assert np.abs(x).min() > 0  # every boundary's erasure moves F
        relative.append(np.abs(e - x).max() / np.abs(x).max())
    # The error of a first-order estimate is second order: ten times smaller steps, about ten
    # times smaller relative error (measured: 5.8% at 1e-2, 0.8% at 1e-3).
    assert relative[1] < 0.02 and relative[1] < relative[0] / 4, relative


@pytest.mark.parametrize(
    "metric, dtype",
    [
        (jaxdepth.metric(reads="last")(lambda r: jnp.argmax(r.logits[:, 0], axis=-1)), "int32"),
        (jaxdepth.metric(reads="last")(lambda r: r.logits[:, 0, 3] > r.logits[:, 0, 4]), "bool"),
    ],
)
def test_site_gradients_refuse_a_metric_that_is_not_floating(params, one, metric, dtype):
    """An argmax or an accuracy has a zero gradient: refused by name of its dtype."""
    with pytest.raises(ValueError, match=f"returns {dtype} values: a metric must be floating point"):
        attribution.site_gradients(params, prompt(one), CONFIG, metric)


@jaxdepth.metric(reads="last")
def logit_3(r):
    return r.logits[:, 0, 3]


def test_site_gradients_refuse_the_former_forms(params, one):
    """A plain function of the logits, a clean-run metric (there is no clean run) and the loose
    keywords are refused, each with the form that says the same."""
    with pytest.raises(TypeError, match=r"(?s)is a plain function; a metric is now one form.*jaxdepth.metric\(reads="):
        attribution.site_gradients(params, prompt(one), CONFIG, lambda logits: logits[0, -1, 3])
    with pytest.raises(
        ValueError, match="site gradients has no clean run to compare with: the metric 'kl_clean_to_run'"
    ):
        attribution.site_gradients(params, prompt(one), CONFIG, jaxdepth.metrics.kl_clean_to_run)
    with pytest.raises(ValueError, match="site gradients knows no answer positions"):
        attribution.site_gradients(params, one.tokens, CONFIG, answer_probability)
    for former, shown in (("valid", "PromptArrays"), ("positions", "reads="), ("remat", "backward=")):
        with pytest.raises(TypeError, match=shown):
            attribution.site_gradients(params, one.tokens, CONFIG, logit_3, **{former: None})
    with pytest.raises(TypeError, match=r"execution=jaxdepth.Execution\(chunk_size=2\)"):
        attribution.site_gradients(params, one.tokens, CONFIG, logit_3, chunk_size=2)
    with pytest.raises(ValueError, match="stores every layer's activations or recomputes them all"):
        attribution.site_gradients(params, one.tokens, CONFIG, logit_3, execution=Execution(backward=2))


def test_a_last_position_metric_on_prompts_of_different_lengths_is_each_prompt_alone(params):
    """Right-padded prompts of different lengths: the metric reads each one's last real token,
    never padding, and its value and gradients are those of the prompt run alone."""
    rng = np.random.default_rng(3)
    lists = [rng.integers(0, 97, 19).tolist(), rng.integers(0, 97, 12).tolist()]
    both = make_batch(lists)
    g = attribution.site_gradients(params, both, CONFIG, logit_3, ("resid_pre", "mlp_out"))
    for b, tokens in enumerate(lists):
        alone = attribution.site_gradients(params, np.asarray([tokens]), CONFIG, logit_3, ("resid_pre", "mlp_out"))
        n = len(tokens)
        assert float(g.value[b]) == pytest.approx(float(alone.value[0]), abs=1e-5)
        for site in ("resid_pre", "mlp_out"):
            rows = slice(None, L) if site == "resid_pre" else slice(None)  # h_L's row is read at the last position
            np.testing.assert_allclose(
                np.asarray(g.gradients[site][rows, b, :n]),
                np.asarray(alone.gradients[site][rows, 0]),
                rtol=1e-4,
                atol=1e-6,
                err_msg=site,
            )
