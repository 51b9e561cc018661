"""Depth use by layer kind: on a model whose layers come in kinds (Qwen3.5's linear attention
beside full attention, a mixture of experts' dense layers beside its sparse ones, Gemma's sliding
window beside full attention, SmolLM3's layers without positions beside rotary ones), every
per-layer measure of its saved results at each kind's layers, on one relative-depth axis: do the
layers of one kind contribute less, or change the residual stream less, than the other kind's at
the same depth? `jaxdepth compare` draws it beside the comparison of models.

The measures are the curves the analyses declare (`jaxdepth.analyses.suite.DepthCurve`, read
through `jaxdepth.lab.depth_comparison.depth_profiles`): a curve of layers (at (l + 0.5) / L)
is taken as it is, each layer's value under its kind; a curve of boundaries (at l / L: the
residual stream h_l) becomes the change across each layer, `y[l + 1] - y[l]` at (l + 0.5) / L,
the layer's own doing. The kinds come from the model's config, which a study saves beside its
results (`jaxdepth.lab.results.saved_model_config`). Nothing is recomputed.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Mapping, Optional, Sequence

import numpy as np

from jaxdepth.analyses.suite import DepthCurve
from jaxdepth.core.config import ModelConfig

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "SPLITS",
    "layer_splits",
    "layer_kinds",
    "KindSeries",
    "KindMeasure",
    "split_by_kind",
    "KindComparison",
    "kind_comparison",
    "kind_comparisons",
    "kind_figure",
    "kinds_markdown",
]

# The ways a config's layers split into kinds, in the order they are offered: by mixer, by MLP,
# by attention window, by positions.
SPLITS = {
    "mixer": "mixer (linear attention or attention)",
    "mlp": "MLP (dense or a mixture of experts)",
    "window": "attention window (sliding or full)",
    "positions": "positions (rotary or none)",
}

_MARKERS = "os^Dv"


def layer_splits(config: ModelConfig) -> dict[str, tuple[str, ...]]:
    """The splits of `config`'s layers into kinds that it has (`SPLITS`, in that order): each
    split's name -> the kind of every layer, for a split whose kinds all have layers. 'mixer':
    'linear attention' (`linear_layers`) or attention ('full attention' where none slides);
    'mlp': 'dense MLP' (`dense_layers`) or 'mixture of experts'; 'window': 'sliding window' or
    'full attention' (`layer_types`); 'positions': 'no positions' (`nope_layers`) or 'rotary
    positions'. Linear-attention layers keep their own kind in the last two (they have neither)."""
    L = config.num_layers
    linear = set(config.linear_layers)
    attention = [i for i in range(L) if i not in linear]
    sliding = config.sliding_layers
    splits = {}
    if linear and attention:
        slides = [sliding[i] for i in attention]
        named = "full attention" if not any(slides) else "sliding-window attention" if all(slides) else "attention"
        splits["mixer"] = tuple("linear attention" if i in linear else named for i in range(L))
    if config.mixed_mlps:
        dense = set(config.dense_layers)
        splits["mlp"] = tuple("dense MLP" if i in dense else "mixture of experts" for i in range(L))
    own = lambda i, kind: "linear attention" if i in linear else kind
    if 0 < sum(sliding[i] for i in attention) < len(attention):
        splits["window"] = tuple(own(i, "sliding window" if sliding[i] else "full attention") for i in range(L))
    nope = set(config.nope_layers) - linear
    if 0 < len(nope) < len(attention):
        splits["positions"] = tuple(own(i, "no positions" if i in nope else "rotary positions") for i in range(L))
    return splits


def _describe(kinds: Sequence[str]) -> str:
    """'linear attention: layers 0, 1, 3; full attention: layer 2'."""
    parts = []
    for kind in dict.fromkeys(kinds):
        layers = [str(i) for i, k in enumerate(kinds) if k == kind]
        parts.append(f"{kind}: layer{'s' if len(layers) > 1 else ''} {', '.join(layers)}")
    return "; ".join(parts)


def layer_kinds(config: ModelConfig, split: Optional[str] = None) -> tuple[str, ...]:
    """The kind of each of `config`'s layers (`('linear attention', 'linear attention', 'full
    attention', ...)`), by `split` (a name of `SPLITS`), or by the one split the config has when
    None. A ValueError when the layers are of one kind, when they split more than one way and
    `split` does not say which (a hybrid mixture of experts: by mixer and by MLP), or when they
    do not split the way `split` names."""
    if split is not None and split not in SPLITS:
        raise ValueError(f"no split {split!r} of layers into kinds; the splits: {', '.join(SPLITS)}")
    splits = layer_splits(config)
    if not splits:
        raise ValueError(
            f"the {config.num_layers} layers of this {config.model_type} model are of one kind (no linear-attention "
            "layers beside attention, dense layers beside experts, sliding layers beside full attention, or layers "
            "without positions beside rotary ones): there are no kinds to compare"
        )
    if split is None:
        if len(splits) > 1:
            ways = " and ".join(f"by {SPLITS[s]} ({_describe(kinds)})" for s, kinds in splits.items())
            raise ValueError(
                f"the layers of this {config.model_type} model split {len(splits)} ways, {ways}: "
                f"choose one (split={' or '.join(repr(s) for s in splits)}; `jaxdepth compare --split`)"
            )
        (split,) = splits
    if split not in splits:
        raise ValueError(
            f"the layers of this {config.model_type} model do not split by {SPLITS[split]}; they split by "
            + ", ".join(SPLITS[s] for s in splits)
        )
    return splits[split]


