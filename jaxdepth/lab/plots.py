"""Figures of the two studies, drawn from result objects (load saved ones with
`jaxdepth.lab.results.load_result`; plotting never recomputes anything).

Every function returns a `matplotlib.figure.Figure` built directly on an Agg canvas: no pyplot,
so no global figure registry, nothing left open between figures and no display needed. Write a
figure with `save_figure`.
"""

from __future__ import annotations

import dataclasses
import operator
import os
from typing import Callable, Mapping, Optional, Sequence, Union

import matplotlib
import matplotlib.ticker
import numpy as np
from matplotlib import patheffects
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import LineCollection
from matplotlib.colors import Colormap
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from jaxdepth.core.atomic import atomic_write
from jaxdepth.analyses.attribution import AttributionResult
from jaxdepth.analyses.contributions import ContributionResult
from jaxdepth.analyses.effective_depth import (
    EffectiveDepth,
    cosine_effective_depth,
    depth_score,
    kl_effective_depth,
    overlap_effective_depth,
)
from jaxdepth.analyses.erasure import ErasureResult
from jaxdepth.analyses.integrated_gradients import IntegratedGradientsResult
from jaxdepth.analyses.layer_skip import LayerSkipResult
from jaxdepth.analyses.logit_lens import LogitLensResult
from jaxdepth.analyses.uncertainty import (
    DEFAULT_RESAMPLES,
    DEFAULT_SEED,
    CurveBand,
    DepthInterval,
    curve_bands,
    effective_depth_intervals,
    has_per_prompt,
)

DPI = 150
MAX_TOKEN_LABELS = 60  # beyond this many tokens, tick labels would overlap: label every k-th
_KL_LABEL = r"KL$(P_l \,\|\, P)$ [nats]"
_SKIP_CMAP = matplotlib.colormaps["viridis"].with_extremes(bad="0.85")  # grey: zero by construction


class ResultTypeError(TypeError, ValueError):
    """A plotting function got a result of the wrong type (a ValueError, and a TypeError)."""


# ----------------------------------------------------------------------------- helpers


def _new_figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)  # render with Agg whatever backend pyplot may be using elsewhere
    return fig


def _expect(result, kind: type, what: str):
    if not isinstance(result, kind):
        raise ResultTypeError(f"{what} needs a {kind.__name__}, got {type(result).__name__}")


def _prompt_index(result, prompt) -> int:
    count = result.tokens.shape[0]
    i = operator.index(prompt)
    if not 0 <= i < count:
        raise ValueError(f"prompt index {i} is out of range: the result holds {count} prompt(s)")
    return i


def _depth(rule: Callable[..., EffectiveDepth], curve, *args) -> Optional[EffectiveDepth]:
    """The effective depth, or None where it is undefined (e.g. a NaN curve): a figure of a broken
    curve is still worth drawing, the title then says 'n/a'."""
    try:
        return rule(curve, *args)
    except ValueError:
        return None


def _depth_text(name: str, ed: Optional[EffectiveDepth], interval: Optional[DepthInterval] = None) -> str:
    if ed is None:
        return f"{name} ED: n/a"
    bounds = (
        ""
        if interval is None
        else " [{}, {}]".format(*("none" if b is None else b for b in (interval.low, interval.high)))
    )
    return f"{name} ED: {ed.layer}{bounds} (ratio {ed.ratio:.2f})" if ed.found else f"{name} ED: no crossing{bounds}"


def _bootstrap(result, resamples: int, seed: int, **thresholds):
    """`(bands, intervals)` of a result with per-prompt curves when `resamples > 0`, else empty
    dicts; empty too where a resampled curve is undefined (NaN): the figure is drawn anyway."""
    if resamples <= 0 or not has_per_prompt(result):
        return {}, {}
    try:
        return (
            curve_bands(result, resamples=resamples, seed=seed),
            effective_depth_intervals(result, resamples=resamples, seed=seed, **thresholds),
        )
    except ValueError:
        return {}, {}


def _draw_band(ax, layers, band: Optional[CurveBand], color: str, label: bool = True):
    """The bootstrap band of an aggregate curve, shaded; labelled once per panel."""
    if band is not None:
        ax.fill_between(
            layers,
            band.low,
            band.high,
            color=color,
            alpha=0.2,
            linewidth=0,
            label=f"{band.level:.0%} bootstrap band ({band.resamples} resamples)" if label else None,
        )


def _draw_per_prompt(ax, layers, per_prompt: Optional[np.ndarray], color: str):
    """Each prompt's own curve, faint (fainter the more prompts), under the aggregate: the spread
    that the mean curve hides. One collection, so a thousand prompts stay cheap to draw."""
    if per_prompt is None:
        return
    segments = [np.column_stack([layers, c]) for c in np.asarray(per_prompt)]
    ax.add_collection(
        LineCollection(
            segments,
            colors=color,
            linewidths=0.7,
            zorder=1,
            alpha=float(np.clip(3.0 / len(segments), 0.08, 0.35)),
            label=f"per prompt (N={len(segments)})",
        )
    )
    ax.autoscale_view()


