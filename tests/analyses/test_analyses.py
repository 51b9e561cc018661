"""Analyses on a tiny random model: vmapped sweeps against the same interventions run one at a
time, chunked against unchunked, exact zeros, and statistics against direct numpy formulas."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdepth.analyses import contributions, erasure, integrated_gradients as ig, layer_skip, logit_lens, uncertainty
from jaxdepth.analyses.ig.path import suffix_value_and_grad
from jaxdepth.analyses.ig.rules import quadrature
from jaxdepth.core import sites
from jaxdepth.core.batch import PromptArrays, make_batch
from jaxdepth.core.config import ModelConfig
from jaxdepth.analyses.layer_skip import SUBLAYERS
from jaxdepth.core.model import forward, random_params, residual_stream, run_layers, embed

CONFIG = ModelConfig(
    model_type="qwen2",
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rope_theta=1e4,
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    qkv_bias=True,
)


@pytest.fixture(scope="module")
def params():
    return random_params(CONFIG, 1, scale=0.2)


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(0)
    return make_batch([rng.integers(0, 97, 30).tolist(), rng.integers(0, 97, 23).tolist()], [20, 15])


# Compare at full float32 matmul precision (as the references compute).
pytestmark = pytest.mark.usefixtures("highest_precision")


@jax.jit
def _probs(params, tokens, valid, interventions):
    return jax.nn.softmax(forward(params, tokens, CONFIG, valid=valid, interventions=interventions), -1)


@jax.jit
def _deltas(params, tokens, valid, interventions):
    return run_layers(
        params, embed(params, tokens), CONFIG, valid=valid, interventions=interventions, tap=lambda r, _: r.delta
    )[1]


def probs(params, tokens, valid, interventions=None):
    """Output probabilities of one plain (not vmapped) forward."""
    return np.asarray(_probs(params, tokens, valid, interventions))


def deltas(params, tokens, valid, interventions=None):
    """Every layer's contribution h_{l+1} - h_l of one plain forward, [L, B, T, D]."""
    return np.asarray(_deltas(params, tokens, valid, interventions))


# ----------------------------------------------------------------------------- §1


def test_contributions_match_numpy(params, batch):
    result = contributions.contributions(params, batch, CONFIG)
    hs = np.asarray(residual_stream(params, jnp.asarray(batch.tokens), CONFIG, valid=jnp.asarray(batch.valid)))
    _, (a, m) = run_layers(
        params,
        embed(params, jnp.asarray(batch.tokens)),
        CONFIG,
        valid=jnp.asarray(batch.valid),
        tap=lambda r, _: (r.attn, r.mlp),
    )
    a, m, h = np.asarray(a, np.float64), np.asarray(m, np.float64), hs[:-1].astype(np.float64)
    v = batch.valid
    n = lambda x: np.linalg.norm(x, axis=-1)
    cos = lambda x, y: np.sum(x * y, -1) / (n(x) * n(y))
    mean = lambda x: (x * v).sum(axis=(1, 2)) / v.sum()
    np.testing.assert_allclose(result.norm_attn, mean(n(a) / n(h)), rtol=1e-4)
    np.testing.assert_allclose(result.norm_mlp, mean(n(m) / n(h + a)), rtol=1e-4)
    np.testing.assert_allclose(result.norm_layer, mean(n(a + m) / n(h)), rtol=1e-4)
    np.testing.assert_allclose(result.cos_attn, mean(cos(a, h)), atol=1e-5)
    np.testing.assert_allclose(result.cos_mlp, mean(cos(m, h + a)), atol=1e-5)
    np.testing.assert_allclose(result.cos_layer, mean(cos(a + m, h)), atol=1e-5)
    # per prompt: the mean over that prompt's own valid tokens, [N, L]
    per_prompt = lambda x: ((x * v).sum(axis=2) / v.sum(axis=1)).T
    np.testing.assert_allclose(result.norm_mlp_per_prompt, per_prompt(n(m) / n(h + a)), rtol=1e-4)
    np.testing.assert_allclose(result.cos_attn_per_prompt, per_prompt(cos(a, h)), atol=1e-5)
    np.testing.assert_allclose(result.cos_layer_per_prompt, per_prompt(cos(a + m, h)), atol=1e-5)
    np.testing.assert_array_equal(result.tokens_per_prompt, v.sum(axis=1))
    # h_{l+1} - h_l is the layer contribution a_l + m_l
    np.testing.assert_allclose(np.diff(hs, axis=0), a + m, atol=1e-5)


