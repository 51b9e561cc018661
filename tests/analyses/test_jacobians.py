"""Layer Jacobians: a token's step is the forward at that token; on a model made linear the
Jacobians are the analytic matrices; a silenced layer is exactly the identity; the suffix's own
block is the full forward's; the randomized estimates sit within their stated error of the exact
ones; a padded batch equals each prompt alone."""

import dataclasses
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config, with_layers_silenced
from jaxdepth.analyses.jacobians import (
    ANALYSIS,
    MEASURES,
    Estimate,
    JacobianResult,
    clean_layer_states,
    jacobian_figure,
    layer_jacobians,
    measured_positions,
)
from jaxdepth.analyses.suite import RunInputs
from jaxdepth.core import layer as core_layer
from jaxdepth.core.batch import make_batch
from jaxdepth.core.loops import LayerRun, run_layers, token_step
from jaxdepth.core.model import random_params, residual_stream

pytestmark = pytest.mark.usefixtures("highest_precision")

CONFIG = tiny_config(num_layers=3)
D = CONFIG.hidden_size
PROBES, ITERATIONS = 48, 12  # one set throughout: the randomized runs share a compilation


@pytest.fixture(scope="module")
def params():
    return random_params(CONFIG, 0, scale=0.2)


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(0)
    return make_batch([rng.integers(1, CONFIG.vocab_size, n).tolist() for n in (9, 6, 12)], [5, 3, 8])


@pytest.fixture(scope="module")
def exact(params, batch):
    return layer_jacobians(params, batch, CONFIG, positions=[[5, 8, 1], [3, 1, -1], [11, 2, 7]])


def test_a_tokens_step_at_its_clean_input_is_the_forward_there(params, batch):
    tokens, valid = jnp.asarray(batch.tokens), jnp.asarray(batch.valid)
    hs = residual_stream(params, tokens, CONFIG, valid=valid)
    inputs, keys, values = clean_layer_states(params, tokens, valid, CONFIG)

    @jax.jit
    def every_layer(b, t):
        step = lambda l: token_step(params, l, inputs[l, b, t], keys[:, b], values[:, b], valid[b], t, CONFIG)  # noqa: E731
        return jax.vmap(step)(jnp.arange(CONFIG.num_layers))

    for b, t in [(0, 0), (0, 8), (1, 5), (2, 11)]:
        np.testing.assert_allclose(every_layer(b, t), hs[1:, b, t], rtol=1e-5, atol=1e-5)


def test_the_suffix_is_the_own_block_of_the_full_forward(params, batch, exact):
    """J_{l->L}(t), the product of the layers' own blocks, equals the derivative of the full
    forward's h_L[t] by h_l[t] (every other position's h_l held): the paths through other
    positions cancel by causality. A layer alone: the derivative of one layer of the full run."""
    valid = jnp.asarray(batch.valid[:1])
    inputs, _, _ = clean_layer_states(params, jnp.asarray(batch.tokens[:1]), valid, CONFIG)
    t = 5

    @jax.jit
    def own_blocks(l):  # d h_{l+1}[t] / d h_l[t] and d h_L[t] / d h_l[t] in the full run from l
        def from_l(x):
            h = inputs[l].at[0, t].set(x)
            final, outs = run_layers(params, h, CONFIG, valid=valid, tap=lambda r, _: r.out, run=LayerRun(start=l))
            return outs[l, 0, t], final[0, t]

        return jax.jacfwd(from_l)(inputs[l, 0, t])

    for l in range(CONFIG.num_layers):
        for which, J in zip(("layer", "suffix"), own_blocks(l)):
            A = J - jnp.eye(D)
            np.testing.assert_allclose(getattr(exact, f"{which}_frob2")[0, 0, l], jnp.sum(A * A), rtol=1e-4)
            np.testing.assert_allclose(getattr(exact, f"{which}_sigma")[0, 0, l], jnp.linalg.norm(A, 2), rtol=1e-4)
    assert np.all(exact.suffix_frob2[0, 0] > 0.01)  # the maps are far from the identity: not vacuous


