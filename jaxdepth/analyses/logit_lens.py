"""Logit lens: how close is each layer's residual, read through the final norm and LM head,
to the model's real output distribution (METHODS §2).

The lens reads the residual boundaries h_0..h_{L-1}: h_0 is the embeddings, h_l the input of
layer l, so entry l of every curve says how far the first l layers have come. h_L, the final
residual, is the output itself (KL 0, overlap 1) and is not part of the curves. At each position,
P_l = softmax(unembed(h_l)) (the final RMSNorm, then the LM head) and P is the model's output
distribution; the statistics are KL(P_l || P) in nats and the top-5 overlap
|top5(P_l) ∩ top5(P)| / 5. Every valid position of every prompt counts, question and answer.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import TYPE_CHECKING, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxdepth.core.batch import PromptBatch
from jaxdepth.core.compilation import jit
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.model import residual_stream, unembed
from jaxdepth.core.sharding import to_host
from jaxdepth.core.saved_result import SavedResult
from jaxdepth.analyses.stats import per_prompt_mean, prompt_mean, token_mean
from jaxdepth.analyses.suite import Analysis, DepthCurve, DepthReading, Settings, option
from jaxdepth.analyses.effective_depth import kl_effective_depth, overlap_effective_depth
from jaxdepth.analyses.metrics import kl_divergence
from jaxdepth.analyses.tuned_lens import translate
from jaxdepth.analyses.uncertainty import DEFAULT_RESAMPLES, DEFAULT_SEED

if TYPE_CHECKING:  # matplotlib is imported when a figure is drawn, not with the analysis
    from matplotlib.figure import Figure

__all__ = [
    "logit_lens",
    "LogitLensResult",
    "lens_per_token",
    "lens_statistics",
    "map_lens",
    "logit_lens_figure",
    "LogitLensSettings",
    "TOP_K",
    "ANALYSIS",
    "depth_reading",
]

TOP_K = 5


def lens_statistics(layer_logits, final_logits, final_top):
    """KL(P_l || P) in nats and top-k overlap per position, from a layer's logits `[..., V]`,
    the final logits `[..., V]` (log-probabilities serve too: the same distribution) and the
    final top-k token ids `[..., k]`. The KL is `jaxdepth.analyses.metrics.kl_divergence`, the
    layer's distribution first."""
    kl = kl_divergence(layer_logits, final_logits)
    k = final_top.shape[-1]
    top_l = jax.lax.top_k(layer_logits, k)[1]
    overlap = jnp.sum(top_l[..., :, None] == final_top[..., None, :], axis=(-2, -1)) / k
    return kl, overlap


@partial(jit, static_argnames="config")
def lens_per_token(params, tokens, valid, config: ModelConfig, translators=None, interventions=None):
    """KL and top-5 overlap `[L, B, T]` each, row l read from h_l (l = 0..L-1: the embeddings,
    then each layer's input; not h_L, which is the output). Values at padded positions (`valid`
    false) are meaningless: `logit_lens` leaves them out. Layers are read one at a time
    (`lax.map`), so only one `[B, T, V]` logit tensor exists at once. With `translators` (a
    tuned lens's), each h_l goes through its layer's translator before the final norm and LM
    head.

    Under `interventions` (anything `jaxdepth.core.sites.as_interventions` takes) the lens reads
    h_0..h_{L-1} of the intervened run (each after the interventions at its `resid_pre`) and
    compares them with the intervened run's output."""
    hs = residual_stream(params, tokens, config, valid=valid, interventions=interventions)
    final = unembed(params, hs[-1], config)  # float32, as `kl_divergence` reads it
    final_top = jax.lax.top_k(final, TOP_K)[1]
    return map_lens(lambda logits: lens_statistics(logits, final, final_top), params, hs[:-1], config, translators)


def map_lens(read, params, hs, config: ModelConfig, translators=None):
    """`read(lens logits [B, T, V])` of each residual boundary of `hs [n, B, T, D]` (h_0..h_{n-1}),
    stacked on a leading axis: each read through the final norm and LM head (after its
    layer's translator where a tuned lens's `translators` are given), one boundary at a time
    (`lax.map`), so that only one `[B, T, V]` logit tensor exists at once."""
    if translators is None:
        return jax.lax.map(lambda h: read(unembed(params, h, config)), hs)
    return jax.lax.map(
        lambda x: read(unembed(params, translate(*x), config)), (hs, translators["weight"], translators["bias"])
    )