def _mark_depth(ax, ed: Optional[EffectiveDepth], label: str, color: str = "C3"):
    """A vertical line at the effective depth, labelled so a legend (and a test) can find it."""
    if ed is not None and ed.found:
        ax.axvline(ed.layer, color=color, linestyle=":", linewidth=1.5, label=f"{label} = {ed.layer}")


def _layer_axis(ax, num_layers: int):
    ax.set_xlabel("layer l")
    ax.set_xlim(-0.5, num_layers - 0.5)
    ax.grid(alpha=0.3)


def _title(fig: Figure, default: str, title: Optional[str], settings: Optional[dict] = None):
    """Suptitle: the caller's title, else a default naming the model and dataset when the result's
    settings record them (study runs do)."""
    if title is None:
        identity = (settings or {}).get("identity", {})
        where = ", ".join(str(identity[k]) for k in ("model", "dataset") if k in identity)
        title = f"{default} ({where})" if where else default
    fig.suptitle(title)


# Whitespace made visible in token labels: a leading space or a newline is often the whole
# difference between two tokens. (DejaVu Sans, matplotlib's default font, has all of these.)
_VISIBLE_WHITESPACE = {" ": "\u2423", "\n": "\u21b5", "\t": "\u21e5", "\r": "\u23ce"}  # ␣ ↵ ⇥ ⏎


def _label_text(text: str) -> str:
    text = "".join(_VISIBLE_WHITESPACE.get(c, c) for c in text)
    return text.replace("$", r"\$")  # '$' starts mathtext: GSM8K prices would garble or fail to render


def _token_labels(token_ids: Sequence[int], tokenizer) -> list[str]:
    """Tick labels for token ids: each id decoded alone to text (no byte-level markers such as
    'Ġ'), whitespace made visible; a tokenizer without `decode` gives its token strings, and no
    tokenizer gives the positions."""
    ids = [int(t) for t in token_ids]
    if tokenizer is None:
        return [str(p) for p in range(len(ids))]
    if hasattr(tokenizer, "decode"):
        texts = [tokenizer.decode([t]) for t in ids]
    else:
        texts = tokenizer.convert_ids_to_tokens(ids)
    return [_label_text(str(t)) for t in texts]


# Colour-scale percentiles: one token column (e.g. integrated gradients at the first token) is
# 1/T of a heatmap's cells, under 5% from T = 20 on; one skipped-layer row of a layer-skip
# matrix is 2/L of its upper triangle, under 10% from L = 20 on.
TOKEN_HEATMAP_PERCENTILE = 95.0
LAYER_SKIP_PERCENTILE = 90.0


def robust_limit(
    values: np.ndarray, percentile: float = TOKEN_HEATMAP_PERCENTILE, dominance: float = 2.0
) -> tuple[float, bool]:
    """An upper colour limit for |values| that a single extreme cell does not set: the largest
    |value|, unless it exceeds `dominance` x the `percentile`-th percentile, then that percentile
    (returned with True: the scale is clipped). Non-finite cells are ignored."""
    magnitudes = np.abs(np.asarray(values, np.float64))
    magnitudes = magnitudes[np.isfinite(magnitudes)]
    if magnitudes.size == 0 or magnitudes.max() == 0:
        return 1.0, False
    top, typical = float(magnitudes.max()), float(np.percentile(magnitudes, percentile))
    if typical > 0 and top > dominance * typical:
        return typical, True
    return top, False


def _clipped_label(label: str, limit: float, top: float, clipped: bool, percentile: float) -> str:
    return (
        f"{label}\n(scale clipped at the {percentile:g}th percentile |value| {limit:.3g}; max {top:.3g})"
        if clipped
        else label
    )


@dataclasses.dataclass(frozen=True)
class TokenPanel:
    """One layer x token heatmap: `values [rows, tokens]` (first row drawn at the bottom), token
    tick labels, the answer start to mark, and how to colour it (`symmetric`: [-limit, limit]
    around the colormap's centre, else [0, limit]). `caption` titles the panel."""

    values: np.ndarray
    labels: Sequence[str]
    row_label: str
    answer_start: int
    cmap: Union[str, Colormap]
    symmetric: bool
    colorbar_label: str
    caption: str = ""
    flagged_rows: Sequence[int] = ()  # rows outlined and named in the legend by `flag_label`
    flag_label: str = ""


def _panel_size(panel: TokenPanel) -> tuple[float, float]:
    rows, n = panel.values.shape
    return (min(max(4.0 + 0.13 * min(n, MAX_TOKEN_LABELS * 2), 7.0), 20.0), min(max(2.5 + 0.14 * rows, 4.0), 11.0))