@dataclasses.dataclass(frozen=True)
class KindSeries:
    """One measure at the layers of one kind: their indices `layers`, their relative depths `x`
    ((l + 0.5) / L) and the values `y`."""

    layers: tuple
    x: np.ndarray
    y: np.ndarray


@dataclasses.dataclass(frozen=True)
class KindMeasure:
    """One measure split by kind: `series` (kind -> `KindSeries`, in the order the kinds first
    occur), drawn with the source curve's `title`, `ylabel` and `log` scale; `change`: the source
    was a curve of boundaries, and these are the changes across each layer (title and label say
    so, on a linear scale)."""

    title: str
    ylabel: str
    log: bool
    change: bool
    series: dict

    def means(self, kind: str) -> tuple[Optional[float], Optional[float], Optional[float]]:
        """The mean of `kind`'s values over every depth, over the first half of the depth
        ((l + 0.5) / L < 1/2) and over the second; None where it has no finite value there."""
        s = self.series[kind]
        x, y = np.asarray(s.x, np.float64), np.asarray(s.y, np.float64)

        def mean(keep):
            values = y[keep & np.isfinite(y)]
            return float(values.mean()) if values.size else None

        return mean(np.ones(len(y), bool)), mean(x < 0.5), mean(x >= 0.5)


def _points(x, L: int, offset: float) -> Optional[np.ndarray]:
    """The integer indices i with x = (i + offset) / L, or None where `x` is not such a grid."""
    at = np.asarray(x, np.float64) * L - offset
    index = np.rint(at)
    if at.size == 0 or not np.allclose(at, index, rtol=0, atol=1e-6):
        return None
    return index.astype(int)


def split_by_kind(curves: Mapping[str, DepthCurve], kinds: Sequence[str]) -> dict[str, KindMeasure]:
    """Each of `curves` (name -> `jaxdepth.analyses.suite.DepthCurve`) at the layers of each kind
    of `kinds` (the kind of each of the L layers, `layer_kinds`): a curve of layers, its values
    there as they are; a curve of boundaries, the change across each layer whose input and output
    it has. A layer whose value is not finite (not measured there: the experts' measures of a
    dense layer), a curve with no layer left, and a curve at other points than layers or
    boundaries are left out. A
    ValueError where `kinds` names one kind only."""
    kinds = tuple(kinds)
    L, order = len(kinds), list(dict.fromkeys(kinds))
    if len(order) < 2:
        raise ValueError(f"the {L} layers are all of one kind ({order[0] if order else 'none'}): nothing to compare")
    measures = {}
    for name, curve in curves.items():
        y = np.asarray(curve.y)
        if y.shape != np.shape(curve.x):
            raise ValueError(f"curve {name!r} has {y.size} values at {np.size(curve.x)} points")
        layers = _points(curve.x, L, 0.5)
        change = layers is None
        if change:
            boundaries = _points(curve.x, L, 0.0)
            if boundaries is None or boundaries.min() < 0 or boundaries.max() > L:
                continue
            at = dict(zip(boundaries.tolist(), y))
            layers = np.array([l for l in range(L) if l in at and l + 1 in at], int)
            y = np.array([at[l + 1] - at[l] for l in layers], np.float64)
        elif layers.min() < 0 or layers.max() >= L:
            continue
        series = {}
        measured = np.isfinite(np.asarray(y, np.float64))
        for kind in order:
            keep = np.array([kinds[l] == kind for l in layers], bool) & measured
            series[kind] = KindSeries(layers=tuple(int(l) for l in layers[keep]), x=(layers[keep] + 0.5) / L, y=y[keep])
        if not any(s.layers for s in series.values()):
            continue  # nothing measured at any layer
        measures[name] = KindMeasure(
            title=f"change across each layer: {curve.title}" if change else curve.title,
            ylabel=f"change ({curve.ylabel})" if change else curve.ylabel,
            log=bool(curve.log) and not change,
            change=change,
            series=series,
        )
    return measures


@dataclasses.dataclass(frozen=True)
class KindComparison:
    """One model's measures by layer kind (`kind_comparison`): the `model` and `dataset` of
    its results, the `split` (a name of `SPLITS`), the kind of each layer (`kinds`) and the
    measures (name -> `KindMeasure`)."""

    model: str
    dataset: str
    split: str
    kinds: tuple
    measures: dict

    @property
    def kind_names(self) -> list[str]:
        """The kinds, in the order they first occur."""
        return list(dict.fromkeys(self.kinds))

    def layers_of(self, kind: str) -> tuple[int, ...]:
        """The layers of `kind`."""
        return tuple(i for i, k in enumerate(self.kinds) if k == kind)


