"""The one driver of integrated gradients: any metric, any site, any layers, every rule.

`attribute` runs the clean run once, then each attributed layer's path (`jaxdepth.analyses.ig.path`)
with a fixed rule (one chunked, vmapped gradient sweep per layer) or the adaptive rule (rounds of
node evaluations, `jaxdepth.analyses.ig.rules`), and returns one `SiteIG`. The public
`jaxdepth.integrated_gradients` and the studies' `jaxdepth.analyses.integrated_gradients` are both
this function, with the user's metric or with the answer probability.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Callable, Optional, Sequence

import jax
import numpy as np

from jaxdepth.analyses.ig import rules
from jaxdepth.analyses.ig.checks import layer_baselines, nonfinite_report, raise_or_warn
from jaxdepth.analyses.ig.path import (
    LayerPath,
    attribution_of,
    choose_backward,
    clean_run,
    path_points,
    weighted_gradient,
)
from jaxdepth.core.progress import ProgressLike, progress_bar, track
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.sharding import to_host
from jaxdepth.core.sweep import auto_chunk_size

# The adaptive rule's nodes of a layer, for its per-channel pass, are padded to a multiple of this
# (zero weights): one compiled computation for layers with similar node counts.
_NODE_MULTIPLE = 8


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
    layers        `[n]` the attributed layers; site, rule: as called
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
    rule: str
    converged: Optional[np.ndarray] = None
    bound: Optional[np.ndarray] = None
    floored: Optional[np.ndarray] = None


# One program, not one per eager operation: it runs once per attributed layer.
@partial(jax.jit, static_argnames="with_inputs")
def _layer_path(x, b, inputs, layer, i, *, with_inputs: bool) -> LayerPath:
    """The path of attributed layer `layer` (the `i`th): its x, baseline and, unless the site is
    the layer's output, its input."""
    return LayerPath(x[layer], b[i], inputs[layer] if with_inputs else None)


def attribute(
    params,
    tokens,
    valid,
    config: ModelConfig,
    *,
    site: str,
    metric,
    aux=None,
    positions=None,
    layers: Sequence[int],
    baseline="channel_mean",
    rule: str = "left",
    steps: int = rules.DEFAULT_STEPS,
    tolerance: Optional[float] = None,
    max_evaluations: Optional[int] = None,
    interventions=None,
    per_channel: bool = True,
    chunk_size: Optional[int] = None,
    memory_budget: Optional[int] = None,
    nonfinite: str = "raise",
    progress: ProgressLike = False,
    on_layer: Optional[Callable[[], None]] = None,
    label: Optional[Sequence] = None,
    adaptive_options: Optional[dict] = None,
    backward: str = "auto",
) -> SiteIG:
    """Integrated gradients of `metric(logits, aux)` (at `positions`; `jaxdepth.analyses.ig.path`)
    with respect to the value at `site` of each of `layers`, arguments already checked
    (`jaxdepth.analyses.ig.checks`): tokens `[B, T]` with `valid [B, T]`; the adaptive rule
    takes one prompt, `tolerance` (one value, or one per attributed layer), `max_evaluations`
    and `adaptive_options` (more keywords of `rules.run_rule`: `atol`, `grid_points`, ...).
    `on_layer()` is called as each layer finishes; `label` names the prompts in a non-finite
    report (default 0..B-1); `backward`: how gradients get the later layers' activations,
    recomputed, stored or 'auto' (`jaxdepth.analyses.ig.path.choose_backward`)."""
    B, T = tokens.shape
    backward = choose_backward(backward, config, B * T, steps, memory_budget)
    x, inputs, f_input = clean_run(
        params,
        tokens,
        valid,
        config,
        site=site,
        metric=metric,
        aux=aux,
        positions=positions,
        interventions=interventions,
    )
    f_input = to_host(f_input)
    report = lambda layer_list, per_position, f_baseline: nonfinite_report(
        layer_list, per_position, f_input, f_baseline, baseline=baseline, site=site, prompts=label
    )
    if not np.all(np.isfinite(f_input)):
        raise_or_warn(report([], np.zeros((0, B, T)), np.zeros((0, B))), nonfinite)
    b = layer_baselines(x, valid, baseline, layers)

    def path(i):
        return _layer_path(x, b, inputs, np.int32(layers[i]), np.int32(i), with_inputs=site != "resid_post")

    def weighted(i, alphas, weights, chunk, channels_too: bool):
        """Layer i's IG with the rule (alphas, weights): (per_position [B, T], per channel or None, F(b))."""
        p = path(i)
        g, f_base = weighted_gradient(
            params,
            valid,
            np.int32(layers[i]),
            p,
            np.asarray(alphas, np.float32),
            np.asarray(weights, np.float32),
            config,
            site=site,
            metric=metric,
            aux=aux,
            positions=positions,
            chunk_size=chunk,
            interventions=interventions,
            backward=backward,
        )
        a = attribution_of(p, g, valid, per_channel=channels_too)
        return (None, a, f_base) if channels_too else (a, None, f_base)

    common = dict(layers=np.asarray(layers), site=site)  # and rule, as called
    if rule == "adaptive":
        tolerance = rules.DEFAULT_TOLERANCE if tolerance is None else tolerance
        max_evaluations = rules.default_budget(steps) if max_evaluations is None else max_evaluations

        def call(layer, alphas, grad, chunk):
            i = layers.index(layer)
            return path_points(
                params,
                valid,
                np.int32(layer),
                path(i),
                np.asarray(alphas, np.float32),
                config,
                site=site,
                metric=metric,
                aux=aux,
                positions=positions,
                interventions=interventions,
                grad=grad,
                chunk_size=chunk,
                backward=backward,
            )

        return _adaptive(
            call,
            weighted,
            layers,
            float(f_input[0]),
            T,
            config,
            tolerance=np.broadcast_to(np.asarray(tolerance, np.float64), (len(layers),)),
            max_evaluations=max_evaluations,
            options={"stored": backward == "stored", **(adaptive_options or {})},
            chunk_size=chunk_size,
            memory_budget=memory_budget,
            progress=progress,
            per_channel=per_channel,
            on_layer=on_layer,
            common=common,
            check=lambda per_position, f_baseline: raise_or_warn(report(layers, per_position, f_baseline), nonfinite),
        )

    alphas, weights = rules.quadrature(rule, steps)
    chunk = chunk_size or auto_chunk_size(
        config, B * T, steps, grad=True, stored=backward == "stored", memory_budget=memory_budget
    )
    per_position, attributions, f_baseline = [], [], []
    for i in track(range(len(layers)), progress, f"integrated gradients at {site} ({rule}, {steps} steps)"):
        pp, a, fb = weighted(i, alphas, weights, chunk, per_channel)
        if per_channel:
            attributions.append(to_host(a))
            pp = _summed(attributions[-1], x.ndim - 1)
        per_position.append(to_host(pp))
        f_baseline.append(to_host(fb))
        if on_layer is not None:
            on_layer()
        if nonfinite == "raise":  # stop at the first such layer: the later ones would cost as much
            raise_or_warn(report(layers[i : i + 1], per_position[-1][None], f_baseline[-1][None]), nonfinite)
    per_position, f_baseline = np.stack(per_position), np.stack(f_baseline)
    raise_or_warn(report(layers, per_position, f_baseline), nonfinite)
    with np.errstate(invalid="ignore", over="ignore"):
        gap = per_position.sum(-1) - (f_input[None] - f_baseline)
    return SiteIG(
        attributions=np.stack(attributions) if per_channel else None,
        per_position=per_position,
        gap=gap,
        f_input=f_input,
        f_baseline=f_baseline,
        evaluations=np.full((len(layers), B), steps),
        rule=rule,
        **common,
    )