# ----------------------------------------------------------------------------- §2


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_logit_lens_matches_numpy(params, batch):
    tokens, valid = jnp.asarray(batch.tokens), jnp.asarray(batch.valid)
    hs = np.asarray(residual_stream(params, tokens, CONFIG, valid=valid), np.float64)
    p = {k: np.asarray(v, np.float64) for k, v in params.items() if k != "layers"}

    def lens_logits(h):
        x = h / np.sqrt(np.mean(h * h, -1, keepdims=True) + CONFIG.rms_norm_eps) * p["final_norm"]
        return x @ p["lm_head"]

    final = _log_softmax(lens_logits(hs[-1]))
    top_final = np.argsort(-final, -1)[..., :5]
    kl = np.zeros((CONFIG.num_layers,) + batch.tokens.shape)
    overlap = np.zeros_like(kl)
    for l in range(CONFIG.num_layers):
        logp_l = _log_softmax(lens_logits(hs[l]))
        kl[l] = np.sum(np.exp(logp_l) * (logp_l - final), -1)  # KL(P_l || P): layer first
        top_l = np.argsort(-logp_l, -1)[..., :5]
        overlap[l] = (top_l[..., :, None] == top_final[..., None, :]).sum((-2, -1)) / 5
    v = batch.valid
    prompt_weighted = ((kl * v).sum(-1) / v.sum(-1)).mean(-1)
    token_weighted = (kl * v).sum((1, 2)) / v.sum()
    result = logit_lens.logit_lens(params, batch, CONFIG)
    np.testing.assert_allclose(result.kl, prompt_weighted, rtol=1e-4)
    np.testing.assert_allclose(result.overlap, ((overlap * v).sum(-1) / v.sum(-1)).mean(-1), atol=1e-6)
    np.testing.assert_allclose(
        logit_lens.logit_lens(params, batch, CONFIG, weighting="token").kl, token_weighted, rtol=1e-4
    )
    assert not np.allclose(prompt_weighted, token_weighted)  # the two weightings really differ
    np.testing.assert_allclose(result.kl_per_prompt, ((kl * v).sum(-1) / v.sum(-1)).T, rtol=1e-4)
    np.testing.assert_allclose(result.overlap_per_prompt, ((overlap * v).sum(-1) / v.sum(-1)).T, atol=1e-6)
    np.testing.assert_array_equal(result.tokens_per_prompt, v.sum(-1))


def test_per_prompt_curves_reaggregate_to_the_stored_curves(params, batch):
    """The stored curves are what the per-prompt curves and token counts give when re-aggregated
    as the bootstrap does: token-weighted for contributions, as the setting says for the lens
    (token-weighted sums run over float32 per-token values: 1e-6; the prompt-weighted mean is the
    same arithmetic, exactly)."""
    # Ten prompts: numpy sums eight or more values pairwise, so a different summation order
    # would show in the last bits.
    rng = np.random.default_rng(1)
    uneven = make_batch([rng.integers(0, 97, n).tolist() for n in (5, 40, 17, 9, 30, 12, 25, 33, 6, 20)])
    for prompts in (batch, uneven):
        result = contributions.contributions(params, prompts, CONFIG)
        assert result.cos_layer_per_prompt.shape == (len(prompts), CONFIG.num_layers)
        for name in contributions.STATISTICS:
            np.testing.assert_allclose(
                uncertainty.aggregate(getattr(result, f"{name}_per_prompt"), result.tokens_per_prompt, "token"),
                getattr(result, name),
                rtol=1e-6,
                atol=1e-6,
            )
        np.testing.assert_allclose(
            uncertainty.aggregate(result.mean_cosine_per_prompt, result.tokens_per_prompt, "token"),
            result.mean_cosine,
            rtol=1e-6,
            atol=1e-6,
        )
        lenses = {w: logit_lens.logit_lens(params, prompts, CONFIG, weighting=w) for w in ("prompt", "token")}
        for name in ("kl", "overlap"):
            per_prompt = getattr(lenses["prompt"], f"{name}_per_prompt")
            # the per-prompt curves do not depend on the weighting, only their aggregation does
            np.testing.assert_array_equal(getattr(lenses["token"], f"{name}_per_prompt"), per_prompt)
            for layout in (per_prompt, np.ascontiguousarray(per_prompt), np.asfortranarray(per_prompt)):
                np.testing.assert_array_equal(
                    uncertainty.aggregate(layout, lenses["prompt"].tokens_per_prompt, "prompt"),
                    getattr(lenses["prompt"], name),
                )
            np.testing.assert_allclose(
                uncertainty.aggregate(per_prompt, lenses["token"].tokens_per_prompt, "token"),
                getattr(lenses["token"], name),
                rtol=1e-6,
                atol=1e-6,
            )


