"""Drawing helpers shared by the analyses' figures: figures on an Agg canvas, layer axes, bootstrap
bands, effective-depth marks, token heatmaps (`TokenPanel`) and their colour limits.

Each analysis draws its own figures in its own module with these helpers (importing this module,
and so matplotlib, only when it draws). Every figure is a `matplotlib.figure.Figure` built
directly on an Agg canvas: no pyplot, so no global figure registry, nothing left open between
figures and no display needed. `jaxdepth.lab.plots.save_figure` writes one.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Callable, Optional, Sequence, Union

import matplotlib
import matplotlib.ticker
import numpy as np
from matplotlib import patheffects
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import LineCollection
from matplotlib.colors import Colormap
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from jaxdepth.analyses.effective_depth import EffectiveDepth
from jaxdepth.analyses.uncertainty import (
    CurveBand,
    DepthInterval,
    curve_bands,
    effective_depth_intervals,
    has_per_prompt,
)

__all__ = [
    "ResultTypeError",
    "expect",
    "new_figure",
    "panel_grid",
    "title_figure",
    "layer_axis",
    "TokenPanel",
    "token_heatmap",
    "stacked_token_figure",
    "prompt_index",
    "depth_or_none",
    "depth_text",
    "bootstrap",
    "draw_band",
    "draw_per_prompt",
    "mark_depth",
    "wrap_at_the_edge",
    "token_labels",
    "robust_limit",
    "clipped_label",
    "panel_size",
    "draw_token_panel",
]

MAX_TOKEN_LABELS = 60  # beyond this many tokens, tick labels would overlap: label every k-th
KL_LABEL = r"KL$(P_l \,\|\, P)$ [nats]"


class ResultTypeError(TypeError, ValueError):
    """A figure function got a result of the wrong type (a ValueError, and a TypeError)."""


def new_figure(width: float, height: float) -> Figure:
    """A figure of `width` x `height` inches on its own Agg canvas, laid out constrained."""
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)  # render with Agg whatever backend pyplot may be using elsewhere
    return fig


def panel_grid(count: int, width: float, height: float, *, columns: int = 4) -> tuple[Figure, list]:
    """A figure of `count` panels, each `width` x `height` inches, in rows of at most `columns`
    (the panels of a last row that is not full left out); returns it and its axes, row by row."""
    if count < 1:
        raise ValueError(f"panel_grid needs at least one panel, got {count}")
    cols = min(count, columns)
    rows = -(-count // cols)
    fig = new_figure(width * cols, 0.9 + height * rows)
    axes = list(np.atleast_1d(fig.subplots(rows, cols)).ravel())
    for ax in axes[count:]:
        ax.remove()
    return fig, axes[:count]


def expect(result, kind: type, what: str):
    """Refuse a `result` that is not a `kind` (a `ResultTypeError` naming `what` needs it)."""
    if not isinstance(result, kind):
        raise ResultTypeError(f"{what} needs a {kind.__name__}, got {type(result).__name__}")


def prompt_index(result, prompt) -> int:
    """`prompt` as an index of the result's prompts; out of range is a ValueError."""
    count = result.tokens.shape[0]
    i = operator.index(prompt)
    if not 0 <= i < count:
        raise ValueError(f"prompt index {i} is out of range: the result holds {count} prompt(s)")
    return i


def depth_or_none(rule: Callable[..., EffectiveDepth], curve, *args) -> Optional[EffectiveDepth]:
    """The effective depth, or None where it is undefined (e.g. a NaN curve): a figure of a broken
    curve is still worth drawing, the title then says 'n/a'."""
    try:
        return rule(curve, *args)
    except ValueError:
        return None


def depth_text(name: str, ed: Optional[EffectiveDepth], interval: Optional[DepthInterval] = None) -> str:
    """The title of an effective depth: its layer, interval and ratio, 'no crossing', or 'n/a'."""
    if ed is None:
        return f"{name} ED: n/a"
    bounds = (
        ""
        if interval is None
        else " [{}, {}]".format(*("none" if b is None else b for b in (interval.low, interval.high)))
    )
    return f"{name} ED: {ed.layer}{bounds} (ratio {ed.ratio:.2f})" if ed.found else f"{name} ED: no crossing{bounds}"


def bootstrap(result, resamples: int, seed: int, **thresholds):
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


def draw_band(ax, layers, band: Optional[CurveBand], color: str, label: bool = True):
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


def draw_per_prompt(ax, layers, per_prompt: Optional[np.ndarray], color: str):
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


def mark_depth(ax, ed: Optional[EffectiveDepth], label: str, color: str = "C3"):
    """A vertical line at the effective depth, labelled so a legend (and a test) can find it."""
    if ed is not None and ed.found:
        ax.axvline(ed.layer, color=color, linestyle=":", linewidth=1.5, label=f"{label} = {ed.layer}")


