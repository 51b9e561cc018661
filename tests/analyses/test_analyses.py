"""The analyses together on a tiny random model: in bfloat16 they stay close to float32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdepth.analyses import contributions, logit_lens
from jaxdepth.core.model import forward

from tiny_qwen import CONFIG, batch, deltas, params, probs  # noqa: F401  (fixtures)

# Compare at full float32 matmul precision (as the references compute).
pytestmark = pytest.mark.usefixtures("highest_precision")


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
