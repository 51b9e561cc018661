"""bf16 weight matrices beside float32 activations (`ModelWeights.with_matmul_dtype`, `--dtype
bf16-matmuls`): every product of activations with a weight matrix reads both inputs rounded to
bf16 and accumulates in float32, forward and backward; everything else stays float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config
from jaxdepth.core import compilation
from jaxdepth.core.primitives import project
from jaxdepth.core.loops import run_layers
from jaxdepth.core.model import embed, forward, random_params, unembed
from jaxdepth.core.weights import ModelWeights

CONFIG = tiny_config(num_layers=2)
SPECS = [None, "btkgd,dke->btkge", "bshe,hed->bshd"]  # the layer's products: whole, per group, per head
SHAPES = {
    None: ((2, 5, 8), (8, 6)),
    "btkgd,dke->btkge": ((2, 5, 3, 2, 8), (8, 3, 4)),
    "bshe,hed->bshd": ((2, 5, 3, 4), (3, 4, 8)),
}


def rounded(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32), np.float64)


@pytest.mark.parametrize("spec", SPECS)
def test_a_product_with_bf16_weights_rounds_its_inputs_and_accumulates_in_float32_both_ways(spec):
    rng = np.random.default_rng(0)
    x_shape, w_shape = SHAPES[spec]
    x = jnp.asarray(rng.standard_normal(x_shape), jnp.float32)
    w = jnp.asarray(rng.standard_normal(w_shape), jnp.bfloat16)
    g = jnp.asarray(rng.standard_normal(np.shape(project(x, w, spec))), jnp.float32)
    einsum = spec or "bti,io->bto"  # x @ w of a [B, T, I] input
    x_spec, rest = einsum.split(",")
    w_spec, out_spec = rest.split("->")

    y, vjp = jax.vjp(lambda x, w: project(x, w, spec), x, w)
    assert y.dtype == jnp.float32
    np.testing.assert_allclose(y, np.einsum(einsum, rounded(x), rounded(w)), rtol=1e-5, atol=1e-5)
    dx, dw = vjp(g)
    assert (dx.dtype, dw.dtype) == (jnp.float32, jnp.bfloat16)
    # the cotangent is rounded too, as the forward's input is: not JAX's default transpose
    # (float32 cotangent times bf16 weights, the input's gradient then rounded to bf16)
    np.testing.assert_allclose(
        dx, np.einsum(f"{out_spec},{w_spec}->{x_spec}", rounded(g), rounded(w)), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(
        np.asarray(dw, np.float64),
        np.einsum(f"{x_spec},{out_spec}->{w_spec}", rounded(x), rounded(g)),
        rtol=1e-2,
        atol=1e-2,
    )
    assert not np.array_equal(rounded(dx), np.asarray(dx, np.float64))  # dx itself is not rounded to bf16


@pytest.mark.parametrize("spec", SPECS)
def test_equal_types_are_the_plain_product(spec):
    rng = np.random.default_rng(1)
    x_shape, w_shape = SHAPES[spec]
    x, w = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in (x_shape, w_shape))
    plain = x @ w if spec is None else jnp.einsum(spec, x, w)
    np.testing.assert_array_equal(project(x, w, spec), plain)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "experts"])
def test_with_matmul_dtype_stores_the_layers_matrices_in_bf16_and_nothing_else(moe):
    from conftest import tiny_moe_config

    config = tiny_moe_config(dense_layers=(1,), dense_size=24) if moe else CONFIG
    weights = ModelWeights(random_params(config, 0, scale=0.3), config, None, "tiny")
    mixed = weights.with_matmul_dtype("bfloat16")
    for name, w in mixed.params["layers"].items():  # [L, in, out], the experts' [L, E, in, out]
        assert w.dtype == (jnp.bfloat16 if w.ndim >= 3 else jnp.float32), name
    assert not moe or mixed.params["layers"]["expert_up"].dtype == jnp.bfloat16
    assert {k for k in mixed.params if k != "layers"} == {k for k in weights.params if k != "layers"}
    assert all(mixed.params[k].dtype == jnp.float32 for k in mixed.params if k != "layers")
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(weights.params))  # the original is left as it is


def _kl(p_logits, q_logits):
    p, q = jax.nn.log_softmax(p_logits), jax.nn.log_softmax(q_logits)
    return np.asarray(jnp.sum(jnp.exp(p) * (p - q), -1))


def test_the_model_runs_float32_activations_through_bf16_products():
    weights = ModelWeights(random_params(CONFIG, 0, scale=0.3), CONFIG, None, "tiny")
    mixed = weights.with_matmul_dtype("bfloat16")
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, CONFIG.vocab_size, (2, 9)))
    full, narrow = forward(weights.params, tokens, CONFIG), forward(mixed.params, tokens, CONFIG)
    assert narrow.dtype == jnp.float32 and np.isfinite(narrow).all()
    assert not np.array_equal(full, narrow)  # the products did round
    # the rounding of a bf16 product, no more: far below all-bf16's (the weights, the residual)
    kl_mixed = _kl(full, narrow)
    kl_bf16 = _kl(full, forward(weights.astype("bfloat16").params, tokens, CONFIG).astype(jnp.float32))
    assert kl_mixed.mean() < kl_bf16.mean() and kl_mixed.max() < kl_bf16.max()

    # The gradient's products are bf16 x bf16 too: no dot multiplies float32 by bf16 (XLA would
    # run it at float32's speed).
    def metric(embeddings):
        h, _ = run_layers(mixed.params, embeddings, CONFIG)
        return jnp.sum(jax.nn.log_softmax(unembed(mixed.params, h, CONFIG))[..., 3])

    embeddings = embed(mixed.params, tokens, CONFIG)
    jaxpr = jax.make_jaxpr(jax.grad(metric))(embeddings)
    dots = [e for e in _equations(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
    assert dots and all(len({v.aval.dtype for v in e.invars}) == 1 for e in dots)


def _equations(jaxpr):
    for e in jaxpr.eqns:
        yield e
        for sub in jax.core.jaxprs_in_params(e.params):
            yield from _equations(sub)


def test_programs_with_bf16_operands_compile_with_the_narrow_options():
    @compilation.jit
    def total(params):
        return sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(params))

    params = random_params(CONFIG, 0)
    mixed = ModelWeights(params, CONFIG, None, "tiny").with_matmul_dtype("bfloat16").params
    np.testing.assert_allclose(total(mixed), total(params), rtol=1e-2)
    assert set(total._jitted) == {False, True}
    assert compilation.has_narrow_floats(mixed) and not compilation.has_narrow_floats(params)
    assert total.lower(mixed).compile() is not None


@pytest.mark.parametrize("site", ["q_in", "head_result"])
def test_a_layer_split_per_head_rounds_as_the_whole_layer_does(site):
    from jaxdepth.core import sites

    mixed = ModelWeights(random_params(CONFIG, 0, scale=0.3), CONFIG, None, "tiny").with_matmul_dtype("bfloat16")
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, CONFIG.vocab_size, (2, 7)))
    whole = forward(mixed.params, tokens, CONFIG)
    split = forward(mixed.params, tokens, CONFIG, interventions=sites.unchanged(site))
    # the same rounded inputs; only the order of the float32 sums differs (per head, then summed)
    np.testing.assert_allclose(split, whole, rtol=1e-5, atol=1e-5)


def test_load_takes_bf16_matmuls_as_a_precision(tmp_path):
    from conftest import save_tiny_checkpoint
    from jaxdepth.lab.sources import BF16_MATMULS, load

    folder = save_tiny_checkpoint(str(tmp_path / "tiny"), context=64)
    full, mixed = load(folder, dtype="float32"), load(folder, dtype=BF16_MATMULS)
    assert type(mixed) is type(full)
    for name, w in mixed.params["layers"].items():
        assert w.dtype == (jnp.bfloat16 if w.ndim == 3 else jnp.float32), name
        np.testing.assert_array_equal(
            np.asarray(w, np.float32), np.asarray(full.params["layers"][name].astype(w.dtype), np.float32)
        )
    np.testing.assert_array_equal(mixed.params["embed"], full.params["embed"])
