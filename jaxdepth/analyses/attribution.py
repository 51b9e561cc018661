"""Gradient attributions as functions: the gradient at every named site of every layer from one
forward and one backward pass, gradient x activation, and attribution patching.

`site_gradients` adds a zero probe at each requested site of every layer (`jaxdepth.core.sites.probe`,
an ordinary intervention appended after the caller's own) and differentiates the
metric with respect to the probes: d metric / d probe_l is the gradient at that site of layer
l, for all layers at once. The backward reads every layer's stored activations; above
`STORED_ACTIVATIONS_LIMIT` bytes the stack runs under `jax.checkpoint` per layer instead, so the
backward keeps one residual per layer and recomputes the rest (a third more work).

Attribution patching (Nanda 2023; Syed et al. 2023) is the first-order estimate of every
residual erasure at once: replacing h_l[t] by a baseline b_l changes a scalar F by about
`grad_l[t] . (b_l - h_l[t])`. It is a screening mode: one forward and one backward instead of
(L+1) x T forwards, exact only where F is linear in h_l[t]. Confirm what it finds with the
exact erasure (`jaxdepth.analyses.erasure.residual_erasure(..., effect=
'answer_probability_change')` measures the same scalar).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import TYPE_CHECKING, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxdepth.core.progress import track
from jaxdepth.core.batch import PromptArrays, PromptBatch
from jaxdepth.core.compilation import jit
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.loops import LayerRun, run_layers
from jaxdepth.core.execution import Execution, refuse_loose_options
from jaxdepth.core.model import embed, token_per_layer_inputs
from jaxdepth.core.sites import as_interventions, probe, site_shape
from jaxdepth.core.sharding import to_host
from jaxdepth.core.sweep import member_bytes
from jaxdepth.core.saved_result import SavedResult
from jaxdepth.analyses.erasure import baseline_residuals
from jaxdepth.analyses.metric_inputs import refuse_readout_padding
from jaxdepth.analyses.ig.engine import prompt_answers
from jaxdepth.analyses.metrics import Metric, answer_probability, as_metric, reads_at, readout
from jaxdepth.analyses.suite import Analysis, per_prompt_figures

if TYPE_CHECKING:  # matplotlib is imported when a figure is drawn, not with the analysis
    from matplotlib.figure import Figure

__all__ = [
    "site_gradients",
    "SiteGradients",
    "attribution_patching",
    "AttributionResult",
    "residual_attribution",
    "attribution_patching_figure",
    "ATTRIBUTION_PATCHING",
    "GRAD_X_ACT",
    "recomputes_layers",
]

# Activations of all layers the backward may keep (rough bytes, `member_bytes` x layers). A
# constant, not the free memory: every process of a multi-process run must compile the same
# program.
STORED_ACTIVATIONS_LIMIT = 2 * 1024**3


def recomputes_layers(config: ModelConfig, tokens: int) -> bool:
    """Whether `site_gradients` recomputes each layer in the backward by default, for a forward of
    `tokens` (batch x length) positions: when all layers' activations exceed
    `STORED_ACTIVATIONS_LIMIT`."""
    return config.num_layers * member_bytes(config, tokens) > STORED_ACTIVATIONS_LIMIT


@dataclasses.dataclass(frozen=True)
class SiteGradients:
    """What `site_gradients` returns: the metric's `value` per prompt `[B]`, and per site the `gradients` and the
    `activations` (the site's values in the same forward), each `[L, B, T, ...]` (`resid_pre`:
    L+1 rows, the last one the final residual h_L). `taps`: the caller's tap, if any."""

    value: jax.Array
    gradients: dict
    activations: dict
    taps: object = None


jax.tree_util.register_dataclass(
    SiteGradients, data_fields=["value", "gradients", "activations", "taps"], meta_fields=[]
)


# What `site_gradients` once took on its own, and what says the same now.
_FORMER_OPTIONS = {
    "valid": "prompts with their mask: tokens=PromptArrays(tokens, valid) (anything with .tokens and .valid)",
    "positions": "a metric that declares the positions it reads: jaxdepth.metric(reads='last' | 'answer' | 'all')",
    "remat": "execution=jaxdepth.Execution(backward='recompute' | 'stored')",
}


