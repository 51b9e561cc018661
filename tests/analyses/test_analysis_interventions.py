"""The analyses under a user's interventions, and with a user's metric: each one equals the same
quantity computed by hand from plain forwards (or taps) under the user's interventions plus the
analysis's own, the user's first; a metric that is not a scalar is refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdepth
from conftest import assert_close, assert_moved
from jaxdepth.analyses import attribution, contributions, erasure, layer_skip, logit_lens, metrics
from jaxdepth.core import sites
from jaxdepth.core.batch import PromptArrays, make_batch
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.loops import run_layers
from jaxdepth.core.model import embed, forward, random_params, residual_stream
from jaxdepth.lab.results import load_result

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
    max_position_embeddings=64,
    tie_word_embeddings=False,
    qkv_bias=True,
)
L, H, D = CONFIG.num_layers, CONFIG.num_heads, CONFIG.hidden_size

# Compare at full float32 matmul precision (as the references compute).
pytestmark = pytest.mark.usefixtures("highest_precision")


@pytest.fixture(scope="module")
def params():
    return random_params(CONFIG, 1, scale=0.2)


def prompts(lengths, answer_starts):
    rng = np.random.default_rng(0)
    return make_batch([rng.integers(0, CONFIG.vocab_size, n).tolist() for n in lengths], answer_starts)


def ablation():
    """Zero ablation of head 3 of layer 0 and head 1 of layer 2 (no position axis: it fits every length)."""
    heads = np.zeros((L, H), np.float32)
    heads[0, 3] = heads[2, 1] = 1.0
    return sites.ablate_heads(heads, head_dim=CONFIG.head_dim)


def steering():
    """Vectors added at every position ([1] broadcasts to every length) to h_1 and to the final
    residual h_L. Adding is not idempotent: a suffix run that started from h_1 after the
    addition and added it again would be caught."""
    v = np.random.default_rng(5).standard_normal((2, D)).astype(np.float32)
    return [
        sites.add("resid_pre", 1, v[0], np.ones(1, np.float32)),
        sites.add("resid_pre", L, v[1], np.ones(1, np.float32)),
    ]


@jaxdepth.metric(reads="last")
def last_logit_difference(r):
    """A user metric: the logit of token 3 minus that of token 5 at the last position."""
    return r.logits[:, 0, 3] - r.logits[:, 0, 5]


def by_hand(logits):
    """`last_logit_difference` of one prompt's whole output `[1, T, V]`, padded to exactly its
    length (its last row is its last token)."""
    return logits[0, -1, 3] - logits[0, -1, 5]


@jaxdepth.metric(reads="last")
def last_logits(r):
    """Not a metric: a vector per prompt."""
    return r.logits[:, 0]


@jax.jit
def _logits(params, tokens, valid, interventions):
    return forward(params, tokens, CONFIG, valid=valid, interventions=interventions)


def logits(params, one, interventions):
    """Logits `[1, T, V]` of one plain forward of prompt batch `one` under `interventions`."""
    return np.asarray(_logits(params, jnp.asarray(one.tokens), jnp.asarray(one.valid), interventions), np.float64)


def softmax(x):
    x = np.exp(x - x.max(-1, keepdims=True))
    return x / x.sum(-1, keepdims=True)


# ----------------------------------------------------------------------------- §1


@jax.jit
def _tapped(params, tokens, valid, interventions):
    return run_layers(
        params,
        embed(params, tokens, CONFIG),
        CONFIG,
        valid=valid,
        interventions=interventions,
        tap=lambda r, _: (r.h, r.attn, r.mlp, r.out),
    )[1]


@pytest.mark.parametrize("with_skip", [False, True])
def test_contributions_under_interventions_equal_a_tap_of_the_intervened_run(params, with_skip):
    """The statistics of the intervened run's own h_l, a_l and m_l. With a whole-layer skip (at
    `delta`, after the sublayers) the layer's contribution is h_{l+1} - h_l, 0 where skipped."""
    batch = prompts((16, 13), None)  # both prompts padded to 16: a [L, 16] skip mask fits every group
    ivs = [ablation()] + ([sites.skip("delta", 1, (np.arange(16) >= 1).astype(np.float32))] if with_skip else [])
    result = contributions.contributions(params, batch, CONFIG, interventions=ivs)
    h, a, m, out = (
        np.asarray(x, np.float64) for x in _tapped(params, jnp.asarray(batch.tokens), jnp.asarray(batch.valid), ivs)
    )
    layer = out - h if with_skip else a + m
    if with_skip:
        assert np.all(layer[1, :, 1:] == 0.0)  # the skipped positions add nothing
    n = lambda x: np.linalg.norm(x, axis=-1)
    cos = lambda x, y: np.sum(x * y, -1) / np.maximum(n(x) * n(y), 1e-6)
    v = batch.valid
    per_prompt = lambda x: ((x * v).sum(axis=2) / v.sum(axis=1)).T  # [N, L]
    expected = {
        "norm_attn": n(a) / n(h),
        "norm_mlp": n(m) / n(h + a),
        "norm_layer": n(layer) / n(h),
        "cos_attn": cos(a, h),
        "cos_mlp": cos(m, h + a),
        "cos_layer": cos(layer, h),
    }
    for name, x in expected.items():
        assert_close(getattr(result, f"{name}_per_prompt"), per_prompt(x), name, tol=1e-5)
        assert_close(getattr(result, name), (x * v).sum(axis=(1, 2)) / v.sum(), name, tol=1e-5)
    clean = contributions.contributions(params, batch, CONFIG)
    assert_moved(result.norm_layer_per_prompt, clean.norm_layer_per_prompt, "contributions")