def _draw_token_panel(fig: Figure, ax, panel: TokenPanel):
    """Draw `panel` on `ax` with its colour bar. The colour limit comes from `robust_limit`:
    clipped, and said so, when one cell dwarfs the rest; a vertical line marks the answer start."""
    values = panel.values
    limit, clipped = robust_limit(values)
    top = float(np.nanmax(np.abs(values))) if np.isfinite(values).any() else 0.0
    vmin, vmax = (-limit if panel.symmetric else 0.0), limit
    colorbar_label = _clipped_label(panel.colorbar_label, limit, top, clipped, TOKEN_HEATMAP_PERCENTILE)
    n = values.shape[1]
    image = ax.imshow(
        values, aspect="auto", origin="lower", interpolation="nearest", cmap=panel.cmap, vmin=vmin, vmax=vmax
    )
    step = max(1, -(-n // MAX_TOKEN_LABELS))
    ticks = np.arange(0, n, step)
    ax.set_xticks(ticks, [panel.labels[t] for t in ticks], rotation=90, fontsize=7)
    ax.set_xlabel("token" if step == 1 else f"token (one label every {step} tokens)")
    ax.set_ylabel(panel.row_label)
    ax.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))  # rows are layers
    if panel.caption:
        ax.set_title(panel.caption, fontsize=10)
    for k, row in enumerate(panel.flagged_rows):
        ax.add_patch(
            Rectangle(
                (-0.5, row - 0.5),
                n,
                1,
                fill=False,
                edgecolor="lime",
                linewidth=1.2,
                linestyle="--",
                label=panel.flag_label if k == 0 else None,
            )
        )
    if 0 < panel.answer_start < n or panel.flagged_rows:
        # A white halo keeps the line visible on dark (magma) and on white (RdBu centre) cells.
        if 0 < panel.answer_start < n:
            ax.axvline(
                panel.answer_start - 0.5,
                color="k",
                linewidth=1.5,
                linestyle="--",
                label="answer start",
                path_effects=[patheffects.withStroke(linewidth=3.5, foreground="w")],
            )
        ax.legend(loc="upper left", fontsize=8, framealpha=0.8)
    fig.colorbar(
        image,
        ax=ax,
        label=colorbar_label,
        pad=0.01,
        extend=("both" if panel.symmetric else "max") if clipped else "neither",
    )


def _token_heatmap(panel: TokenPanel) -> Figure:
    """A figure of one token panel, sized to its rows and tokens."""
    fig = _new_figure(*_panel_size(panel))
    _draw_token_panel(fig, fig.add_subplot(), panel)
    return fig


def stacked_token_figure(
    panels: Sequence[TokenPanel], *, title: Optional[str] = None, settings: Optional[dict] = None
) -> Figure:
    """Token panels one above the other, on one token axis each (e.g. a case study's erasure and
    integrated gradients of the same prompt). `settings` (a result's) name the model and
    dataset in the default title."""
    if not panels:
        raise ValueError("stacked_token_figure needs at least one panel")
    sizes = [_panel_size(p) for p in panels]
    fig = _new_figure(max(w for w, _ in sizes), sum(h for _, h in sizes))
    axes = np.atleast_1d(fig.subplots(len(panels), 1, height_ratios=[h for _, h in sizes]))
    for ax, panel in zip(axes, panels):
        _draw_token_panel(fig, ax, panel)
    _title(fig, "Per-token analyses", title, settings)
    return fig


# ----------------------------------------------------------------------------- figures


