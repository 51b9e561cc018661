"""Integrated gradients: one engine for every use.

- `path`: the device side, a layer's straight path at a site and gradients along it that run
  only the layers after the site;
- `rules`: the quadrature rules, fixed (left, midpoint, Gauss-Legendre) and adaptive (certified),
  each a value (`FixedRule`, `AdaptiveRule`);
- `checks`: argument checks, baselines, and the refusal of non-finite values;
- `engine`: `attribute`, the one driver, returning a `SiteIG`, and `Attribution`, what it
  attributes (how it runs is the core's `Execution`, `jaxdepth.core.execution`, re-exported here);
- here: `integrated_gradients`, the public form (`jaxdepth.integrated_gradients`).

The studies' integrated gradients (`jaxdepth.analyses.integrated_gradients`) are `attribute`
with the answer probability (`jaxdepth.analyses.metrics.answer_probability`) as the metric.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Union

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
    clean_readout,
    warn_if_zero_baseline_diverges,
)
from jaxdepth.analyses.ig.engine import Attribution, SiteIG, attribute, prompt_answers, prompt_reads
from jaxdepth.analyses.ig.rules import AdaptiveRule, FixedRule
from jaxdepth.analyses.metric_inputs import refuse_readout_padding
from jaxdepth.analyses.metrics import Metric, as_metric
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.execution import Execution, refuse_loose_options

__all__ = [
    "integrated_gradients",
    "Attribution",
    "SiteIG",
    "NonFiniteAttributionError",
    "FixedRule",
    "AdaptiveRule",
    "Execution",
]

# What an `Attribution` says: given on their own, these keywords are refused with the value
# that says the same.
ATTRIBUTION_FIELDS = ("site", "layers", "baseline", "per_channel")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Prompts:
    """The prompts as `attribute` reads them, a pytree: `tokens`, `valid [B, T]`, the answers
    (arrays, or None) and the task's `labels`."""

    tokens: Any
    valid: Any
    answer_positions: Any = None
    answer_real: Any = None
    answer_targets: Any = None
    labels: Any = None


def _prompts(tokens, config: ModelConfig) -> _Prompts:
    """`tokens` (an int array, or anything with `.tokens` and `.valid`, its answers and labels
    where it has them as arrays) as `_Prompts`, checked against the model."""
    ids = check_tokens_array(getattr(tokens, "tokens", tokens), config)
    valid = getattr(tokens, "valid", None)
    valid = jnp.ones(ids.shape, bool) if valid is None else jnp.asarray(valid, bool)
    labels = getattr(tokens, "labels", None)
    labels = labels if isinstance(labels, (jax.Array, np.ndarray)) else None  # arrays only, not a method
    return _Prompts(jnp.asarray(ids, jnp.int32), valid, **prompt_answers(tokens), labels=labels)


def _attribution(what, options: dict) -> Attribution:
    """`what` as an `Attribution` (a `Metric` alone is `Attribution(metric)`), refusing loose
    keywords with the value that says the same."""
    loose = {k: v for k, v in options.items() if k in ATTRIBUTION_FIELDS}
    if loose:
        shown = ", ".join(f"{k}={v!r}" for k, v in loose.items())
        raise TypeError(
            f"integrated_gradients() takes what it attributes as one value: jaxdepth.analyses.ig.Attribution("
            f"metric, {shown}), not {', '.join(loose)} on their own"
        )
    refuse_loose_options("integrated_gradients", options)
    return what if isinstance(what, Attribution) else Attribution(what)