# ----------------------------------------------------------------------------- §2


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_logit_lens_under_a_layer_skip_reads_the_intervened_stream(params):
    batch = prompts((16, 13), None)
    skip = sites.skip("delta", 1, (np.arange(16) >= 1).astype(np.float32))  # layer 1 at all positions but 0
    result = logit_lens.logit_lens(params, batch, CONFIG, interventions=skip)
    hs = np.asarray(
        residual_stream(params, jnp.asarray(batch.tokens), CONFIG, valid=jnp.asarray(batch.valid), interventions=skip),
        np.float64,
    )
    assert np.all(hs[2, :, 1:] == hs[1, :, 1:])  # the skip really acted on the stream
    p = {k: np.asarray(v, np.float64) for k, v in params.items() if k != "layers"}

    def lens_logits(h):
        x = h / np.sqrt(np.mean(h * h, -1, keepdims=True) + CONFIG.rms_norm_eps) * p["final_norm"]
        return x @ p["lm_head"]

    final = _log_softmax(lens_logits(hs[-1]))  # the intervened output
    top_final = np.argsort(-final, -1)[..., :5]
    kl, overlap = np.zeros((L,) + batch.tokens.shape), np.zeros((L,) + batch.tokens.shape)
    for l in range(L):
        logp = _log_softmax(lens_logits(hs[l]))
        kl[l] = np.sum(np.exp(logp) * (logp - final), -1)  # KL(P_l || P)
        overlap[l] = (np.argsort(-logp, -1)[..., :5, None] == top_final[..., None, :]).sum((-2, -1)) / 5
    v = batch.valid
    per_prompt = lambda x: ((x * v).sum(-1) / v.sum(-1)).T
    assert_close(result.kl_per_prompt, per_prompt(kl), "KL per prompt", tol=1e-5)
    assert_close(result.overlap_per_prompt, per_prompt(overlap), "overlap per prompt", tol=1e-6)
    assert_close(result.kl, per_prompt(kl).mean(0), "KL", tol=1e-5)
    assert_moved(result.kl_per_prompt, logit_lens.logit_lens(params, batch, CONFIG).kl_per_prompt, "lens")


# ----------------------------------------------------------------------------- §3


@jax.jit
def _deltas(params, tokens, valid, interventions):
    return run_layers(
        params,
        embed(params, tokens, CONFIG),
        CONFIG,
        valid=valid,
        interventions=interventions,
        tap=lambda r, _: r.delta,
    )[1][:, 0]