def test_on_a_linear_model_the_jacobians_are_the_analytic_matrices(params, batch, monkeypatch):
    """No normalization, a linear MLP and zero query/key weights (each position averages the
    values up to its own, 1/(t+1) each), norms reduced to their weights g: h_{l+1} = (h + a)
    (I + diag(g_mlp) W_up W_down), a's own part h diag(g_attn) W_v W_o / (t+1), so
    J_l(t)^T = (I + diag(g_attn) W_v W_o / (t+1)) (I + diag(g_mlp) W_up W_down)."""
    config = dataclasses.replace(CONFIG, num_kv_heads=CONFIG.num_heads, rms_norm_eps=0.125)  # its own compilations
    monkeypatch.setattr(core_layer, "norm", lambda x, w, config, bias=None: x * w)
    monkeypatch.setattr(core_layer, "mlp_hidden", lambda p, x, config: x @ p["up"])
    linear = random_params(config, 3, scale=0.2)
    linear = dict(linear, layers=dict(linear["layers"], q=0 * linear["layers"]["q"], k=0 * linear["layers"]["k"]))
    positions = np.array([[5, 8], [3, 1], [11, 2]])
    result = layer_jacobians(linear, batch, config, positions=positions)
    estimated = layer_jacobians(
        linear, batch, config, positions=positions, estimate=Estimate(PROBES, ITERATIONS, exact_width=0)
    )
    eye = np.eye(D)
    w = {
        name: np.asarray(linear["layers"][name], np.float64)
        for name in ("v", "o", "up", "down", "attn_norm", "mlp_norm")
    }
    for b, m in [(0, 0), (1, 1), (2, 0)]:
        t = positions[b, m]
        suffix = eye
        for l in reversed(range(config.num_layers)):
            J = (_attention(w, l, t) @ _mlp(w, l)).T
            suffix = suffix @ J
            for which, M in (("layer", J), ("suffix", suffix)):
                A = M - eye
                np.testing.assert_allclose(getattr(result, f"{which}_frob2")[b, m, l], np.sum(A * A), rtol=1e-4)
                np.testing.assert_allclose(getattr(result, f"{which}_sigma")[b, m, l], np.linalg.norm(A, 2), rtol=1e-4)
                # the randomized estimates: within four standard errors; the power method from below
                frob2 = getattr(estimated, f"{which}_frob2")[b, m, l]
                assert abs(frob2 - np.sum(A * A)) <= 4 * getattr(estimated, f"{which}_frob2_error")[b, m, l]
                sigma = getattr(estimated, f"{which}_sigma")[b, m, l]
                assert np.linalg.norm(A, 2) * (1 - 1e-2) <= sigma <= np.linalg.norm(A, 2) * (1 + 1e-5)


def _attention(w, l, t):
    """I + diag(g) W_v W_o / (t + 1): the token's own share of the averaged values (the norm now
    multiplies by its weight g)."""
    return np.eye(D) + (w["attn_norm"][l][:, None] * w["v"][l]) @ w["o"][l] / (t + 1)


def _mlp(w, l):
    """I + diag(g) W_up W_down: the MLP reads h + a times its norm's weight."""
    return np.eye(D) + (w["mlp_norm"][l][:, None] * w["up"][l]) @ w["down"][l]


def test_a_silenced_layer_is_exactly_the_identity(params, batch):
    silenced = with_layers_silenced(params, [1, 2])  # layers 1 and 2 write nothing
    positions = [[5, 8, 2], [3, 1, 4], [11, -1, -1]]
    for exact_width in (D, 0):
        result = layer_jacobians(
            silenced, batch, CONFIG, positions=positions, estimate=Estimate(PROBES, ITERATIONS, exact_width=exact_width)
        )
        measured = result.measured
        for name in ("layer_frob2", "layer_sigma"):
            assert np.all(getattr(result, name)[measured][:, 1:] == 0), name
            assert np.all(getattr(result, name)[measured][:, 0] > 0.01)
        for name in ("suffix_frob2", "suffix_sigma"):  # from layer 1 on nothing moves; from 0, layer 0 does
            assert np.all(getattr(result, name)[measured][:, 1:] == 0)
        if exact_width:  # (the estimates of the two draw different probes)
            np.testing.assert_allclose(
                result.suffix_frob2[measured][:, 0], result.layer_frob2[measured][:, 0], rtol=1e-5
            )
        assert np.all(np.isnan(result.layer_frob2[2, 1]))  # -1: not measured