@dataclasses.dataclass
class LogitLensResult(SavedResult):
    """Curves `kl` (nats) and `overlap` (0..1) `[L]`, entry l read from h_l (l = 0..L-1: the
    embeddings, then each layer's input; module docstring), aggregated over positions and
    prompts as `settings['weighting']` says. `settings` also holds 'lens' ('logit' or 'tuned')
    and whatever the caller passed.

    `kl_per_prompt` and `overlap_per_prompt [N, L]` hold each prompt's mean over its own valid
    positions and `tokens_per_prompt [N]` its number of valid positions: the curves are their
    plain mean over prompts ('prompt' weighting) or their token-count-weighted mean ('token').
    Results saved before per-prompt curves existed load with them None.
    """

    kl: np.ndarray
    overlap: np.ndarray
    settings: dict
    kl_per_prompt: Optional[np.ndarray] = None
    overlap_per_prompt: Optional[np.ndarray] = None
    tokens_per_prompt: Optional[np.ndarray] = None


def logit_lens(
    params,
    batch: PromptBatch,
    config: ModelConfig,
    *,
    weighting: str = "prompt",
    translators=None,
    settings=None,
    interventions=None,
) -> LogitLensResult:
    """KL(P_l || P) and top-5 overlap of h_0..h_{L-1} over every valid position of `batch` (a
    `PromptBatch`, e.g. from `jaxdepth.lab.prompts.encode`): a `LogitLensResult` of curves
    `[L]`. `weighting` is 'prompt' (mean over positions, then over prompts: the default) or
    'token' (mean over all tokens). Per-prompt curves are kept whichever the weighting. With
    `translators` (`TunedLens.translators()`), the curves are the tuned lens's
    (`settings['lens']` says which lens read them). `settings` (a dict) is stored in the
    result's.

    `interventions` (`jaxdepth.core.sites`; default none) act on every forward: the lens of the
    intervened model (see `lens_per_token`). The prompts run in groups at their own padded
    lengths (`PromptBatch.groups`), so intervention data indexed by position must broadcast to
    every length (`[L, 1]` keep-masks, head ablations, a vector added at every position); data
    that does not is refused at trace time."""
    aggregate = {"prompt": prompt_mean, "token": token_mean}
    if weighting not in aggregate:
        raise ValueError(f"weighting must be 'prompt' or 'token', got {weighting!r}")
    # Prompts of similar length together (`PromptBatch.groups`), each group trimmed to its own
    # padded length: little compute spent on padding, enough rows per LM-head matmul, and
    # `[B, T, V]` buffers of bounded size.
    L, T = config.num_layers, batch.tokens.shape[1]
    kl, overlap = np.zeros((L, len(batch), T), np.float32), np.zeros((L, len(batch), T), np.float32)
    for index, group in batch.groups():
        k, o = lens_per_token(params, group.tokens, group.valid, config, translators, interventions)
        Tg = group.tokens.shape[1]
        kl[:, index, :Tg], overlap[:, index, :Tg] = to_host(k)[:, : len(index)], to_host(o)[:, : len(index)]
    agg = aggregate[weighting]
    # Per-prompt means from the same per-position statistics (no second pass through the model).
    per_prompt = lambda x: per_prompt_mean(x, batch.valid).T  # [N, L]
    return LogitLensResult(
        kl=agg(kl, batch.valid),
        overlap=agg(overlap, batch.valid),
        settings={**(settings or {}), "weighting": weighting, "lens": "logit" if translators is None else "tuned"},
        kl_per_prompt=per_prompt(kl),
        overlap_per_prompt=per_prompt(overlap),
        tokens_per_prompt=batch.lengths.astype(np.int64),
    )


# ----------------------------------------------------------------------------- figures