def deltas(params, one, interventions):
    """Every layer's h_{l+1} - h_l `[L, T, D]` of one plain forward of `one` under `interventions`."""
    return np.asarray(_deltas(params, jnp.asarray(one.tokens), jnp.asarray(one.valid), interventions))


def test_layer_skip_metric_and_effects_equal_full_forwards_one_member_at_a_time(params, tmp_path):
    """Each (prompt, skipped layer, split) member: the metric change, the output shift and the
    later layers' changes equal plain forwards under the user's interventions plus the skip
    against plain forwards under the user's interventions alone."""
    batch = prompts((32, 16), None)  # each prompt alone is padded to exactly its length: -1 is real
    user = [ablation(), *steering()]
    result = layer_skip.layer_skip(params, batch, CONFIG, interventions=user, metric=last_logit_difference)
    assert result.metric_change_per_prompt.shape == (2, L, 4)

    for i in range(len(batch)):
        one = batch.single(i)
        T = one.tokens.shape[1]
        pos = np.arange(T)
        splits = [t for t in result.split_positions[i] if t >= 0]
        assert len(splits) == (3 if i == 0 else 1)  # range(8, T - 4, 8)
        clean = logits(params, one, user)
        clean_deltas = deltas(params, one, user)
        later, output = np.zeros((L, L)), np.zeros(L)
        for s in range(L):
            for k, t in enumerate(splits):
                both = user + [sites.skip("delta", s, ((pos >= 1) & (pos < t)).astype(np.float32))]
                skipped = logits(params, one, both)
                change = by_hand(skipped) - by_hand(clean)
                assert result.metric_change_per_prompt[i, s, k] == pytest.approx(change, abs=2e-5), (i, s, t)
                output[s] = max(output[s], np.linalg.norm(softmax(skipped) - softmax(clean), axis=-1)[0, t:].max())
                d = deltas(params, one, both)
                ratio = np.linalg.norm(clean_deltas - d, axis=-1) / np.maximum(
                    np.linalg.norm(clean_deltas, axis=-1), 1e-6
                )
                later[s] = np.maximum(later[s], np.where(np.arange(L) > s, ratio[:, t:].max(-1), 0.0))
        assert np.all(np.isnan(result.metric_change_per_prompt[i, :, len(splits) :]))  # splits it does not have
        assert_close(result.output_per_prompt[i], output, "output shift", tol=2e-6)
        assert_close(result.later_per_prompt[i], later, "later layers", tol=2e-5)
    changes = result.metric_change_per_prompt
    assert np.abs(changes[~np.isnan(changes)]).max() > 1e-2  # the metric really moves
    for s in range(L):  # the change of largest magnitude, with its sign
        real = changes[:, s][~np.isnan(changes[:, s])]
        assert result.metric_change[s] == real[np.argmax(np.abs(real))]
    # the built-in measures are those of the intervened model, not of the clean one
    assert_moved(
        result.output_per_prompt,
        layer_skip.layer_skip(params, batch, CONFIG).output_per_prompt,
        "output shift",
    )
    loaded = load_result(result.save(str(tmp_path / "skip.npz")))
    np.testing.assert_array_equal(loaded.metric_change_per_prompt, changes)
    np.testing.assert_array_equal(loaded.metric_change, result.metric_change)


# ----------------------------------------------------------------------------- §4


