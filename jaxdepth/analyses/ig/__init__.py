"""Integrated gradients: one engine for every use.

- `path`: the device side, a layer's straight path at a site and gradients along it that run
  only the layers after the site;
- `rules`: the quadrature rules, fixed (left, midpoint, Gauss-Legendre) and adaptive (certified);
- `checks`: argument checks, baselines, and the refusal of non-finite values;
- `engine`: `attribute`, the one driver, returning a `SiteIG`;
- here: `integrated_gradients`, the public form (`jaxdepth.integrated_gradients`).

The studies' integrated gradients (`jaxdepth.analyses.integrated_gradients`) are `attribute`
with the answer probability as the metric.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp

from jaxdepth.analyses.ig import rules
from jaxdepth.analyses.ig.checks import (
    NonFiniteAttributionError,
    check_backward,
    check_layers,
    check_nonfinite_option,
    check_rule,
    check_site,
    check_tokens_array,
    warn_if_zero_baseline_diverges,
)
from jaxdepth.analyses.ig.engine import SiteIG, attribute
from jaxdepth.core.progress import ProgressLike
from jaxdepth.core.config import ModelConfig

__all__ = ["integrated_gradients", "SiteIG", "NonFiniteAttributionError", "LogitsMetric"]


@dataclasses.dataclass(frozen=True)
class LogitsMetric:
    """A user's `metric(logits)` in the form the path code takes, `metric(logits, aux)`. Frozen:
    it hashes as the user's function does, so the same function reuses its compilations."""

    fn: Callable

    def __call__(self, logits, aux):
        return self.fn(logits)


def integrated_gradients(
    params,
    tokens,
    config: ModelConfig,
    metric: Callable,
    *,
    site: str = "resid_post",
    layers: Optional[Sequence[int]] = None,
    baseline: Union[str, jax.Array] = "channel_mean",
    rule: str = "left",
    steps: int = rules.DEFAULT_STEPS,
    tolerance: Optional[float] = None,
    interventions=None,
    valid=None,
    positions=None,
    per_channel: bool = True,
    max_evaluations: Optional[int] = None,
    chunk_size: Optional[int] = None,
    memory_budget: Optional[int] = None,
    progress: ProgressLike = False,
    nonfinite: str = "raise",
    backward: str = "auto",
) -> SiteIG:
    """Integrated gradients of `metric` with respect to the value at `site` of each of `layers`.

    tokens: int `[B, T]` (right-padded where `valid [B, T]` says so; default all valid).
    metric: `metric(logits [B, T, V]) -> scalar` (one prompt) or `[B]` (one value per prompt:
        prompts are attributed independently); jit-traceable, float32 logits. Static: define it
        once (module level) to reuse compilations; anything else is refused at trace time.
        With `positions` (`[A]`), the logits passed are `[B, A, V]`, those positions only.
    site: any of `jaxdepth.core.sites.SITES`; layers: indices in 0..L-1 (default all).
    baseline: 'channel_mean' (per channel, the mean of x over each prompt's valid positions),
        'token_mean' (per position, the mean over the site's channels), 'zero', or an array
        broadcastable to `[layers, B, T, *trailing]`. 'zero' at a residual site ('resid_pre',
        'resid_post') diverges (RMSNorm's gradient at 0 is 1/sqrt(eps)) and is warned about.
    rule: 'left' (α_k = k/steps, the published rule), 'midpoint', 'gauss' (Gauss-Legendre), 'right'
        with `steps`; or 'adaptive' with `tolerance` (default 0.01): per layer, composite
        Simpson refined where the exact per-interval error is largest until a certified bound
        on the completeness gap is at most tolerance * max(|F(x) - F(b)|, 0.1 |F(x)|) (the
        floor: `floored` says which layers met it), or `max_evaluations` gradient evaluations
        (default `steps`: never more than the fixed rule) are spent
        (`jaxdepth.analyses.ig.rules`). The adaptive rule takes one prompt; its per-channel
        attributions cost one more gradient per node (a second pass with the final rule).
    interventions: act on the clean run and on every path run (the path's own setting of the
        site comes after the site's interventions).
    per_channel: False keeps only `per_position` (no `[n, B, T, *trailing]` array).
    nonfinite: 'raise' (default): a `NonFiniteAttributionError` naming the layers and positions
        where F(x), F(b) or the attributions are NaN or infinite, at the first layer that has one
        (the adaptive rule stops refining a layer at its first non-finite evaluation); 'warn':
        a warning naming them all, and the values returned.
    backward: 'stored': each gradient's backward runs from the later layers' kept matmul
        outputs (two layer passes); 'recompute': it runs each later layer again (three passes,
        a sixth of the memory); 'auto' (default): stored when 8 gradients (or all, if fewer) fit
        in the memory budget (`jaxdepth.analyses.ig.path.choose_backward`). The numbers agree
        to float rounding.

    Returns a `SiteIG`. Example::

        result = jaxdepth.integrated_gradients(params, tokens, config, logit_difference,
                                               site="head_out", steps=64)
        result.per_position  # [L, B, T]; result.gap says whether 64 steps were enough
    """
    tokens = check_tokens_array(tokens, config)
    check_site(site)
    layers = check_layers(layers, config.num_layers)
    tolerance, max_evaluations = check_rule(rule, steps, tolerance, max_evaluations, tokens.shape[0])
    check_nonfinite_option(nonfinite)
    check_backward(backward)
    warn_if_zero_baseline_diverges(baseline, site)
    B, T = tokens.shape
    valid = jnp.ones((B, T), bool) if valid is None else jnp.asarray(valid, bool)
    return attribute(
        params,
        jnp.asarray(tokens, jnp.int32),
        valid,
        config,
        site=site,
        metric=LogitsMetric(metric),
        positions=None if positions is None else jnp.asarray(positions, jnp.int32),
        layers=layers,
        baseline=baseline,
        rule=rule,
        steps=steps,
        tolerance=tolerance,
        max_evaluations=max_evaluations,
        interventions=interventions,
        per_channel=per_channel,
        chunk_size=chunk_size,
        memory_budget=memory_budget,
        nonfinite=nonfinite,
        progress=progress,
        backward=backward,
    )