def integrated_gradients(
    params,
    tokens,
    config: ModelConfig,
    what: Union[Metric, Attribution],
    *,
    rule: Union[rules.Rule, str] = rules.FixedRule(),
    interventions=None,
    execution: Execution = Execution(),
    **loose,
) -> SiteIG:
    """Integrated gradients of a metric with respect to the value at a site of each of some
    layers: `what`, an `Attribution(metric, site='resid_post', layers=None, baseline=
    'channel_mean', per_channel=True)`, or a `Metric` alone (`Attribution(metric)`).

    tokens: int `[B, T]` (every position valid), or right-padded prompts with their `valid [B, T]`:
        a `jaxdepth.core.batch.PromptBatch` (what `encode` and `make_batch` return) or anything
        else with `.tokens` and `.valid` (a `PromptArrays`, whose answers a metric reading
        'answer' reads; `.labels`, where given, is `Readout.labels`).
    metric: a `jaxdepth.analyses.metrics.Metric`, one value per prompt `[B]` (prompts are
        attributed independently), read at its declared positions only (the LM head runs
        there alone); a metric with `clean=True` is given the input's run (F(x)'s) as the
        clean run. A plain function of the logits is refused (a `TypeError` showing the new
        form); a metric that reads a padded position of a prompt (reads 'all') is refused
        before anything runs (a `ValueError` naming the prompt and its length;
        `jaxdepth.analyses.metric_inputs`).
    site: any of `jaxdepth.core.sites.SITES`; layers: indices in 0..L-1 (default all).
    baseline: 'channel_mean' (per channel, the mean of x over each prompt's valid positions),
        'token_mean' (per position, the mean over the site's channels), 'zero', or an array
        broadcastable to `[layers, B, T, *trailing]`. 'zero' at a residual site ('resid_pre',
        'resid_post') diverges (RMSNorm's gradient at 0 is 1/sqrt(eps)) and is warned about.
    per_channel: False keeps only `per_position`, no `[n, B, T, *trailing]` array.
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
    execution: a `jaxdepth.Execution`: chunk size, memory budget (by default
        `jaxdepth.analyses.ig.path.IG_MEMORY_FRACTION` of the free memory), backward ('stored':
        each gradient's backward runs from the later layers' kept matmul outputs, two layer
        passes; 'recompute': it runs each later layer again, three passes, a sixth of the
        memory; an int k: the last k layers stored, the others recomputed; 'auto', the
        default: stored whenever one stored gradient fits in the memory budget, the chunk
        shrinking first, else as many stored layers as fit; the numbers agree to float
        rounding), `nonfinite` ('raise', the default: a `NonFiniteAttributionError` naming the
        layers and positions where F(x), F(b) or the attributions are NaN or infinite, at the
        first layer that has one, the adaptive rule stopping a layer at its first non-finite
        evaluation; 'warn': a warning naming them all, and the values returned), `progress` and
        `on_layer` (called as each attributed layer finishes). Loose `site=`, `layers=`,
        `chunk_size=`, ... keywords are refused with the value that says the same.

    Returns a `SiteIG`. Example::

        result = jaxdepth.integrated_gradients(params, tokens, config,
                                               Attribution(logit_difference, site="head_out"),
                                               rule=FixedRule(steps=64))
        result.per_position  # [L, B, T]; result.gap says whether 64 steps were enough
    """
    attribution = _attribution(what, loose)
    prompts = _prompts(tokens, config)
    answers = prompts.answer_positions is not None and prompts.answer_targets is not None
    metric = as_metric(attribution.metric, "integrated gradients", answers_available=answers)
    check_site(attribution.site)
    layers = check_layers(attribution.layers, config.num_layers)
    rule = check_prompts(rules.as_rule(rule), prompts.tokens.shape[0])
    if isinstance(rule, rules.AdaptiveRule):
        rule.tolerances(len(layers))  # a tolerance per layer: as many as the layers
    warn_if_zero_baseline_diverges(attribution.baseline, attribution.site)
    reads = prompt_reads(metric, prompts)
    refuse_readout_padding(  # the one more forward only where a position read is padding
        metric,
        reads.real,
        lambda: clean_readout(params, prompts, config, metric, reads, interventions),
        analysis="integrated gradients",
        lengths=np.asarray(prompts.valid).sum(axis=1),
        hint="or read only real positions: reads='last' or 'answer' (its padding marked real=False)",
    )
    return attribute(
        params,
        prompts,
        config,
        dataclasses.replace(attribution, layers=layers),
        rule=rule,
        interventions=interventions,
        execution=execution,
    )