def contributions_figure(
    result: ContributionResult,
    *,
    title: Optional[str] = None,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = DEFAULT_SEED,
) -> Figure:
    """Cosine of the attention, MLP and layer outputs with the residual (and their mean, which the
    cosine effective depth reads) and their relative norms, per layer; the cosine ED is a vertical
    line in both panels. Where the result has per-prompt curves, each prompt's mean cosine is a
    faint line and, with `resamples > 0`, a shaded 95% bootstrap band over prompts (`seed` as in
    `uncertainty`) surrounds the mean cosine and the norms, and the title gives the ED's interval."""
    _expect(result, ContributionResult, "contributions_figure")
    L = len(result.cos_layer)
    layers = np.arange(L)
    ed = _depth(cosine_effective_depth, result.mean_cosine)
    bands, intervals = _bootstrap(result, resamples, seed)
    fig = _new_figure(11, 4.2)
    cos_ax, norm_ax = fig.subplots(1, 2, sharex=True)
    _draw_per_prompt(cos_ax, layers, result.mean_cosine_per_prompt, "0.5")
    for i, name in enumerate(("attn", "mlp", "layer")):
        cos_ax.plot(layers, getattr(result, f"cos_{name}"), marker=".", label=name)
        norm_ax.plot(layers, getattr(result, f"norm_{name}"), marker=".", label=name)
        _draw_band(norm_ax, layers, bands.get(f"norm_{name}"), f"C{i}", label=i == 0)
    cos_ax.plot(layers, result.mean_cosine, color="k", linestyle="--", label="mean")
    _draw_band(cos_ax, layers, bands.get("mean_cosine"), "k")
    cos_ax.axhline(0, color="grey", linewidth=0.8)
    for ax in (cos_ax, norm_ax):
        _mark_depth(ax, ed, "cosine ED")
        _layer_axis(ax, L)
        ax.legend(fontsize=8)
    cos_ax.set(ylabel="cosine with the residual", title=_depth_text("cosine", ed, intervals.get("cosine")))
    norm_ax.set(ylabel="||contribution|| / ||residual||", title="relative norm")
    # The first layers' norms are often tens of times the rest: a log axis keeps both readable.
    norms = np.stack([result.norm_attn, result.norm_mlp, result.norm_layer])
    if np.all(norms[np.isfinite(norms)] > 0):
        norm_ax.set_yscale("log")
    _title(fig, "Layer contributions", title, result.settings)
    return fig


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
    _expect(result, LogitLensResult, "logit_lens_figure")
    L = len(result.kl)
    layers = np.arange(L)
    kl_ed = _depth(kl_effective_depth, result.kl, kl_fraction)
    overlap_ed = _depth(overlap_effective_depth, result.overlap, overlap_threshold)
    bands, intervals = _bootstrap(result, resamples, seed, kl_fraction=kl_fraction, overlap_threshold=overlap_threshold)
    fig = _new_figure(11, 4.2)
    kl_ax, overlap_ax = fig.subplots(1, 2, sharex=True)
    _draw_per_prompt(kl_ax, layers, result.kl_per_prompt, "C0")
    _draw_per_prompt(overlap_ax, layers, result.overlap_per_prompt, "C1")
    kl_ax.plot(layers, result.kl, marker=".", color="C0", label="KL")
    _draw_band(kl_ax, layers, bands.get("kl"), "C0")
    kl_ax.axhline(kl_fraction * np.nanmax(result.kl), color="grey", linestyle="--", label=f"{kl_fraction:g} x max KL")
    _mark_depth(kl_ax, kl_ed, "KL ED")
    overlap_ax.plot(layers, result.overlap, marker=".", color="C1", label="top-5 overlap")
    _draw_band(overlap_ax, layers, bands.get("overlap"), "C1")
    overlap_ax.axhline(overlap_threshold, color="grey", linestyle="--", label=f"threshold {overlap_threshold:g}")
    _mark_depth(overlap_ax, overlap_ed, "overlap ED")
    overlap_ax.set_ylim(-0.02, 1.02)
    kl_ax.set(ylabel=_KL_LABEL, title=_depth_text("KL", kl_ed, intervals.get("kl")))
    overlap_ax.set(ylabel="top-5 overlap with P", title=_depth_text("overlap", overlap_ed, intervals.get("overlap")))
    for ax in (kl_ax, overlap_ax):
        _layer_axis(ax, L)
        ax.legend(fontsize=8)
    weighting = result.settings.get("weighting")
    _title(fig, "Logit lens" + (f", {weighting}-weighted" if weighting else ""), title, result.settings)
    return fig


def lens_comparison_figure(
    results: Mapping[str, LogitLensResult],
    *,
    kl_fraction: float = 0.5,
    overlap_threshold: float = 0.3,
    title: Optional[str] = None,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = DEFAULT_SEED,
) -> Figure:
    """Several readings of the same residual streams side by side (e.g. `{"logit lens": ...,
    "tuned lens": ...}`): KL(P_l || P) and top-5 overlap per layer, one colour per lens, with
    bootstrap bands, each lens's effective depths (vertical) and the thresholds (horizontal)."""
    for result in results.values():
        _expect(result, LogitLensResult, "lens_comparison_figure")
    fig = _new_figure(11, 4.2)
    kl_ax, overlap_ax = fig.subplots(1, 2, sharex=True)
    for k, (name, result) in enumerate(results.items()):
        color, layers = f"C{k}", np.arange(len(result.kl))
        bands, intervals = _bootstrap(
            result, resamples, seed, kl_fraction=kl_fraction, overlap_threshold=overlap_threshold
        )
        for ax, curve, method, rule, arg in (
            (kl_ax, result.kl, "kl", kl_effective_depth, kl_fraction),
            (overlap_ax, result.overlap, "overlap", overlap_effective_depth, overlap_threshold),
        ):
            ed = _depth(rule, curve, arg)
            label = _depth_text(method if method == "overlap" else "KL", ed, intervals.get(method))
            ax.plot(layers, curve, marker=".", color=color, label=f"{name}: {label}")
            _draw_band(ax, layers, bands.get(method), color, label=False)
            if ed is not None and ed.found:
                ax.axvline(ed.layer, color=color, linestyle=":", linewidth=1.5)
        kl_ax.axhline(kl_fraction * np.nanmax(result.kl), color=color, linestyle="--", linewidth=0.8)
    overlap_ax.axhline(overlap_threshold, color="grey", linestyle="--", label=f"threshold {overlap_threshold:g}")
    overlap_ax.set_ylim(-0.02, 1.02)
    kl_ax.set(ylabel=_KL_LABEL, title=f"KL (dashed: {kl_fraction:g} x each lens's max)")
    overlap_ax.set(ylabel="top-5 overlap with P", title="top-5 overlap")
    for ax in (kl_ax, overlap_ax):
        _layer_axis(ax, len(next(iter(results.values())).kl))
        ax.legend(fontsize=7)
    first = next(iter(results.values()))
    _title(fig, " vs ".join(results), title, first.settings)
    return fig


