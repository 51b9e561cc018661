"""Every depth measure of a set of saved results on one relative-depth axis (`jaxdepth compare`):
where each model's effective depths (the studies' measures: residual cosine, the lens's KL and
top-5 overlap) fall beside the shape of its residual stream (matrix entropy, the attention-sink
rate), its layers' distance from the identity, and the boundary by which its tokens are decided.

A results folder is any `<model>/<dataset>/` folder `jaxdepth run` wrote; each measure is drawn
where its result is there (contributions, logit_lens, geometry, jacobians, decision_depth) and
left out where it is not. Plotting never recomputes anything."""

from __future__ import annotations

import dataclasses
import os
from typing import Iterable, Optional, Sequence

import numpy as np
from matplotlib.figure import Figure

from jaxdepth.analyses import drawing as d
from jaxdepth.lab.results import load_result

__all__ = ["DepthProfile", "depth_profiles", "depth_comparison_figure", "profiles_markdown"]

# The effective depths of `jaxdepth.lab.table`, and the mean decision depth, by name.
RATIO_NAMES = {"cosine": "cosine ED", "kl": "KL ED", "overlap": "top-5 overlap ED", "decision": "mean decision depth"}
# The curves, by name: (panel title, y label, log scale).
CURVES = {
    "entropy": ("matrix entropy of the residual stream", "normalized entropy", False),
    "sink_rate": ("attention-sink rate", "share of heads", False),
    "layer_distance": ("layer Jacobian's distance from I", "||J_l - I||_F / ||I||_F", True),
    "decided": ("positions decided by boundary l", "share of positions", False),
}
_FILES = ("contributions.npz", "logit_lens.npz", "geometry.npz", "jacobians.npz", "decision_depth.npz")


@dataclasses.dataclass(frozen=True)
class DepthProfile:
    """One model on one dataset: `ratios` (effective depth / L by method, and the mean decision
    depth / L; None where no layer qualifies) and `curves` (name -> (relative depth, value),
    each the mean over prompts), of what its folder holds."""

    model: str
    dataset: str
    num_layers: int
    ratios: dict
    curves: dict
    fingerprint: Optional[str] = None  # the model's (`jaxdepth.lab.model_identity`); None if unrecorded


def _profile(folder: str, files: set) -> DepthProfile:
    from jaxdepth.lab.table import collect, result_identity

    ratios, curves, num_layers = {}, {}, None
    # the model and dataset the results record (their identity), else the folders': as `table.collect` does
    identity = {"model": os.path.basename(os.path.dirname(folder)), "fingerprint": None}
    identity["dataset"] = os.path.basename(folder)
    if {"contributions.npz", "logit_lens.npz"} & files:
        for row in collect([folder], resamples=0):
            ratios[row["method"]] = row["ratio"]
            num_layers = row["layers"]
            identity = {k: row[k] for k in ("model", "fingerprint", "dataset")}

    def load(name):
        result = load_result(os.path.join(folder, name))
        identity.update(result_identity(result, folder))
        return result

    if "geometry.npz" in files:
        g = load("geometry.npz")
        L = num_layers = g.num_layers
        curves["entropy"] = (np.arange(L + 1) / L, np.nanmean(g.entropy, axis=0))
        curves["sink_rate"] = ((np.arange(L) + 0.5) / L, np.nanmean(g.sink_rate(), axis=0))
    if "jacobians.npz" in files:
        j = load("jacobians.npz")
        L = num_layers = j.num_layers
        curves["layer_distance"] = ((np.arange(L) + 0.5) / L, np.nanmean(j.per_prompt("layer_distance"), axis=0))
    if "decision_depth.npz" in files:
        r = load("decision_depth.npz")
        L = num_layers = r.num_layers
        depths = r.depth[r.valid]
        ratios["decision"] = float(depths.mean()) / L if depths.size else None
        curves["decided"] = (np.arange(L + 1) / L, np.array([(depths <= l).mean() for l in range(L + 1)]))
    return DepthProfile(
        model=identity["model"],
        dataset=identity["dataset"],
        num_layers=int(num_layers),
        ratios=ratios,
        curves=curves,
        fingerprint=identity["fingerprint"],
    )


