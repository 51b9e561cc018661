"""Integrated gradients of any metric, with respect to any named site of any layers, under any
interventions: `jaxdepth.integrated_gradients`.

For layer l, x is the value at `site` of layer l in the clean run (after the interventions at
that site) and b a baseline; the path sets the site's value of layer l, at every position, to
b + α (x - b), and F is the metric of the logits:

    IG_l[b, t, c] = (x - b)[b, t, c] * sum_k w_k dF/dx(b + α_k (x - b))[b, t, c]

summed over the site's channels c in `per_position`. The layers before l are not rerun: the path
starts at layer l (recomputed from its clean input when the site is inside it) and the gradient
runs back through the later layers only. All steps of a layer are one vmapped, chunked gradient
sweep; every layer of a call reuses one compiled computation (`weighted_gradient`). The
studies' integrated gradients (`jaxdepth.analyses.integrated_gradients`) are this computation
with the answer probability as the metric.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxdepth.analyses import adaptive_ig
from jaxdepth.analyses.integrated_gradients import (BASELINES, LayerPath, check_nonfinite_option, ig_baseline,
                                                    metric_head, nonfinite_report, quadrature, raise_or_warn,
                                                    site_inputs, warn_if_zero_baseline_diverges, weighted_gradient)
from jaxdepth.core.compilation import jit
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.model import check_tokens
from jaxdepth.core.sharding import to_host
from jaxdepth.core.sites import SITES
from jaxdepth.core.sweep import auto_chunk_size

RULES = ("left", "midpoint", "gauss", "adaptive")
DEFAULT_TOLERANCE = 0.01  # the adaptive rule's, relative to |F(x) - F(b)|
# The adaptive rule's nodes of a layer, for its per-channel pass, are padded to a multiple of this
# (zero weights): one compiled computation for layers with similar node counts.
_NODE_MULTIPLE = 8


@dataclasses.dataclass(frozen=True)
class LogitsMetric:
    """A user's `metric(logits)` in the form the path code takes, `metric(logits, aux)`. Frozen:
    it hashes as the user's function does, so the same function reuses its compilations."""

    fn: Callable

    def __call__(self, logits, aux):
        return self.fn(logits)


@dataclasses.dataclass(frozen=True)
class SiteIG:
    """What `integrated_gradients` returns, as numpy arrays (`n` = the attributed layers, in
    the order of `layers`):

    attributions  `[n, B, T, *trailing]` per channel of the site (None with `per_channel=False`):
                  (x - b) times the path-averaged gradient of F
    per_position  `[n, B, T]`, summed over the site's channels (0 at invalid positions)
    gap           `[n, B]`, the completeness gap sum_t per_position - (F(x) - F(b)): positive
                  when the attributions add up to more than F's change along the path, zero
                  for exact integration; compare it with F(x) - F(b) to judge the rule
    f_input       `[B]` F(x): the metric of the run itself (under the interventions), the path's
                  end, the same for every layer
    f_baseline    `[n, B]` F(b): the metric with layer l's value at the site set to the
                  baseline b, the path's start (one per attributed layer)
    evaluations   `[n, B]` gradient evaluations spent per layer
    layers        `[n]` the attributed layers; site, rule: as called
    converged, bound  `[n, B]`, adaptive rule only: whether the certified bound
                  sum_i |e_i| + |φ(1) - F(x)| (>= |gap|) met the tolerance; a layer stopped at a
                  non-finite value has converged False and bound NaN
    """

    attributions: Optional[np.ndarray]
    per_position: np.ndarray
    gap: np.ndarray
    f_input: np.ndarray
    f_baseline: np.ndarray
    evaluations: np.ndarray
    layers: np.ndarray
    site: str
    rule: str
    converged: Optional[np.ndarray] = None
    bound: Optional[np.ndarray] = None