def layer_skip_figure(
    results: Union[LayerSkipResult, Mapping[str, LayerSkipResult]], *, title: Optional[str] = None
) -> Figure:
    """Effect of skipping layer s on every later layer's contribution (heatmap, s on the y axis,
    measured layer j on the x axis) and on the output (bars sharing the s axis), one row per
    sublayer when given a dict `name -> LayerSkipResult`. Cells zero by construction (j <= s in
    the 'future' mode, j < s in the 'current' mode, whose diagonal is measured) are drawn grey;
    all heatmaps share one colour scale so sublayers compare directly."""
    if isinstance(results, LayerSkipResult):
        results = {results.settings.get("sublayer", "layer"): results}
    if not isinstance(results, Mapping):
        raise ResultTypeError(
            f"layer_skip_figure needs a LayerSkipResult or a dict of them, got {type(results).__name__}"
        )
    rows = dict(results)
    if not rows:
        raise ValueError("layer_skip_figure needs at least one LayerSkipResult")
    for name, result in rows.items():
        _expect(result, LayerSkipResult, f"layer_skip_figure ({name!r})")
    # One scale for every sublayer, read from the cells that are not zero by construction: a
    # single extreme cell (skipping layer 0 often changes everything) would otherwise leave the
    # rest of the matrix one colour.
    # Grey: zero by causality (j <= s in the 'future' mode, j < s in the 'current' one).
    first = lambda r: 0 if r.settings.get("mode") == "current" else 1
    shown = {
        name: np.where(np.triu(np.ones_like(r.later, bool), k=first(r)), r.later, np.nan) for name, r in rows.items()
    }
    measured = np.concatenate([m[np.isfinite(m)] for m in shown.values()])
    vmax, clipped = robust_limit(measured, LAYER_SKIP_PERCENTILE)
    top = float(measured.max()) if measured.size else 0.0
    out_max = max(float(np.nanmax(r.output)) for r in rows.values()) or 1.0
    L = max(len(r.output) for r in rows.values())
    size = min(max(3.0, 0.12 * L + 2.0), 6.0)
    fig = _new_figure(size * 1.75 + 1.5, size * len(rows) + 0.6)
    axes = fig.subplots(len(rows), 2, squeeze=False, width_ratios=[3, 1])
    for (name, result), (heat_ax, out_ax) in zip(rows.items(), axes):
        n = len(result.output)
        image = heat_ax.imshow(
            shown[name], origin="upper", interpolation="nearest", aspect="auto", cmap=_SKIP_CMAP, vmin=0.0, vmax=vmax
        )
        try:
            score = f"depth score {depth_score(result.later):.2f}"
        except ValueError:
            score = "depth score undefined"
        mode = result.settings.get("mode")
        heat_ax.set(
            xlabel="measured layer j",
            ylabel="skipped layer s",
            title=f"{name}{f' ({mode})' if mode else ''}: later layers, {score}",
        )
        # Horizontal bars share the skipped-layer axis, so row s of the heatmap and bar s align.
        out_ax.sharey(heat_ax)
        out_ax.barh(np.arange(n), result.output, color="C3", height=0.8)
        out_ax.set(xlabel=r"$\|y - \bar{y}\|_2$ (max)", title="output", xlim=(0, out_max * 1.05))
        out_ax.grid(axis="x", alpha=0.3)
    # Below the heatmap column: to its right it would sit between heatmaps and bars.
    fig.colorbar(
        image,
        ax=axes[:, 0].tolist(),
        location="bottom",
        shrink=0.8,
        aspect=40,
        extend="max" if clipped else "neither",
        label=_clipped_label(
            r"$\|\Delta_j - \bar{\Delta}_j\| \,/\, \|\Delta_j\|$ (max)", vmax, top, clipped, LAYER_SKIP_PERCENTILE
        ),
    )
    _title(fig, "Effect of skipping a layer", title, next(iter(rows.values())).settings)
    return fig


