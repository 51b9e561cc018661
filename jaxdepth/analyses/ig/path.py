"""The device side of integrated gradients: a layer's straight path at a site, the metric at the
end of the model, and gradients along the path that run only the layers after the site.

For layer l and a site, x is the site's value in the clean run and b a baseline; the path sets
the value to b + α (x - b) at every position and F is a metric of the logits. A gradient
evaluation enters at layer l (recomputing layer l from its clean input when the site is inside
it, `site_entry`), runs the later layers forward and back (`suffix_value_and_grad`), and never
touches the layers before l. `layer` is traced everywhere: every layer of a prompt reuses one
compiled computation.

F is a `jaxdepth.analyses.metrics.Metric` of the logits at the positions it reads (`Objective`):
the metric is static (define it once, at module level, or every call compiles anew), its
positions, answer tokens and labels traced, so a new prompt's reuse the compiled computation.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxdepth.analyses.metrics import Metric, Reads, measure, readout
from jaxdepth.core.compilation import jit
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.execution import BACKWARDS, Execution
from jaxdepth.core.flops import layer_flops
from jaxdepth.core.layer import shared_kv_at
from jaxdepth.core.loops import Backward, LayerRun, run_layer, run_layers, stored_layers, suffix_value_and_grad
from jaxdepth.core.model import layer_inputs, token_per_layer_inputs
from jaxdepth.core.padding import DeviceSpeed
from jaxdepth.core.sites import SPLIT_SITES, Intervention, unchanged
from jaxdepth.core.sweep import available_memory_budget, member_bytes, sweep, weighted_sum

__all__ = [
    "LayerPath",
    "Objective",
    "clean_values",
    "clean_run",
    "layer_run_inputs",
    "weighted_gradient",
    "path_points",
    "attribution_of",
    "site_entry",
    "choose_backward",
    "ig_memory_budget",
    "prompt_seconds",
    "BACKWARDS",
    "IG_MEMORY_FRACTION",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerPath:
    """The straight path of one layer's value at a site, from the baseline `b` to `x` (`[B, T,
    ...]`, b broadcastable to x), for prompts whose real tokens are `valid [B, T]`: `layer`
    (an int32 scalar, traced: every layer reuses one compilation) and the layer's input
    `h_in [B, T, D]`, from which a site inside the layer recomputes it (None for
    `resid_post`). A pytree.

    Gemma 4: `per_layer_inputs` `[B, T, L, P]`, the tokens' own (of their clean embeddings,
    `jaxdepth.core.model.token_per_layer_inputs`), which every run along the path gives its
    layers: the path moves a residual (or a site's value), not the layers' inputs; and
    `key_values`, the clean run's keys and values `[L, B, T, K, Dh]` (as its records hold
    them, `clean_key_values`), from which the runs along the path take the keys shared
    among layers at their boundary (`jaxdepth.core.layer.shared_kv_at`): the layers before
    the path's site ran on clean inputs. None in a model without them."""

    x: jax.Array
    b: jax.Array
    layer: jax.Array
    valid: jax.Array
    h_in: Optional[jax.Array] = None
    per_layer_inputs: Optional[jax.Array] = None
    key_values: Optional[tuple] = None

    def shared_kv(self, boundary, config: ModelConfig):
        """The keys and values shared among layers at `boundary` in the clean run (None in a
        model that shares none)."""
        return None if self.key_values is None else shared_kv_at(self.key_values, boundary, config)

    def at(self, alpha):
        """b + α(x - b)."""
        return self.b + alpha * (self.x - self.b)


@dataclasses.dataclass(frozen=True)
class Objective:
    """What a path is of and what it measures: the value at `site` and F, the `metric`
    (`jaxdepth.analyses.metrics.Metric`) of the logits at the positions it reads (`reads`, a
    `Reads`: the LM head runs there alone), given the clean run's logits there (`clean`
    `[B, P, V]`, for a metric with `clean=True`: the input x's run, F(x)'s) and the task's
    `labels`. A pytree: `site` and `metric` are static (part of a compilation's key: define
    the metric once, at module level), `reads`, `clean` and `labels` traced, so a new
    prompt's reuse the compiled computation."""

    site: str
    metric: Metric
    reads: Reads
    clean: Any = None
    labels: Any = None

    def head(self, params, config: ModelConfig):
        """h_L `[B, T, D]` -> F per prompt `[B]`: the metric of the `Readout` at its positions
        (`jaxdepth.analyses.metrics.measure`)."""
        return lambda h_last: measure(
            self.metric, params, h_last, config, self.reads, clean=self.clean, labels=self.labels
        )


jax.tree_util.register_dataclass(Objective, data_fields=["reads", "clean", "labels"], meta_fields=["site", "metric"])


# jitted: called once per attributed layer outside the gradient's program, it would otherwise
# compile one program per eager operation
@partial(jax.jit, static_argnames="per_channel")
def attribution_of(path: LayerPath, g, *, per_channel: bool = False):
    """`(x - b) * g` over the path's valid positions (`path.valid [B, T]`), g the
    path-averaged gradient: per channel `[B, T, ...]`, or summed over the site's axes after
    the position, `[B, T]`."""
    a = (path.x - path.b) * g
    valid = path.valid
    if per_channel:
        return a * valid.reshape(valid.shape + (1,) * (a.ndim - 2))
    return jnp.sum(a, axis=tuple(range(2, a.ndim))) * valid


def clean_values(params, tokens, valid, config: ModelConfig, objective: Objective, *, interventions=None):
    """The clean run under `interventions`: every layer's value at the objective's site `[L, B, T, ...]`
    (float32, after the site's interventions), every layer's input before its interventions
    `[L, B, T, D]` (what a path at a site inside a layer recomputes the layer from), F(x) `[B]`
    and the objective with the clean run's logits at the metric's positions (`clean`), where
    its metric reads them: the input's run is integrated gradients' clean run. At a site of a
    split layer (`jaxdepth.core.sites.SPLIT_SITES`) every layer runs split, as the path's runs,
    which set the site, do."""
    site = objective.site
    if site in SPLIT_SITES:
        interventions = (interventions, unchanged(site))
    inputs, h_last, x = layer_inputs(
        params, tokens, config, valid=valid, interventions=interventions, tap=lambda r, _: getattr(r, site)
    )
    if objective.metric.clean:
        objective = dataclasses.replace(objective, clean=readout(params, h_last, config, objective.reads).logits)
    return x.astype(jnp.float32), inputs[:-1], objective.head(params, config)(h_last), objective


clean_run = jit(clean_values, static_argnames="config")
clean_run.__doc__ = "`clean_values`, jitted."


@partial(jit, static_argnames="config")
def layer_run_inputs(params, tokens, valid, config: ModelConfig, *, interventions=None):
    """What a path's runs give their layers besides the residual (`LayerPath`): `(per_layer_inputs
    [B, T, L, P], key_values)`, the tokens' per-layer inputs and the keys and values of every
    layer of the clean run under `interventions` (as its records hold them), each None in a
    model without per-layer inputs or without layers that share keys and values."""
    per_layer = token_per_layer_inputs(params, tokens, config)
    if not config.shared_kv_layers:
        return per_layer, None
    _, _, kv = layer_inputs(
        params, tokens, config, valid=valid, interventions=interventions, tap=lambda r, _: (r.k, r.v)
    )
    return per_layer, kv


# Integrated gradients' share of the free memory when no budget is given (the other sweeps take
# `jaxdepth.core.sweep.MEMORY_FRACTION`, a quarter). The published code holds a block of 16
# steps at once, each with what torch's autograd keeps of the later layers for the backward: at
# the study's longest prompts (Qwen2.5-1.5B, 384 tokens) about 16 x 0.85 GiB, 57% of a 24 GiB
# machine. IG may take as much, so that it stores where the reference does; the weights are
# resident already (free memory does not count them) and XLA's temporaries fit in the rest.
IG_MEMORY_FRACTION = 0.6


def ig_memory_budget(memory_budget: Optional[int] = None) -> int:
    """`memory_budget`, or `IG_MEMORY_FRACTION` of the free memory (read now): integrated
    gradients' `Execution.budget`."""
    if memory_budget is not None:
        return Execution(memory_budget=memory_budget).budget()
    return available_memory_budget(IG_MEMORY_FRACTION)


def choose_backward(backward, config: ModelConfig, seq_len: int, memory_budget: Optional[int] = None):
    """What a sweep of gradients over `seq_len` tokens keeps for its backward
    (`jaxdepth.core.loops.suffix_value_and_grad`): `backward` itself unless it is 'auto', which
    picks the cheapest that fits one gradient in `memory_budget` (default `ig_memory_budget()`;
    the sweep's chunk shrinks, down to one gradient, before the backward recomputes): 'stored'
    (every later layer's matmul outputs: two layer passes per gradient), else the number of
    layers whose outputs fit (the others recomputed: three passes each), else 'recompute'."""
    if backward != "auto":
        stored_layers(backward, config.num_layers)  # refused here, not inside a compiled sweep
        return backward
    budget = ig_memory_budget(memory_budget)
    fits = lambda k: member_bytes(config, seq_len, grad=True, stored=k) <= budget  # noqa: E731
    if fits(True):
        return "stored"
    # (layers that share keys and values run their suffix as one scan: all stored or none)
    k = 0 if config.shared_kv_layers else max((k for k in range(config.num_layers) if fits(k)), default=0)
    return k if k > 0 else "recompute"


def prompt_seconds(
    config: ModelConfig, seq_len: int, evaluations: int, speed: DeviceSpeed, memory_budget: Optional[int] = None
) -> float:
    """Estimated seconds of integrated gradients over every layer of one prompt padded to
    `seq_len`: `evaluations` gradients per layer, each crossing the later layers forward and
    back (two layer passes where the backward stores, three where it recomputes,
    `choose_backward`), at `speed` (`jaxdepth.core.padding`); what padding by cost weighs."""
    L = config.num_layers
    kept = stored_layers(choose_backward("auto", config, seq_len, memory_budget), L)
    one = layer_flops(config, seq_len, seq_len)
    crossed = [(min(kept, L - l - 1), L - l - 1) for l in range(L)]  # (stored, all) later layers
    flops = evaluations * sum(2 * s * one + 3 * (n - s) * one for s, n in crossed)
    return flops / speed.flops_per_second


def _set_value(value, layer, data):
    at, z = data
    return jnp.where(layer == at, z.astype(value.dtype), value)


def site_entry(
    params, layer, h_in, valid, config: ModelConfig, site: str, interventions, *, per_layer_inputs=None, shared_kv=None
):
    """z -> h_{layer+1}: the layer's output as a function of its value z at `site` (the
    identity for `resid_post`); otherwise layer `layer` runs from its input `h_in` `[B, T, D]`
    with the site's value set to z after the site's own interventions (with `per_layer_inputs`
    and the keys and values shared at its boundary, `shared_kv`, as `run_layer` takes them).

    Where layers share keys and values, the later layers read the keys of a layer that computes
    its own as its clean run computed them: a site the layer's keys are computed from
    (`resid_pre`) is refused there (its keys would move along the path)."""
    if site == "resid_post":
        return lambda z: z
    if site == "resid_pre" and config.shared_kv_layers:
        raise ValueError(
            "integrated gradients at resid_pre of a model whose layers share keys and values is not implemented: the "
            "layer's keys, which later layers reuse, move with it; attribute at resid_post of the layer before"
        )

    def entry(z):
        set_site = Intervention(site, _set_value, (layer, z))
        ivs = (interventions, set_site)
        r = run_layer(
            params,
            layer,
            h_in,
            config,
            valid=valid,
            interventions=ivs,
            per_layer_inputs=per_layer_inputs,
            shared_kv=shared_kv,
        )
        return r.out

    return entry


def _entry(params, path: LayerPath, config, site, interventions):
    dtype = params["embed"].dtype
    h_in = None if path.h_in is None else path.h_in.astype(dtype)
    options = dict(per_layer_inputs=path.per_layer_inputs, shared_kv=path.shared_kv(path.layer, config))
    return site_entry(params, path.layer, h_in, path.valid, config, site, interventions, **options)


def _suffix(path: LayerPath, config: ModelConfig) -> dict:
    """What the runs from boundary layer+1 of `path` take besides the residual: the tokens'
    per-layer inputs and the keys and values shared at that boundary (`LayerPath`)."""
    return dict(per_layer_inputs=path.per_layer_inputs, shared_kv=path.shared_kv(path.layer + 1, config))


@partial(jit, static_argnames=("config", "chunk_size", "backward"))
def weighted_gradient(
    params,
    path: LayerPath,
    nodes,
    config: ModelConfig,
    objective: Objective,
    *,
    chunk_size: Optional[int] = None,
    interventions=None,
    backward: Backward = "recompute",
):
    """`(sum_k w_k dF/dz(path.at(α_k)) [B, T, ...], F(b) [B])` for the value z at the
    objective's site of layer `path.layer` along `path`, `nodes = (alphas [n], weights [n])`;
    F the objective's metric per prompt under `interventions`: a fixed quadrature rule's
    gradient sum.

    The steps are one chunked sweep of gradients that start at boundary layer+1 (and, for a site
    inside the layer, back through the layer recomputed from `path.h_in` with the site set),
    the chunks summed as they run (`jaxdepth.core.sweep.weighted_sum`).
    """
    dtype = params["embed"].dtype
    head = objective.head(params, config)
    layer, valid = path.layer, path.valid
    entry = _entry(params, path, config, objective.site, interventions)
    total = lambda h: jnp.sum(head(h))  # prompts do not interact: each one's gradient is its own F's

    def gradient(alpha):
        h_next, pullback = jax.vjp(entry, path.at(alpha).astype(dtype))
        _, g = suffix_value_and_grad(
            params,
            h_next,
            layer + 1,
            config,
            total,
            valid=valid,
            interventions=interventions,
            backward=backward,
            **_suffix(path, config),
        )
        return pullback(g)[0].astype(jnp.float32)

    suffix = _suffix(path, config)
    h_base, _ = run_layers(
        params,
        entry(path.b.astype(dtype)),
        config,
        valid=valid,
        interventions=interventions,
        run=LayerRun(start=layer + 1, shared_kv=suffix["shared_kv"]),
        per_layer_inputs=suffix["per_layer_inputs"],
    )
    alphas, weights = nodes
    return weighted_sum(gradient, alphas, weights, chunk_size), head(h_base)


@partial(jit, static_argnames=("config", "chunk_size", "backward"))
def path_points(
    params,
    path: LayerPath,
    alphas,
    config: ModelConfig,
    objective: Objective,
    *,
    interventions=None,
    chunk_size: Optional[int] = None,
    backward: Optional[Backward] = "recompute",
):
    """φ and the per-token integrand at path points `alphas [n]` of layer `path.layer` of one
    prompt (`path` of batch 1): what the adaptive rule evaluates.

    Returns `(phi [n], integrand [n, T])` where phi = F(b + α(x - b)) and integrand[t] = sum over
    the site's channels of (x - b) dF/dx at t (zero at invalid positions). `backward` as
    `weighted_gradient`'s, or None: forward passes only, φ alone (the integrand all zeros).
    """
    dtype = params["embed"].dtype
    layer, valid = path.layer, path.valid
    T = valid.shape[1]
    head = objective.head(params, config)
    value_of = lambda h: head(h)[0]  # noqa: E731
    channels = tuple(range(2, path.x.ndim))  # the site's axes after the position
    entry = _entry(params, path, config, objective.site, interventions)

    def member(alpha):
        z = path.at(alpha).astype(dtype)
        suffix = _suffix(path, config)
        if backward is None:
            run = LayerRun(start=layer + 1, shared_kv=suffix["shared_kv"])
            h_last, _ = run_layers(
                params,
                entry(z),
                config,
                valid=valid,
                interventions=interventions,
                run=run,
                per_layer_inputs=suffix["per_layer_inputs"],
            )
            return value_of(h_last), jnp.zeros(T, jnp.float32)
        h_next, pullback = jax.vjp(entry, z)
        value, g = suffix_value_and_grad(
            params,
            h_next,
            layer + 1,
            config,
            value_of,
            valid=valid,
            interventions=interventions,
            backward=backward,
            **suffix,
        )
        g = pullback(g)[0]
        return value, jnp.sum((path.x - path.b) * g.astype(jnp.float32), axis=channels)[0] * valid[0]

    return sweep(member, alphas, chunk_size)