def test_prompt_groups_partition_the_batch_and_give_each_prompt_its_own_result(params):
    """`PromptBatch.groups` packs prompts shortest first within the token budget (a longer
    prompt alone), and the per-prompt curves of contributions and the lens, computed in groups
    with padding, are those of each prompt run alone."""
    rng = np.random.default_rng(2)
    lengths = (5, 40, 17, 9, 30, 12, 25, 70, 6, 20)
    prompts = make_batch([rng.integers(0, 97, n).tolist() for n in lengths])
    groups = prompts.groups(max_tokens=64)
    order = np.concatenate([index for index, _ in groups])
    np.testing.assert_array_equal(np.sort(order), np.arange(len(lengths)))
    np.testing.assert_array_equal(np.asarray(lengths)[order], np.sort(lengths))  # shortest first
    for index, group in groups:
        rows, T = group.tokens.shape
        assert T == prompts.buckets.padded(prompts.lengths[index].max())
        assert rows == 1 or rows * T <= 64
        np.testing.assert_array_equal(group.tokens[: len(index)], prompts.tokens[index, :T])
    assert max(len(index) for index, _ in groups) > 1 and any(len(index) == 1 for index, _ in groups)

    together = contributions.contributions(params, prompts, CONFIG)
    lens = logit_lens.logit_lens(params, prompts, CONFIG)
    for i in range(len(lengths)):
        alone = prompts.select([i])
        one = contributions.contributions(params, alone, CONFIG)
        for name in contributions.STATISTICS:
            np.testing.assert_allclose(
                getattr(together, f"{name}_per_prompt")[i], getattr(one, f"{name}_per_prompt")[0], rtol=1e-5, atol=1e-6
            )
        one_lens = logit_lens.logit_lens(params, alone, CONFIG)
        np.testing.assert_allclose(lens.kl_per_prompt[i], one_lens.kl_per_prompt[0], rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(lens.overlap_per_prompt[i], one_lens.overlap_per_prompt[0], atol=1e-6)


# ----------------------------------------------------------------------------- §3


def _skip_reference(params, one, layer, split, sublayer):
    """The same skip intervention through the plain forward, one at a time, numpy statistics."""
    T = one.tokens.shape[1]
    length = int(one.lengths[0])
    pos = np.arange(T)
    tokens, valid = jnp.asarray(one.tokens), jnp.asarray(one.valid)
    iv = sites.skip(SUBLAYERS[sublayer], layer, ((pos >= 1) & (pos < split)).astype(np.float32))
    d_clean, d_skip = deltas(params, tokens, valid), deltas(params, tokens, valid, iv)
    ratio = np.linalg.norm(d_clean - d_skip, axis=-1) / np.maximum(np.linalg.norm(d_clean, axis=-1), 1e-6)
    future = (pos >= split) & (pos < length)
    later = ratio[:, 0, future].max(-1)
    out = np.linalg.norm(probs(params, tokens, valid) - probs(params, tokens, valid, iv), axis=-1)[0, future].max()
    return later, out


@pytest.mark.parametrize("sublayer", ["layer", "attn", "mlp"])
def test_layer_skip_sweep_equals_one_at_a_time(params, batch, sublayer):
    result = layer_skip.layer_skip(params, batch, CONFIG, sublayer=sublayer, progress=False)
    L = CONFIG.num_layers
    for i in range(len(batch)):
        splits = [t for t in result.split_positions[i] if t >= 0]
        assert splits, "every test prompt is long enough for a split position"
        ref_later = np.zeros((L, L))
        ref_out = np.zeros(L)
        for s in range(L):
            for t in splits:
                later, out = _skip_reference(params, batch.single(i), s, t, sublayer)
                ref_later[s] = np.maximum(ref_later[s], np.where(np.arange(L) > s, later, 0))
                ref_out[s] = max(ref_out[s], out)
        np.testing.assert_allclose(result.later_per_prompt[i], ref_later, atol=2e-5)
        np.testing.assert_allclose(result.output_per_prompt[i], ref_out, atol=2e-6)
    np.testing.assert_array_equal(result.later, result.later_per_prompt.max(0))


def test_layer_skip_exact_zeros_and_chunking(params, batch):
    full = layer_skip.layer_skip(params, batch, CONFIG, progress=False)
    chunked = layer_skip.layer_skip(params, batch, CONFIG, progress=False, chunk_size=3)
    lower = np.tril(np.ones((CONFIG.num_layers,) * 2, bool))
    assert np.all(full.later[lower] == 0.0) and np.all(full.later_per_prompt[:, lower] == 0.0)
    assert np.all(full.later[~lower] > 0)
    assert full.output[-1] == 0.0  # the last layer, skipped before t_s, cannot reach p >= t_s
    np.testing.assert_allclose(chunked.later, full.later, atol=1e-6)
    np.testing.assert_allclose(chunked.output, full.output, atol=1e-7)
    # skipped layers in calls of 3 (the last call padded by repeating layer L-1), as a tight
    # memory budget makes them, give what one call over all L gives
    one, T = batch.single(0), batch.single(0).tokens.shape[1]
    pos = np.arange(T)
    masks = layer_skip.SkipMasks(
        np.asarray([(pos >= 1) & (pos < t) for t in (8, 12)], np.float32), np.asarray([pos >= t for t in (8, 12)])
    )
    args = (params, PromptArrays(jnp.asarray(one.tokens), jnp.asarray(one.valid)), masks, CONFIG)
    assert layer_skip.skipped_layer_groups(CONFIG, T, 2, memory_budget=4 * 2 * T * CONFIG.hidden_size * 4 * 3) == 3
    for whole, grouped in zip(
        layer_skip.skip_effects_of_prompt(*args), layer_skip.skip_effects_of_prompt(*args, layers_per_call=3)
    ):
        assert grouped.shape == whole.shape
        np.testing.assert_allclose(grouped, whole, atol=1e-7)


def test_split_positions_follow_the_reference_sampling():
    import random

    rng = random.Random(123)
    expected = []
    for length in (30, 50, 12):
        c = list(range(8, length - 4, 8))
        rng.shuffle(c)
        expected.append(sorted(c[:4]))
    assert layer_skip.sample_split_positions([30, 50, 12], seed=123) == expected
    assert expected[2] == []  # range(8, 8, 8) is empty: too short


@pytest.mark.parametrize("sublayer", ["layer", "attn", "mlp"])
def test_current_mode_equals_one_at_a_time_with_the_diagonal_measured(params, batch, sublayer):
    """'current': skip every position but 0, measure every position. Only j < s is zero by
    construction; the diagonal D[s, s] is the skipped layer's own change (1 for a whole layer)."""
    result = layer_skip.layer_skip(params, batch, CONFIG, sublayer=sublayer, mode="current", progress=False)
    L = CONFIG.num_layers
    for i in range(len(batch)):
        one = batch.single(i)
        T, length = one.tokens.shape[1], int(one.lengths[0])
        pos = np.arange(T)
        tokens, valid = jnp.asarray(one.tokens), jnp.asarray(one.valid)
        ref = np.zeros((L, L))
        for s in range(L):
            iv = sites.skip(SUBLAYERS[sublayer], s, ((pos >= 1) & (pos < length)).astype(np.float32))
            d_clean, d_skip = deltas(params, tokens, valid), deltas(params, tokens, valid, iv)
            ratio = np.linalg.norm(d_clean - d_skip, axis=-1) / np.maximum(np.linalg.norm(d_clean, axis=-1), 1e-6)
            ref[s] = np.where(np.arange(L) >= s, ratio[:, 0, :length].max(-1), 0.0)
        np.testing.assert_allclose(result.later_per_prompt[i], ref, atol=2e-5)
    upper = np.triu(np.ones((L, L), bool))
    assert np.all(result.later_per_prompt[:, ~upper] == 0.0)  # j < s: exactly zero
    diagonal = np.diagonal(result.later, axis1=-2, axis2=-1)
    assert np.all(diagonal > 0)
    if sublayer == "layer":
        np.testing.assert_allclose(diagonal, 1.0, atol=1e-6)


def test_current_mode_skips_all_but_position_zero(params, batch):
    result = layer_skip.layer_skip(params, batch.select(slice(0, 1)), CONFIG, mode="current", progress=False)
    one = batch.single(0)
    pos = np.arange(one.tokens.shape[1])
    tokens, valid = jnp.asarray(one.tokens), jnp.asarray(one.valid)
    iv = sites.skip("delta", 1, (pos >= 1).astype(np.float32))
    out = np.linalg.norm(probs(params, tokens, valid) - probs(params, tokens, valid, iv), axis=-1)[0, :30].max()
    np.testing.assert_allclose(result.output[1], out, atol=2e-6)


# ----------------------------------------------------------------------------- §4


def test_erasure_sweep_equals_one_at_a_time(params, batch):
    baseline = erasure.mean_residuals(params, batch, CONFIG)
    hs = np.asarray(residual_stream(params, jnp.asarray(batch.tokens), CONFIG, valid=jnp.asarray(batch.valid)))
    np.testing.assert_allclose(
        baseline, (hs * batch.valid[None, :, :, None]).sum((1, 2)) / batch.valid.sum(), rtol=1e-5, atol=1e-6
    )
    result = erasure.residual_erasure(params, batch, CONFIG, baseline, progress=False)
    # other chunks and pieces of 11 positions (the prompt padded to 33), or one piece: the same numbers
    chunked = erasure.residual_erasure(params, batch, CONFIG, baseline, progress=False, chunk_size=7, blocks=3)
    np.testing.assert_allclose(chunked.effects, result.effects, rtol=1e-5, atol=1e-7)
    chunked = erasure.residual_erasure(params, batch, CONFIG, baseline, progress=False, chunk_size=5, blocks=1)
    np.testing.assert_allclose(chunked.effects, result.effects, rtol=1e-5, atol=1e-7)
    i = 1
    one = batch.single(i)
    tokens, valid = jnp.asarray(one.tokens), jnp.asarray(one.valid)
    clean = probs(params, tokens, valid)
    answer = one.answer_prediction_mask()[0]
    length = int(one.lengths[0])
    for l in range(CONFIG.num_layers + 1):
        for t in range(length):
            iv = sites.replace("resid_pre", l, np.arange(one.tokens.shape[1]) == t, baseline[l])
            diff = np.linalg.norm(probs(params, tokens, valid, iv) - clean, axis=-1)[0]
            assert result.effects[i, l, t] == pytest.approx(diff[answer].max(), abs=2e-6)
    # after the last answer-predicting position nothing can change: exact zeros
    assert np.all(result.effects[i, :, length - 1 :] == 0.0)
    assert np.all(result.effects[0, :, int(batch.lengths[0]) - 1 :] == 0.0)


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
    result = ig.integrated_gradients(
        params, batch.select(slice(1, 2)), CONFIG, steps=steps, rule="midpoint", progress=False
    )
    chunked = ig.integrated_gradients(
        params, batch.select(slice(1, 2)), CONFIG, steps=steps, rule="midpoint", progress=False, chunk_size=5
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


@pytest.mark.parametrize("backward", ["recompute", "stored"])
def test_suffix_gradient_equals_jax_grad_of_a_plain_forward(params, batch, backward):
    # Both backwards (layer by layer recomputing each layer, or from each layer's kept activations)
    # give F and dF/dh_start of a plain forward with h_start set, from every start.
    one = batch.single(1)
    tokens, valid = jnp.asarray(one.tokens), jnp.asarray(one.valid)
    objective = ig.answer_objective(params, batch.prompt(1), CONFIG)
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
    result = ig.integrated_gradients(
        params, batch.select(slice(1, 2)), CONFIG, steps=steps, rule="midpoint", target=target, progress=False
    )
    assert result.settings["target"] == target
    one = batch.single(1)
    tokens, valid = jnp.asarray(one.tokens), jnp.asarray(one.valid)
    answer = jnp.asarray(one.answer_prediction_mask()[0])
    _, xs = run_layers(
        params, embed(params, tokens), CONFIG, valid=valid, tap=lambda r, _: r.attn if target == "attn" else r.mlp
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
            ig.integrated_gradients(
                params, batch.select(slice(0, 1)), CONFIG, steps=n, target=target, progress=False
            ).gap
        ).max()
        for n in (2, 8, 32)
    ]
    assert gaps[0] > 2 * gaps[1] > 4 * gaps[2] > 0, gaps


def test_ig_completeness_gap_shrinks_with_steps(params, batch):
    gaps = [
        np.abs(ig.integrated_gradients(params, batch.select(slice(0, 1)), CONFIG, steps=n, progress=False).gap).max()
        for n in (2, 8, 32)
    ]
    assert gaps[0] > 2 * gaps[1] > 4 * gaps[2] > 0


def test_ig_zero_where_the_output_cannot_depend(params, batch):
    result = ig.integrated_gradients(params, batch.select(slice(0, 1)), CONFIG, steps=4, progress=False)
    last_prediction = int(batch.lengths[0]) - 2
    # positions after the last answer prediction reach no measured output: exactly zero
    assert np.all(result.attributions[0, :, last_prediction + 1 :] == 0.0)
    assert np.any(result.attributions[0, :, : last_prediction + 1] != 0.0)
    # a model whose output ignores the residual (zero final norm): every layer's attribution is 0
    dead = {**params, "final_norm": jnp.zeros_like(params["final_norm"])}
    flat = ig.integrated_gradients(dead, batch.select(slice(0, 1)), CONFIG, steps=4, progress=False)
    assert np.all(flat.attributions == 0.0) and np.all(flat.gap == 0.0)


def test_quadrature_rules_integrate_exactly():
    for rule, steps in (("left", 4), ("midpoint", 4), ("gauss", 3)):
        a, w = quadrature(rule, steps)
        assert np.isclose(w.sum(), 1.0)
    a, w = quadrature("left", 4)
    np.testing.assert_array_equal(a, [0, 0.25, 0.5, 0.75])
    a, w = quadrature("gauss", 3)
    assert np.isclose(np.sum(w * a**5), 1 / 6)  # exact for polynomials up to degree 5


# ----------------------------------------------------------------------------- compilation


def test_new_intervention_values_do_not_recompile(params, batch):
    """New split positions are new mask values and new measured rows (within one padded row
    count): neither the skipped forwards nor the output shifts compile again."""
    one = batch.single(0)
    prompt = PromptArrays(jnp.asarray(one.tokens), jnp.asarray(one.valid))
    jitted = (layer_skip.skipped_runs, layer_skip.output_shifts)
    T = one.tokens.shape[1]
    assert T <= layer_skip.ROWS_MULTIPLE  # both splits' measured rows pad to one count
    sizes = []
    for t in (9, 17):
        pos = np.arange(T)
        masks = layer_skip.SkipMasks(np.asarray([(pos >= 1) & (pos < t)], np.float32), np.asarray([pos >= t]))
        layer_skip.skip_effects_of_prompt(params, prompt, masks, CONFIG, sublayer="layer", chunk_size=None)
        sizes.append([f._cache_size() for f in jitted])
    assert sizes[1] == sizes[0]


# ----------------------------------------------------------------------------- bf16


def test_bfloat16_mode_stays_close_to_float32(params, batch):
    """bf16 weights and activations, float32 statistics: per-token KL to the float32 output
    distribution stays below 1e-3 nats on this model, and every analysis gives finite curves."""
    p16 = jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), params)
    tokens, valid = jnp.asarray(batch.tokens), jnp.asarray(batch.valid)
    logp32 = jax.nn.log_softmax(forward(params, tokens, CONFIG, valid=valid), -1)
    logits16 = forward(p16, tokens, CONFIG, valid=valid)
    assert logits16.dtype == jnp.float32  # logits are float32 even in bf16 mode
    logp16 = jax.nn.log_softmax(logits16, -1)
    kl = np.asarray(jnp.sum(jnp.exp(logp32) * (logp32 - logp16), -1))[batch.valid]
    assert kl.max() < 1e-3 and kl.mean() > 0  # close, and really computed in lower precision
    lens = logit_lens.logit_lens(p16, batch, CONFIG)
    lens32 = logit_lens.logit_lens(params, batch, CONFIG)
    np.testing.assert_allclose(lens.kl, lens32.kl, rtol=0.05, atol=1e-3)
    assert np.all(np.isfinite(contributions.contributions(p16, batch, CONFIG).cos_layer))
