"""Every depth measure of a set of saved results on one relative-depth axis (`jaxdepth compare`):
where each model's effective depths (the studies' measures: residual cosine, the lens's KL and
top-5 overlap) fall beside the shape of its residual stream (matrix entropy, the attention-sink
rate), its layers' distance from the identity, and the boundary by which its tokens are decided.

A results folder is any `<model>/<dataset>/` folder `jaxdepth run` wrote; each measure is drawn
where its result is there and left out where it is not. What a result gives is what its
analysis declares (`Analysis.depth`, a `jaxdepth.analyses.suite.DepthReading`: ratios and
curves), so a plugin's analysis that declares a reading joins the comparison as the built-in
ones do. Plotting never recomputes anything."""

from __future__ import annotations

import dataclasses
import os
from typing import Iterable, Optional, Sequence

from matplotlib.figure import Figure

from jaxdepth.analyses import drawing as d
from jaxdepth.core.config import ModelConfig
from jaxdepth.lab.results import load_result, saved_model_config

__all__ = ["DepthProfile", "depth_profiles", "depth_comparison_figure", "profiles_markdown"]


@dataclasses.dataclass(frozen=True)
class DepthProfile:
    """One model on one dataset, as its results' declared readings say
    (`jaxdepth.analyses.suite.DepthReading`): `ratios` (name -> depth / L: the effective depths,
    the mean decision depth, ...; None where no layer qualifies) with their `labels`, and
    `curves` (name -> `jaxdepth.analyses.suite.DepthCurve`, each the mean over prompts), and
    the model's `config` where its results folder holds it (None: saved before it was recorded),
    which says the kinds of its layers (`jaxdepth.lab.kind_comparison`)."""

    model: str
    dataset: str
    num_layers: int
    ratios: dict
    curves: dict
    fingerprint: Optional[str] = None  # the model's (`jaxdepth.lab.model_identity`); None if unrecorded
    labels: dict = dataclasses.field(default_factory=dict)
    config: Optional[ModelConfig] = None  # saved beside the results (`jaxdepth.lab.results.saved_model_config`)


def _readers() -> dict:
    """The registered analyses that declare a depth reading, by their result files' names."""
    from jaxdepth.lab.registry import ANALYSES

    return {f"{entry.name}.npz": entry for entry in ANALYSES.values() if entry.depth is not None}


def _profile(folder: str, files: set) -> DepthProfile:
    from jaxdepth.lab.table import result_identity

    ratios, labels, curves, num_layers, identity = {}, {}, {}, None, None
    for name, entry in _readers().items():
        if name not in files:
            continue
        result = load_result(os.path.join(folder, name))
        identity = identity or result_identity(result, folder)
        reading = entry.depth(result)
        num_layers = reading.num_layers
        for key, (label, ratio) in reading.ratios.items():
            ratios[key], labels[key] = ratio, label
        curves.update(reading.curves)
    return DepthProfile(
        model=identity["model"],
        dataset=identity["dataset"],
        num_layers=int(num_layers),
        ratios=ratios,
        curves=curves,
        fingerprint=identity["fingerprint"],
        labels=labels,
        config=saved_model_config(folder),
    )


def depth_profiles(roots: Iterable[str]) -> list[DepthProfile]:
    """One profile per model and dataset of the results folders under `roots` (each a run's
    output, a model's folder or a dataset's) that hold any of the measures (folders of the same
    model and dataset read as one); a root with none is an error."""
    profiles, readers = [], _readers()
    for root in roots:
        if not os.path.isdir(root):
            raise FileNotFoundError(f"no results folder {root}")
        found = [(folder, set(files) & set(readers)) for folder, _, files in sorted(os.walk(root))]
        found = [(folder, files) for folder, files in found if files]
        if not found:
            raise FileNotFoundError(f"no results of {', '.join(readers)} under {root}")
        profiles.extend(_profile(folder, files) for folder, files in found)
    return _merged(profiles)