def test_the_randomized_estimates_are_within_their_stated_error(params, batch, exact):
    """Hutchinson's estimates within four of their standard errors, and the relative error of
    the distance within the stated bound sqrt(2/P) (on the squared norm); the power method a
    lower bound within 1% after 12 Lanczos steps at width 32."""
    probes = PROBES
    estimated = layer_jacobians(
        params, batch, CONFIG, positions=exact.positions, estimate=Estimate(probes, ITERATIONS, exact_width=0, seed=5)
    )
    measured = exact.measured
    for which in ("layer", "suffix"):
        truth, frob2 = getattr(exact, f"{which}_frob2")[measured], getattr(estimated, f"{which}_frob2")[measured]
        error = getattr(estimated, f"{which}_frob2_error")[measured]
        assert np.all(np.abs(frob2 - truth) <= 4 * error)
        assert np.all(np.abs(frob2 / truth - 1) <= 3 * np.sqrt(2 / probes))
        sigma, true_sigma = getattr(estimated, f"{which}_sigma")[measured], getattr(exact, f"{which}_sigma")[measured]
        assert np.all(sigma <= true_sigma * (1 + 1e-5)) and np.all(sigma >= true_sigma * (1 - 1e-2))


def test_a_padded_batch_equals_each_prompt_alone(params, batch, exact):
    for b in range(3):
        alone = make_batch([batch.tokens[b, : batch.lengths[b]].tolist()], [int(batch.answer_start[b])])
        single = layer_jacobians(params, alone, CONFIG, positions=exact.positions[b : b + 1])
        for name in MEASURES:
            np.testing.assert_allclose(getattr(single, name)[0], getattr(exact, name)[b], rtol=2e-5, atol=1e-6)


def test_positions_settings_and_refusals(params, batch, exact, tmp_path):
    assert measured_positions([9, 1, 3], tokens=4).tolist() == [[1, 3, 6, 8], [0, -1, -1, -1], [1, 2, -1, -1]]
    with pytest.raises(ValueError, match="one of its prompt's tokens"):
        layer_jacobians(params, batch, CONFIG, positions=[[9], [0], [0]])
    with pytest.raises(ValueError, match="positions must be"):
        layer_jacobians(params, batch, CONFIG, positions=[[1], [1]])
    narrow = dict(params, layers={n: w.astype(jnp.bfloat16) if w.ndim == 3 else w for n, w in params["layers"].items()})
    with pytest.raises(ValueError, match="forward-mode"):
        layer_jacobians(narrow, batch, CONFIG)

    path = str(tmp_path / "j.npz")
    exact.save(path)
    again = JacobianResult.load(path)
    assert np.array_equal(again.suffix_sigma, exact.suffix_sigma, equal_nan=True) and again.settings["exact"]
    assert exact.per_prompt("layer_distance").shape == (3, CONFIG.num_layers)
    assert jacobian_figure(exact, resamples=20) is not None

    settings = ANALYSIS.settings(
        jacobian_tokens=3, jacobian_exact_width=0, jacobian_probes=PROBES, jacobian_iterations=ITERATIONS
    )
    model = SimpleNamespace(params=params, config=CONFIG)
    suite = ANALYSIS.run(RunInputs(model=model, batch=batch, settings=settings, progress=False))
    assert suite.positions.shape == (3, 3) and not suite.settings["exact"] and suite.settings["probes"] == PROBES
    assert np.all(np.isfinite(suite.layer_sigma[suite.measured]))
    assert ANALYSIS.summary(suite)[0].startswith("layer closest to the identity")
