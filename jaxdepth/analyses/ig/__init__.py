"""Integrated gradients: one engine for every use.

- `path`: the device side, a layer's straight path at a site and gradients along it that run
  only the layers after the site;
- `rules`: the quadrature rules, fixed (left, midpoint, Gauss-Legendre) and adaptive (certified),
  each a value (`FixedRule`, `AdaptiveRule`);
- `checks`: argument checks, baselines, and the refusal of non-finite values;
- `engine`: `attribute`, the one driver, returning a `SiteIG`, and `Execution`, how it runs;
- here: `integrated_gradients`, the public form (`jaxdepth.integrated_gradients`).

The studies' integrated gradients (`jaxdepth.analyses.integrated_gradients`) are `attribute`
with the answer probability as the metric.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxdepth.analyses.ig import rules
from jaxdepth.analyses.ig.checks import (
    NonFiniteAttributionError,
    check_layers,
    check_prompts,
    check_site,
    check_tokens_array,
    warn_if_zero_baseline_diverges,
)
from jaxdepth.analyses.ig.engine import Attribution, Execution, SiteIG, attribute
from jaxdepth.analyses.ig.rules import AdaptiveRule, FixedRule
from jaxdepth.analyses.metric_inputs import clean_logits, refuse_padding_reads
from jaxdepth.core.config import ModelConfig

__all__ = [
    "integrated_gradients",
    "SiteIG",
    "NonFiniteAttributionError",
    "LogitsMetric",
    "FixedRule",
    "AdaptiveRule",
    "Execution",
]


@dataclasses.dataclass(frozen=True)
class LogitsMetric:
    """A user's `metric(logits)` in the form the path code takes, `metric(logits, aux)`, and the
    positions whose logits it reads: with `positions` (ints `[A]`) the logits passed are
    `[B, A, V]`, those positions only (the LM head runs there alone), else `[B, T, V]`. Frozen:
    it hashes as the user's function does, so the same function reuses its compilations."""

    fn: Callable
    positions: Optional[tuple[int, ...]] = None

    def __post_init__(self):
        if self.positions is not None:  # a tuple of ints, to hash
            object.__setattr__(self, "positions", tuple(int(p) for p in np.atleast_1d(self.positions)))

    def __call__(self, logits, aux):
        return self.fn(logits)


def integrated_gradients(
    params,
    tokens,
    config: ModelConfig,
    metric: Union[Callable, LogitsMetric],
    *,
    site: str = "resid_post",
    layers: Optional[Sequence[int]] = None,
    baseline: Union[str, jax.Array] = "channel_mean",
    rule: Union[rules.Rule, str] = rules.FixedRule(),
    interventions=None,
    execution: Execution = Execution(),
) -> SiteIG:
    """Integrated gradients of `metric` with respect to the value at `site` of each of `layers`.

    tokens: int `[B, T]` (every position valid), or right-padded prompts with their `valid [B, T]`:
        a `jaxdepth.core.batch.PromptBatch` (what `encode` and `make_batch` return) or anything
        else with `.tokens` and `.valid`.
    metric: `metric(logits [B, T, V]) -> scalar` (one prompt) or `[B]` (one value per prompt:
        prompts are attributed independently); jit-traceable, float32 logits. Static: define it
        once (module level) to reuse compilations; anything else is refused at trace time.
        `LogitsMetric(metric, positions)` passes it the logits at `positions` only, `[B, A, V]`.
        A metric that reads a padded position of a prompt is refused before anything runs (a
        `ValueError` naming the prompt and its length; `jaxdepth.analyses.metric_inputs`).
    site: any of `jaxdepth.core.sites.SITES`; layers: indices in 0..L-1 (default all).
    baseline: 'channel_mean' (per channel, the mean of x over each prompt's valid positions),
        'token_mean' (per position, the mean over the site's channels), 'zero', or an array
        broadcastable to `[layers, B, T, *trailing]`. 'zero' at a residual site ('resid_pre',
        'resid_post') diverges (RMSNorm's gradient at 0 is 1/sqrt(eps)) and is warned about.
    rule: `FixedRule(kind, steps)`: 'left' (α_k = k/steps, the published rule, the default with
        256 steps), 'midpoint', 'gauss' (Gauss-Legendre), 'right'; or `AdaptiveRule(tolerance,
        max_evaluations)`: per layer, composite Simpson refined where the exact per-interval
        error is largest until a certified bound on the completeness gap is at most tolerance *
        max(|F(x) - F(b)|, 0.1 |F(x)|) (the floor: `floored` says which layers met it), or
        `max_evaluations` gradient evaluations (default 256) are spent
        (`jaxdepth.analyses.ig.rules`). The adaptive rule takes one prompt; its per-channel
        attributions cost one more gradient per node (a second pass with the final rule). A
        rule's name ('left', 'adaptive', ...) stands for that rule with its defaults.
    interventions: act on the clean run and on every path run (the path's own setting of the
        site comes after the site's interventions).
    execution: an `Execution`: chunk size, memory budget, backward ('stored': each gradient's
        backward runs from the later layers' kept matmul outputs, two layer passes; 'recompute':
        it runs each later layer again, three passes, a sixth of the memory; an int k: the
        last k layers stored, the others recomputed; 'auto', the default: stored whenever one
        stored gradient fits in the memory budget, the chunk shrinking first, else as many
        stored layers as fit; the numbers agree to float rounding), `nonfinite` ('raise', the
        default: a `NonFiniteAttributionError` naming the layers and positions where F(x),
        F(b) or the attributions are NaN or infinite, at the first layer that has one, the
        adaptive rule stopping a layer at its first non-finite evaluation; 'warn': a warning
        naming them all, and the values returned), `per_channel` (False keeps only
        `per_position`, no `[n, B, T, *trailing]` array) and `progress`.

    Returns a `SiteIG`. Example::

        result = jaxdepth.integrated_gradients(params, tokens, config, logit_difference,
                                               site="head_out", rule=FixedRule(steps=64))
        result.per_position  # [L, B, T]; result.gap says whether 64 steps were enough
    """
    valid = getattr(tokens, "valid", None)
    tokens = check_tokens_array(getattr(tokens, "tokens", tokens), config)
    check_site(site)
    layers = check_layers(layers, config.num_layers)
    rule = check_prompts(rules.as_rule(rule), tokens.shape[0])
    if isinstance(rule, rules.AdaptiveRule):
        rule.tolerances(len(layers))  # a tolerance per layer: as many as the layers
    warn_if_zero_baseline_diverges(baseline, site)
    B, T = tokens.shape
    valid = jnp.ones((B, T), bool) if valid is None else jnp.asarray(valid, bool)
    if not isinstance(metric, LogitsMetric):
        metric = LogitsMetric(metric)
    positions = None if metric.positions is None else jnp.asarray(metric.positions, jnp.int32)
    refuse_padding_reads(
        metric.fn,
        lambda: clean_logits(params, jnp.asarray(tokens, jnp.int32), valid, config, interventions, positions),
        valid if positions is None else valid[:, positions],
        analysis="integrated gradients",
        hint="or declare the positions it reads, LogitsMetric(metric, positions), at real positions of every prompt",
    )
    attribution = Attribution(
        site=site,
        layers=layers,
        metric=LogitsMetric(metric.fn),  # without its positions: one compilation for any positions
        positions=positions,
        baseline=baseline,
    )
    return attribute(
        params,
        jnp.asarray(tokens, jnp.int32),
        valid,
        config,
        attribution,
        rule=rule,
        interventions=interventions,
        execution=execution,
    )
