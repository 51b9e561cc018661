"""The tiny Qwen2 (GQA, biases, untied) and the two prompts that the analyses' tests run on,
and the plain forwards they compare against."""

import jax
import numpy as np
import pytest

from jaxdepth.core.batch import make_batch
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.loops import run_layers
from jaxdepth.core.model import embed, forward, random_params

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


@jax.jit
def _probs(params, tokens, valid, interventions):
    return jax.nn.softmax(forward(params, tokens, CONFIG, valid=valid, interventions=interventions), -1)


@jax.jit
def _deltas(params, tokens, valid, interventions):
    return run_layers(
        params,
        embed(params, tokens, CONFIG),
        CONFIG,
        valid=valid,
        interventions=interventions,
        tap=lambda r, _: r.delta,
    )[1]


def probs(params, tokens, valid, interventions=None):
    """Output probabilities of one plain (not vmapped) forward."""
    return np.asarray(_probs(params, tokens, valid, interventions))


def deltas(params, tokens, valid, interventions=None):
    """Every layer's contribution h_{l+1} - h_l of one plain forward, [L, B, T, D]."""
    return np.asarray(_deltas(params, tokens, valid, interventions))