@partial(jit, static_argnames=("config", "site", "metric"))
def _clean_run(params, tokens, valid, positions, config: ModelConfig, site: str, metric, interventions=None):
    """The site's values `[L, B, T, ...]`, the layers' inputs and F(x) `[B]` of the clean run."""
    x, inputs, h_last = site_inputs(params, tokens, valid, config, site, interventions)
    return x, inputs, metric_head(params, config, metric, None, positions)(h_last)


def _baselines(x, valid, baseline, layers):
    """The baseline of each attributed layer, broadcast to its x `[n, B, T, ...]`."""
    if isinstance(baseline, str):
        if baseline not in BASELINES:
            raise ValueError(f"baseline must be one of {BASELINES} or an array, got {baseline!r}")
        return jnp.stack([jnp.broadcast_to(ig_baseline(x[l], valid, baseline), x[l].shape) for l in layers])
    b = jnp.asarray(baseline, jnp.float32)
    target = (len(layers),) + x.shape[1:]
    try:
        return jnp.broadcast_to(b, target)
    except ValueError:
        raise ValueError(f"a baseline array must broadcast to the site's values of the attributed layers "
                         f"{target} ([layers, B, T, *trailing]); got shape {b.shape}") from None


def _check_arguments(tokens, config, site, layers, rule, steps, tolerance):
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"tokens must be an int array [batch, seq], got {tokens.dtype} {tokens.shape}")
    check_tokens(tokens, config)
    if site not in SITES:
        raise ValueError(f"unknown site {site!r}; sites: {', '.join(SITES)}")
    L = config.num_layers
    layers = list(range(L)) if layers is None else [int(l) for l in np.atleast_1d(layers)]
    if not layers or any(not 0 <= l < L for l in layers) or len(set(layers)) != len(layers):
        raise ValueError(f"layers must be distinct layer indices in 0..{L - 1}, got {layers}")
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    if rule == "adaptive":
        tolerance = DEFAULT_TOLERANCE if tolerance is None else float(tolerance)
        if not tolerance > 0:
            raise ValueError(f"tolerance must be > 0, got {tolerance}")
        if tokens.shape[0] != 1:
            raise ValueError(f"the adaptive rule refines each prompt's path on its own: give one prompt "
                             f"(tokens [1, T]), got {tokens.shape[0]}")
    elif tolerance is not None:
        raise ValueError(f"tolerance is the adaptive rule's; the {rule!r} rule takes steps")
    elif steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    return tokens, layers, tolerance


