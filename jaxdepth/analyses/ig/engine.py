"""The one driver of integrated gradients: any metric, any site, any layers, every rule.

`attribute` runs the clean run once, then integrates each attributed layer's path
(`jaxdepth.analyses.ig.path`: the gradient at the site along it, and F and the integrand for the
adaptive rule) with the integrator (`jaxdepth.analyses.ig.integrator`): a fixed rule (one chunked,
vmapped gradient sweep per layer) or the adaptive rule (rounds of node evaluations,
`jaxdepth.analyses.ig.rules`), and returns one `SiteIG`. The public
`jaxdepth.integrated_gradients` and the studies' `jaxdepth.analyses.integrated_gradients` are both
this function, with the user's metric or with the answer probability.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Optional, Sequence

import jax
import numpy as np

from jaxdepth.analyses.ig import rules
from jaxdepth.analyses.ig.checks import (
    layer_baselines,
    nonfinite_report,
    raise_or_warn,
)
from jaxdepth.analyses.ig.integrator import Paths, adapt, integrate_final, integrate_fixed
from jaxdepth.analyses.ig.path import (
    IG_MEMORY_FRACTION,
    LayerPath,
    Objective,
    attribution_of,
    choose_backward,
    clean_run,
    layer_run_inputs,
    path_points,
    weighted_gradient,
)
from jaxdepth.analyses.metrics import Metric, Reads, reads_at
from jaxdepth.core.progress import progress_bar, track
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.execution import Execution
from jaxdepth.core.loops import stored_layers
from jaxdepth.core.sharding import to_host
from jaxdepth.core.sweep import auto_chunk_size

__all__ = [
    "attribute",
    "Attribution",
    "Execution",
    "SiteIG",
    "prompt_reads",
    "prompt_answers",
]


@dataclasses.dataclass(frozen=True)
class SiteIG:
    """Integrated gradients of a metric at a site, as numpy arrays (`n` = the attributed layers,
    in the order of `layers`):

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
    layers        `[n]` the attributed layers; site: as called; rule: the `rules.FixedRule` or
                  `rules.AdaptiveRule` it ran
    converged, bound, floored  `[n, B]`, adaptive rule only: whether the certified bound
                  sum_i |e_i| + |φ(1) - F(x)| (>= |gap|) met the tolerance; a layer stopped at a
                  non-finite value has converged False and bound NaN; `floored`: the tolerance
                  was relative to the floor `FLOOR_SHARE |F(x)|`, F moving less along the path
    """

    attributions: Optional[np.ndarray]
    per_position: np.ndarray
    gap: np.ndarray
    f_input: np.ndarray
    f_baseline: np.ndarray
    evaluations: np.ndarray
    layers: np.ndarray
    site: str
    rule: rules.Rule
    converged: Optional[np.ndarray] = None
    bound: Optional[np.ndarray] = None
    floored: Optional[np.ndarray] = None


# One program, not one per eager operation: it runs once per attributed layer.
@partial(jax.jit, static_argnames="with_inputs")
def _layer_path(x, b, inputs, layer, i, *, with_inputs: bool) -> LayerPath:
    """The path of attributed layer `layer` (the `i`th): its x, baseline and, unless the site is
    the layer's output, its input (its layer and mask set by the caller)."""
    return LayerPath(x[layer], b[i], layer, None, inputs[layer] if with_inputs else None)


@dataclasses.dataclass(frozen=True, eq=False)
class Attribution:
    """What integrated gradients attribute: F, a `jaxdepth.analyses.metrics.Metric` (one value
    per prompt, read at its declared positions), to the value at `site` (any of
    `jaxdepth.core.sites.SITES`) of each of `layers` (indices in 0..L-1, default all), along the
    straight path from `baseline` (a name of `jaxdepth.analyses.ig.checks.BASELINES` or an
    array broadcastable to `[layers, B, T, *trailing]`); `per_channel`: keep the attributions
    per channel of the site (`SiteIG.attributions`), not only per position."""

    metric: Metric
    site: str = "resid_post"
    layers: Optional[Sequence[int]] = None
    baseline: Any = "channel_mean"
    per_channel: bool = True


def _array(value):
    """`value` if it is an array (a prompt's answers), None for anything else (a method)."""
    return value if isinstance(value, (jax.Array, np.ndarray)) else None