@pytest.mark.parametrize("steer", [False, True])
def test_erasure_of_a_metric_under_interventions_equals_one_at_a_time(params, steer):
    """The vmapped erasures (two position blocks: the second reads the clean prefix's keys and
    values) of a user metric and of the built-in effect equal forwards with the user's
    interventions and then the replacement, run one at a time."""
    batch = prompts((16,), [10])
    user = [ablation()] + (steering() if steer else [])
    baseline = erasure.mean_residuals(params, batch, CONFIG, interventions=user)
    hs = np.asarray(residual_stream(params, jnp.asarray(batch.tokens), CONFIG, interventions=user))
    assert_close(baseline, hs[:, 0].mean(1), "baseline under the interventions", tol=1e-6)
    result = erasure.residual_erasure(params, batch, CONFIG, baseline, interventions=user, metric=last_logit_difference)
    assert erasure.piece_width(16) == 8  # two pieces: the second reads the first one's clean keys and values
    one = batch.single(0)
    T = one.tokens.shape[1]
    clean = logits(params, one, user)
    answer = one.answer_prediction_mask()[0]
    for l in range(L + 1):
        for t in range(T):
            erased = logits(params, one, [*user, sites.replace("resid_pre", l, np.arange(T) == t, baseline[l])])
            change = by_hand(erased) - by_hand(clean)
            assert result.metric_change[0, l, t] == pytest.approx(change, abs=2e-5), (l, t)
            shift = np.linalg.norm(softmax(erased) - softmax(clean), axis=-1)[0, answer].max()
            assert result.effects[0, l, t] == pytest.approx(shift, abs=2e-6), (l, t)
    assert np.abs(result.metric_change).max() > 1e-2
    # erasing h_L[t] changes the logits at t alone: the metric, read at the last position, by exactly 0
    assert np.all(result.metric_change[0, L, : T - 1] == 0.0) and result.metric_change[0, L, T - 1] != 0.0
    plain = erasure.residual_erasure(params, batch, CONFIG, baseline, metric=last_logit_difference)
    assert_moved(result.metric_change, plain.metric_change, "erasure metric")
    np.testing.assert_array_equal(plain.effects, erasure.residual_erasure(params, batch, CONFIG, baseline).effects)


# ----------------------------------------------------------------------------- attribution


def test_attribution_patching_under_interventions_equals_site_gradients_by_hand(params):
    batch = prompts((16,), [10])
    user = [ablation(), *steering()]
    baseline = erasure.mean_residuals(params, batch, CONFIG, interventions=user)
    result = attribution.attribution_patching(params, batch, CONFIG, baseline, interventions=user)
    one = batch.single(0)
    positions, real = (jnp.asarray(x) for x in one.answer_positions(0))
    tokens, valid = jnp.asarray(one.tokens), jnp.asarray(one.valid)
    prompt = PromptArrays(tokens, valid, positions, real)
    g = jax.jit(
        lambda p: attribution.site_gradients(p, prompt, CONFIG, metrics.answer_probability, interventions=user)
    )(params)
    grad, h = np.asarray(g.gradients["resid_pre"][:, 0]), np.asarray(g.activations["resid_pre"][:, 0])
    assert_close(result.f_input[0], g.value[0], "F", tol=1e-6)
    # F by hand: the summed probabilities of the answer tokens, read from the intervened forward
    probs = softmax(logits(params, one, user))[0]
    targets = np.asarray(one.tokens)[0, np.minimum(np.asarray(positions) + 1, one.tokens.shape[1] - 1)]
    by_hand_f = sum(probs[p, t] for p, t, r in zip(np.asarray(positions), targets, np.asarray(real)) if r)
    assert_close(result.f_input[0], by_hand_f, "F by hand", tol=1e-5)
    np.testing.assert_allclose(result.grad_x_act[0], (grad * h).sum(-1), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(result.patching[0], (grad * (baseline[:, None] - h)).sum(-1), rtol=1e-5, atol=1e-7)
    clean = attribution.attribution_patching(params, batch, CONFIG, baseline)
    assert_moved(result.patching, clean.patching, "patching", tol=1e-6)


# ----------------------------------------------------------------------------- refusals


def test_a_metric_that_is_not_one_value_per_prompt_is_refused(params):
    batch = prompts((16,), [10])
    with pytest.raises(ValueError, match="must return one value per prompt"):
        layer_skip.layer_skip(params, batch, CONFIG, metric=last_logits)
    baseline = np.zeros((L + 1, D), np.float32)
    with pytest.raises(ValueError, match="must return one value per prompt"):
        erasure.residual_erasure(params, batch, CONFIG, baseline, metric=last_logits)
    with pytest.raises(TypeError, match="is a plain function"):
        layer_skip.layer_skip(params, batch, CONFIG, metric=by_hand)