def integrated_gradients(params, tokens, config: ModelConfig, metric: Callable, *, site: str = "resid_post",
                         layers: Optional[Sequence[int]] = None, baseline: Union[str, jax.Array] = "channel_mean",
                         rule: str = "left", steps: int = 256, tolerance: Optional[float] = None,
                         interventions=None, valid=None, positions=None, per_channel: bool = True,
                         max_evaluations: int = adaptive_ig.MAX_EVALUATIONS, chunk_size: Optional[int] = None,
                         memory_budget: Optional[int] = None, progress: bool = False,
                         nonfinite: str = "raise") -> SiteIG:
    """Integrated gradients of `metric` with respect to the value at `site` of each of `layers`.

    tokens: int `[B, T]` (right-padded where `valid [B, T]` says so; default all valid).
    metric: `metric(logits [B, T, V]) -> scalar` (one prompt) or `[B]` (one value per prompt:
        prompts are attributed independently); jit-traceable, float32 logits. Static: define it
        once (module level) to reuse compilations; anything else is refused at trace time.
        With `positions` (`[A]`), the logits passed are `[B, A, V]`, those positions only.
    site: any of `jaxdepth.core.sites.SITES`; layers: indices in 0..L-1 (default all).
    baseline: 'channel_mean' (per channel, the mean of x over each prompt's valid positions),
        'token_mean' (per position, the mean over the site's channels), 'zero', or an array
        broadcastable to `[layers, B, T, *trailing]`.
    rule: 'left' (α_k = k/steps, the published rule), 'midpoint', 'gauss' (Gauss-Legendre)
        with `steps`; or 'adaptive' with `tolerance` (default 0.01): per layer, composite
        Simpson refined where the exact per-interval error is largest until a certified bound
        on the completeness gap is at most tolerance * |F(x) - F(b)|, or `max_evaluations`
        (`jaxdepth.analyses.adaptive_ig`). The adaptive rule takes one prompt; its per-channel
        attributions cost one more gradient per node (a second pass with the final rule).
    interventions: act on the clean run and on every path run (the path's own setting of the
        site comes after the site's interventions).
    per_channel: False keeps only `per_position` (no `[n, B, T, *trailing]` array).
    nonfinite: 'raise' (default): a `NonFiniteAttributionError` naming the layers and positions
        where F(x), F(b) or the attributions are NaN or infinite, at the first layer that has one
        (the adaptive rule stops refining a layer at its first non-finite evaluation); 'warn':
        a warning naming them all, and the values returned. A zero baseline at a residual site
        ('resid_pre', 'resid_post') diverges (RMSNorm's gradient at 0 is 1/sqrt(eps)): it is
        warned about up front; prefer 'channel_mean'.

    Returns a `SiteIG`. Example::

        result = jaxdepth.integrated_gradients(params, tokens, config, logit_difference,
                                               site="head_out", steps=64)
        result.per_position  # [L, B, T]; result.gap says whether 64 steps were enough
    """
    tokens, layers, tolerance = _check_arguments(tokens, config, site, layers, rule, steps, tolerance)
    check_nonfinite_option(nonfinite)
    warn_if_zero_baseline_diverges(baseline, site)
    B, T = tokens.shape
    tokens = jnp.asarray(tokens, jnp.int32)
    valid = jnp.ones((B, T), bool) if valid is None else jnp.asarray(valid, bool)
    positions = None if positions is None else jnp.asarray(positions, jnp.int32)
    metric = LogitsMetric(metric)
    x, inputs, f_input = _clean_run(params, tokens, valid, positions, config, site, metric, interventions)
    f_input = to_host(f_input)
    report = lambda layer_list, per_position, f_baseline: nonfinite_report(layer_list, per_position, f_input,
                                                                          f_baseline, baseline=baseline, site=site)
    if not np.all(np.isfinite(f_input)):
        raise_or_warn(report([], np.zeros((0, B, T)), np.zeros((0, B))), nonfinite)
    b = _baselines(x, valid, baseline, layers)
    index = {layer: i for i, layer in enumerate(layers)}

    def path(layer):
        return LayerPath(x[layer], b[index[layer]], inputs[layer] if site != "resid_post" else None)

    def weighted(i, alphas, weights, chunk):
        l = layers[i]
        g, f_base = weighted_gradient(params, valid, jnp.int32(l), path(l), jnp.asarray(alphas, jnp.float32),
                                      jnp.asarray(weights, jnp.float32), config, site=site, metric=metric,
                                      positions=positions, chunk_size=chunk, interventions=interventions)
        mask = valid.reshape(valid.shape + (1,) * (x.ndim - 3))
        return (x[l] - b[i]) * g * mask, f_base

    n = len(layers)
    common = dict(layers=np.asarray(layers), site=site, rule=rule)
    if rule == "adaptive":
        def path_points(layer, alphas, grad, chunk):
            return adaptive_ig.site_path_points(params, valid, jnp.int32(layer), path(layer),
                                                jnp.asarray(alphas, jnp.float32), config, site=site, metric=metric,
                                                positions=positions, interventions=interventions, grad=grad,
                                                chunk_size=chunk)

        return _adaptive(path_points, weighted, layers, float(f_input[0]), T, config, tolerance=tolerance,
                         max_evaluations=max_evaluations, chunk_size=chunk_size, memory_budget=memory_budget,
                         progress=progress, per_channel=per_channel, common=common,
                         check=lambda per_position, f_baseline: raise_or_warn(
                             report(layers, per_position, f_baseline), nonfinite))

    alphas, weights = quadrature(rule, steps)
    chunk = chunk_size or auto_chunk_size(config, B * T, steps, grad=True, memory_budget=memory_budget)
    attributions, f_baseline = [], []
    def summed(a):  # [..., B, T, *trailing] -> [..., B, T]; inf - inf is NaN, and reported as such
        with np.errstate(invalid="ignore", over="ignore"):
            return a.reshape(a.shape[:a.ndim - x.ndim + 3] + (-1,)).sum(-1)

    for i in tqdm(range(n), desc=f"integrated gradients at {site} ({rule}, {steps} steps)", disable=not progress):
        a, fb = weighted(i, alphas, weights, chunk)
        attributions.append(to_host(a))
        f_baseline.append(to_host(fb))
        if nonfinite == "raise":  # stop at the first such layer: the later ones would cost as much
            raise_or_warn(report(layers[i:i + 1], summed(attributions[-1])[None], f_baseline[-1][None]), nonfinite)
    attributions, f_baseline = np.stack(attributions), np.stack(f_baseline)
    per_position = summed(attributions)
    raise_or_warn(report(layers, per_position, f_baseline), nonfinite)
    return SiteIG(attributions=attributions if per_channel else None, per_position=per_position,
                  gap=per_position.sum(-1) - (f_input[None] - f_baseline), f_input=f_input, f_baseline=f_baseline,
                  evaluations=np.full((n, B), steps), **common)


