"""The logit lens (METHODS §2) on a tiny random model against numpy, and its per-prompt curves
re-aggregated."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxdepth.analyses import contributions, logit_lens, uncertainty
from jaxdepth.core.batch import make_batch
from jaxdepth.core.model import residual_stream

from tiny_qwen import CONFIG, batch, deltas, params, probs  # noqa: F401  (fixtures)

# Compare at full float32 matmul precision (as the references compute).
pytestmark = pytest.mark.usefixtures("highest_precision")


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