def erasure_panel(result: ErasureResult, prompt: int = 0, *, tokenizer=None) -> TokenPanel:
    """The erasure heatmap of one prompt as a `TokenPanel` (see `erasure_figure`)."""
    _expect(result, ErasureResult, "erasure_panel")
    p = _prompt_index(result, prompt)
    n = int(result.lengths[p])
    return TokenPanel(
        result.effects[p, :, :n],
        _token_labels(result.tokens[p, :n], tokenizer),
        row_label="erased boundary l (0 = embeddings)",
        answer_start=int(result.answer_start[p]),
        cmap="magma",
        symmetric=False,
        colorbar_label=r"max over answer of $\|y - \bar{y}\|_2$",
        caption="residual erasure",
    )


def erasure_figure(result: ErasureResult, prompt: int = 0, *, tokenizer=None, title: Optional[str] = None) -> Figure:
    """Residual erasure of one prompt: the effect on the answer predictions of erasing h_l[t],
    boundary l = 0..L (y) by token t (x). `tokenizer` (its `decode`, else `convert_ids_to_tokens`)
    labels the tokens; None labels positions."""
    fig = _token_heatmap(dataclasses.replace(erasure_panel(result, prompt, tokenizer=tokenizer), caption=""))
    _title(fig, f"Residual erasure, prompt {_prompt_index(result, prompt)}", title, result.settings)
    return fig


_IG_ROWS = {
    "layer": r"layer l (output $h_{l+1}$)",
    "attn": r"layer l (attention output $a_l$)",
    "mlp": r"layer l (MLP output $m_l$)",
}


def relative_gaps(result: IntegratedGradientsResult, prompt: int = 0) -> np.ndarray:
    """`[L]` each layer's |completeness gap| / |F(x) - F(b_l)| of one prompt (NaN where F did not
    move): the share of the effect that the attributions fail to account for."""
    p = _prompt_index(result, prompt)
    with np.errstate(divide="ignore", invalid="ignore"):
        relative = np.abs(result.gap[p]) / np.abs(result.f_input[p] - result.f_baseline[p])
    return np.where(np.isfinite(relative), relative, np.nan)


def _ig_caption(result: IntegratedGradientsResult, p: int, name: str = "integrated gradients") -> str:
    relative = relative_gaps(result, p)
    share = (
        f", up to {100 * np.nanmax(relative):.3g}% of |F(x) \N{MINUS SIGN} F(b)|" if np.isfinite(relative).any() else ""
    )
    gap = f"max |completeness gap| = {np.nanmax(np.abs(result.gap[p])):.3g}{share}"
    converged = getattr(result, "converged", None)  # the adaptive rule's result
    if converged is not None:
        return (
            f"{name}, {result.rule}: {int(converged[p].sum())} of {converged.shape[1]} layers converged, "
            f"{int(result.evaluations[p].sum())} gradient evaluations; {gap}"
        )
    return f"{name}, {result.rule}: {gap}"


def integrated_gradients_panel(result: IntegratedGradientsResult, prompt: int = 0, *, tokenizer=None) -> TokenPanel:
    """The IG heatmap of one prompt as a `TokenPanel` (see `integrated_gradients_figure`)."""
    _expect(result, IntegratedGradientsResult, "integrated_gradients_panel")
    p = _prompt_index(result, prompt)
    converged = getattr(result, "converged", None)  # the adaptive rule's result
    n = int(result.lengths[p])
    return TokenPanel(
        result.attributions[p, :, :n],
        _token_labels(result.tokens[p, :n], tokenizer),
        row_label=_IG_ROWS[result.settings.get("target", "layer")],
        answer_start=int(result.answer_start[p]),
        cmap="RdBu_r",
        symmetric=True,
        colorbar_label="attribution to F (answer probability)",
        caption=_ig_caption(result, p),
        flagged_rows=tuple(np.flatnonzero(~converged[p])) if converged is not None else (),
        flag_label="not converged (budget spent)",
    )


def integrated_gradients_figure(
    result: IntegratedGradientsResult, prompt: int = 0, *, tokenizer=None, title: Optional[str] = None
) -> Figure:
    """Integrated-gradients attribution of the answer probability to each token of each layer's
    output, for one prompt (diverging colours centred at 0), and beside it each layer's
    completeness gap as a share of what F moved, |gap_l| / |F(x) - F(b_l)|: a layer whose gap is
    large had too few integration steps, and its attributions are not to be trusted. The title
    names the rule and steps and gives the largest |completeness gap| over layers."""
    p = _prompt_index(result, prompt)
    panel = dataclasses.replace(integrated_gradients_panel(result, p, tokenizer=tokenizer), caption="")
    width, height = _panel_size(panel)
    fig = _new_figure(width + _GAP_PANEL_WIDTH, height)
    grid = fig.add_gridspec(1, 2, width_ratios=[width, _GAP_PANEL_WIDTH])
    heatmap = fig.add_subplot(grid[0])
    _draw_token_panel(fig, heatmap, panel)  # the heatmap and its colour bar come first in fig.axes
    _draw_gap_panel(fig.add_subplot(grid[1], sharey=heatmap), result, p)
    _title(fig, _ig_caption(result, p, f"Integrated gradients, prompt {p}"), title, result.settings)
    return fig


