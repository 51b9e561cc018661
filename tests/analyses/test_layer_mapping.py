"""Cross-model linear maps on tiny models: a model mapped onto itself is exact on the diagonal, a
copy with an identity layer inserted shifts the best matches by one after it, the errors equal a
float64 numpy least-squares fit, and the streamed statistics equal those of all tokens at once."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdepth
from conftest import assert_close
from jaxdepth.analyses import layer_mapping as lm
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.model import random_params, residual_stream

pytestmark = pytest.mark.usefixtures("highest_precision")

EPS32 = float(np.finfo(np.float32).eps)
# A wider-and-deeper partner for the tiny qwen2 model (3 layers, width 64): another width and depth.
LARGE = ModelConfig(
    model_type="llama",
    vocab_size=300,
    hidden_size=48,
    intermediate_size=96,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=12,
    rope_theta=1e4,
    rms_norm_eps=1e-5,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    qkv_bias=False,
)

_accumulate = jax.jit(lm.accumulate_statistics)
_errors = jax.jit(lm.accumulate_errors)
_residuals = jax.jit(
    lambda params, tokens, valid, config: residual_stream(params, tokens[None], config, valid=valid[None])[:, 0],
    static_argnames="config",
)
PAD = 72  # every prompt right-padded to one length: one compilation per model, and padding exercised


@pytest.fixture(scope="module")
def small(tiny_model):
    """The conftest tiny qwen2 (3 layers, width 64, randomised biases and norms), as jaxdepth loads it."""
    return jaxdepth.load(tiny_model("qwen2_gqa_untied").folder)


def prompts(seed, count, low=40, high=70):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 300, n).astype(np.int32) for n in rng.integers(low, high, count)]


TRAIN, HELD_OUT = prompts(0, 6), prompts(1, 3)  # 330 training tokens for width 64: well determined


def residuals(params, config, tokens, *, padded=False):
    """`[L+1, T, D]` float32 residuals of one prompt, run right-padded to PAD tokens; the padded
    rows are returned with `padded=True`, else cut off."""
    ids, valid = np.zeros(PAD, np.int32), np.arange(PAD) < len(tokens)
    ids[: len(tokens)] = tokens
    h = np.asarray(_residuals(params, jnp.asarray(ids), jnp.asarray(valid), config), np.float32)
    return h if padded else h[:, : len(tokens)]


def mask(tokens, first_position=1):
    """Positions that count in the padded run: valid ones from `first_position` on."""
    return (np.arange(PAD) >= first_position) & (np.arange(PAD) < len(tokens))


def statistics(small_model, large_params, large_config, train=TRAIN):
    s, c = small_model.config, large_config
    stats = lm.empty_statistics(s.num_layers + 1, s.hidden_size, c.num_layers + 1, c.hidden_size)
    for tokens in train:
        stats = _accumulate(
            stats,
            residuals(small_model.params, s, tokens, padded=True),
            residuals(large_params, c, tokens, padded=True),
            mask(tokens),
        )
    return stats


def held_out_errors(small_model, large_params, large_config, ridge, train=TRAIN, held_out=HELD_OUT):
    fit = lm.fit_maps(statistics(small_model, large_params, large_config, train), ridge)
    sums = lm.empty_errors(small_model.config.num_layers + 1, large_config.num_layers + 1)
    for tokens in held_out:
        sums = _errors(
            sums,
            fit,
            residuals(small_model.params, small_model.config, tokens, padded=True),
            residuals(large_params, large_config, tokens, padded=True),
            mask(tokens),
        )
    return lm.relative_errors(sums)


def solve_tolerance(small_model) -> float:
    """With ridge 0 a map onto an exact copy of its input is recovered up to the float32 solve's
    rounding, which is bounded by cond(Gram) * eps32 relative (asserted small enough to mean
    something): 1.7e-5 for this model, whose Grams have condition numbers of 20 to 290."""
    gram = np.asarray(statistics(small_model, small_model.params, small_model.config).xx, np.float64)
    cond = max(np.linalg.cond(g) for g in gram)
    assert cond < 1e3, cond
    return cond * EPS32


def test_model_onto_itself_is_exact_on_the_diagonal(small):
    errors, baseline = held_out_errors(small, small.params, small.config, ridge=0.0)
    tol = solve_tolerance(small)
    L1 = small.config.num_layers + 1
    assert errors.shape == (L1, L1)
    assert np.all(np.diag(errors) <= tol), (np.diag(errors), tol)
    off = errors[~np.eye(L1, dtype=bool)]
    assert off.min() > 0.1, off.min()  # other boundaries are far from linear copies: not vacuous
    np.testing.assert_array_equal(lm.best_match(errors), np.arange(L1))
    assert np.all(baseline > 0.9)  # the training mean alone predicts almost nothing of these residuals


def with_identity_layer(model, k: int):
    """`model` with a layer inserted before layer k whose attention output projection and MLP
    down projection are zero: it adds nothing, so large boundary k+1 equals boundary k."""

    def insert(name, w):
        inserted = w[min(k, w.shape[0] - 1)][None]
        if name in ("o", "down"):
            inserted = jnp.zeros_like(inserted)
        return jnp.concatenate([w[:k], inserted, w[k:]], axis=0)

    params = {**model.params, "layers": {n: insert(n, w) for n, w in model.params["layers"].items()}}
    return params, dataclasses.replace(model.config, num_layers=model.config.num_layers + 1)


@pytest.mark.parametrize("k", [0, 1, 3])
def test_an_inserted_identity_layer_shifts_the_diagonal_after_it(small, k):
    params, config = with_identity_layer(small, k)
    h = residuals(params, config, TRAIN[0])
    assert np.array_equal(h[k], h[k + 1])  # the inserted layer really adds nothing
    errors, _ = held_out_errors(small, params, config, ridge=0.0)
    m = np.arange(small.config.num_layers + 1)
    expected = np.where(m <= k, m, m + 1)  # at m = k both k and k+1 hold h_k: the shallower one
    np.testing.assert_array_equal(lm.best_match(errors), expected)
    assert np.all(errors[m, expected] <= solve_tolerance(small)), errors[m, expected]
    others = errors.copy()
    others[m, expected] = np.inf
    others[k, k + 1] = np.inf  # the inserted layer's output: the same residual as boundary k
    assert others.min() > 0.1


def numpy_errors(small_model, large_params, large_config, ridge):
    """The reference: every token in float64, centered with the training means, the ridge
    normal equations solved (or `lstsq` without a ridge), the errors summed over held-out tokens."""

    def tokens(model_params, config, prompt_set):
        rows = [residuals(model_params, config, t)[:, 1:] for t in prompt_set]
        return np.concatenate(rows, axis=1).astype(np.float64)

    xs, ys = tokens(small_model.params, small_model.config, TRAIN), tokens(large_params, large_config, TRAIN)
    xh, yh = tokens(small_model.params, small_model.config, HELD_OUT), tokens(large_params, large_config, HELD_OUT)
    errors = np.zeros((len(xs), len(ys)))
    for m in range(len(xs)):
        mx = xs[m].mean(axis=0)
        x = xs[m] - mx
        for l in range(len(ys)):
            my = ys[l].mean(axis=0)
            if ridge == 0:
                w = np.linalg.lstsq(x, ys[l] - my, rcond=None)[0]
            else:
                gram = x.T @ x
                lam = ridge * np.trace(gram) / gram.shape[0]
                w = np.linalg.solve(gram + lam * np.eye(gram.shape[0]), x.T @ (ys[l] - my))
            predicted = (xh[m] - mx) @ w + my
            errors[m, l] = np.sqrt(np.sum((yh[l] - predicted) ** 2) / np.sum(yh[l] ** 2))
    baseline = np.sqrt(np.sum((yh - ys.mean(axis=1, keepdims=True)) ** 2, axis=(1, 2)) / np.sum(yh**2, axis=(1, 2)))
    return errors, baseline


@pytest.mark.parametrize("ridge", [0.0, 1e-3, 1e-1])
def test_errors_equal_a_float64_least_squares_fit(small, ridge):
    large_params = random_params(LARGE, 5, scale=0.2)
    errors, baseline = held_out_errors(small, large_params, LARGE, ridge)
    expected, expected_baseline = numpy_errors(small, large_params, LARGE, ridge)
    assert errors.shape == (4, 5)
    # Errors are O(0.1-1); float32 statistics and solves against float64 agree to cond * eps32
    # (condition numbers below 300 here, ridge 0 being the worst case): 5e-5 absolute.
    assert_close(errors, expected, f"relative errors, ridge {ridge}", tol=5e-5)
    assert_close(baseline, expected_baseline, "baseline errors", tol=1e-5)
    np.testing.assert_array_equal(lm.best_match(errors), np.argmin(expected, axis=1))


def test_explicit_maps_equal_the_normal_equations(small):
    large_params = random_params(LARGE, 5, scale=0.2)
    stats = statistics(small, large_params, LARGE)
    weight, bias = lm.linear_maps(lm.fit_maps(stats, 1e-2))
    m, l = 2, 3
    x = np.concatenate([residuals(small.params, small.config, t)[m, 1:] for t in TRAIN]).astype(np.float64)
    y = np.concatenate([residuals(large_params, LARGE, t)[l, 1:] for t in TRAIN]).astype(np.float64)
    xc = x - x.mean(axis=0)
    gram = xc.T @ xc
    w = np.linalg.solve(gram + 1e-2 * np.trace(gram) / len(gram) * np.eye(len(gram)), xc.T @ (y - y.mean(axis=0)))
    predicted = x @ np.asarray(weight[m, :, l], np.float64) + np.asarray(bias[m, l], np.float64)
    reference = x @ w + (y.mean(axis=0) - x.mean(axis=0) @ w)
    # Predictions of residuals of norm ~5-9: float32 weights and bias agree to ~1e-5 relative.
    assert_close(predicted / np.abs(reference).max(), reference / np.abs(reference).max(), "predictions", tol=1e-5)


def test_streamed_statistics_equal_those_of_all_tokens(small):
    large_params = random_params(LARGE, 5, scale=0.2)
    stats = statistics(small, large_params, LARGE)
    x = np.concatenate([residuals(small.params, small.config, t)[:, 1:] for t in TRAIN], axis=1).astype(np.float64)
    y = np.concatenate([residuals(large_params, LARGE, t)[:, 1:] for t in TRAIN], axis=1).astype(np.float64)
    xc, yc = x - x.mean(axis=1, keepdims=True), y - y.mean(axis=1, keepdims=True)
    assert float(stats.count) == x.shape[1] == sum(len(t) - 1 for t in TRAIN)
    for got, want, what in (
        (stats.x_mean, x.mean(axis=1), "x mean"),
        (stats.y_mean, y.mean(axis=1), "y mean"),
        (stats.xx, np.einsum("mnd,mne->mde", xc, xc), "centered Gram"),
        (stats.xy, np.einsum("mnd,lne->mdle", xc, yc), "centered cross-products"),
    ):
        scale = np.abs(want).max()
        assert_close(np.asarray(got) / scale, want / scale, what, tol=1e-6)  # float32 sums, relative to the largest


def test_masked_tokens_never_count(small):
    """Position 0 left out by the mask equals position 0 cut off, and padding rows holding
    garbage (NaN here) equal no padding, for the statistics and the error sums alike."""
    h = residuals(small.params, small.config, TRAIN[0])
    L1, T, D = h.shape
    padded = np.concatenate([h, np.full((L1, 7, D), np.nan, np.float32)], axis=1)
    keep = np.concatenate([np.arange(T) >= 1, np.zeros(7, bool)])
    every = np.ones(T - 1, bool)
    cut = _accumulate(lm.empty_statistics(L1, D, L1, D), h[:, 1:], h[:, 1:], every)
    masked = _accumulate(lm.empty_statistics(L1, D, L1, D), padded, padded, keep)
    for got, want in zip(jax.tree.leaves(masked), jax.tree.leaves(cut)):
        assert np.all(np.isfinite(got))
        assert_close(got, want, "masked vs cut statistics", tol=1e-5 * max(1.0, float(np.abs(want).max())))
    fit = lm.fit_maps(cut, 1e-3)
    sums = _errors(lm.empty_errors(L1, L1), fit, padded, padded, keep)
    reference = _errors(lm.empty_errors(L1, L1), fit, h[:, 1:], h[:, 1:], every)
    assert float(sums.count) == T - 1
    for got, want in zip(jax.tree.leaves(sums), jax.tree.leaves(reference)):
        assert_close(got, want, "masked vs cut error sums", tol=1e-5 * max(1.0, float(np.abs(want).max())))


def test_equal_relative_depth_and_offsets():
    assert np.allclose(lm.equal_relative_depth(2, 4), [0, 2, 4])
    result = lm.LayerMappingResult(
        errors=np.zeros((3, 5), np.float32),
        best_match=np.array([0, 3, 4]),
        baseline_errors=np.ones(5, np.float32),
        small_model="s",
        large_model="l",
        dataset="d",
        train_tokens=1,
        heldout_tokens=1,
        train_prompts=1,
        heldout_prompts=1,
        settings={},
    )
    assert (result.small_layers, result.large_layers) == (2, 4)
    np.testing.assert_array_equal(result.diagonal_offset(), [0, 1, 0])