def depth_profiles(roots: Iterable[str]) -> list[DepthProfile]:
    """One profile per model and dataset of the results folders under `roots` (each a run's
    output, a model's folder or a dataset's) that hold any of the measures (folders of the same
    model and dataset read as one); a root with none is an error."""
    profiles = []
    for root in roots:
        if not os.path.isdir(root):
            raise FileNotFoundError(f"no results folder {root}")
        found = [(folder, set(files) & set(_FILES)) for folder, _, files in sorted(os.walk(root))]
        found = [(folder, files) for folder, files in found if files]
        if not found:
            raise FileNotFoundError(f"no results of {', '.join(_FILES)} under {root}")
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
            first, ratios={**p.ratios, **first.ratios}, curves={**p.curves, **first.curves}
        )
    named = lambda p: {"model": p.model, "fingerprint": p.fingerprint}
    return with_model_labels(list(merged.values()), named, lambda p, label: dataclasses.replace(p, model=label))


def depth_comparison_figure(profiles: Sequence[DepthProfile]) -> Figure:
    """Left: each profile's effective depths and mean decision depth as ratios of its depth (one
    row per profile, one marker per measure). Then one panel per curve any profile has, over
    relative depth, with each profile's KL effective depth (else its cosine one) as a dotted
    line in its colour: where the studies' depth ends against where the geometry turns."""
    if not profiles:
        raise ValueError("depth_comparison_figure needs at least one profile")
    names = [n for n in CURVES if any(n in p.curves for p in profiles)]
    fig = d.new_figure(4.6 * (len(names) + 1), 0.9 + max(3.3, 0.45 * len(profiles)))
    axes = np.atleast_1d(fig.subplots(1, len(names) + 1))
    labels = [f"{p.model} / {p.dataset} (L={p.num_layers})" for p in profiles]
    ax = axes[0]
    for k, (method, label) in enumerate(RATIO_NAMES.items()):
        ys = [i for i, p in enumerate(profiles) if p.ratios.get(method) is not None]
        xs = [profiles[i].ratios[method] for i in ys]
        ax.plot(xs, ys, "osD^"[k], linestyle="none", markersize=7, color=f"C{k}", label=label)
    ax.set_yticks(range(len(profiles)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set(xlim=(0, 1.02), xlabel="depth / L", title="effective depths")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    for ax, name in zip(axes[1:], names):
        title, ylabel, log = CURVES[name]
        for i, p in enumerate(profiles):
            if name not in p.curves:
                continue
            ax.plot(*p.curves[name], color=f"C{i}", marker="o", markersize=2.5, label=labels[i])
            marker = p.ratios.get("kl", p.ratios.get("cosine"))
            if marker is not None:
                ax.axvline(marker, color=f"C{i}", linestyle=":", linewidth=1.2)
        ax.set(xlabel="relative depth", ylabel=ylabel, xlim=(0, 1.02), title=title, yscale="log" if log else "linear")
        ax.grid(alpha=0.3)
    axes[-1].legend(fontsize=7)
    d.title_figure(fig, "Depth measures on one relative-depth axis (dotted: KL effective depth)", None)
    return fig


def profiles_markdown(profiles: Sequence[DepthProfile]) -> str:
    """The ratios of every profile as a Markdown table (blank where not measured or not found)."""
    lines = ["| model | dataset | L | " + " | ".join(RATIO_NAMES.values()) + " |"]
    lines.append("|---" * (3 + len(RATIO_NAMES)) + "|")
    for p in profiles:
        cells = ["" if p.ratios.get(m) is None else f"{p.ratios[m]:.2f}" for m in RATIO_NAMES]
        lines.append(f"| {p.model} | {p.dataset} | {p.num_layers} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