def _refuse_former_options(options: dict) -> None:
    former = [k for k in options if k in _FORMER_OPTIONS]
    if former:
        raise TypeError("site_gradients() takes " + "; ".join(f"instead of {k}=, {_FORMER_OPTIONS[k]}" for k in former))
    refuse_loose_options("site_gradients", options)


def _remat(execution: Execution, config: ModelConfig, tokens: int) -> bool:
    """Whether the backward recomputes each layer: `execution.backward` 'recompute', or 'auto'
    where all layers' activations exceed `STORED_ACTIVATIONS_LIMIT` (`recomputes_layers`)."""
    if execution.backward == "auto":
        return recomputes_layers(config, tokens)
    if execution.backward not in ("stored", "recompute"):
        raise ValueError(
            f"site_gradients stores every layer's activations or recomputes them all: backward 'auto', 'stored' "
            f"or 'recompute', got {execution.backward!r}"
        )
    return execution.backward == "recompute"


def site_gradients(
    params,
    tokens,
    config: ModelConfig,
    metric: Metric,
    sites: Sequence[str] = ("resid_pre",),
    *,
    interventions=None,
    tap=None,
    execution: Execution = Execution(),
    **former,
) -> SiteGradients:
    """The gradient of `metric` (summed over the prompts, which do not interact: each prompt's
    gradient is its own F's) with respect to the value at each of `sites` of every layer, and
    those values, from one forward and one backward pass.

    tokens: int `[B, T]` (every position real), or anything with `.tokens` and `.valid [B, T]`
        (a `PromptBatch`, a `PromptArrays`, whose answers a metric reading 'answer' reads;
        `.labels`, where given, is `Readout.labels`).
    metric: a `jaxdepth.analyses.metrics.Metric`, F per prompt `[B]`, read at its declared
        positions only (the LM head, the largest matmul of a small model, runs there alone);
        with `tap` (as `run_layers` takes it) the tap's results are `Readout.taps`. There is no
        clean run: a metric with `clean=True` is refused by name, and a plain function of the
        logits (the form taken before) with a message showing the new one.

    Gradients are taken after `interventions` act: at the value the model really used. Call it
    inside `jax.jit` (a `Metric` made inside may close over traced arrays);
    `residual_attribution` is an example. `execution.backward`: 'recompute' recomputes each
    layer in the backward instead of storing its activations, 'stored' stores them, 'auto'
    (default) recomputes where `recomputes_layers`. A metric that reads a padded position (of
    'all' positions, or an answer span's padding) is refused, a `ValueError` naming the prompt
    and its length, where the arrays are concrete (called outside `jit`; `Model.site_gradients`
    checks before it jits); inside `jit`, check it first with
    `jaxdepth.analyses.metric_inputs.refuse_readout_padding`.

    Returns `SiteGradients`: `value [B]`, F per prompt."""
    _refuse_former_options(former)
    answers = prompt_answers(tokens)
    has_answers = answers["answer_positions"] is not None and answers["answer_targets"] is not None
    metric = as_metric(metric, "site gradients", clean_available=False, answers_available=has_answers)
    valid = getattr(tokens, "valid", None)
    labels = getattr(tokens, "labels", None)
    tokens = getattr(tokens, "tokens", tokens)
    B, T = tokens.shape
    L = config.num_layers
    remat = _remat(execution, config, B * T)
    reads = reads_at(metric, jnp.ones((B, T), bool) if valid is None else valid, **answers)
    zeros = {s: jnp.zeros((L + (s == "resid_pre"),) + site_shape(s, config, B, T), jnp.float32) for s in sites}
    base = as_interventions(interventions)

    def read(record, x):
        return {s: getattr(record, s) for s in sites}, None if tap is None else tap(record, x)

    # the tokens' per-layer inputs (Gemma 4) are an input of the layers: a probe at h_0 moves the
    # residual, not them (`token_per_layer_inputs`)
    extra = token_per_layer_inputs(params, tokens, config)

    def value(probes):
        ivs = base + tuple(probe(s, probes[s]) for s in sites)
        h, (values, taps) = run_layers(
            params,
            embed(params, tokens, config),
            config,
            valid=valid,
            interventions=ivs,
            tap=read,
            run=LayerRun(remat=remat),
            per_layer_inputs=extra,
        )
        if "resid_pre" in values:  # boundary L, the final residual, after its interventions
            values["resid_pre"] = jnp.concatenate([values["resid_pre"], h[None]], axis=0)
        r = readout(params, h, config, reads, labels=labels, taps=taps)
        f = metric(r)
        return jnp.sum(f), (f, values, taps, r)

    (_, (f, values, taps, r)), grads = jax.value_and_grad(value, has_aux=True)(zeros)
    # Called outside a trace (concrete logits), a metric reading padding is refused here; inside
    # jit or grad nothing can raise on data (the logits are unused there, and compiled away), and
    # the caller checks (`Model.site_gradients` does).
    traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((r, valid)))
    if valid is not None and not traced:
        refuse_readout_padding(
            metric,
            r.real,
            r,
            analysis="site gradients",
            lengths=np.asarray(valid).sum(axis=1),
            hint="or read only real positions: reads='last' or 'answer' (its padding marked real=False)",
        )
    return SiteGradients(f, grads, values, taps)