def kind_comparison(profile, split: Optional[str] = None, *, config: Optional[ModelConfig] = None) -> KindComparison:
    """The measures of `profile` (a `jaxdepth.lab.depth_comparison.DepthProfile`) split by the
    kinds of its model's layers (`layer_kinds(config, split)`), `config` the model's (None: the
    one saved with the results, `profile.config`). A ValueError where the config is unknown or
    of another depth, where its layers are of one kind or split more ways than `split` settles,
    and where the results hold no per-layer curve."""
    config = config or profile.config
    where = f"{profile.model} / {profile.dataset}"
    if config is None:
        raise ValueError(
            f"{where}: no model config was saved with these results (saved before it was recorded), so the kinds of "
            "its layers are unknown; a rerun of `jaxdepth run` on the same model and prompts reuses the results and "
            "records it"
        )
    if config.num_layers != profile.num_layers:
        raise ValueError(f"{where}: the results have {profile.num_layers} layers, the config {config.num_layers}")
    try:
        kinds = layer_kinds(config, split)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    split = split or next(iter(layer_splits(config)))
    measures = split_by_kind(profile.curves, kinds)
    if not measures:
        raise ValueError(f"{where}: the results hold no per-layer curve to split by kind")
    return KindComparison(model=profile.model, dataset=profile.dataset, split=split, kinds=kinds, measures=measures)


def kind_figure(comparison: KindComparison, *, title: Optional[str] = None) -> "Figure":
    """One panel per measure over relative depth (l + 0.5) / L, each kind's layers a series of
    its own colour and marker, joined within the kind, so that the kinds compare at the same
    depth; the legend names the kinds and their numbers of layers. A change across layers has a
    zero line. Panels in rows of four."""
    from jaxdepth.analyses import drawing as d  # matplotlib, only to draw

    names = list(comparison.measures)
    fig, axes = d.panel_grid(len(names), 4.2, 3.3)
    for ax, name in zip(axes, names):
        measure = comparison.measures[name]
        for k, kind in enumerate(comparison.kind_names):
            s = measure.series[kind]
            count = len(comparison.layers_of(kind))
            label = f"{kind} ({count} layer{'s' if count > 1 else ''})"
            ax.plot(s.x, s.y, marker=_MARKERS[k % len(_MARKERS)], markersize=5, linewidth=1, color=f"C{k}", label=label)
        values = np.concatenate([np.asarray(s.y, np.float64) for s in measure.series.values()])
        log = measure.log and values.size and np.all(values[np.isfinite(values)] > 0)
        if measure.change:
            ax.axhline(0, color="grey", linewidth=0.8)
        ax.set(xlabel="relative depth (l + 0.5) / L", ylabel=measure.ylabel, xlim=(0, 1.02))
        ax.set_yscale("log" if log else "linear")
        ax.set_title(measure.title, fontsize=9, wrap=True)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    default = (
        f"Depth use by layer kind: {comparison.model} / {comparison.dataset} "
        f"(L={len(comparison.kinds)}, by {SPLITS[comparison.split]})"
    )
    d.title_figure(fig, default, title)
    return fig


def kind_comparisons(profiles: Sequence, split: Optional[str] = None) -> tuple[list[KindComparison], list[str]]:
    """`kind_comparison` of each of `profiles` whose model has layers of more than one kind, and
    a line for each profile left out that a reader should hear of: its config unknown, its
    layers split several ways (and `split` None), no per-layer curve, or not the `split` asked
    for. A profile whose layers are of one kind is left out silently, unless `split` was asked
    for. A ValueError where `split` is asked for and no profile has it."""
    comparisons, notes = [], []
    for p in profiles:
        if p.config is not None and not layer_splits(p.config) and split is None:
            continue
        try:
            comparisons.append(kind_comparison(p, split))
        except ValueError as error:
            notes.append(f"no figure by layer kind: {error}")
    if split is not None and not comparisons:
        raise ValueError(f"--split {split}: no results here are of a model whose layers split by {SPLITS[split]}")
    return comparisons, notes


def _number(value: Optional[float]) -> str:
    return "" if value is None else f"{value:.4g}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def kinds_markdown(comparisons: Sequence[KindComparison]) -> str:
    """Per model and dataset, a Markdown table of the mean of each measure over each kind's
    layers, over all of the depth and over its first and second halves ((l + 0.5) / L below 1/2
    and from it; blank where the kind has no layer there)."""
    parts = []
    for c in comparisons:
        parts.append(f"## {c.model} / {c.dataset}: {len(c.kinds)} layers by {SPLITS[c.split]}\n")
        parts.append(f"{_describe(c.kinds)}\n")
        lines = ["| measure | kind | layers | mean | first half | second half |", "|---|---|---|---|---|---|"]
        for measure in c.measures.values():
            for kind in c.kind_names:
                mean, first, second = measure.means(kind)
                count = len(measure.series[kind].layers)
                lines.append(
                    f"| {_cell(measure.title)} | {kind} | {count} | {_number(mean)} | {_number(first)} | "
                    f"{_number(second)} |"
                )
        parts.append("\n".join(lines) + "\n")
    return "\n".join(parts)
