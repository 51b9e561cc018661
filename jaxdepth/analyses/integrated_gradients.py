"""Integrated gradients of the answer probability with respect to each layer's output
(METHODS §5), or to its attention or MLP output (the first study's sublayer attributions).

For layer l, x = h_{l+1} over the whole prompt (target 'layer'; a_l for 'attn', m_l for 'mlp')
and F(x) = sum over answer tokens of their teacher-forced probabilities when x is set:

    IG_l[t] = sum_c (x - b)[t, c] * sum_k w_k dF/dx(b + α_k (x - b))[t, c]

For a sublayer target, layer l is recomputed from its clean input with the sublayer's output
set to the path point (the rest of layer l, e.g. the MLP reading h_l + a_l, follows it), then
the later layers run as for the layer target.

All steps of a layer are one vmapped gradient, chunked; each starts at boundary l+1, so the
layers before it are neither run nor differentiated, and the backward recomputes one layer at a
time instead of storing its activations. Every layer of a prompt reuses one compiled
computation. The completeness gap `sum_t IG_l[t] - (F(x) - F(b))` says whether the number of
steps is enough.

The path code here is general: any site (`site_entry`), any metric of the logits
(`metric(logits, aux)`, `metric_head`), steps summed as they run (`weighted_gradient`). The
studies' IG is that code with `answer_probability` at `resid_post`, `attn_out` or `mlp_out`;
`jaxdepth.integrated_gradients` (`jaxdepth.analyses.ig_at_sites`) is its public form.
"""

from __future__ import annotations

import dataclasses
import warnings
from functools import partial
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxdepth.core.batch import PromptArrays, PromptBatch
from jaxdepth.core.compilation import jit
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.model import (final_residual, layer_context, layer_inputs, layer_params, layer_step,
                                 run_layers_from, unembed)
from jaxdepth.core.sites import Intervention, as_interventions
from jaxdepth.core.saved_result import SavedResult
from jaxdepth.core.sweep import auto_chunk_size, sweep_sum
from jaxdepth.core.sharding import to_host

RULES = ("left", "midpoint", "gauss")
# Each prompt runs padded to a multiple of this many positions, not the 16 of the other
# analyses: a padded position costs every interpolation step of every layer (a 20-token prompt
# padded to 32 would cost 1.6x), while a compilation shared with prompts of similar length
# saves seconds of hours.
PAD_TO = 4
BASELINES = ("channel_mean", "token_mean", "zero")
# What a layer's attribution is taken with respect to, per study target: the site of its
# output h_{l+1}, or of one of its sublayers' outputs.
TARGETS = {"layer": "resid_post", "attn": "attn_out", "mlp": "mlp_out"}