def layer_axis(ax, num_layers: int):
    """An x axis of layers 0..L-1, labelled, with a light grid."""
    ax.set_xlabel("layer l")
    ax.set_xlim(-0.5, num_layers - 0.5)
    ax.grid(alpha=0.3)


def title_figure(fig: Figure, default: str, title: Optional[str], settings: Optional[dict] = None):
    """Suptitle: the caller's title, else a default naming the model and dataset when the result's
    settings record them (study runs do)."""
    if title is None:
        identity = (settings or {}).get("identity", {})
        where = ", ".join(str(identity[k]) for k in ("model", "dataset") if k in identity)
        title = f"{default} ({where})" if where else default
    # wrapped at drawing time to the figure's width: a long title (IG's caption) stays in the image
    fig.suptitle(title, wrap=True)


def wrap_at_the_edge(text):
    """Let `text` (a label) break into lines where it would leave the figure (matplotlib's
    wrapping at draw time, which the constrained layout sees): a colour bar's label runs along
    the bar, and with a clipping note it can be longer than a short figure is tall. Its text
    stays as set (`get_text`); only its drawing breaks. Returns `text`."""
    text.set_wrap(True)
    return text


# Whitespace made visible in token labels: a leading space or a newline is often the whole
# difference between two tokens. (DejaVu Sans, matplotlib's default font, has all of these.)
_VISIBLE_WHITESPACE = {" ": "\u2423", "\n": "\u21b5", "\t": "\u21e5", "\r": "\u23ce"}  # ␣ ↵ ⇥ ⏎


def _label_text(text: str) -> str:
    text = "".join(_VISIBLE_WHITESPACE.get(c, c) for c in text)
    return text.replace("$", r"\$")  # '$' starts mathtext: GSM8K prices would garble or fail to render


def token_labels(token_ids: Sequence[int], tokenizer) -> list[str]:
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


# Colour-scale percentile: one token column (e.g. integrated gradients at the first token) is
# 1/T of a heatmap's cells, under 5% from T = 20 on.
TOKEN_HEATMAP_PERCENTILE = 95.0


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


def clipped_label(label: str, limit: float, top: float, clipped: bool, percentile: float) -> str:
    """A colour bar's label, saying where and why its scale was clipped when it was."""
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


def panel_size(panel: TokenPanel) -> tuple[float, float]:
    """(width, height) in inches that fit the panel's tokens and rows, within bounds."""
    rows, n = panel.values.shape
    return (min(max(4.0 + 0.13 * min(n, MAX_TOKEN_LABELS * 2), 7.0), 20.0), min(max(2.5 + 0.14 * rows, 4.0), 11.0))


def draw_token_panel(fig: Figure, ax, panel: TokenPanel):
    """Draw `panel` on `ax` with its colour bar. The colour limit comes from `robust_limit`:
    clipped, and said so, when one cell dwarfs the rest; a vertical line marks the answer start."""
    values = panel.values
    limit, clipped = robust_limit(values)
    top = float(np.nanmax(np.abs(values))) if np.isfinite(values).any() else 0.0
    vmin, vmax = (-limit if panel.symmetric else 0.0), limit
    colorbar_label = clipped_label(panel.colorbar_label, limit, top, clipped, TOKEN_HEATMAP_PERCENTILE)
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
    bar = fig.colorbar(
        image,
        ax=ax,
        label=colorbar_label,
        pad=0.01,
        extend=("both" if panel.symmetric else "max") if clipped else "neither",
    )
    wrap_at_the_edge(bar.ax.yaxis.label)


def token_heatmap(panel: TokenPanel) -> Figure:
    """A figure of one token panel, sized to its rows and tokens."""
    fig = new_figure(*panel_size(panel))
    draw_token_panel(fig, fig.add_subplot(), panel)
    return fig


def stacked_token_figure(
    panels: Sequence[TokenPanel], *, title: Optional[str] = None, settings: Optional[dict] = None
) -> Figure:
    """Token panels one above the other, on one token axis each (e.g. a case study's erasure and
    integrated gradients of the same prompt). `settings` (a result's) name the model and
    dataset in the default title."""
    if not panels:
        raise ValueError("stacked_token_figure needs at least one panel")
    sizes = [panel_size(p) for p in panels]
    fig = new_figure(max(w for w, _ in sizes), sum(h for _, h in sizes))
    axes = np.atleast_1d(fig.subplots(len(panels), 1, height_ratios=[h for _, h in sizes]))
    for ax, panel in zip(axes, panels):
        draw_token_panel(fig, ax, panel)
    title_figure(fig, "Per-token analyses", title, settings)
    return fig