def prompt_answers(prompts) -> dict:
    """The answers of `prompts` as `reads_at` takes them: `answer_positions`, `answer_real`
    and `answer_targets`, each an array where `prompts` holds them as arrays (a `PromptArrays`
    with answers), else None. Trace-safe."""
    positions = _array(getattr(prompts, "answer_positions", None))
    if positions is None:
        return dict(answer_positions=None, answer_real=None, answer_targets=None)
    real, targets = getattr(prompts, "answer_real", None), getattr(prompts, "answer_targets", None)
    return dict(answer_positions=positions, answer_real=_array(real), answer_targets=_array(targets))


def prompt_reads(m: Metric, prompts) -> Reads:
    """The positions `m` reads in `prompts` (`.valid [B, T]`; for 'answer' also the arrays of
    `prompt_answers`): `jaxdepth.analyses.metrics.reads_at`. Trace-safe."""
    answers = prompt_answers(prompts) if m.reads == "answer" else {}
    return reads_at(m, prompts.valid, **answers)


def attribute(
    params,
    prompts,
    config: ModelConfig,
    attribution: Attribution,
    *,
    rule: rules.Rule,
    interventions=None,
    execution: Execution = Execution(),
    label: Optional[Sequence] = None,
) -> SiteIG:
    """Integrated gradients of `attribution` under `rule` (arguments already checked,
    `jaxdepth.analyses.ig.checks`; `attribution.layers` a list) of `prompts`: anything with
    `tokens [B, T]` and `valid [B, T]` (a `PromptArrays`, with its answers for a metric that
    reads them, and `labels` for `Readout.labels` where it has them); the adaptive rule takes
    one prompt. `label` names the prompts in a non-finite report (default 0..B-1)."""
    tokens, valid = prompts.tokens, prompts.valid
    B, T = tokens.shape
    layers, site = list(attribution.layers), attribution.site
    budget = execution.budget(IG_MEMORY_FRACTION)  # read once: every choice below sees the same memory
    backward = choose_backward(execution.backward, config, B * T, budget)
    execution = execution.replace(backward=backward, memory_budget=budget)
    objective = Objective(
        site, attribution.metric, prompt_reads(attribution.metric, prompts), labels=getattr(prompts, "labels", None)
    )
    x, inputs, f_input, objective = clean_run(params, tokens, valid, config, objective, interventions=interventions)
    per_layer, key_values = layer_run_inputs(params, tokens, valid, config, interventions=interventions)
    f_input = to_host(f_input)
    report = lambda layer_list, per_position, f_baseline: nonfinite_report(
        layer_list, per_position, f_input, f_baseline, baseline=attribution.baseline, site=site, prompts=label
    )
    if not np.all(np.isfinite(f_input)):
        raise_or_warn(report([], np.zeros((0, B, T)), np.zeros((0, B))), execution.nonfinite)
    b = layer_baselines(x, valid, attribution.baseline, layers)

    def path(i):
        layer = np.int32(layers[i])
        p = _layer_path(x, b, inputs, layer, np.int32(i), with_inputs=site != "resid_post")
        # the layer and the mask as given, not as a program's outputs: the path functions' calls
        # keep one signature (one compilation) with the experiments' own paths
        return dataclasses.replace(p, layer=layer, valid=valid, per_layer_inputs=per_layer, key_values=key_values)

    def weighted(i, alphas, weights, chunk, *, channels_too: bool):
        """Layer i's IG with the rule (alphas, weights): (per_position [B, T], per channel or None, F(b))."""
        p = path(i)
        g, f_base = weighted_gradient(
            params,
            p,
            (alphas, weights),
            config,
            objective,
            chunk_size=chunk,
            interventions=interventions,
            backward=backward,
        )
        a = attribution_of(p, g, per_channel=channels_too)
        return (None, a, f_base) if channels_too else (a, None, f_base)

    def points(i, alphas, grad, chunk):
        return path_points(
            params,
            path(i),
            alphas,
            config,
            objective,
            interventions=interventions,
            chunk_size=chunk,
            backward=backward if grad else None,
        )

    per_channel = attribution.per_channel
    stored = stored_layers(backward, config.num_layers)  # the later layers whose matmul outputs are kept
    paths = Paths(
        weighted=partial(weighted, channels_too=per_channel),
        points=points,
        chunk=execution.chunk_size
        or auto_chunk_size(
            config, B * T, rule.evaluations, grad=True, stored=stored, memory_budget=execution.memory_budget
        ),
        call_size=execution.chunk_size or rules.largest_call(config, T, execution.memory_budget, stored=stored),
    )
    if isinstance(rule, rules.AdaptiveRule):
        check = lambda per_position, f_baseline: raise_or_warn(
            report(layers, per_position, f_baseline), execution.nonfinite
        )
        return _adaptive(paths, check, float(f_input[0]), attribution=attribution, rule=rule, execution=execution)

    per_position, attributions, f_baseline = [], [], []
    desc = f"integrated gradients at {site} ({rule.kind}, {rule.steps} steps)"
    for i in track(range(len(layers)), execution.progress, desc):
        pp, a, fb = integrate_fixed(paths, i, rule)
        if per_channel:
            attributions.append(to_host(a))
            pp = _summed(attributions[-1], x.ndim - 1)
        per_position.append(to_host(pp))
        f_baseline.append(to_host(fb))
        execution.layer_done()
        if execution.nonfinite == "raise":  # stop at the first such layer: the later ones would cost as much
            raise_or_warn(report(layers[i : i + 1], per_position[-1][None], f_baseline[-1][None]), "raise")
    per_position, f_baseline = np.stack(per_position), np.stack(f_baseline)
    raise_or_warn(report(layers, per_position, f_baseline), execution.nonfinite)
    with np.errstate(invalid="ignore", over="ignore"):
        gap = per_position.sum(-1) - (f_input[None] - f_baseline)
    return SiteIG(
        attributions=np.stack(attributions) if per_channel else None,
        per_position=per_position,
        gap=gap,
        f_input=f_input,
        f_baseline=f_baseline,
        evaluations=np.full((len(layers), B), rule.steps),
        layers=np.asarray(layers),
        site=site,
        rule=rule,
    )


