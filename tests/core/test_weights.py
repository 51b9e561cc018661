"""`ModelWeights`, the converters' record, and the shell's `Model` over it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from conftest import tiny_config
from jaxdepth.core.model import random_params
from jaxdepth.core.weights import ModelWeights
from jaxdepth.lab.loaded_model import Model

CONFIG = tiny_config(num_layers=2)


def test_model_of_weights_wraps_the_same_arrays_and_astype_casts_a_copy():
    params = jax.tree.map(np.asarray, random_params(CONFIG, 0))
    weights = ModelWeights(params=params, config=CONFIG, tokenizer=None, source="tiny")
    model = Model.of(weights)
    assert isinstance(model, Model) and Model.of(model) is model
    assert model.params is params and (model.config, model.tokenizer, model.source) == (CONFIG, None, "tiny")
    half = weights.astype("bfloat16")
    assert type(half) is ModelWeights and type(model.astype("bfloat16")) is Model
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(half.params))
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(weights.params))  # the original is left as it is
    logits = model.logits(np.zeros((1, 4), np.int32))
    assert logits.shape == (1, 4, CONFIG.vocab_size) and np.isfinite(logits).all()
