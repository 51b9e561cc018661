"""Run by tests/test_sharding.py in a fresh interpreter with 8 host CPU devices: every
analysis, and site interventions of a kind defined here, on a 4 (data) x 2 (model) mesh must
equal the same on one device."""

import os
import sys

assert "xla_force_host_platform_device_count=8" in os.environ.get("XLA_FLAGS", ""), "needs 8 host devices"

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxdepth.analyses import contributions, erasure, integrated_gradients as ig, layer_skip, logit_lens  # noqa: E402
from jaxdepth.analyses.ig import Execution, FixedRule  # noqa: E402
from jaxdepth.core import sites  # noqa: E402
from jaxdepth.core.batch import make_batch  # noqa: E402
from jaxdepth.core.config import ModelConfig  # noqa: E402
from jaxdepth.core.model import forward, random_params  # noqa: E402
from jaxdepth.core.sharding import make_mesh, shard_params  # noqa: E402

CONFIG = ModelConfig(
    model_type="qwen2",
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rope_theta=1e4,
    rms_norm_eps=1e-6,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    qkv_bias=True,
)


def scale_hidden(value, layer, data):
    """An intervention kind the package does not define: scale one layer's MLP hidden activations."""
    return value * jax.numpy.where(layer == data["layer"], data["factor"], 1.0)


@jax.jit
def site_interventions(params, tokens):
    """A vmapped stack of the user-defined kind (one member per layer) and a head ablation."""
    layers = jax.numpy.arange(CONFIG.num_layers)
    stack = sites.Intervention("mlp_hidden", scale_hidden, {"layer": layers, "factor": -1.5 + 0.0 * layers})
    scaled = jax.vmap(lambda iv: forward(params, tokens, CONFIG, interventions=iv))(stack)
    heads = np.zeros((CONFIG.num_layers, CONFIG.num_heads), np.float32)
    heads[1, 2] = 1.0
    ablated = forward(params, tokens, CONFIG, interventions=sites.ablate_heads(heads, head_dim=CONFIG.head_dim))
    return scaled, ablated


def run_all(params, batch):
    baseline = erasure.mean_residuals(params, batch, CONFIG)
    scaled, ablated = site_interventions(params, jax.numpy.asarray(batch.tokens))
    return {
        "user_intervention_stack": np.asarray(scaled),
        "head_ablation": np.asarray(ablated),
        "contributions": contributions.contributions(params, batch, CONFIG).cos_layer,
        "lens_kl": logit_lens.logit_lens(params, batch, CONFIG).kl,
        "skip_later": layer_skip.layer_skip(params, batch, CONFIG, execution=Execution(chunk_size=8)).later,
        "skip_output": layer_skip.layer_skip(params, batch, CONFIG, execution=Execution(chunk_size=8)).output,
        "erasure": erasure.residual_erasure(params, batch, CONFIG, baseline, execution=Execution(chunk_size=8)).effects,
        "ig": ig.integrated_gradients_of_answers(
            params, batch, CONFIG, rule=FixedRule(steps=4), execution=Execution(progress=False, chunk_size=8)
        ).attributions,
    }


def check_sharded_restore(params):
    """A converted checkpoint restored onto a mesh lands in its sharded layout, values intact."""
    import tempfile

    import jaxdepth
    from conversion.checkpoint import save_converted
    from jaxdepth.lab.loaded_model import Model

    mesh = make_mesh(data=4, model=2)
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_converted(Model(params, CONFIG, None, "random"), os.path.join(tmp, "ckpt"))
        model = jaxdepth.load(folder, mesh=mesh)
    up = model.params["layers"]["up"]
    assert up.sharding.spec == jax.sharding.PartitionSpec(None, None, "model"), up.sharding
    assert up.addressable_shards[0].data.shape == (3, 32, 32)  # half of the MLP width per device
    for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), b)
    print("sharded restore: ok")


def check_sharded_experts():
    """A mixture's experts lie on the model axis, each device holding whole experts, and the
    forward and a vmapped sweep over dropped experts equal one device's."""
    import dataclasses

    from jaxdepth.core import experts

    config = dataclasses.replace(CONFIG, num_experts=4, experts_per_token=2, qkv_bias=False)
    params = random_params(config, 1, scale=0.2)
    tokens = jax.numpy.asarray(np.random.default_rng(1).integers(0, 96, (4, 21)))
    drops = np.eye(config.num_experts, dtype=np.float32)

    @jax.jit
    def run(params):
        swept = jax.vmap(lambda m: forward(params, tokens, config, interventions=experts.drop_experts(1, m)))(drops)
        return forward(params, tokens, config), swept

    with jax.default_matmul_precision("highest"):
        single = run(params)
        mesh = make_mesh(data=4, model=2)
        sharded_params = shard_params(params, mesh)
        gate = sharded_params["layers"]["expert_gate"]
        assert gate.sharding.spec == jax.sharding.PartitionSpec(None, "model", None, None), gate.sharding
        assert gate.addressable_shards[0].data.shape == (3, 2, 32, 64)  # 2 whole experts per device
        with jax.set_mesh(mesh):
            sharded = run(sharded_params)
    for a, b in zip(single, sharded):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    print("sharded experts: ok")


def main():
    assert len(jax.devices()) == 8
    check_sharded_experts()
    params = random_params(CONFIG, 0, scale=0.2)
    rng = np.random.default_rng(0)
    batch = make_batch([rng.integers(0, 96, 26).tolist(), rng.integers(0, 96, 19).tolist()], [18, 12])
    with jax.default_matmul_precision("highest"):
        single = run_all(params, batch)
        mesh = make_mesh(data=4, model=2)
        sharded_params = shard_params(params, mesh)
        assert sharded_params["layers"]["q"].sharding.spec[2] == "model"
        with jax.set_mesh(mesh):
            sharded = run_all(sharded_params, batch)
    check_sharded_restore(params)
    worst = 0.0
    for name in single:
        diff = float(np.max(np.abs(single[name] - sharded[name])))
        scale = float(np.max(np.abs(single[name])))
        print(f"{name}: max |single - sharded| = {diff:.3g} (max value {scale:.3g})")
        if not np.allclose(single[name], sharded[name], rtol=1e-4, atol=1e-5):
            worst = max(worst, diff)
            print(f"MISMATCH in {name}")
    sys.exit(1 if worst else 0)


if __name__ == "__main__":
    main()
