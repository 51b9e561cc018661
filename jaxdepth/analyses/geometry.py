"""Geometry of the residual stream: how compressed each boundary's token representations are
(matrix entropy), how far the first token's residual outgrows the others (massive activations)
and how many heads of each layer park their attention on the first token (attention sinks),
all from one forward per group of prompts. Queipo-de-Llano et al. (arXiv 2510.06477) tie the
three together: the middle layers' "compression valley" of low entropy coincides with the
first token's massive norm and with attention sinks.

Boundaries l = 0..L: h_0 the embeddings, h_L the final residual (before the final norm). The
geometry quantities are per boundary (L + 1 values per prompt), the sink rate per layer (L
values: layer l's attention).

- Matrix entropy (Skean et al., "Layer by Layer", arXiv 2502.02013): for one prompt's valid
  token representations Z (n x D, a row per valid token), the Gram matrix K = Z Z^T, its
  eigenvalues lambda_i, p_i = lambda_i / trace(K), H = -sum_i p_i log p_i (0 log 0 = 0),
  normalised: H / log(min(n, D)), in [0, 1]. A rank-1 Z gives 0, n orthogonal rows of equal
  norm give 1. A prompt of one token has log(min(1, D)) = 0: its entropy is NaN. Z is NOT
  centred: centring would remove the common direction that the first token's massive norm
  creates, and that direction is the compression the paper links to sinks. Computed in
  float32 as the squared singular values of Z (padding rows zeroed: zero rows add only zero
  singular values), which are the eigenvalues of Z Z^T (T x T) and of Z^T Z (D x D) alike,
  whichever is smaller. Not from a float32 Gram: its eigenvalues err by about eps * lambda_max,
  so a rank-1 Z of 349 rows comes out at 6e-6 rather than 0, and a cut-off above that noise
  would drop real eigenvalues where the first token's norm is 170 times the median (the
  embedded model's middle layers: there the other tokens' eigenvalues are a few 1e-5 of
  lambda_max). Squared singular values err by about eps^2 * lambda_max (1e-11 for that rank-1
  Z) and come within 3e-7 of a float64 computation on the embedded model; XLA:CPU's SVD also
  ran about 20x faster than its symmetric eigensolver inside the layer loop.
- Massive activations (Sun, Chen, Kolter and Liu, "Massive Activations in Large Language
  Models", arXiv 2402.17762), per prompt and boundary: `first_norm_ratio` = ||h[0]|| / the
  median over the prompt's valid tokens t of ||h[t]||; `max_activation` = the max over valid t
  and d of |h[t, d]|, at token `max_position` (t) and dimension `max_dimension` (d) (the first
  in row-major order on ties); `max_ratio` = max |h| / the median over valid (t, d) of |h[t, d]|.
- Attention-sink rate (Gu et al., "When Attention Sink Emerges in Language Models", arXiv
  2410.10781, threshold eps = 0.3): for layer l, query head h and prompt b, the sink score
  alpha = the mean over the prompt's valid query positions i of attn_probs[b, h, i, 0] (the
  attention to the first token); the head is a sink head when alpha > eps, and the layer's
  sink rate for that prompt is the share of its H heads that are. The scores are kept
  (`sink_scores [N, L, H]`), so that another threshold needs no new run
  (`GeometryResult.sink_rate`).

The figure shows each over relative depth (boundary l / L; layer l at (l + 0.5) / L), so that
models of different depths compare: the mean over prompts with a 95% bootstrap band over prompts
(`uncertainty.resample_indices`).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import TYPE_CHECKING, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from jaxdepth.analyses.suite import Analysis, DepthCurve, DepthReading, Settings, option
from jaxdepth.analyses.uncertainty import DEFAULT_RESAMPLES, DEFAULT_SEED, prompt_mean_band
from jaxdepth.core.batch import PromptBatch
from jaxdepth.core.compilation import jit
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.layer import LayerRecord, Params
from jaxdepth.core.loops import run_layers
from jaxdepth.core.model import embed, per_layer_inputs
from jaxdepth.core.saved_result import SavedResult
from jaxdepth.core.sharding import to_host

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "matrix_entropy",
    "massive_activations",
    "sink_scores",
    "sink_rate",
    "geometry_stats",
    "geometry",
    "GeometryResult",
    "geometry_figure",
    "GeometrySettings",
    "ANALYSIS",
    "SINK_THRESHOLD",
    "depth_reading",
]

SINK_THRESHOLD = 0.3  # Gu et al.'s eps
BOUNDARY_FIELDS = ("entropy", "first_norm_ratio", "max_activation", "max_position", "max_dimension", "max_ratio")


def matrix_entropy(h: Float[Array, "B T D"], valid: Bool[Array, "B T"]) -> Float[Array, " B"]:
    """Each prompt's normalised matrix entropy of its valid rows of `h`, uncentred (module
    docstring), in float32; NaN for a prompt of one token."""
    z = jnp.where(valid[..., None], h.astype(jnp.float32), 0.0)
    # Scaled to trace 1: the squared singular values are then the p_i themselves.
    frobenius = jnp.sqrt(jnp.sum(z * z, axis=(1, 2), keepdims=True))
    z = z / jnp.where(frobenius > 0, frobenius, 1.0)
    p = jnp.square(jnp.linalg.svd(z, compute_uv=False))
    p = p / jnp.sum(p, axis=-1, keepdims=True)
    entropy = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), axis=-1)
    n = jnp.sum(valid, axis=1)
    most = jnp.log(jnp.minimum(n, z.shape[2]).astype(jnp.float32))
    return jnp.where(n > 1, entropy / jnp.where(n > 1, most, 1.0), jnp.nan)


def _median(values: Float[Array, "B M"], mask: Bool[Array, "B M"]) -> Float[Array, " B"]:
    """The median of each row's non-negative `values` where `mask` (the mean of the two middle
    ones for an even count), exact. Found by bisection on the float32 bit patterns, which order
    non-negative floats as the floats do: 31 counting passes over the row instead of a sort,
    which XLA:CPU runs about 8x slower on a prompt's 200,000 activations."""
    bits = jax.lax.bitcast_convert_type(values.astype(jnp.float32), jnp.int32)
    n = jnp.sum(mask, axis=1)
    ranks = jnp.stack([(n - 1) // 2, n // 2], axis=1)  # [B, 2]: the two middle ranks, 0-based

    def halve(_, bounds):
        low, high = bounds
        middle = low + (high - low) // 2
        enough = jnp.sum(mask[:, None] & (bits[:, None] <= middle[..., None]), axis=-1) > ranks
        return jnp.where(enough, low, middle + 1), jnp.where(enough, middle, high)

    # the smallest pattern with more than `rank` values at or below it: 31 halvings of [0, inf]
    start = (jnp.zeros_like(ranks), jnp.full_like(ranks, 0x7F800000))
    _, found = jax.lax.fori_loop(0, 31, halve, start)
    middle = jax.lax.bitcast_convert_type(found, jnp.float32)
    return jnp.where(n > 0, jnp.mean(middle, axis=1), jnp.nan)


def massive_activations(h: Float[Array, "B T D"], valid: Bool[Array, "B T"]) -> dict[str, Array]:
    """Each prompt's massive-activation statistics of one boundary (module docstring), `[B]`
    each: `first_norm_ratio`, `max_activation`, `max_position`, `max_dimension`, `max_ratio`."""
    h = h.astype(jnp.float32)
    B, T, D = h.shape
    norms = jnp.linalg.norm(h, axis=-1)
    flat = jnp.abs(h).reshape(B, T * D)
    flat_valid = jnp.repeat(valid, D, axis=1)
    where = jnp.argmax(jnp.where(flat_valid, flat, -1.0), axis=1)
    largest = jnp.take_along_axis(flat, where[:, None], axis=1)[:, 0]
    return {
        "first_norm_ratio": norms[:, 0] / _median(norms, valid),
        "max_activation": largest,
        "max_position": (where // D).astype(jnp.int32),
        "max_dimension": (where % D).astype(jnp.int32),
        "max_ratio": largest / _median(flat, flat_valid),
    }


def sink_scores(attn_probs: Float[Array, "B H S T"], valid: Bool[Array, "B S"]) -> Float[Array, "B H"]:
    """Each head's sink score alpha: its mean attention to the first token over the prompt's
    valid query positions (Gu et al.; module docstring). Padding queries do not count."""
    to_first = jnp.where(valid[:, None, :], attn_probs[..., 0].astype(jnp.float32), 0.0)
    return jnp.sum(to_first, axis=-1) / jnp.maximum(jnp.sum(valid, axis=-1), 1)[:, None]


def sink_rate(scores: Float[Array, "*b H"], threshold: float = SINK_THRESHOLD) -> np.ndarray:
    """The share of heads `[...]` whose sink score exceeds `threshold`, from scores `[..., H]`."""
    return np.mean(np.asarray(scores) > threshold, axis=-1)


def _boundary(h: Float[Array, "B T D"], valid: Bool[Array, "B T"]) -> dict[str, Array]:
    return {"entropy": matrix_entropy(h, valid), **massive_activations(h, valid)}


@partial(jit, static_argnames="config")
def geometry_stats(
    params: Params, tokens: Int[Array, "B T"], valid: Bool[Array, "B T"], config: ModelConfig
) -> tuple[dict[str, Array], Float[Array, "L B H"]]:
    """One forward: `(per_boundary, sinks)`, where `per_boundary` maps `entropy`,
    `first_norm_ratio`, `max_activation`, `max_position`, `max_dimension` and `max_ratio` to
    `[L + 1, B]` each (boundaries h_0..h_L) and `sinks` holds every layer's
    heads' sink scores `[L, B, H]`. Each layer reduces its input h_l and its attention inside
    the layer loop, so the stream of residuals `[L + 1, B, T, D]` is never held."""

    def tap(record: LayerRecord, _):
        return _boundary(record.h, valid), sink_scores(record.attn_probs, valid)

    h0 = embed(params, tokens, config)
    extra = per_layer_inputs(params, tokens, h0, config)
    h_last, (stats, sinks) = run_layers(params, h0, config, valid=valid, tap=tap, per_layer_inputs=extra)
    last = _boundary(h_last, valid)
    return {k: jnp.concatenate([stats[k], last[k][None]], axis=0) for k in BOUNDARY_FIELDS}, sinks


@dataclasses.dataclass
class GeometryResult(SavedResult):
    """Per prompt and boundary `[N, L + 1]`: `entropy` (normalised matrix entropy; NaN for a
    one-token prompt), `first_norm_ratio`, `max_activation`, `max_position`, `max_dimension`,
    `max_ratio`; per prompt, layer and query head `sink_scores [N, L, H]`; `lengths [N]`;
    `num_layers` L; `settings` (`sink_threshold` among them). Module docstring: the definitions."""

    entropy: np.ndarray
    first_norm_ratio: np.ndarray
    max_activation: np.ndarray
    max_position: np.ndarray
    max_dimension: np.ndarray
    max_ratio: np.ndarray
    sink_scores: np.ndarray
    lengths: np.ndarray
    num_layers: int
    settings: dict

    @property
    def threshold(self) -> float:
        """The sink threshold this result was run with (Gu et al.'s 0.3 by default)."""
        return float(self.settings.get("sink_threshold", SINK_THRESHOLD))

    def sink_rate(self, threshold: Optional[float] = None) -> np.ndarray:
        """Each prompt's sink rate per layer `[N, L]`: the share of heads whose sink score exceeds
        `threshold` (None: the result's own)."""
        return sink_rate(self.sink_scores, self.threshold if threshold is None else threshold)

    def largest_activation(self) -> dict:
        """The largest |activation| over every prompt and boundary: `value`, `prompt`,
        `boundary`, `position` (token) and `dimension`."""
        b, l = np.unravel_index(np.argmax(self.max_activation), self.max_activation.shape)
        return {
            "value": float(self.max_activation[b, l]),
            "prompt": int(b),
            "boundary": int(l),
            "position": int(self.max_position[b, l]),
            "dimension": int(self.max_dimension[b, l]),
        }


def geometry(
    params: Params,
    batch: PromptBatch,
    config: ModelConfig,
    *,
    sink_threshold: float = SINK_THRESHOLD,
    settings: Optional[dict] = None,
) -> GeometryResult:
    """The residual stream's geometry over `batch` (module docstring): one forward per group of
    prompts of similar length (`PromptBatch.groups`)."""
    N, L, H = len(batch), config.num_layers, config.num_heads
    per_boundary = {k: np.zeros((N, L + 1), np.float32) for k in BOUNDARY_FIELDS}
    per_boundary["max_position"] = np.zeros((N, L + 1), np.int32)
    per_boundary["max_dimension"] = np.zeros((N, L + 1), np.int32)
    scores = np.zeros((N, L, H), np.float32)
    for index, group in batch.groups():
        stats, sinks = jax.tree.map(to_host, geometry_stats(params, group.tokens, group.valid, config))
        for k in BOUNDARY_FIELDS:
            per_boundary[k][index] = stats[k][:, : len(index)].T
        scores[index] = sinks[:, : len(index)].transpose(1, 0, 2)
    return GeometryResult(
        **per_boundary,
        sink_scores=scores,
        lengths=np.asarray(batch.lengths, np.int64),
        num_layers=L,
        settings={
            **(settings or {}),
            "sink_threshold": float(sink_threshold),
            # a linear-attention layer has no attention probabilities: its sink scores are zeros, not measured
            **({"attention_layers": list(config.attention_layers)} if config.mixed_mixers else {}),
        },
    )


# ----------------------------------------------------------------------------- figure


def geometry_figure(result: GeometryResult, *, resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED) -> Figure:
    """Three panels over relative depth: the matrix entropy and the first token's norm ratio (log
    axis) at each boundary l / L, and the sink rate of each attention layer at (l + 0.5) / L;
    each the mean over prompts (faint: each prompt's) with a 95% bootstrap band over prompts."""
    from jaxdepth.analyses import drawing as d

    d.expect(result, GeometryResult, "geometry_figure")
    L = result.num_layers
    attention = np.asarray(result.settings.get("attention_layers", range(L)), int)  # no linear-attention layer
    boundaries, layers = np.arange(L + 1) / L, (attention + 0.5) / L
    panels = [
        (result.entropy, boundaries, "matrix entropy (normalised)", "compression", "C0"),
        (result.first_norm_ratio, boundaries, r"$\|h_l[0]\|$ / median$_t \|h_l[t]\|$", "first-token norm", "C3"),
        (
            result.sink_rate()[:, attention],
            layers,
            "share of sink heads",
            f"attention sinks (alpha > {result.threshold:g})",
            "C2",
        ),
    ]
    fig = d.new_figure(14, 4.2)
    for ax, (per_prompt, x, ylabel, title, color) in zip(fig.subplots(1, 3), panels):
        mean, band, count = prompt_mean_band(np.asarray(per_prompt, np.float64), resamples, seed)
        if mean is not None:
            d.draw_per_prompt(ax, x, per_prompt[np.all(np.isfinite(per_prompt), axis=1)], color)
            d.draw_band(ax, x, band, color)
            ax.plot(x, mean, color=color, linewidth=2, label=f"mean over {count} prompts")
            ax.legend(fontsize=8)
        ax.set(xlabel="relative depth l / L", ylabel=ylabel, title=title, xlim=(0, 1))
        ax.grid(alpha=0.3)
    fig.axes[1].set_yscale("log")
    fig.axes[2].set_ylim(-0.02, 1.02)
    d.title_figure(fig, f"Geometry of the residual stream (L = {L})", None, result.settings)
    return fig


# ----------------------------------------------------------------------------- in the suite


def _check_threshold(value: float) -> float:
    value = float(value)
    if not 0 <= value < 1:
        raise ValueError(f"--geometry-sink-threshold must lie in [0, 1), got {value}")
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class GeometrySettings(Settings):
    """The geometry analysis's settings in a study (`Settings` and its options)."""

    geometry_sink_threshold: float = option(
        SINK_THRESHOLD,
        "geometry: a head is a sink head where its mean attention to the first token exceeds this (Gu et al.: 0.3)",
        metavar="EPS",
    )

    def __post_init__(self):
        super().__post_init__()
        _check_threshold(self.geometry_sink_threshold)


def _summary(result: GeometryResult) -> list[str]:
    with np.errstate(all="ignore"):
        entropy = np.nanmean(result.entropy, axis=0) if np.isfinite(result.entropy).any() else None
    ratio = result.first_norm_ratio.mean(axis=0)
    L = result.num_layers
    attention = np.asarray(result.settings.get("attention_layers", range(L)), int)
    sinks = result.sink_rate().mean(axis=0)[attention]
    top = result.largest_activation()
    lines = []
    if entropy is not None:
        valley = int(np.nanargmin(entropy))
        lines.append(f"entropy valley {entropy[valley]:.2f} at boundary {valley}/{L}")
    lines.append(f"first-token norm ratio up to {ratio.max():.1f}x at boundary {int(ratio.argmax())}/{L}")
    if attention.size:
        lines.append(f"sink rate peaks at {sinks.max():.0%} in layer {int(attention[sinks.argmax()])}")
    lines.append(f"largest |activation| {top['value']:.1f} (token {top['position']}, dim {top['dimension']})")
    return lines


def depth_reading(result: GeometryResult) -> DepthReading:
    """The matrix entropy at every boundary and the attention-sink rate of every attention layer
    (all but a hybrid model's linear-attention layers, `settings['attention_layers']`), each
    the mean over prompts, on the relative-depth axis."""
    L = result.num_layers
    attention = np.asarray(result.settings.get("attention_layers", range(L)), int)
    return DepthReading(
        num_layers=L,
        curves={
            "entropy": DepthCurve(
                "matrix entropy of the residual stream",
                "normalized entropy",
                np.arange(L + 1) / L,
                np.nanmean(result.entropy, axis=0),
            ),
            "sink_rate": DepthCurve(
                "attention-sink rate",
                "share of heads",
                (attention + 0.5) / L,
                np.nanmean(result.sink_rate(), axis=0)[attention],
            ),
        },
    )


ANALYSIS = Analysis(
    name="geometry",
    default=False,  # in the suite, run when named: `--analyses geometry`
    result_type=GeometryResult,
    settings=GeometrySettings,
    identity=lambda s: {"geometry_sink_threshold": s.geometry_sink_threshold},
    run=lambda x: geometry(x.model.params, x.batch, x.model.config, sink_threshold=x.settings.geometry_sink_threshold),
    figures=lambda r, tokenizer, n: {"": geometry_figure(r)},
    summary=_summary,
    depth=depth_reading,
)
