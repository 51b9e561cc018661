"""The Flax NNX module: its split state is the params pytree (the same arrays), calling it equals
the pure forward bit for bit, its Params carry the partition table's specs, and its state
survives an orbax round trip bit for bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdepth.core import sites
from jaxdepth.core.config import ModelConfig
from jaxdepth.lab.loaded_model import Model
from jaxdepth.core.model import forward, random_params
from jaxdepth.core.module import Decoder, abstract_decoder, partition_specs
from jaxdepth.core.sharding import PARTITION_RULES

CONFIGS = {
    "qwen2_untied": ModelConfig(
        model_type="qwen2",
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rope_theta=12345.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        qkv_bias=True,
    ),
    "llama_tied": ModelConfig(
        model_type="llama",
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=4,
        head_dim=8,
        rope_theta=1e4,
        rms_norm_eps=1e-5,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        qkv_bias=False,
    ),
}


@pytest.fixture(params=sorted(CONFIGS))
def setup(request):
    config = CONFIGS[request.param]
    params = jax.tree.map(jnp.asarray, random_params(config, 0, scale=0.2))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (2, 9)), jnp.int32)
    return params, config, tokens


def test_split_state_is_the_params_pytree_without_copies(setup):
    params, config, _ = setup
    decoder = Decoder(params, config)
    _, state = nnx.split(decoder)
    pure = state.to_pure_dict()
    assert jax.tree.structure(pure) == jax.tree.structure(params)
    for ours, theirs in zip(jax.tree.leaves(pure), jax.tree.leaves(params)):
        assert ours is theirs  # one source of truth: the module wraps the arrays, it does not copy them
    assert isinstance(decoder.layers["q"], nnx.Param) and decoder.layers["q"].shape[0] == config.num_layers
    model = Model(params=params, config=config, tokenizer=None, source="tiny")
    assert all(a is b for a, b in zip(jax.tree.leaves(model.module.params()), jax.tree.leaves(params)))


def test_calling_the_module_equals_the_pure_forward_bit_for_bit(setup):
    params, config, tokens = setup
    decoder = Decoder(params, config)
    pure = jax.jit(forward, static_argnames="config")
    np.testing.assert_array_equal(nnx.jit(lambda m, t: m(t))(decoder, tokens), pure(params, tokens, config))
    iv = sites.keep("mlp_out", np.ones((config.num_layers, 9), np.float32) * np.r_[1, 0, 1, 1, 0, 1, 1, 1, 1])
    np.testing.assert_array_equal(
        nnx.jit(lambda m, t, iv: m(t, interventions=iv))(decoder, tokens, iv),
        jax.jit(lambda p, t, iv: forward(p, t, config, interventions=iv))(params, tokens, iv),
    )


def test_params_carry_the_partition_table(setup):
    params, config, _ = setup
    specs = partition_specs(Decoder(params, config))
    expected = jax.tree_util.tree_map_with_path(lambda path, _: PARTITION_RULES[str(path[-1].key)], params)
    assert specs == expected


def test_nnx_state_orbax_round_trip_is_bit_identical(setup, tmp_path):
    import orbax.checkpoint as ocp

    params, config, _ = setup
    state = nnx.state(Decoder(params, config), nnx.Param)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "state", state)
    checkpointer.wait_until_finished()
    target = nnx.state(abstract_decoder(config, jnp.float32), nnx.Param)
    restored = checkpointer.restore(tmp_path / "state", target)
    back = Decoder(restored.to_pure_dict(), config)
    for ours, theirs in zip(jax.tree.leaves(back.params()), jax.tree.leaves(params)):
        assert np.asarray(ours).tobytes() == np.asarray(theirs).tobytes()
