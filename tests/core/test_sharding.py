"""Sharding: the partition table covers every parameter, and sharded analyses equal
single-device ones on 8 simulated CPU devices (in a fresh interpreter: the device count is
fixed when JAX starts)."""

import os
import subprocess
import sys

import jax
import pytest
from jax.sharding import PartitionSpec as P

from jaxdepth.core.config import ModelConfig
from jaxdepth.core.model import param_shapes
from jaxdepth.core.sharding import PARTITION_RULES, make_mesh, param_spec


@pytest.mark.parametrize("qkv_bias,tied", [(True, True), (False, False)])
def test_partition_table_covers_every_parameter(qkv_bias, tied):
    config = ModelConfig(
        model_type="qwen2" if qkv_bias else "llama",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rope_theta=1e4,
        rms_norm_eps=1e-6,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        qkv_bias=qkv_bias,
    )
    shapes = param_shapes(config)
    names = set(shapes) - {"layers"} | set(shapes["layers"])
    assert names <= set(PARTITION_RULES)
    mesh = make_mesh(data=1, model=1, devices=jax.devices()[:1])
    for path, shape in jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))[0]:
        assert len(param_spec(str(path[-1].key), shape, mesh)) == len(shape)


def test_unknown_parameter_and_uneven_axes():
    mesh = make_mesh(data=1, model=1, devices=jax.devices()[:1])
    with pytest.raises(KeyError, match="no partition rule"):
        param_spec("rotary_inv_freq", (8,), mesh)
    assert param_spec("q", (2, 32, 24), mesh) == P(None, None, "model")


@pytest.mark.slow(seconds=150)
def test_sharded_analyses_equal_single_device():
    # the session's XLA flags (its optimisation level: conftest.py) plus 8 host devices
    xla_flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()
    env = {**os.environ, "XLA_FLAGS": xla_flags, "JAX_PLATFORMS": "cpu"}
    script = os.path.join(os.path.dirname(__file__), "sharded_equivalence.py")
    proc = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=900)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