def _summed(a: np.ndarray, value_ndim: int) -> np.ndarray:
    """`[..., B, T, *trailing]` -> `[..., B, T]` (a value of `value_ndim` axes); inf - inf is NaN,
    and reported as such."""
    with np.errstate(invalid="ignore", over="ignore"):
        return a.reshape(a.shape[: a.ndim - value_ndim + 2] + (-1,)).sum(-1)


def _adaptive(
    call,
    weighted,
    layers,
    f_input: float,
    seq_len: int,
    config: ModelConfig,
    *,
    tolerance: np.ndarray,
    max_evaluations: int,
    options: dict,
    chunk_size,
    memory_budget,
    progress: ProgressLike,
    per_channel: bool,
    on_layer,
    common: dict,
    check,
) -> SiteIG:
    """The adaptive rule (one prompt): `call(layer, alphas, grad, chunk)` the rounds' evaluations
    (`path_points`), `weighted(i, alphas, weights, chunk, channels_too)` the weighted per-channel
    pass of the i-th attributed layer, `check(per_position [n, 1, T], f_baseline [n, 1])` the
    non-finite check, before that pass."""
    site = common["site"]

    def layer_done():
        bar.update()
        if on_layer is not None:
            on_layer()

    with progress_bar(progress, total=len(layers), desc=f"adaptive integrated gradients at {site}") as bar:
        finished = rules.run_rule(
            call,
            layers,
            f_input,
            seq_len,
            config,
            tolerance=tolerance,
            max_evaluations=max_evaluations,
            chunk_size=chunk_size,
            memory_budget=memory_budget,
            on_layer=layer_done,
            **options,
        )
    summary = rules.summarise(finished)
    check(summary["attributions"][:, None], summary["f_baseline"][:, None])
    attributions = None
    if per_channel:  # a second pass: the final composite rule's weights, gradients per channel
        parts = []
        for i, r in enumerate(finished):
            alphas, weights = r.node_weights()
            pad = -len(alphas) % _NODE_MULTIPLE
            alphas, weights = np.pad(alphas, (0, pad), mode="edge"), np.pad(weights, (0, pad))
            parts.append(to_host(weighted(i, alphas, weights, chunk_size or _NODE_MULTIPLE, True)[1]))
        attributions = np.stack(parts)
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
        rule="adaptive",
        **common,
    )