_GAP_PANEL_WIDTH = 1.8  # inches beside the IG heatmap


def _draw_gap_panel(ax, result: IntegratedGradientsResult, p: int):
    """Bars of `relative_gaps` in percent, one per layer, on the heatmap's layer axis; the worst
    is written out, and the adaptive rule's tolerance is a dashed line."""
    percent = 100 * relative_gaps(result, p)
    layers = np.arange(len(percent))
    rows = ax.get_ylim()  # the heatmap's: bars must not widen the shared layer axis
    ax.barh(layers, np.nan_to_num(percent), height=0.7, color="0.35")
    ax.set_ylim(rows)
    ax.set_xlabel("|completeness gap|\n% of |F(x) \N{MINUS SIGN} F(b)|")
    ax.tick_params(labelleft=False)
    ax.set_title("completeness", fontsize=10)
    tolerance = result.settings.get("tolerance")
    if getattr(result, "converged", None) is not None and isinstance(tolerance, (int, float)):
        ax.axvline(100 * tolerance, color="C3", linestyle="--", linewidth=1, label="tolerance")
        ax.legend(loc="lower right", fontsize=7, framealpha=0.8)
    if np.isfinite(percent).any():
        worst = int(np.nanargmax(percent))
        ax.set_xlim(0, max(1.25 * percent[worst], 1.0))
        ax.annotate(
            f"{percent[worst]:.3g}%",
            (percent[worst], worst),
            xytext=(2, 0),
            textcoords="offset points",
            va="center",
            fontsize=7,
        )
    ax.grid(axis="x", alpha=0.3)


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
    _expect(result, AttributionResult, "attribution_patching_figure")
    what = {
        "patching": ("Attribution patching (first-order screening)", r"estimated change of F, $g \cdot (b - h)$"),
        "grad_x_act": ("Gradient x activation", r"$g \cdot h$, gradient of F times $h_l[t]$"),
    }
    if quantity not in what:
        raise ValueError(f"quantity must be one of {', '.join(what)}, got {quantity!r}")
    name, label = what[quantity]
    p = _prompt_index(result, prompt)
    n = int(result.lengths[p])
    fig = _token_heatmap(
        TokenPanel(
            getattr(result, quantity)[p, :, :n],
            _token_labels(result.tokens[p, :n], tokenizer),
            row_label="boundary l (0 = embeddings)",
            answer_start=int(result.answer_start[p]),
            cmap="RdBu_r",
            symmetric=True,
            colorbar_label=label,
        )
    )
    _title(fig, f"{name}, prompt {p}: F(x) = {result.f_input[p]:.3g}", title, result.settings)
    return fig


# quantity -> (result type, panel title, y label)
_QUANTITIES = {
    "mean_cosine": (ContributionResult, "mean cosine", "mean cosine with the residual"),
    "kl": (LogitLensResult, "KL", _KL_LABEL),
    "overlap": (LogitLensResult, "top-5 overlap", "top-5 overlap with P"),
}


