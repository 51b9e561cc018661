"""Checks of integrated gradients' arguments, the baselines, and the refusal of non-finite
values: one place for what every entry point (`jaxdepth.integrated_gradients`, the studies'
`jaxdepth.analyses.integrated_gradients`) validates."""

from __future__ import annotations

import warnings
from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxdepth.analyses.ig.rules import AdaptiveRule, Rule
from jaxdepth.analyses.metrics import Metric, Readout, Reads, readout
from jaxdepth.core.compilation import jit
from jaxdepth.core.loops import run_layers
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.model import check_tokens, embed, token_per_layer_inputs
from jaxdepth.core.sites import SITES

__all__ = [
    "NonFiniteAttributionError",
    "ig_baseline",
    "BASELINES",
    "clean_readout",
    "layer_baselines",
    "check_tokens_array",
    "check_layers",
    "check_prompts",
    "check_site",
    "warn_if_zero_baseline_diverges",
    "nonfinite_report",
    "raise_or_warn",
]

BASELINES = ("channel_mean", "token_mean", "zero")


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


def layer_baselines(x, valid, baseline, layers):
    """The baseline of each attributed layer, broadcast to its x: `[n, B, T, ...]` from the
    site's values of every layer `x [L, B, T, ...]` (a name of `BASELINES`, or an array
    broadcastable to `[n, B, T, ...]`)."""
    if isinstance(baseline, str):
        if baseline not in BASELINES:
            raise ValueError(f"baseline must be one of {BASELINES} or an array, got {baseline!r}")
        return _named_baselines(x, valid, baseline, tuple(layers))
    b = jnp.asarray(baseline, jnp.float32)
    target = (len(layers),) + x.shape[1:]
    try:
        return jnp.broadcast_to(b, target)
    except ValueError:
        raise ValueError(
            f"a baseline array must broadcast to the site's values of the attributed layers "
            f"{target} ([layers, B, T, *trailing]); got shape {b.shape}"
        ) from None


@partial(jax.jit, static_argnames=("kind", "layers"))  # one program, not one per eager operation
def _named_baselines(x, valid, kind: str, layers: tuple[int, ...]):
    return jnp.stack([jnp.broadcast_to(ig_baseline(x[l], valid, kind), x[l].shape) for l in layers])


