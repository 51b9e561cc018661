"""The device side of integrated gradients: a layer's straight path at a site, the metric at the
end of the model, and gradients along the path that run only the layers after the site.

For layer l and a site, x is the site's value in the clean run and b a baseline; the path sets
the value to b + α (x - b) at every position and F is a metric of the logits. A gradient
evaluation enters at layer l (recomputing layer l from its clean input when the site is inside
it, `site_entry`), runs the later layers forward and back (`suffix_value_and_grad`), and never
touches the layers before l. `layer` is traced everywhere: every layer of a prompt reuses one
compiled computation.

Metrics take the form `metric(logits, aux)`: `metric` is static (define it once, at module
level, or every call compiles anew), `aux` a traced pytree (the answer tokens, say), so a new
prompt's `aux` reuses the compiled computation.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp

from jaxdepth.analyses.stats import floating_metric
from jaxdepth.core.compilation import jit
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.model import (
    final_residual,
    layer_context,
    layer_inputs,
    layer_params,
    layer_step,
    run_layers_from,
    unembed,
)
from jaxdepth.core.sites import Intervention, check_layer_indices
from jaxdepth.core.sweep import auto_chunk_size, sweep, sweep_sum


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerPath:
    """The straight path of one layer's value at a site, from the baseline `b` to `x` (`[B, T,
    ...]`, b broadcastable to x), and the layer's input `h_in [B, T, D]`, from which a site
    inside the layer recomputes it (None for `resid_post`). A pytree."""

    x: jax.Array
    b: jax.Array
    h_in: Optional[jax.Array] = None

    def at(self, alpha):
        """b + α(x - b)."""
        return self.b + alpha * (self.x - self.b)


# jitted: called once per attributed layer outside the gradient's program, it would otherwise
# compile one program per eager operation
@partial(jax.jit, static_argnames="per_channel")
def attribution_of(path: LayerPath, g, valid, *, per_channel: bool = False):
    """`(x - b) * g` over the valid positions (`valid [B, T]`), g the path-averaged gradient:
    per channel `[B, T, ...]`, or summed over the site's axes after the position, `[B, T]`."""
    a = (path.x - path.b) * g
    if per_channel:
        return a * valid.reshape(valid.shape + (1,) * (a.ndim - 2))
    return jnp.sum(a, axis=tuple(range(2, a.ndim))) * valid


def per_prompt(value, batch: int):
    """A metric's value as one number per prompt `[B]`: a scalar (one prompt) or `[B]`. Anything
    else is refused at trace time: F, its path and its completeness gap are per prompt."""
    value = jnp.asarray(value)
    if value.shape == () and batch == 1:
        return value[None].astype(jnp.float32)
    if value.shape == (batch,):
        return value.astype(jnp.float32)
    raise ValueError(
        f"the metric must return a scalar (for one prompt) or one value per prompt, shape "
        f"({batch},); it returned shape {value.shape} for a batch of {batch} prompts"
    )


def metric_head(params, config: ModelConfig, metric, aux, positions):
    """h_L `[B, T, D]` -> the metric per prompt `[B]`, from the logits at `positions` `[A]` only
    (all positions if None: the LM head is the largest matmul of a small model). A metric that is
    not floating point is refused at trace time (`jaxdepth.analyses.stats.floating_metric`)."""

    def head(h_last):
        logits = unembed(params, h_last if positions is None else h_last[:, positions], config)
        return per_prompt(floating_metric(metric(logits, aux), metric), h_last.shape[0])

    return head


def clean_values(
    params, tokens, valid, config: ModelConfig, *, site: str, metric, aux=None, positions=None, interventions=None
):
    """The clean run under `interventions`: every layer's value at `site` `[L, B, T, ...]`
    (float32, after the site's interventions), every layer's input before its interventions
    `[L, B, T, D]` (what a path at a site inside a layer recomputes the layer from) and F(x) `[B]`."""
    inputs, h_last, x = layer_inputs(
        params, tokens, config, valid=valid, interventions=interventions, tap=lambda r, _: getattr(r, site)
    )
    return x.astype(jnp.float32), inputs[:-1], metric_head(params, config, metric, aux, positions)(h_last)


clean_run = jit(clean_values, static_argnames=("config", "site", "metric"))
clean_run.__doc__ = "`clean_values`, jitted."


# How a gradient's backward gets the activations of the layers after the attributed one: the
# drivers' choices ('auto' picks one of the other two by memory, `choose_backward`).
BACKWARDS = ("auto", "recompute", "stored")
# 'auto' stores when a chunk of this many gradients (or all of them, if fewer) fits in memory:
# fewer at once and the smaller vmap costs more than the layer pass it saves.
STORED_MIN_CHUNK = 8


def choose_backward(
    backward: str, config: ModelConfig, seq_len: int, members: int, memory_budget: Optional[int] = None
) -> str:
    """'recompute' or 'stored' for a sweep of `members` gradients over `seq_len` tokens:
    `backward` itself unless it is 'auto', which stores when `STORED_MIN_CHUNK` gradients (or
    `members`, if fewer) fit in `memory_budget` (`jaxdepth.core.sweep.auto_chunk_size`)."""
    if backward not in BACKWARDS:
        raise ValueError(f"backward must be one of {BACKWARDS}, got {backward!r}")
    if backward != "auto":
        return backward
    fits = auto_chunk_size(config, seq_len, members, grad=True, stored=True, memory_budget=memory_budget)
    return "stored" if fits >= min(members, STORED_MIN_CHUNK) else "recompute"


def suffix_value_and_grad(
    params, z, start, config: ModelConfig, head, *, valid=None, interventions=None, backward: str = "recompute"
):
    """`head(h_L)` when h_start = z, and its gradient with respect to z, running only layers
    start..L-1 (`layer_step`, with `interventions` at their sites, as every driver).

    backward 'recompute' (default): the layers before `start` are neither run nor
    differentiated; the forward keeps each layer's input, and the backward walks the layers in
    reverse with one `jax.vjp` each, recomputing that layer (three layer passes per gradient:
    forward, forward again, backward). 'stored': the forward keeps each layer's matmul outputs
    as well (`_PullbackLayout`), and the backward runs from them (two layer passes, and about
    twice the activations of a forward per layer and sweep member,
    `jaxdepth.core.sweep.member_bytes(stored=True)`). Both skip the layers before `start`
    entirely. `start` may be traced but not batched.
    """
    if backward == "stored":
        return _stored_suffix_value_and_grad(params, z, start, config, head, valid=valid, interventions=interventions)
    if backward != "recompute":
        raise ValueError(
            f"backward must be 'recompute' or 'stored' here ('auto' is chosen by the drivers, "
            f"`choose_backward`), got {backward!r}"
        )
    L = config.num_layers
    ivs = check_layer_indices(interventions, L)
    context = layer_context(z, valid, config)
    apply = lambda i, h: layer_step(layer_params(params, i), h, i, context, config, ivs).out

    def forward_step(i, carry):
        h, inputs = carry
        return apply(i, h), inputs.at[i].set(h)

    h_last, inputs = jax.lax.fori_loop(start, L, forward_step, (z, jnp.zeros((L,) + z.shape, z.dtype)))
    # Interventions at boundary L sit between the last layer and the head.
    value, grad = jax.value_and_grad(lambda h: head(final_residual(h, config, ivs)))(h_last)

    def backward_step(k, g):
        i = L - 1 - k
        _, pullback = jax.vjp(lambda h: apply(i, h), inputs[i])
        return pullback(g)[0]

    return value, jax.lax.fori_loop(0, L - start, backward_step, grad)


def _stored_suffix_value_and_grad(params, z, start, config: ModelConfig, head, *, valid, interventions):
    L = config.num_layers
    ivs = check_layer_indices(interventions, L)
    context = layer_context(z, valid, config)
    layout = _PullbackLayout.of(params, z, context, config, ivs)

    def forward_step(i, carry):
        h, kept = carry
        out, saved = layout.linearize(params, i, h, context, config, ivs)
        return out, tuple(k if k is None else k.at[i].set(r) for k, r in zip(kept, saved))

    kept = tuple(
        None if j is not None else jnp.zeros((L,) + r.shape, r.dtype)
        for j, r in zip(layout.from_weights, layout.shapes)
    )
    h_last, kept = jax.lax.fori_loop(start, L, forward_step, (z, kept))
    value, grad = jax.value_and_grad(lambda h: head(final_residual(h, config, ivs)))(h_last)

    def backward_step(k, g):
        i = L - 1 - k
        return layout.pullback(params, i, kept)(g)[0]

    return value, jax.lax.fori_loop(0, L - start, backward_step, grad)


@dataclasses.dataclass(frozen=True)
class _PullbackLayout:
    """What `jax.vjp` of one layer keeps for its backward (its residuals): their tree, shapes, and
    which of them are the layer's own weights. The layer index is traced, so every layer keeps
    the same tree; the forward stores each layer's residuals in a buffer `[L, ...]` (skipped
    layers cost nothing), the backward rebuilds that layer's pullback from them. The weights are
    read again from `params` rather than stored: a buffer would copy the whole model."""

    treedef: jax.tree_util.PyTreeDef
    shapes: tuple
    from_weights: tuple  # per residual: the index of the layer weight it is, or None

    @staticmethod
    def _linearize(params, i, h, context, config, ivs):
        p = layer_params(params, i)
        # Keep the matmuls' outputs only; the elementwise work between them (norms, softmax, the
        # gate) is recomputed in the backward. Half the bytes of keeping everything, and faster
        # on CPU, where writing fresh memory costs more than that arithmetic (SmolLM2-135M's
        # shape, 100 tokens, 8 steps, AMD EPYC: layer 0 4.87 s against 5.19 s keeping all).
        step = jax.checkpoint(
            lambda h: layer_step(p, h, i, context, config, ivs).out, policy=jax.checkpoint_policies.dots_saveable
        )
        out, pullback = jax.vjp(step, h)
        saved, treedef = jax.tree_util.tree_flatten(pullback)
        weights = jax.tree_util.tree_leaves(p)
        from_weights = tuple(next((j for j, w in enumerate(weights) if r is w), None) for r in saved)
        return out, saved, treedef, from_weights

    @classmethod
    def of(cls, params, z, context, config, ivs):
        found = {}

        def trace(i, h):
            _, saved, found["treedef"], found["from_weights"] = cls._linearize(params, i, h, context, config, ivs)
            return saved

        shapes = jax.eval_shape(trace, jnp.int32(0), z)
        return cls(found["treedef"], tuple(shapes), found["from_weights"])

    def linearize(self, params, i, h, context, config, ivs):
        """Layer i at h: its output and the residuals to store (None where a weight is kept)."""
        out, saved, treedef, from_weights = self._linearize(params, i, h, context, config, ivs)
        # shapes and dtypes only: eval_shape keeps weak types (a Python float in an intervention)
        signature = lambda arrays: tuple((a.shape, a.dtype) for a in arrays)  # noqa: E731
        if (treedef.num_leaves, signature(saved), from_weights) != (
            self.treedef.num_leaves,
            signature(self.shapes),
            self.from_weights,
        ):
            raise AssertionError("a layer's pullback kept different residuals in two traces of it")
        return out, tuple(None if j is not None else r for j, r in zip(from_weights, saved))

    def pullback(self, params, i, kept):
        """Layer i's pullback, from its stored residuals and its weights."""
        weights = jax.tree_util.tree_leaves(layer_params(params, i))
        saved = [weights[j] if j is not None else k[i] for j, k in zip(self.from_weights, kept)]
        return jax.tree_util.tree_unflatten(self.treedef, saved)


def _set_value(value, layer, data):
    at, z = data
    return jnp.where(layer == at, z.astype(value.dtype), value)


def site_entry(params, layer, h_in, valid, config: ModelConfig, site: str, interventions):
    """z -> h_{layer+1}: the layer's output as a function of its value z at `site` (the
    identity for `resid_post`); otherwise layer `layer` runs from its input `h_in` `[B, T, D]`
    with the site's value set to z after the site's own interventions."""
    if site == "resid_post":
        return lambda z: z
    ivs = check_layer_indices(interventions, config.num_layers)
    context = layer_context(h_in, valid, config)

    def entry(z):
        set_site = Intervention(site, _set_value, (layer, z))
        return layer_step(layer_params(params, layer), h_in, layer, context, config, ivs + (set_site,)).out

    return entry


def _entry(params, layer, path: LayerPath, valid, config, site, interventions):
    dtype = params["embed"].dtype
    return site_entry(
        params, layer, None if path.h_in is None else path.h_in.astype(dtype), valid, config, site, interventions
    )


@partial(jit, static_argnames=("config", "site", "metric", "chunk_size", "backward"))
def weighted_gradient(
    params,
    valid,
    layer,
    path: LayerPath,
    alphas,
    weights,
    config: ModelConfig,
    *,
    site: str,
    metric,
    aux=None,
    positions=None,
    chunk_size: Optional[int] = None,
    interventions=None,
    backward: str = "recompute",
):
    """`(sum_k w_k dF/dz(path.at(α_k)) [B, T, ...], F(b) [B])` for the value z at `site` of
    layer `layer` along `path`; F the metric per prompt (`metric(logits, aux)` at `positions`,
    `metric_head`) under `interventions`: a fixed quadrature rule's gradient sum.

    The steps are one chunked sweep of gradients that start at boundary layer+1 (and, for a site
    inside the layer, back through layer `layer` recomputed from `path.h_in` with the site set),
    the chunks summed as they run (`sweep_sum`).
    """
    dtype = params["embed"].dtype
    head = metric_head(params, config, metric, aux, positions)
    entry = _entry(params, layer, path, valid, config, site, interventions)
    total = lambda h: jnp.sum(head(h))  # prompts do not interact: each one's gradient is its own F's

    def member(m):
        alpha, weight = m
        h_next, pullback = jax.vjp(entry, path.at(alpha).astype(dtype))
        _, g = suffix_value_and_grad(
            params, h_next, layer + 1, config, total, valid=valid, interventions=interventions, backward=backward
        )
        return weight * pullback(g)[0].astype(jnp.float32)

    h_base, _ = run_layers_from(
        params, entry(path.b.astype(dtype)), layer + 1, config, valid=valid, interventions=interventions
    )
    return sweep_sum(member, (alphas, weights), chunk_size), head(h_base)


@partial(jit, static_argnames=("config", "site", "metric", "grad", "chunk_size", "backward"))
def path_points(
    params,
    valid,
    layer,
    path: LayerPath,
    alphas,
    config: ModelConfig,
    *,
    site: str,
    metric,
    aux=None,
    positions=None,
    interventions=None,
    grad: bool = True,
    chunk_size: Optional[int] = None,
    backward: str = "recompute",
):
    """φ and the per-token integrand at path points `alphas [n]` of layer `layer` of one prompt
    (`path` of batch 1): what the adaptive rule evaluates.

    Returns `(phi [n], integrand [n, T])` where phi = F(b + α(x - b)) and integrand[t] = sum over
    the site's channels of (x - b) dF/dx at t (zero at invalid positions; all zeros with
    `grad=False`, forward only).
    """
    dtype = params["embed"].dtype
    T = valid.shape[1]
    head = metric_head(params, config, metric, aux, positions)
    objective = lambda h: head(h)[0]
    channels = tuple(range(2, path.x.ndim))  # the site's axes after the position
    entry = _entry(params, layer, path, valid, config, site, interventions)

    def member(alpha):
        z = path.at(alpha).astype(dtype)
        if not grad:
            h_last, _ = run_layers_from(params, entry(z), layer + 1, config, valid=valid, interventions=interventions)
            return objective(h_last), jnp.zeros(T, jnp.float32)
        h_next, pullback = jax.vjp(entry, z)
        value, g = suffix_value_and_grad(
            params, h_next, layer + 1, config, objective, valid=valid, interventions=interventions, backward=backward
        )
        g = pullback(g)[0]
        return value, jnp.sum((path.x - path.b) * g.astype(jnp.float32), axis=channels)[0] * valid[0]

    return sweep(member, alphas, chunk_size)