# ----------------------------------------------------------------------------- attribution patching


@partial(jit, static_argnames="config")
def residual_attribution(
    params, tokens, valid, answer_positions, answer_real, baseline, config: ModelConfig, interventions=None
):
    """For one prompt (`tokens [1, T]`): F(x) (the answer probability,
    `jaxdepth.analyses.metrics.answer_probability`, at the answer positions `[A]`), gradient x
    activation `[L+1, T]` (`grad_l[t] . h_l[t]`) and the attribution-patching estimate
    `[L+1, T]` (`grad_l[t] . (b_l - h_l[t])`, the first-order change of F when h_l[t] is
    replaced by `baseline[l]`, `[L+1, D]` as in erasure), at every boundary l = 0..L, from one
    forward and one backward pass.

    Under `interventions` (anything `jaxdepth.core.sites.as_interventions` takes) everything is
    the intervened run's: h_l is the residual after the interventions at its `resid_pre`, and
    the estimate is that of replacing it there, after them (the user's interventions first,
    then the replacement: what `jaxdepth.analyses.erasure.residual_erasure(...,
    interventions=...)` computes exactly)."""
    prompt = PromptArrays(tokens, valid, answer_positions, answer_real)
    g = site_gradients(params, prompt, config, answer_probability, ("resid_pre",), interventions=interventions)
    grad, h = g.gradients["resid_pre"][:, 0], g.activations["resid_pre"][:, 0].astype(jnp.float32)
    return (
        g.value[0],
        jnp.sum(grad * h, axis=-1),
        jnp.sum(grad * (baseline[:, None, :].astype(jnp.float32) - h), axis=-1),
    )


@dataclasses.dataclass
class AttributionResult(SavedResult):
    """Per prompt `[P, L+1, T]` (0 beyond each prompt's length): `patching`, the
    attribution-patching estimate of erasing h_l[t] (the first-order change of F, the summed
    answer probability), and `grad_x_act`, gradient x activation; `f_input [P]` is F on the
    clean prompt. A screening result: confirm with the exact erasure."""

    patching: np.ndarray
    grad_x_act: np.ndarray
    f_input: np.ndarray
    tokens: np.ndarray
    lengths: np.ndarray
    answer_start: np.ndarray
    settings: dict


