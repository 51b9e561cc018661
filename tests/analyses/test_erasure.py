"""Residual erasure (METHODS §4) on a tiny random model: the sweep equals the erasures run one at
a time."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxdepth.analyses import erasure
from jaxdepth.core import sites
from jaxdepth.core.model import residual_stream

from tiny_qwen import CONFIG, batch, deltas, params, probs  # noqa: F401  (fixtures)

# Compare at full float32 matmul precision (as the references compute).
pytestmark = pytest.mark.usefixtures("highest_precision")


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