def relative_depth_figure(
    results: Mapping[str, Union[ContributionResult, LogitLensResult]],
    quantity: Optional[str] = None,
    *,
    kl_fraction: float = 0.5,
    overlap_threshold: float = 0.3,
    title: Optional[str] = None,
) -> Figure:
    """Several models' curves on one relative-depth axis (l + 1) / L in (0, 1], so models of
    different depths compare; each model's effective depth is a marker on its curve.

    `results` maps a model name to a ContributionResult (quantity 'mean_cosine') or a
    LogitLensResult ('kl', 'overlap'), all of one type. `quantity` None draws every quantity
    of that type, one panel each. The thresholds are those of the effective depths (§6).
    """
    if not results:
        raise ValueError("relative_depth_figure needs at least one result")
    kinds = {type(r) for r in results.values()}
    if len(kinds) != 1 or not kinds <= {ContributionResult, LogitLensResult}:
        raise ResultTypeError(
            "relative_depth_figure needs only ContributionResults or only LogitLensResults, got "
            + ", ".join(sorted(k.__name__ for k in kinds))
        )
    kind = kinds.pop()
    available = [q for q, spec in _QUANTITIES.items() if spec[0] is kind]
    if quantity is not None and quantity not in available:
        raise ValueError(f"quantity {quantity!r} is not one of a {kind.__name__}'s: {available}")
    quantities = available if quantity is None else [quantity]
    fig = _new_figure(5.5 * len(quantities) + 0.5, 4.2)
    axes = np.atleast_1d(fig.subplots(1, len(quantities), sharex=True))
    # (effective-depth rule, threshold line): KL's threshold depends on each curve's maximum.
    rules = {
        "mean_cosine": (cosine_effective_depth, 0.0),
        "kl": (lambda c: kl_effective_depth(c, kl_fraction), None),
        "overlap": (lambda c: overlap_effective_depth(c, overlap_threshold), overlap_threshold),
    }
    for ax, q in zip(axes, quantities):
        _, panel, ylabel = _QUANTITIES[q]
        rule, threshold = rules[q]
        for i, (model, result) in enumerate(results.items()):
            curve = np.asarray(getattr(result, q))
            x = (np.arange(len(curve)) + 1) / len(curve)
            ax.plot(x, curve, color=f"C{i}", label=f"{model} (L={len(curve)})")
            ed = _depth(rule, curve)
            if ed is not None and ed.found:
                ax.plot(x[ed.layer], curve[ed.layer], "o", color=f"C{i}", markersize=7, markeredgecolor="k")
        if threshold is not None:
            ax.axhline(threshold, color="grey", linestyle="--", linewidth=0.8)
        ax.set(
            xlabel="relative depth (l + 1) / L",
            ylabel=ylabel,
            xlim=(0, 1.01),
            title=f"{panel} (markers: effective depth)",
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    _title(fig, "Across models, on a relative depth axis", title)
    return fig


_METHOD_NAMES = {"cosine": "cosine ED", "kl": "KL ED", "overlap": "top-5 overlap ED"}


def long_cot_figure(
    sources: Mapping[str, Sequence[dict]],
    pairs: Sequence[tuple[str, str, str]],
    *,
    datasets: Sequence[str] = ("gsm8k",),
    title: Optional[str] = None,
) -> Figure:
    """Base model against its long-CoT distillation, per model size: the effective-depth ratio
    of each (a row of panels per dataset, a column per method), the pair joined by a line so a
    rise or fall reads at a glance.

    `sources` maps a label ('published', 'jaxdepth') to rows shaped like
    `jaxdepth.lab.table.collect`'s; `pairs` are (size label, base model, long-CoT model), as
    `jaxdepth.lab.published.LONG_COT_PAIRS`. Cells a source lacks are left out, not drawn as 0."""
    if not sources or not pairs or not datasets:
        raise ValueError("long_cot_figure needs a source of rows, a (size, base, long-CoT) pair and a dataset")
    fig = _new_figure(4.2 * len(_METHOD_NAMES) + 0.6, 3.3 * len(datasets) + 0.7)
    axes = np.atleast_2d(fig.subplots(len(datasets), len(_METHOD_NAMES), sharey=True, sharex=True))
    x = np.arange(len(pairs), dtype=float)
    width = 0.6 / len(sources)
    for row, dataset in zip(axes, datasets):
        for ax, (method, name) in zip(row, _METHOD_NAMES.items()):
            for i, (label, rows) in enumerate(sources.items()):
                ratio = {r["model"]: r["ratio"] for r in rows if r["dataset"] == dataset and r["method"] == method}
                _draw_pairs(ax, x + (i - (len(sources) - 1) / 2) * width, pairs, ratio, label, f"C{i}")
            ax.set_xticks(x, [size for size, _, _ in pairs])
            ax.set_title(f"{name} on {dataset}", fontsize=10)
            ax.grid(alpha=0.3)
        row[0].set_ylabel("ED ratio (ED + 1) / L")
    for ax in axes[-1]:
        ax.set_xlabel("model size")
    axes[0, -1].legend(fontsize=8, loc="lower right")
    _title(fig, "Base vs long-CoT (R1-distilled) models", title)
    return fig


def _draw_pairs(ax, xs, pairs, ratio: Mapping[str, Optional[float]], label: str, color: str):
    """Each (base, long-CoT) pair at its x: a filled circle, an open square, a line between."""
    for x, (_, base, cot) in zip(xs, pairs):
        if ratio.get(base) is not None and ratio.get(cot) is not None:
            ax.plot([x, x], [ratio[base], ratio[cot]], color=color, linewidth=1, alpha=0.6)
    for index, marker, kind, face in ((1, "o", "base", color), (2, "s", "long-CoT", "white")):
        ys = np.array([np.nan if ratio.get(p[index]) is None else ratio[p[index]] for p in pairs], float)
        ax.plot(
            xs, ys, marker, color=color, markersize=7, markerfacecolor=face, linestyle="none", label=f"{label}: {kind}"
        )


# ----------------------------------------------------------------------------- saving


def save_figure(fig: Figure, path_without_extension: str, *, dpi: int = DPI) -> tuple[str, str]:
    """Write `fig` as PATH.png (at `dpi`) and PATH.pdf, each atomically (a temporary file in the
    same folder renamed into place, so a reader never sees half a file); returns both paths.
    A trailing .png or .pdf on the path is dropped rather than doubled."""
    base = os.fspath(path_without_extension)
    if os.path.splitext(base)[1].lower() in (".png", ".pdf"):
        base = os.path.splitext(base)[0]
    paths = []
    for fmt in ("png", "pdf"):
        with atomic_write(f"{base}.{fmt}") as f:
            fig.savefig(f, format=fmt, dpi=dpi)
        paths.append(f"{base}.{fmt}")
    return paths[0], paths[1]
