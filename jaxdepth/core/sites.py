"""Named intervention sites of a decoder layer, and interventions as data.

Every layer exposes these sites, in the order the layer computes them (names as in
TransformerLens, shapes in the glossary of `jaxdepth.core.model`):

    resid_pre   h_l, the layer's input                         [B, T, D]
    head_out    each attention head's output, before o_proj      [B, T, H, Dh]
    attn_out    a_l, the attention output after o_proj           [B, T, D]
    mlp_hidden  silu(gate) * up, the MLP's hidden activations    [B, T, F]
    mlp_out     m_l, the MLP output                              [B, T, D]
    delta       the layer's contribution a_l + m_l               [B, T, D]
    resid_post  h_{l+1}, the layer's output                      [B, T, D]

`resid_pre` at layer index L (one past the last layer) is the final residual h_L, the input of
the final norm: an intervention there edits boundary L. Taps (see `jaxdepth.core.model.LayerRecord`)
also read the queries, keys, values and attention probabilities.

An `Intervention` is a site name, a pure function `fn(value, layer, data) -> value` and `data`,
a pytree of arrays. `layer` is the (traced) layer index, so one intervention can act on any
subset of layers; `data` is the only part JAX traces: a new value never recompiles, a stack of
interventions (data with a leading axis) `vmap`s, and gradients flow into `data`. `site` and
`fn` are static: define `fn` once (at module level), not as a new lambda per call, or every call
compiles anew. Write `fn` with `where` and multiplications, not Python `if` on values: under
`vmap` both branches of a `lax.cond` run anyway.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Optional, Union

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

SITES = ("resid_pre", "head_out", "attn_out", "mlp_hidden", "mlp_out", "delta", "resid_post")


@dataclasses.dataclass(frozen=True)
class Intervention:
    """Apply `fn(value, layer, data)` to the value at `site` of every layer (and, for
    `resid_pre`, to the final residual with layer = L)."""

    site: str
    fn: Callable[[Array, Array, Any], Array]
    data: Any = None

    def __post_init__(self):
        if self.site not in SITES:
            raise ValueError(f"unknown intervention site {self.site!r}; sites: {', '.join(SITES)}")


jax.tree_util.register_dataclass(Intervention, data_fields=["data"], meta_fields=["site", "fn"])

InterventionsLike = Union[None, Intervention, Iterable[Any]]


def as_interventions(interventions: InterventionsLike) -> tuple[Intervention, ...]:
    """A flat tuple of `Intervention`s from None, one intervention, a bundle with a
    `site_interventions()` method (`jaxdepth.core.interventions.Interventions`), or a (nested)
    sequence of these."""
    if interventions is None:
        return ()
    if isinstance(interventions, Intervention):
        return (interventions,)
    if hasattr(interventions, "site_interventions"):
        return tuple(interventions.site_interventions())
    return tuple(iv for item in interventions for iv in as_interventions(item))


def apply_at(site: str, value: Array, layer, interventions: tuple[Intervention, ...]) -> Array:
    """`value` at `site` of `layer` after every intervention on that site, in order."""
    for iv in interventions:
        if iv.site == site:
            value = iv.fn(value, layer, iv.data).astype(value.dtype)
    return value


# ----------------------------------------------------------------------------- built-in kinds
#
# Each kind is a module-level function of (value, layer, data) and a constructor that packs
# its data. Layer indices in data may be traced, so a vmapped sweep over layers compiles once.

def _expand(mask, value):
    """A position mask `[T]` or `[B, T]` as a multiplier of `value` `[B, T, ...]`."""
    return mask.reshape(mask.shape + (1,) * (value.ndim - 2)).astype(value.dtype)


def _multiply(value, layer, masks):
    return value * _expand(masks[layer], value)


def keep(site: str, masks: Float[Array, "layer *bt"]) -> Intervention:
    """Multiply the value at `site` by `masks[l]` (`[L, T]` or `[L, B, T]`, per position) at
    every layer l: 1 keeps it, 0 removes it (the `Interventions` keep-masks)."""
    return Intervention(site, _multiply, jnp.asarray(masks, jnp.float32))


def _replace(value, layer, data):
    at, positions, new = data
    hit = (layer == at) & (positions > 0)
    return jnp.where(_expand(hit, value) > 0, jnp.broadcast_to(new, value.shape).astype(value.dtype), value)


def replace(site: str, layer, positions, value) -> Intervention:
    """Replace the value at `site` of layer `layer` by `value` (broadcast to the site's shape)
    where `positions` (`[T]` or `[B, T]`) is > 0."""
    return Intervention(site, _replace, (jnp.asarray(layer, jnp.int32), jnp.asarray(positions, jnp.float32),
                                         jnp.asarray(value)))


def _add(value, layer, data):
    at, positions, vector = data
    return value + jnp.where(layer == at, 1.0, 0.0) * _expand(positions, value) * vector.astype(value.dtype)


def add(site: str, layer, vector, positions) -> Intervention:
    """Add `vector` (broadcast to the site's trailing shape, e.g. `[D]`: a steering vector) to the
    value at `site` of layer `layer`, scaled by `positions` (`[T]` or `[B, T]`: 1 adds, 0 not)."""
    return Intervention(site, _add, (jnp.asarray(layer, jnp.int32), jnp.asarray(positions, jnp.float32),
                                     jnp.asarray(vector)))


def _patch(value, layer, data):
    cached, where = data
    return jnp.where(where[layer], cached[layer].astype(value.dtype), value)


def patch(site: str, cached, where) -> Intervention:
    """Activation patching: at every layer l, take the value cached from another run
    (`cached[l]`, e.g. a tap of that run, `[L, B, T, ...]`) where the boolean `where[l]`
    (broadcastable to the site's shape, e.g. `[L, 1, T, 1]` for positions or `[L, 1, 1, H, 1]`
    for heads at `head_out`) is true."""
    return Intervention(site, _patch, (jnp.asarray(cached), jnp.asarray(where, bool)))


def _ablate_heads(value, layer, data):
    heads, means = data
    hit = heads[layer][None, None, :, None]
    return jnp.where(hit > 0, means[layer][None, None].astype(value.dtype), value)


def ablate_heads(heads, means: Optional[Any] = None, *, head_dim: Optional[int] = None) -> Intervention:
    """Ablate attention heads at `head_out`: where `heads[l, h]` (`[L, H]`) is > 0, head h of layer
    l outputs `means[l, h]` (`[L, H, Dh]`: mean ablation, e.g. its mean over a dataset from a
    tap) or zeros (`means` None: zero ablation; give `head_dim`)."""
    heads = jnp.asarray(heads, jnp.float32)
    if means is None:
        if head_dim is None:
            raise ValueError("zero ablation needs head_dim (or give the means)")
        means = jnp.zeros(heads.shape + (head_dim,), jnp.float32)
    return Intervention("head_out", _ablate_heads, (heads, jnp.asarray(means)))