def _summed(a: np.ndarray, value_ndim: int) -> np.ndarray:
    """`[..., B, T, *trailing]` -> `[..., B, T]` (a value of `value_ndim` axes); inf - inf is NaN,
    and reported as such."""
    with np.errstate(invalid="ignore", over="ignore"):
        return a.reshape(a.shape[: a.ndim - value_ndim + 2] + (-1,)).sum(-1)


def _adaptive(
    paths: Paths, check, f_input: float, *, attribution: Attribution, rule: rules.AdaptiveRule, execution: Execution
) -> SiteIG:
    """The adaptive rule (one prompt) on `paths` (one per attributed layer, keyed by its index),
    `check(per_position [n, 1, T], f_baseline [n, 1])` the non-finite check, before the
    per-channel pass (`integrator.integrate_final`)."""
    layers = list(attribution.layers)

    def layer_done():
        bar.update()
        execution.layer_done()

    desc = f"adaptive integrated gradients at {attribution.site}"
    with progress_bar(execution.progress, total=len(layers), desc=desc) as bar:
        finished = adapt(paths, range(len(layers)), f_input, rule, on_done=layer_done)
    summary = rules.summarise(finished)
    check(summary["attributions"][:, None], summary["f_baseline"][:, None])
    attributions = None
    if attribution.per_channel:  # a second pass: the final composite rule's weights, gradients per channel
        attributions = np.stack([to_host(integrate_final(paths, i, r)[1]) for i, r in enumerate(finished)])
    column = lambda a: np.asarray(a)[:, None]  # [n] -> [n, B=1]
    per_position = summary["attributions"][:, None].astype(np.float32)
    f_baseline = column(summary["f_baseline"]).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        gap = per_position.astype(np.float64).sum(-1) - (f_input - f_baseline)
    return SiteIG(
        attributions=attributions,
        per_position=per_position,
        gap=gap,
        f_input=np.array([f_input], np.float32),
        f_baseline=f_baseline,
        evaluations=column(summary["evaluations"]),
        converged=column(summary["converged"]),
        bound=column(summary["bound"]),
        floored=column(summary["floored"]),
        layers=np.asarray(layers),
        site=attribution.site,
        rule=rule,
    )