def _adaptive(path_points, weighted, layers, f_input: float, seq_len: int, config: ModelConfig, *, tolerance: float,
              max_evaluations: int, chunk_size, memory_budget, progress: bool, per_channel: bool, common: dict,
              check):
    """The adaptive rule of `integrated_gradients` (one prompt): `path_points(layer, alphas, grad,
    chunk)` the rounds' evaluations (`site_path_points`), `weighted(i, alphas, weights, chunk)` the weighted
    per-channel pass of the i-th attributed layer, `check(per_position [n, 1, T], f_baseline [n, 1])`
    the non-finite check, before the per-channel pass."""
    site = common["site"]
    with tqdm(total=len(layers), desc=f"adaptive integrated gradients at {site}", disable=not progress) as bar:
        rules = adaptive_ig.run_rule(path_points, layers, f_input, seq_len, config,
                                     tolerance=np.full(len(layers), tolerance),
                                     max_evaluations=max_evaluations, chunk_size=chunk_size,
                                     memory_budget=memory_budget, on_layer=bar.update)
    summary = adaptive_ig.summarise(rules)
    check(summary["attributions"][:, None], summary["f_baseline"][:, None])
    attributions = None
    if per_channel:
        parts = []
        for i, rule in enumerate(rules):
            alphas, weights = rule.node_weights()
            pad = -len(alphas) % _NODE_MULTIPLE
            alphas, weights = np.pad(alphas, (0, pad), mode="edge"), np.pad(weights, (0, pad))
            parts.append(to_host(weighted(i, alphas, weights, chunk_size or _NODE_MULTIPLE)[0]))
        attributions = np.stack(parts)
    column = lambda a: np.asarray(a)[:, None]  # [n] -> [n, B=1]
    per_position = summary["attributions"][:, None].astype(np.float32)
    f_baseline = column(summary["f_baseline"]).astype(np.float32)
    return SiteIG(attributions=attributions, per_position=per_position,
                  gap=per_position.astype(np.float64).sum(-1) - (f_input - f_baseline),
                  f_input=np.array([f_input], np.float32), f_baseline=f_baseline,
                  evaluations=column(summary["evaluations"]), converged=column(summary["converged"]),
                  bound=column(summary["bound"]), **common)
