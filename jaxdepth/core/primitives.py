"""The primitives of a layer: `project`, the one product of activations with a weight matrix
(in the weights' precision where they are narrower), and the activation functions by name."""

from __future__ import annotations

from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp
from jaxtyping import Array

__all__ = [
    "project",
    "ACTIVATIONS",
    "gated_units",
]


def project(x: Array, w: Array, spec: Optional[str] = None) -> Array:
    """`x @ w` (or `jnp.einsum(spec, x, w)`): the one product of activations with a weight
    matrix. Where `w` is stored in a narrower float type than `x` (bfloat16 matrices beside
    float32 activations: `ModelWeights.with_matmul_dtype`), the product reads its inputs rounded
    to `w`'s type and accumulates in float32, forward and backward, as a GPU's bf16 or TF32
    matmul does; the result keeps `x`'s type, so the residual stream, norms and softmaxes stay in
    float32. Equal types: the plain product."""
    if jnp.finfo(w.dtype).bits >= jnp.finfo(x.dtype).bits:
        return x @ w if spec is None else jnp.einsum(spec, x, w)
    return _rounded_product(x, w, spec or "...i,io->...o")


def _narrow_einsum(spec: str, a: Array, b: Array) -> Array:
    """`einsum(spec, a, b)` of two bf16 operands, accumulated in float32. XLA:CPU has no bf16 dot
    with batch axes (an index in both operands and the output: the split layer's per-head
    products), so those multiply float32 copies: the same numbers, since products of bf16 values
    are exact in float32."""
    operands, out = spec.split("->")
    a_spec, b_spec = operands.split(",")
    if set(a_spec) & set(b_spec) & set(out) - {"."}:
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _rounded_product(x: Array, w: Array, spec: str) -> Array:
    return _narrow_einsum(spec, x.astype(w.dtype), w).astype(x.dtype)


def _rounded_product_forward(x, w, spec):
    return _rounded_product(x, w, spec), (x, w)


def _rounded_product_backward(spec, saved, g):
    # JAX's own transpose would multiply the float32 cotangent by the narrow weights in float32
    # (the slow product) and then round the input's gradient to the narrow type; here both
    # backward products are rounded-input, float32-accumulated products like the forward one.
    x, w = saved
    x_spec, rest = spec.split(",")
    w_spec, out_spec = rest.split("->")
    g = g.astype(w.dtype)
    dx = _narrow_einsum(f"{out_spec},{w_spec}->{x_spec}", g, w).astype(x.dtype)
    if x_spec.startswith("..."):  # the leading axes are summed over for w's gradient: make them one
        x, g = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
        x_spec, out_spec = x_spec.replace("...", "n"), out_spec.replace("...", "n")
    dw = _narrow_einsum(f"{x_spec},{out_spec}->{w_spec}", x.astype(w.dtype), g)
    return dx, dw.astype(w.dtype)


_rounded_product.defvjp(_rounded_product_forward, _rounded_product_backward)


# The activations of `ModelConfig.activation`, by name.
ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_tanh": partial(jax.nn.gelu, approximate=True),
    "gelu": partial(jax.nn.gelu, approximate=False),
}


def gated_units(gate: Array, up: Array, config) -> Array:
    """A gated MLP's hidden units from its gate and up projections: `act(gate) * up`, or
    GPT-OSS's clamped GLU (`ModelConfig.mlp` 'clamped': the gate capped above and the up
    projection clipped at +-`glu_limit`, `(up + 1) * gate * sigmoid(glu_alpha * gate)`)."""
    if config.mlp == "clamped":
        gate = jnp.minimum(gate, config.glu_limit)
        up = jnp.clip(up, -config.glu_limit, config.glu_limit)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * config.glu_alpha))
    return ACTIVATIONS[config.activation](gate) * up
