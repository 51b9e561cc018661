"""The studies' interventions as one bundle of arrays: skipping layers or sublayers at chosen
positions, and replacing the residual at one boundary.

`Interventions` is a convenience over the general mechanism of `jaxdepth.core.sites` (any function
at any named site): `site_interventions()` turns it into site interventions, which is all the
layer step sees. Every intervention is an array inside a pytree, never Python control flow, so that a new
intervention *value* reuses the compiled computation and a stack of interventions can be
`vmap`ped. A field left as `None` is absent from the computation altogether (that changes the
traced structure, not a value, and compiles once per structure).

Shapes (glossary in `jaxdepth.core.model`): masks over positions are `[T]` (same for every prompt
of the batch) or `[B, T]`; per-layer masks carry a leading layer axis, `[L, T]` or `[L, B, T]`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxdepth.core import sites


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Interventions:
    """What to change in a forward pass.

    keep_layer, keep_attn, keep_mlp: `[L, T]` or `[L, B, T]` multipliers of layer l's whole
        contribution `a_l + m_l`, of `a_l`, and of `m_l` at each position. 1 computes the
        sublayer normally, 0 skips it (the residual passes through unchanged). Zeroing `a_l`
        also changes the MLP's input, exactly as zeroing the attention output in a hook does.
    edit_boundary: scalar int, the residual boundary `l` in 0..L whose vector `h_l` is
        replaced (0 = the embeddings, L = the input of the final norm); -1 replaces nothing
        (unlike `jaxdepth.sites`, where -1 is the last layer); below -1 is refused.
    edit_mask: `[T]` or `[B, T]`, where (>0) `h_l` is replaced.
    edit_value: broadcastable to `[B, T, D]`, the replacement vectors. Gradients with respect
        to it are gradients with respect to the residual at that boundary.
    """

    keep_layer: Optional[Float[Array, "layer *bt"]] = None
    keep_attn: Optional[Float[Array, "layer *bt"]] = None
    keep_mlp: Optional[Float[Array, "layer *bt"]] = None
    edit_boundary: Optional[Int[Array, ""]] = None
    edit_mask: Optional[Float[Array, "*bt"]] = None
    edit_value: Optional[Float[Array, "*btd"]] = None

    def site_interventions(self) -> tuple[sites.Intervention, ...]:
        """The same interventions at their sites: the keep-masks multiply `delta`, `attn_out`
        and `mlp_out`; the edit replaces `resid_pre` of layer `edit_boundary` (the final
        residual when it is L)."""
        out = [sites.keep(site, mask) for site, mask in (("delta", self.keep_layer), ("attn_out", self.keep_attn),
                                                         ("mlp_out", self.keep_mlp)) if mask is not None]
        if self.edit_boundary is not None:
            # -1 is this bundle's "no edit" (a sweep's padding member), not the last layer as in
            # `sites`: it becomes an edit of boundary 0 at no position, which leaves h_0 as it is.
            boundary, mask = jnp.asarray(self.edit_boundary, jnp.int32), jnp.asarray(self.edit_mask, jnp.float32)
            none = (boundary == -1).reshape(boundary.shape + (1,) * max(mask.ndim - boundary.ndim, 0))
            mask = jnp.where(none, 0.0, mask)
            out.append(sites.replace("resid_pre", jnp.where(boundary == -1, 0, boundary), mask, self.edit_value))
        return tuple(out)

    def __post_init__(self):
        edit_fields = (self.edit_boundary, self.edit_mask, self.edit_value)
        # Tracers and placeholder objects pass through pytree unflattening; only check real Nones.
        if any(f is None for f in edit_fields) and not all(f is None for f in edit_fields):
            raise ValueError("edit_boundary, edit_mask and edit_value must be given together")
        boundary = self.edit_boundary
        concrete = isinstance(boundary, (int, np.integer, np.ndarray, jax.Array))
        if concrete and not isinstance(boundary, jax.core.Tracer):
            if np.any(np.asarray(boundary) < -1):
                raise ValueError(f"edit_boundary must be a boundary in 0..L, or -1 for no edit; got {boundary}")


def skip_layer(num_layers: int, layer, positions: Float[Array, "*bt"], sublayer: str = "layer") -> Interventions:
    """Skip `sublayer` ('layer', 'attn' or 'mlp') of `layer` where `positions` is 1.

    `layer` may be a traced integer, so a vmapped sweep over layers compiles once.
    """
    if sublayer not in ("layer", "attn", "mlp"):
        raise ValueError(f"sublayer must be 'layer', 'attn' or 'mlp', got {sublayer!r}")
    positions = jnp.asarray(positions, jnp.float32)
    hit = jnp.arange(num_layers).reshape((num_layers,) + (1,) * positions.ndim) == layer
    keep = jnp.where(hit, 1.0 - positions, 1.0)
    return Interventions(**{f"keep_{sublayer}": keep})


def replace_residual(boundary, positions: Float[Array, "*bt"], value) -> Interventions:
    """Replace `h_boundary` by `value` where `positions` is 1 (`boundary` may be traced)."""
    return Interventions(edit_boundary=jnp.asarray(boundary, jnp.int32),
                         edit_mask=jnp.asarray(positions, jnp.float32),
                         edit_value=jnp.asarray(value))