def attribution_patching(
    params,
    batch: PromptBatch,
    config: ModelConfig,
    baseline: np.ndarray,
    *,
    interventions=None,
    execution: Execution = Execution(),
    settings=None,
    **loose,
) -> AttributionResult:
    """Attribution patching and gradient x activation of every (boundary, position) of every
    prompt of `batch`, one forward and one backward pass per prompt (a screening mode): an
    `AttributionResult`. `baseline [L+1, D]` is what each h_l[t] is replaced by, as in the
    exact erasure (`jaxdepth.analyses.erasure.mean_residuals`). `execution.progress` shows a
    progress bar over the prompts; `settings` (a dict) is stored in the result.

    `interventions` (`jaxdepth.core.sites`; default none) act on every forward and backward:
    the attributions of the intervened model, each erasure estimated after the interventions at
    its site (see `residual_attribution`). Each prompt runs at its own padded length
    (`PromptBatch.single`), so intervention data indexed by position must broadcast to every
    length (`[L, 1]` keep-masks, head ablations, a vector added at every position); data that
    does not is refused at trace time."""
    refuse_loose_options("attribution_patching", loose)
    L, T = config.num_layers, batch.tokens.shape[1]
    if baseline.shape != (L + 1, config.hidden_size):
        raise ValueError(f"baseline must be [L+1, D] = {(L + 1, config.hidden_size)}, got {baseline.shape}")
    patching, gxa = np.zeros((len(batch), L + 1, T), np.float32), np.zeros((len(batch), L + 1, T), np.float32)
    f_input = np.zeros(len(batch), np.float32)
    for i in track(range(len(batch)), execution.progress, "attribution patching (prompts)"):
        one = batch.single(i)
        Ti = one.tokens.shape[1]
        positions, real = one.answer_positions(0)
        f, g, p = residual_attribution(params, one.tokens, one.valid, positions, real, baseline, config, interventions)
        # Padding positions come after every answer position: causality gives them zero gradient.
        f_input[i], gxa[i, :, :Ti], patching[i, :, :Ti] = to_host(f), to_host(g), to_host(p)
    return AttributionResult(
        patching=patching,
        grad_x_act=gxa,
        f_input=f_input,
        tokens=batch.tokens,
        lengths=batch.lengths,
        answer_start=batch.answer_start,
        settings=dict(settings or {}),
    )


# ----------------------------------------------------------------------------- figures


def attribution_patching_figure(
    result: AttributionResult,
    prompt: int = 0,
    *,
    tokenizer=None,
    title: Optional[str] = None,
    quantity: str = "patching",
) -> Figure:
    """Attribution patching of one prompt: the first-order estimate of how erasing h_l[t]
    (boundary l = 0..L, y; token t, x) changes F, the summed answer probability (diverging
    colours centred at 0). A screening estimate: the exact erasure confirms it. `quantity`
    'grad_x_act' draws gradient x activation instead."""
    from jaxdepth.analyses import drawing as d

    d.expect(result, AttributionResult, "attribution_patching_figure")
    what = {
        "patching": ("Attribution patching (first-order screening)", r"estimated change of F, $g \cdot (b - h)$"),
        "grad_x_act": ("Gradient x activation", r"$g \cdot h$, gradient of F times $h_l[t]$"),
    }
    if quantity not in what:
        raise ValueError(f"quantity must be one of {', '.join(what)}, got {quantity!r}")
    name, label = what[quantity]
    p = d.prompt_index(result, prompt)
    n = int(result.lengths[p])
    fig = d.token_heatmap(
        d.TokenPanel(
            getattr(result, quantity)[p, :, :n],
            d.token_labels(result.tokens[p, :n], tokenizer),
            row_label="boundary l (0 = embeddings)",
            answer_start=int(result.answer_start[p]),
            cmap="RdBu_r",
            symmetric=True,
            colorbar_label=label,
        )
    )
    d.title_figure(fig, f"{name}, prompt {p}: F(x) = {result.f_input[p]:.3g}", title, result.settings)
    return fig


# ----------------------------------------------------------------------------- in the suite


def _run_attribution(x):
    return attribution_patching(
        x.model.params, x.batch, x.model.config, baseline_residuals(x), execution=Execution(progress=x.progress)
    )


# One forward and one backward pass per prompt give both; each is its own analysis so either
# can be asked for alone.
ATTRIBUTION_PATCHING = Analysis(
    name="attribution_patching",
    result_type=AttributionResult,
    identity=lambda s: {"detail_prompts": s.detail_prompts},
    run=_run_attribution,
    figures=per_prompt_figures(attribution_patching_figure),
    summary=lambda r: [f"attribution patching (screening) max |estimate| {float(abs(r.patching).max()):.3g}"],
    detail=True,
    uses_baseline=True,
)
GRAD_X_ACT = Analysis(
    name="grad_x_act",
    result_type=AttributionResult,
    identity=lambda s: {"detail_prompts": s.detail_prompts},  # g . h does not read the baseline
    run=_run_attribution,
    figures=per_prompt_figures(partial(attribution_patching_figure, quantity="grad_x_act")),
    summary=lambda r: [f"grad x act max |value| {float(abs(r.grad_x_act).max()):.3g}"],
    detail=True,
)