def check_tokens_array(tokens, config: ModelConfig) -> np.ndarray:
    """`tokens` as an int array `[batch, seq]` the model can take."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"tokens must be an int array [batch, seq], got {tokens.dtype} {tokens.shape}")
    check_tokens(tokens, config)
    return tokens


def check_layers(layers, num_layers: int) -> list[int]:
    """Distinct layer indices in 0..L-1 (all of them for None)."""
    layers = list(range(num_layers)) if layers is None else [int(l) for l in np.atleast_1d(layers)]
    if not layers or any(not 0 <= l < num_layers for l in layers) or len(set(layers)) != len(layers):
        raise ValueError(f"layers must be distinct layer indices in 0..{num_layers - 1}, got {layers}")
    return layers


def check_prompts(rule: Rule, prompts: int) -> Rule:
    """`rule`, after refusing the adaptive rule on `prompts` != 1 (it refines one prompt's path at a
    time)."""
    if isinstance(rule, AdaptiveRule) and prompts != 1:
        raise ValueError(
            f"the adaptive rule refines each prompt's path on its own: give one prompt (tokens [1, T]), got {prompts}"
        )
    return rule


def check_site(site: str) -> None:
    """Refuse a name that is not a site of `jaxdepth.core.sites.SITES`."""
    if site not in SITES:
        raise ValueError(f"unknown site {site!r}; sites: {', '.join(SITES)}")


# ----------------------------------------------------------------------------- non-finite values
#
#
# A NaN or an infinity in F, its gradient or an attribution is never returned silently: the
# functions raise `NonFiniteAttributionError` (or, with `nonfinite="warn"`, warn and return
# them), naming the layers and positions. The usual cause is a zero baseline at a residual.

# Sites whose value an RMSNorm reads as a whole (the next layer's, or the final, norm): a zero
# baseline there puts the path's start where the norm's gradient is 1/sqrt(eps).
NORMALISED_SITES = ("resid_pre", "resid_post")
ZERO_BASELINE_ADVICE = (
    "a zero baseline at a residual site ('resid_pre', 'resid_post', the study's 'layer' target) starts the path at "
    "h = 0, where every RMSNorm's gradient is 1/sqrt(eps) (316 at eps = 1e-5): through a few dozen layers the "
    "gradient overflows to inf and NaN, and the norm's scale invariance puts all of F's change in a sliver of the "
    "path near alpha = 0 that no fixed rule resolves. Use baseline='channel_mean' (the default) or 'token_mean'; "
    "a zero baseline is safe at sites inside a layer ('attn_out', 'mlp_out', 'head_out', 'mlp_hidden', 'delta')"
)


class NonFiniteAttributionError(FloatingPointError):
    """F, its gradient or an attribution of integrated gradients is NaN or infinite."""


def warn_if_zero_baseline_diverges(baseline, site: str) -> None:
    """Warn up front about a zero baseline at a residual site (`ZERO_BASELINE_ADVICE`)."""
    if isinstance(baseline, str) and baseline == "zero" and site in NORMALISED_SITES:
        warnings.warn(f"integrated gradients at {site!r} with baseline='zero': {ZERO_BASELINE_ADVICE}.", stacklevel=3)


def _spans(indices) -> str:
    """0, 1, 2, 5 -> '0-2, 5'."""
    indices, out = sorted(int(i) for i in indices), []
    for i in indices:
        if out and i == out[-1][1] + 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


def nonfinite_report(
    layers, per_position, f_input, f_baseline, *, baseline=None, site: str = "", prompts=None
) -> Optional[str]:
    """None if every value is finite; else a message naming, per attributed layer, where F(x),
    F(b) or the attributions (`per_position [n, B, T]`, `f_baseline [n, B]`, `f_input [B]`) are
    not finite. `prompts` labels the rows of B (default 0..B-1)."""
    per_position, f_baseline = np.asarray(per_position), np.asarray(f_baseline)
    f_input = np.atleast_1d(np.asarray(f_input))
    prompts = list(range(per_position.shape[1])) if prompts is None else list(prompts)
    lines = []
    if not np.all(np.isfinite(f_input)):
        lines.append(
            f"F(x), the metric of the run itself, is not finite (prompts "
            f"{_spans(np.asarray(prompts)[~np.isfinite(f_input)])})"
        )
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
    advice = (
        f"\n{ZERO_BASELINE_ADVICE}."
        if isinstance(baseline, str) and baseline == "zero"
        else "\nCheck the metric (a log of a probability that underflows?) and the baseline."
    )
    return (
        f"integrated gradients{f' at {site!r}' if site else ''} are not finite (NaN or inf) at:\n  "
        + "\n  ".join(lines)
        + advice
    )


def raise_or_warn(report: Optional[str], nonfinite: str) -> None:
    """Act on a `nonfinite_report`: raise `NonFiniteAttributionError`, or warn."""
    if report is None:
        return
    if nonfinite == "raise":
        raise NonFiniteAttributionError(report + "\n(nonfinite='warn' returns the values with a warning)")
    warnings.warn(report, RuntimeWarning, stacklevel=3)


# ----------------------------------------------------------------------------- padding reads


@partial(jit, static_argnames=("config", "metric"))
def clean_readout(params, prompts, config: ModelConfig, metric: Metric, reads: Reads, interventions=None) -> Readout:
    """The `Readout` of the run of `prompts` (`.tokens`, `.valid [B, T]`, `.labels` or None)
    under `interventions` at `reads`, for `metric` (its own logits as the clean ones where it
    reads them): what `jaxdepth.analyses.metric_inputs.refuse_readout_padding` checks a metric
    on, for an analysis that keeps no readout of its own before it runs."""
    h0, extra = embed(params, prompts.tokens, config), token_per_layer_inputs(params, prompts.tokens, config)
    h, _ = run_layers(params, h0, config, valid=prompts.valid, interventions=interventions, per_layer_inputs=extra)
    labels = getattr(prompts, "labels", None)
    return readout(params, h, config, reads, clean_final=h if metric.clean else None, labels=labels)
