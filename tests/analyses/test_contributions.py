"""Contributions (METHODS §1) on a tiny random model against numpy, and prompt groups: each
prompt of a padded group gets its own curves."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxdepth.analyses import contributions, logit_lens
from jaxdepth.core.batch import make_batch
from jaxdepth.core.loops import run_layers
from jaxdepth.core.model import embed, residual_stream

from tiny_qwen import CONFIG, batch, deltas, params, probs  # noqa: F401  (fixtures)

# Compare at full float32 matmul precision (as the references compute).
pytestmark = pytest.mark.usefixtures("highest_precision")


# ----------------------------------------------------------------------------- §1


def test_contributions_match_numpy(params, batch):
    result = contributions.contributions(params, batch, CONFIG)
    hs = np.asarray(residual_stream(params, jnp.asarray(batch.tokens), CONFIG, valid=jnp.asarray(batch.valid)))
    _, (a, m) = run_layers(
        params,
        embed(params, jnp.asarray(batch.tokens), CONFIG),
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