def logit_lens_figure(
    result: LogitLensResult,
    *,
    kl_fraction: float = 0.5,
    overlap_threshold: float = 0.3,
    title: Optional[str] = None,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = DEFAULT_SEED,
) -> Figure:
    """KL(P_l || P) and top-5 overlap with the final output per layer, with the thresholds of the
    KL and overlap effective depths (horizontal) and the depths themselves (vertical). Where the
    result has per-prompt curves, each prompt's curves are faint lines and, with `resamples > 0`,
    a shaded 95% bootstrap band over prompts (`seed` as in `uncertainty`) surrounds each curve,
    and the titles give the EDs' intervals."""
    from jaxdepth.analyses import drawing as d

    d.expect(result, LogitLensResult, "logit_lens_figure")
    L = len(result.kl)
    layers = np.arange(L)
    kl_ed = d.depth_or_none(kl_effective_depth, result.kl, kl_fraction)
    overlap_ed = d.depth_or_none(overlap_effective_depth, result.overlap, overlap_threshold)
    bands, intervals = d.bootstrap(
        result, resamples, seed, kl_fraction=kl_fraction, overlap_threshold=overlap_threshold
    )
    fig = d.new_figure(11, 4.2)
    kl_ax, overlap_ax = fig.subplots(1, 2, sharex=True)
    d.draw_per_prompt(kl_ax, layers, result.kl_per_prompt, "C0")
    d.draw_per_prompt(overlap_ax, layers, result.overlap_per_prompt, "C1")
    kl_ax.plot(layers, result.kl, marker=".", color="C0", label="KL")
    d.draw_band(kl_ax, layers, bands.get("kl"), "C0")
    kl_ax.axhline(kl_fraction * np.nanmax(result.kl), color="grey", linestyle="--", label=f"{kl_fraction:g} x max KL")
    d.mark_depth(kl_ax, kl_ed, "KL ED")
    overlap_ax.plot(layers, result.overlap, marker=".", color="C1", label="top-5 overlap")
    d.draw_band(overlap_ax, layers, bands.get("overlap"), "C1")
    overlap_ax.axhline(overlap_threshold, color="grey", linestyle="--", label=f"threshold {overlap_threshold:g}")
    d.mark_depth(overlap_ax, overlap_ed, "overlap ED")
    overlap_ax.set_ylim(-0.02, 1.02)
    kl_ax.set(ylabel=d.KL_LABEL, title=d.depth_text("KL", kl_ed, intervals.get("kl")))
    overlap_ax.set(ylabel="top-5 overlap with P", title=d.depth_text("overlap", overlap_ed, intervals.get("overlap")))
    for ax in (kl_ax, overlap_ax):
        d.layer_axis(ax, L)
        ax.legend(fontsize=8)
    weighting = result.settings.get("weighting")
    d.title_figure(fig, "Logit lens" + (f", {weighting}-weighted" if weighting else ""), title, result.settings)
    return fig


# ----------------------------------------------------------------------------- in the suite


@dataclasses.dataclass(frozen=True, kw_only=True)
class LogitLensSettings(Settings):
    """The logit lens's settings in a study (`Settings` and its options)."""

    lens_weighting: str = option(
        "prompt",
        "logit lens: average each prompt's positions, then the prompts (default), or every token at once",
        choices=("prompt", "token"),
    )


def depth_reading(result: LogitLensResult) -> DepthReading:
    """The KL and top-5 overlap effective depths of `result`, for the table and the comparison,
    and both curves at the boundaries l / L. The logit lens of h_L is the output itself (P_L = P:
    KL 0, overlap 1), which closes each curve at 1, so that every layer's change of it is known;
    a tuned lens's curves end at h_{L-1}, as read."""
    kl, overlap = kl_effective_depth(result.kl), overlap_effective_depth(result.overlap)
    L = kl.num_layers
    kl_curve, overlap_curve = np.asarray(result.kl, np.float64), np.asarray(result.overlap, np.float64)
    if result.settings.get("lens", "logit") == "logit":
        kl_curve, overlap_curve = np.append(kl_curve, 0.0), np.append(overlap_curve, 1.0)
    x = np.arange(len(kl_curve)) / L
    return DepthReading(
        num_layers=L,
        effective_depths={"kl": kl, "overlap": overlap},
        ratios={"kl": ("KL ED", kl.ratio), "overlap": ("top-5 overlap ED", overlap.ratio)},
        curves={
            "kl": DepthCurve("logit lens: KL(P_l || P)", "nats", x, kl_curve),
            "overlap": DepthCurve("logit lens: top-5 overlap with P", "overlap", x, overlap_curve),
        },
        per_prompt=result.tokens_per_prompt is not None,
    )


ANALYSIS = Analysis(
    name="logit_lens",
    result_type=LogitLensResult,
    settings=LogitLensSettings,
    identity=lambda s: {"lens_weighting": s.lens_weighting},
    run=lambda x: logit_lens(x.model.params, x.batch, x.model.config, weighting=x.settings.lens_weighting),
    figures=lambda r, tokenizer, n: {"": logit_lens_figure(r)},
    summary=lambda r: [f"KL ED {kl_effective_depth(r.kl)}", f"overlap ED {overlap_effective_depth(r.overlap)}"],
    feeds_table=True,
    depth=depth_reading,
)
