"""The shell's figures, which read several results at once: lenses compared on one model
(`lens_comparison_figure`, `jaxdepth tuned-lens`), models compared on a relative depth axis
(`relative_depth_figure`), base and long-CoT models (`long_cot_figure`), and `save_figure`,
which writes any figure. Each analysis draws its own figures in its own module
(`jaxdepth.analyses.layer_skip.layer_skip_figure`, ...: the `figures` of its declaration), with
the helpers of `jaxdepth.analyses.drawing`; plotting never recomputes anything (load saved
results with `jaxdepth.lab.results.load_result`).
"""

from __future__ import annotations

import os
from typing import Mapping, Optional, Sequence, Union

import numpy as np
from matplotlib.figure import Figure

from jaxdepth.core.atomic import atomic_write
from jaxdepth.analyses import drawing as d
from jaxdepth.analyses.contributions import ContributionResult
from jaxdepth.analyses.effective_depth import cosine_effective_depth, kl_effective_depth, overlap_effective_depth
from jaxdepth.analyses.logit_lens import LogitLensResult
from jaxdepth.analyses.uncertainty import DEFAULT_RESAMPLES, DEFAULT_SEED

__all__ = [
    "lens_comparison_figure",
    "relative_depth_figure",
    "long_cot_figure",
    "save_figure",
    "DPI",
]


DPI = 150


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
        d.expect(result, LogitLensResult, "lens_comparison_figure")
    fig = d.new_figure(11, 4.2)
    kl_ax, overlap_ax = fig.subplots(1, 2, sharex=True)
    for k, (name, result) in enumerate(results.items()):
        color, layers = f"C{k}", np.arange(len(result.kl))
        bands, intervals = d.bootstrap(
            result, resamples, seed, kl_fraction=kl_fraction, overlap_threshold=overlap_threshold
        )
        for ax, curve, method, rule, arg in (
            (kl_ax, result.kl, "kl", kl_effective_depth, kl_fraction),
            (overlap_ax, result.overlap, "overlap", overlap_effective_depth, overlap_threshold),
        ):
            ed = d.depth_or_none(rule, curve, arg)
            label = d.depth_text(method if method == "overlap" else "KL", ed, intervals.get(method))
            ax.plot(layers, curve, marker=".", color=color, label=f"{name}: {label}")
            d.draw_band(ax, layers, bands.get(method), color, label=False)
            if ed is not None and ed.found:
                ax.axvline(ed.layer, color=color, linestyle=":", linewidth=1.5)
        kl_ax.axhline(kl_fraction * np.nanmax(result.kl), color=color, linestyle="--", linewidth=0.8)
    overlap_ax.axhline(overlap_threshold, color="grey", linestyle="--", label=f"threshold {overlap_threshold:g}")
    overlap_ax.set_ylim(-0.02, 1.02)
    kl_ax.set(ylabel=d.KL_LABEL, title=f"KL (dashed: {kl_fraction:g} x each lens's max)")
    overlap_ax.set(ylabel="top-5 overlap with P", title="top-5 overlap")
    for ax in (kl_ax, overlap_ax):
        d.layer_axis(ax, len(next(iter(results.values())).kl))
        ax.legend(fontsize=7)
    first = next(iter(results.values()))
    d.title_figure(fig, " vs ".join(results), title, first.settings)
    return fig


# quantity -> (result type, panel title, y label)
_QUANTITIES = {
    "mean_cosine": (ContributionResult, "mean cosine", "mean cosine with the residual"),
    "kl": (LogitLensResult, "KL", d.KL_LABEL),
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
        raise d.ResultTypeError(
            "relative_depth_figure needs only ContributionResults or only LogitLensResults, got "
            + ", ".join(sorted(k.__name__ for k in kinds))
        )
    kind = kinds.pop()
    available = [q for q, spec in _QUANTITIES.items() if spec[0] is kind]
    if quantity is not None and quantity not in available:
        raise ValueError(f"quantity {quantity!r} is not one of a {kind.__name__}'s: {available}")
    quantities = available if quantity is None else [quantity]
    fig = d.new_figure(5.5 * len(quantities) + 0.5, 4.2)
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
            ed = d.depth_or_none(rule, curve)
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
    d.title_figure(fig, "Across models, on a relative depth axis", title)
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
    fig = d.new_figure(4.2 * len(_METHOD_NAMES) + 0.6, 3.3 * len(datasets) + 0.7)
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
    d.title_figure(fig, "Base vs long-CoT (R1-distilled) models", title)
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