def quadrature(rule: str, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Nodes α_k in [0, 1] and weights w_k (summing to 1) of a quadrature rule.

    'left': α_k = k/n (the default, as the published code); 'midpoint': (k + 1/2)/n;
    'gauss': Gauss-Legendre on [0, 1].
    """
    if steps < 1:
        raise ValueError("steps must be >= 1")
    k = np.arange(steps, dtype=np.float64)
    if rule == "left":
        return k / steps, np.full(steps, 1.0 / steps)
    if rule == "midpoint":
        return (k + 0.5) / steps, np.full(steps, 1.0 / steps)
    if rule == "gauss":
        nodes, weights = np.polynomial.legendre.leggauss(steps)
        return (nodes + 1) / 2, weights / 2
    raise ValueError(f"rule must be one of {RULES}, got {rule!r}")


def ig_baseline(x, valid, kind):
    """The baseline b of a site's value x `[B, T, *trailing]` (`trailing` the site's axes after
    the position: `[D]`, `[H, Dh]`, ...), with `valid [B, T]`, broadcastable to x:

    'channel_mean' (default): per channel, the mean of x over each prompt's valid positions,
    `[B, 1, *trailing]`; 'token_mean': per position, the mean over the trailing axes,
    `[B, T, 1, ...]` (the second study's code); 'zero': zeros; or an array, returned as given.
    """
    if not isinstance(kind, str):
        return jnp.asarray(kind, jnp.float32)
    if kind == "channel_mean":
        w = valid.reshape(valid.shape + (1,) * (x.ndim - 2)).astype(x.dtype)
        return jnp.sum(x * w, axis=1, keepdims=True) / jnp.sum(w, axis=1, keepdims=True)
    if kind == "token_mean":
        return jnp.mean(x, axis=tuple(range(2, x.ndim)), keepdims=True)
    if kind == "zero":
        return jnp.zeros_like(x)
    raise ValueError(f"baseline must be one of {BASELINES} or an array, got {kind!r}")


def suffix_value_and_grad(params, z, start, config: ModelConfig, head, *, valid=None, interventions=None):
    """`head(h_L)` when h_start = z, and its gradient with respect to z, running only layers
    start..L-1 (`layer_step`, with `interventions` at their sites, as every driver).

    The layers before `start` are neither run nor differentiated: the forward stores each
    layer's input, and the backward walks the layers in reverse with one `jax.vjp` each
    (recomputing that layer, as `jax.checkpoint` would). `start` may be traced but not batched.
    """
    L = config.num_layers
    ivs = as_interventions(interventions)
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


# ----------------------------------------------------------------------------- non-finite values
#
# A NaN or an infinity in F, its gradient or an attribution is never returned silently: the
# functions raise `NonFiniteAttributionError` (or, with `nonfinite="warn"`, warn and return
# them), naming the layers and positions. The usual cause is a zero baseline at a residual.

NONFINITE = ("raise", "warn")
# Sites whose value an RMSNorm reads as a whole (the next layer's, or the final, norm): a zero
# baseline there puts the path's start where the norm's gradient is 1/sqrt(eps).
NORMALISED_SITES = ("resid_pre", "resid_post")
ZERO_BASELINE_ADVICE = (
    "a zero baseline at a residual site ('resid_pre', 'resid_post', the study's 'layer' target) starts the path at "
    "h = 0, where every RMSNorm's gradient is 1/sqrt(eps) (316 at eps = 1e-5): through a few dozen layers the "
    "gradient overflows to inf and NaN, and the norm's scale invariance puts all of F's change in a sliver of the "
    "path near alpha = 0 that no fixed rule resolves. Use baseline='channel_mean' (the default) or 'token_mean'; "
    "a zero baseline is safe at sites inside a layer ('attn_out', 'mlp_out', 'head_out', 'mlp_hidden', 'delta')")


class NonFiniteAttributionError(FloatingPointError):
    """F, its gradient or an attribution of integrated gradients is NaN or infinite."""


def check_nonfinite_option(nonfinite: str) -> None:
    """Refuse a `nonfinite` argument other than 'raise' or 'warn'."""
    if nonfinite not in NONFINITE:
        raise ValueError(f"nonfinite must be one of {NONFINITE}, got {nonfinite!r}")


def warn_if_zero_baseline_diverges(baseline, site: str) -> None:
    """Warn up front about a zero baseline at a residual site (`ZERO_BASELINE_ADVICE`)."""
    if isinstance(baseline, str) and baseline == "zero" and site in NORMALISED_SITES:
        warnings.warn(f"integrated gradients at {site!r} with baseline='zero': {ZERO_BASELINE_ADVICE}.",
                      stacklevel=3)


def _spans(indices) -> str:
    """0, 1, 2, 5 -> '0-2, 5'."""
    indices, out = sorted(int(i) for i in indices), []
    for i in indices:
        if out and i == out[-1][1] + 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


def nonfinite_report(layers, per_position, f_input, f_baseline, *, baseline=None, site: str = "",
                     prompts=None) -> Optional[str]:
    """None if every value is finite; else a message naming, per attributed layer, where F(x),
    F(b) or the attributions (`per_position [n, B, T]`, `f_baseline [n, B]`, `f_input [B]`) are
    not finite. `prompts` labels the rows of B (default 0..B-1)."""
    per_position, f_baseline = np.asarray(per_position), np.asarray(f_baseline)
    f_input = np.atleast_1d(np.asarray(f_input))
    prompts = list(range(per_position.shape[1])) if prompts is None else list(prompts)
    lines = []
    if not np.all(np.isfinite(f_input)):
        lines.append(f"F(x), the metric of the run itself, is not finite (prompts "
                     f"{_spans(np.asarray(prompts)[~np.isfinite(f_input)])})")
    for i, layer in enumerate(layers):
        for j, prompt in enumerate(prompts):
            where = []
            if not np.isfinite(f_baseline[i, j]):
                where.append("F(b)")
            bad = ~np.isfinite(per_position[i, j])
            if bad.any():
                where.append(f"the attributions at positions {_spans(np.flatnonzero(bad))}")
            if where:
                lines.append(f"layer {layer}, prompt {prompt}: " + " and ".join(where))
    if not lines:
        return None
    advice = (f"\n{ZERO_BASELINE_ADVICE}." if isinstance(baseline, str) and baseline == "zero" else
              "\nCheck the metric (a log of a probability that underflows?) and the baseline.")
    return (f"integrated gradients{f' at {site!r}' if site else ''} are not finite (NaN or inf) at:\n  "
            + "\n  ".join(lines) + advice)


def raise_or_warn(report: Optional[str], nonfinite: str) -> None:
    """Act on a `nonfinite_report`: raise `NonFiniteAttributionError`, or warn."""
    if report is None:
        return
    if nonfinite == "raise":
        raise NonFiniteAttributionError(report + "\n(nonfinite='warn' returns the values with a warning)")
    warnings.warn(report, RuntimeWarning, stacklevel=3)


# ----------------------------------------------------------------------------- metrics of h_L
#
# The path code takes a metric as a static function `metric(logits, aux)` and `aux`, a traced
# pytree (the answer tokens, say): a new prompt's `aux` reuses the compiled computation, where
# a closure over its arrays would compile anew.


def answer_probability(logits, aux):
    """The studies' F: the summed teacher-forced probabilities of the answer tokens, from the
    logits at the answer positions `[1, A, V]`; `aux = (targets [A], real [A])`."""
    targets, real = aux
    probs = jax.nn.softmax(logits[0].astype(jnp.float32), axis=-1)
    return jnp.sum(jnp.where(real, probs[jnp.arange(targets.shape[0]), targets], 0.0))


def per_prompt(value, batch: int):
    """A metric's value as one number per prompt `[B]`: a scalar (one prompt) or `[B]`. Anything
    else is refused at trace time: F, its path and its completeness gap are per prompt."""
    value = jnp.asarray(value)
    if value.shape == () and batch == 1:
        return value[None].astype(jnp.float32)
    if value.shape == (batch,):
        return value.astype(jnp.float32)
    raise ValueError(f"the metric must return a scalar (for one prompt) or one value per prompt, shape "
                     f"({batch},); it returned shape {value.shape} for a batch of {batch} prompts")


def metric_head(params, config: ModelConfig, metric, aux, positions):
    """h_L `[B, T, D]` -> the metric per prompt `[B]`, from the logits at `positions` `[A]` only
    (all positions if None: the LM head is the largest matmul of a small model)."""
    def head(h_last):
        logits = unembed(params, h_last if positions is None else h_last[:, positions], config)
        return per_prompt(metric(logits, aux), h_last.shape[0])
    return head


def answer_aux(prompt: PromptArrays):
    """`answer_probability`'s `aux` for a prompt: its answer targets and which are real."""
    return prompt.answer_targets, prompt.answer_real


def answer_objective(params, prompt: PromptArrays, config: ModelConfig):
    """F(h_L): the summed teacher-forced probabilities of the answer tokens of one prompt."""
    head = metric_head(params, config, answer_probability, answer_aux(prompt), prompt.answer_positions)
    return lambda h_last: head(h_last)[0]


# ----------------------------------------------------------------------------- paths at a site


def site_inputs(params, tokens, valid, config: ModelConfig, site: str, interventions=None):
    """The clean run under `interventions`: every layer's value at `site` `[L, B, T, ...]`
    (float32, after the site's interventions), every layer's input before its interventions
    `[L, B, T, D]` (what a path at another site than `resid_post` recomputes the layer from)
    and h_L `[B, T, D]`. Only the site's value and the layers' outputs are kept."""
    inputs, h_last, x = layer_inputs(params, tokens, config, valid=valid, interventions=interventions,
                                     tap=lambda r, _: getattr(r, site))
    return x.astype(jnp.float32), inputs[:-1], h_last


@partial(jit, static_argnames=("config", "baseline", "target"))
def ig_inputs(params, prompt: PromptArrays, config: ModelConfig, *, baseline: str = "channel_mean",
              interventions=None, target: str = "layer"):
    """Each layer's target x `[L, T, D]` (float32: its output, or its attention or MLP output),
    its baseline b (broadcast to x), each layer's input before its interventions `[L, T, D]`
    (what a sublayer target recomputes the layer from) and F(x), all under `interventions`."""
    x, inputs, h_last = site_inputs(params, prompt.tokens, prompt.valid, config, TARGETS[target], interventions)
    b = jnp.broadcast_to(jax.vmap(lambda xl: ig_baseline(xl, prompt.valid, baseline))(x), x.shape)
    return x[:, 0], b[:, 0], inputs[:, 0], answer_objective(params, prompt, config)(h_last)


def _set_value(value, layer, data):
    at, z = data
    return jnp.where(layer == at, z.astype(value.dtype), value)


def site_entry(params, layer, h_in, valid, config: ModelConfig, site: str, interventions):
    """z -> h_{layer+1}: the layer's output as a function of its value z at `site` (the
    identity for `resid_post`); otherwise layer `layer` runs from its input `h_in` `[B, T, D]`
    with the site's value set to z after the site's own interventions."""
    if site == "resid_post":
        return lambda z: z
    ivs = as_interventions(interventions)
    context = layer_context(h_in, valid, config)

    def entry(z):
        set_site = Intervention(site, _set_value, (layer, z))
        return layer_step(layer_params(params, layer), h_in, layer, context, config, ivs + (set_site,)).out
    return entry


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


@partial(jit, static_argnames=("config", "site", "metric", "chunk_size"))
def weighted_gradient(params, valid, layer, path: LayerPath, alphas, weights, config: ModelConfig, *, site: str,
                      metric, aux=None, positions=None, chunk_size: Optional[int] = None, interventions=None):
    """`(sum_k w_k dF/dz(path.at(α_k)) [B, T, ...], F(b) [B])` for the value z at `site` of
    layer `layer` along `path`; F the metric per prompt (`metric(logits, aux)` at `positions`,
    `metric_head`) under `interventions`.

    The steps are one chunked sweep of gradients that start at boundary layer+1 (and, for a site
    inside the layer, back through layer `layer` recomputed from `path.h_in` with the site set),
    the chunks summed as they run (`sweep_sum`). `layer` is traced, so every layer of a prompt
    reuses one compiled computation.
    """
    dtype = params["embed"].dtype
    head = metric_head(params, config, metric, aux, positions)
    entry = site_entry(params, layer, None if path.h_in is None else path.h_in.astype(dtype), valid, config, site,
                       interventions)
    total = lambda h: jnp.sum(head(h))  # prompts do not interact: each one's gradient is its own F's

    def member(m):
        alpha, weight = m
        h_next, pullback = jax.vjp(entry, path.at(alpha).astype(dtype))
        _, g = suffix_value_and_grad(params, h_next, layer + 1, config, total, valid=valid,
                                     interventions=interventions)
        return weight * pullback(g)[0].astype(jnp.float32)

    h_base, _ = run_layers_from(params, entry(path.b.astype(dtype)), layer + 1, config, valid=valid,
                                interventions=interventions)
    return sweep_sum(member, (alphas, weights), chunk_size), head(h_base)


def study_path(x, b, inputs, layer, target: str) -> LayerPath:
    """Layer `layer`'s path for a study target, from `ig_inputs`' `[L, T, D]` arrays (batch 1)."""
    return LayerPath(x[layer][None], b[layer][None], None if target == "layer" else inputs[layer][None])


def ig_of_layer(params, prompt: PromptArrays, layer, path: LayerPath, config: ModelConfig, *, alphas, weights,
                chunk_size: Optional[int] = None, interventions=None, target: str = "layer"):
    """IG of one layer along `path` (`study_path`): `(attributions [T], F(b))`,
    `weighted_gradient` with the studies' F."""
    g, f_base = weighted_gradient(params, prompt.valid, layer, path, alphas, weights, config, site=TARGETS[target],
                                  metric=answer_probability, aux=answer_aux(prompt),
                                  positions=prompt.answer_positions, chunk_size=chunk_size,
                                  interventions=interventions)
    return jnp.sum((path.x - path.b) * g, axis=-1)[0] * prompt.valid[0], f_base[0]


def ig_of_prompt(params, prompt: PromptArrays, config: ModelConfig, *, alphas, weights,
                 baseline: str = "channel_mean", chunk_size: Optional[int] = None,
                 on_layer: Optional[Callable[[], None]] = None, interventions=None, target: str = "layer"):
    """IG for one prompt (`PromptArrays`, batch 1) with the quadrature rule `alphas`, `weights`:
    `(attributions [L, T], f_input [], f_baseline [L])`.

    Layers run one after another (`ig_of_layer`, one compiled computation for all of them);
    `on_layer()` is called after each (progress). `interventions` (`jaxdepth.core.sites`) act on
    the whole forward, before and after the attributed layer: IG of a model with, say, an
    earlier layer skipped. `target`: 'layer' (h_{l+1}), 'attn' (a_l) or 'mlp' (m_l).
    """
    if target not in TARGETS:
        raise ValueError(f"target must be one of {', '.join(TARGETS)}, got {target!r}")
    x, b, inputs, f_input = ig_inputs(params, prompt, config, baseline=baseline, interventions=interventions,
                                      target=target)
    alphas, weights = jnp.asarray(alphas, jnp.float32), jnp.asarray(weights, jnp.float32)
    attributions, f_baseline = [], []
    for layer in range(config.num_layers):
        a, fb = ig_of_layer(params, prompt, jnp.int32(layer), study_path(x, b, inputs, layer, target), config,
                            alphas=alphas, weights=weights, chunk_size=chunk_size, interventions=interventions,
                            target=target)
        attributions.append(a)
        f_baseline.append(fb)
        if on_layer is not None:
            jax.block_until_ready(a)
            on_layer()
    return jnp.stack(attributions), f_input, jnp.stack(f_baseline)


@dataclasses.dataclass
class IntegratedGradientsResult(SavedResult):
    """`attributions [P, L, T]`, completeness `gap [P, L]`, `f_input [P]` = F(x), `f_baseline
    [P, L]` = F(b), with the prompts' tokens for labelling."""

    attributions: np.ndarray
    gap: np.ndarray
    f_input: np.ndarray
    f_baseline: np.ndarray
    tokens: np.ndarray
    lengths: np.ndarray
    answer_start: np.ndarray
    settings: dict

    @property
    def rule(self) -> str:
        """Which quadrature produced the attributions, in words: "left rule, 256 steps"."""
        return f"{self.settings.get('rule', 'left')} rule, {self.settings.get('steps', '?')} steps"


def integrated_gradients(params, batch: PromptBatch, config: ModelConfig, *, steps: int = 256,
                         rule: str = "left", baseline: str = "channel_mean", target: str = "layer",
                         chunk_size: Optional[int] = None, memory_budget: Optional[int] = None,
                         progress: bool = True, settings=None, interventions=None,
                         on_layer: Optional[Callable[[], None]] = None,
                         nonfinite: str = "raise") -> IntegratedGradientsResult:
    """Integrated gradients per layer and token for every prompt of `batch`, with respect to
    each layer's output (`target` 'layer', the default), attention output ('attn') or MLP
    output ('mlp'), optionally under `interventions` (see `ig_of_prompt`; each prompt runs at
    its own padded length, `batch.single(i, PAD_TO)`, so position masks in them must have that length).
    `on_layer()` is called as each layer of each prompt finishes. `nonfinite`: 'raise' (default)
    stops at the first prompt with a NaN or infinite F or attribution, naming its layers and
    positions (`NonFiniteAttributionError`); 'warn' warns and goes on."""
    if baseline not in BASELINES:
        raise ValueError(f"baseline must be one of {BASELINES}, got {baseline!r}")
    if target not in TARGETS:
        raise ValueError(f"target must be one of {', '.join(TARGETS)}, got {target!r}")
    check_nonfinite_option(nonfinite)
    warn_if_zero_baseline_diverges(baseline, TARGETS[target])
    alphas, weights = quadrature(rule, steps)
    L, T = config.num_layers, batch.tokens.shape[1]
    P = len(batch)
    attributions = np.zeros((P, L, T), np.float32)
    f_input, f_baseline = np.zeros(P, np.float32), np.zeros((P, L), np.float32)
    with tqdm(total=P * L, desc=f"integrated gradients ({steps} steps, layers)", disable=not progress) as bar:
        def layer_done():
            bar.update()
            if on_layer is not None:
                on_layer()

        for i in range(P):
            prompt = batch.prompt(i, PAD_TO)
            Ti = prompt.tokens.shape[1]
            chunk = chunk_size or auto_chunk_size(config, Ti, steps, grad=True, memory_budget=memory_budget)
            a, fx, fb = ig_of_prompt(params, prompt, config, alphas=alphas, weights=weights, baseline=baseline,
                                     chunk_size=chunk, on_layer=layer_done, interventions=interventions,
                                     target=target)
            attributions[i, :, :Ti], f_input[i], f_baseline[i] = to_host(a), to_host(fx), to_host(fb)
            raise_or_warn(nonfinite_report(range(L), attributions[i][:, None], f_input[i:i + 1], f_baseline[i][:, None],
                                           baseline=baseline, site=TARGETS[target], prompts=[i]), nonfinite)
    gap = attributions.sum(axis=-1) - (f_input[:, None] - f_baseline)
    return IntegratedGradientsResult(
        attributions=attributions, gap=gap, f_input=f_input, f_baseline=f_baseline,
        tokens=batch.tokens, lengths=batch.lengths, answer_start=batch.answer_start,
        settings={**(settings or {}), "steps": steps, "rule": rule, "baseline": baseline,
                  **({} if target == "layer" else {"target": target})})