def _merged(profiles: list[DepthProfile]) -> list[DepthProfile]:
    """One profile per (model, fingerprint, dataset): folders of the same model and dataset
    (analyses run into different output folders) are read as one, the first folder's measure
    kept where two hold the same one; two models of one name are two profiles, told apart by
    their fingerprints (`jaxdepth.lab.table.with_model_labels`). Results of one name and one
    unrecorded fingerprint with different depths are refused: not one model."""
    from jaxdepth.lab.table import with_model_labels

    merged: dict = {}
    for p in profiles:
        key = (p.model, p.fingerprint, p.dataset)
        if key not in merged:
            merged[key] = p
            continue
        first = merged[key]
        if first.num_layers != p.num_layers:
            raise ValueError(
                f"two results of {p.model} on {p.dataset} have {first.num_layers} and {p.num_layers} layers: "
                "not one model (rename a results folder)"
            )
        merged[key] = dataclasses.replace(
            first,
            ratios={**p.ratios, **first.ratios},
            curves={**p.curves, **first.curves},
            labels={**p.labels, **first.labels},
            config=first.config or p.config,
        )
    named = lambda p: {"model": p.model, "fingerprint": p.fingerprint}
    return with_model_labels(list(merged.values()), named, lambda p, label: dataclasses.replace(p, model=label))


_RATIO_MARKERS = "osD^vP"  # one per ratio (the effective depths, the decision and settling depths, ...)


def depth_comparison_figure(profiles: Sequence[DepthProfile]) -> Figure:
    """First: each profile's effective depths and mean decision depth as ratios of its depth (one
    row per profile, one marker per measure). Then one panel per curve any profile has, over
    relative depth, with each profile's KL effective depth (else its cosine one) as a dotted
    line in its colour: where the studies' depth ends against where the geometry turns. The
    panels go in rows of four."""
    if not profiles:
        raise ValueError("depth_comparison_figure needs at least one profile")
    names = list(dict.fromkeys(n for p in profiles for n in p.curves))  # in the order the readings give them
    ratio_labels = _ratio_labels(profiles)
    fig, axes = d.panel_grid(len(names) + 1, 4.6, max(3.3, 0.45 * len(profiles)))
    labels = [f"{p.model} / {p.dataset} (L={p.num_layers})" for p in profiles]
    ax = axes[0]
    for k, (method, label) in enumerate(ratio_labels.items()):
        ys = [i for i, p in enumerate(profiles) if p.ratios.get(method) is not None]
        xs = [profiles[i].ratios[method] for i in ys]
        marker = _RATIO_MARKERS[k % len(_RATIO_MARKERS)]
        ax.plot(xs, ys, marker, linestyle="none", markersize=7, color=f"C{k}", label=label)
    ax.set_yticks(range(len(profiles)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set(xlim=(0, 1.02), xlabel="depth / L", title="effective depths")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    for ax, name in zip(axes[1:], names):
        style = next(p.curves[name] for p in profiles if name in p.curves)
        title, ylabel, log = style.title, style.ylabel, style.log
        for i, p in enumerate(profiles):
            if name not in p.curves:
                continue
            curve = p.curves[name]
            ax.plot(curve.x, curve.y, color=f"C{i}", marker="o", markersize=2.5, label=labels[i])
            marker = p.ratios.get("kl", p.ratios.get("cosine"))
            if marker is not None:
                ax.axvline(marker, color=f"C{i}", linestyle=":", linewidth=1.2)
        ax.set(xlabel="relative depth", ylabel=ylabel, xlim=(0, 1.02), title=title, yscale="log" if log else "linear")
        ax.grid(alpha=0.3)
    axes[-1].legend(fontsize=7)
    d.title_figure(fig, "Depth measures on one relative-depth axis (dotted: KL effective depth)", None)
    return fig


def _ratio_labels(profiles: Sequence[DepthProfile]) -> dict:
    """Every ratio any profile has, name -> label, in the order the readings give them."""
    return {name: label for p in profiles for name, label in p.labels.items()}


def profiles_markdown(profiles: Sequence[DepthProfile]) -> str:
    """The ratios of every profile as a Markdown table (blank where not measured or not found)."""
    ratio_labels = _ratio_labels(profiles)
    lines = ["| model | dataset | L | " + " | ".join(ratio_labels.values()) + " |"]
    lines.append("|---" * (3 + len(ratio_labels)) + "|")
    for p in profiles:
        cells = ["" if p.ratios.get(m) is None else f"{p.ratios[m]:.2f}" for m in ratio_labels]
        lines.append(f"| {p.model} | {p.dataset} | {p.num_layers} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
