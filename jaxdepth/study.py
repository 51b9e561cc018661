"""The whole suite of analyses on one model and one prompt set, with results on disk.

Each (model, dataset, analysis) result is written atomically to
`OUT/<model>/<dataset>/<analysis>.npz` together with the settings and software versions that
produced it. A rerun loads every finished result whose settings match and computes only the
rest, so an interrupted run resumes, and a changed setting is never confused with a cached one.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from typing import Callable, Optional, Sequence

import numpy as np

from jaxdepth.batch import PromptBatch
from jaxdepth.loading import Model
from jaxdepth.results import load_result

ANALYSES = ("contributions", "logit_lens", "layer_skip", "erasure", "integrated_gradients")


@dataclasses.dataclass(frozen=True, kw_only=True)
class StudySettings:
    """Everything that changes a result. Part of every saved result's settings."""

    num_prompts: int = 10
    detail_prompts: Optional[int] = None  # prompts for erasure and IG (per-position sweeps); None: all
    seed: int = 123
    lens_weighting: str = "prompt"
    skip_sublayers: tuple = ("layer", "attn", "mlp")
    ig_steps: int = 256
    ig_rule: str = "left"
    ig_baseline: str = "channel_mean"
    memory_budget: Optional[int] = None


def software_versions() -> dict:
    import flax
    import jax

    import jaxdepth

    return {"jax": jax.__version__, "flax": flax.__version__, "jaxdepth": getattr(jaxdepth, "__version__", "0.1.0")}


def slug(text: str) -> str:
    """A folder name for a model source or dataset name."""
    base = os.path.basename(os.path.normpath(text)) if os.path.exists(text) else text
    return re.sub(r"[^A-Za-z0-9._-]+", "_", base).strip("_") or "model"


def run_analysis(name: str, model: Model, batch: PromptBatch, settings: StudySettings,
                 baseline_batch: Optional[PromptBatch] = None, progress: bool = True):
    """Run one analysis by name; returns its result object (or a dict of them for layer skip)."""
    from jaxdepth import contributions, erasure, integrated_gradients, layer_skip, logit_lens

    p, c = model.params, model.config
    if name in ("erasure", "integrated_gradients") and settings.detail_prompts is not None:
        batch = batch.select(slice(0, settings.detail_prompts))
    if name == "contributions":
        return contributions.contributions(p, batch, c)
    if name == "logit_lens":
        return logit_lens.logit_lens(p, batch, c, weighting=settings.lens_weighting)
    if name == "layer_skip":
        return {sub: layer_skip.layer_skip(p, batch, c, sublayer=sub, seed=settings.seed,
                                           memory_budget=settings.memory_budget, progress=progress)
                for sub in settings.skip_sublayers}
    if name == "erasure":
        baseline = erasure.mean_residuals(p, baseline_batch if baseline_batch is not None else batch, c)
        return erasure.residual_erasure(p, batch, c, baseline, memory_budget=settings.memory_budget,
                                        progress=progress)
    if name == "integrated_gradients":
        return integrated_gradients.integrated_gradients(
            p, batch, c, steps=settings.ig_steps, rule=settings.ig_rule, baseline=settings.ig_baseline,
            memory_budget=settings.memory_budget, progress=progress)
    raise ValueError(f"unknown analysis {name!r}; known: {', '.join(ANALYSES)}")


def result_folder(out_dir: str, model_name: str, dataset: str) -> str:
    return os.path.join(out_dir, slug(model_name), slug(dataset))


def run_study(model: Model, model_name: str, dataset: str, batch: PromptBatch, out_dir: str, *,
              analyses: Sequence[str] = ANALYSES, settings: StudySettings = StudySettings(),
              baseline_batch: Optional[PromptBatch] = None, baseline_name: Optional[str] = None,
              progress: bool = True, log: Callable[[str], None] = print) -> dict:
    """Run `analyses` for one (model, dataset), reusing saved results with identical settings.

    `baseline_batch` holds the prompts whose mean residual is the erasure baseline (None: the
    dataset's own prompts); `baseline_name` says which, in the erasure result's settings."""
    for name in analyses:
        if name not in ANALYSES:
            raise ValueError(f"unknown analysis {name!r}; known: {', '.join(ANALYSES)}")
    folder = result_folder(out_dir, model_name, dataset)
    common = {"model": model_name, "dataset": dataset, "num_prompts": settings.num_prompts,
              "prompt_tokens_sha": _batch_digest(batch)}
    baseline_sha = None if baseline_batch is None else _batch_digest(baseline_batch)
    results = {}
    for name in analyses:
        identity = {**common, **_relevant_settings(name, settings, baseline_sha)}
        paths = _paths(folder, name, settings)
        cached = [_load_matching(path, identity) for path in paths.values()]
        if all(r is not None for r in cached):
            log(f"{name}: reusing {folder}")
            results[name] = dict(zip(paths, cached)) if name == "layer_skip" else cached[0]
            continue
        start = time.perf_counter()
        result = run_analysis(name, model, batch, settings, baseline_batch, progress)
        seconds = time.perf_counter() - start
        parts = result if isinstance(result, dict) else {None: result}
        for key, part in parts.items():
            _check_finite(name, part)
            part.settings.update(identity=identity, versions=software_versions(), seconds=seconds)
            if name == "erasure":
                part.settings["baseline"] = baseline_name or "the dataset's own prompts"
            part.save(paths[key])
        log(f"{name}: {seconds:.1f} s -> {folder}")
        results[name] = result
    return results


def write_figures(results: dict, folder: str, tokenizer=None, *, detail_prompts: int = 1) -> list[str]:
    """The studies' figures for one (model, dataset) as PNG and PDF under `folder/figures`.
    Heatmaps of erasure and integrated gradients are drawn for the first `detail_prompts`."""
    from jaxdepth import plots

    out = os.path.join(folder, "figures")
    figures = {}
    if "contributions" in results:
        figures["contributions"] = plots.contributions_figure(results["contributions"])
    if "logit_lens" in results:
        figures["logit_lens"] = plots.logit_lens_figure(results["logit_lens"])
    if "layer_skip" in results:
        figures["layer_skip"] = plots.layer_skip_figure(results["layer_skip"])
    for name, draw in (("erasure", plots.erasure_figure), ("integrated_gradients", plots.integrated_gradients_figure)):
        if name in results:
            for i in range(min(detail_prompts, len(results[name].lengths))):
                figures[f"{name}_prompt{i}"] = draw(results[name], i, tokenizer=tokenizer)
    paths = []
    for name, fig in figures.items():
        paths.extend(plots.save_figure(fig, os.path.join(out, name)))
    return paths


def _check_finite(name: str, result) -> None:
    """Refuse to save a result holding NaN or infinity: it would poison every table and figure."""
    for field in dataclasses.fields(result):
        value = getattr(result, field.name)
        if isinstance(value, np.ndarray) and value.dtype.kind == "f" and not np.all(np.isfinite(value)):
            raise ValueError(f"{name}: {field.name} contains NaN or infinite values (check the model's "
                             "weights, its dtype, and the prompts); nothing was saved")


def _relevant_settings(name: str, settings: StudySettings, baseline_sha) -> dict:
    """The settings that change analysis `name`'s result: a cached result is reused when these
    match, so changing, say, the IG steps never invalidates the logit lens."""
    detail = {"detail_prompts": settings.detail_prompts}
    return {
        "contributions": {},
        "logit_lens": {"lens_weighting": settings.lens_weighting},
        "layer_skip": {"seed": settings.seed},
        "erasure": {**detail, "baseline_tokens_sha": baseline_sha},
        "integrated_gradients": {**detail, "ig_steps": settings.ig_steps, "ig_rule": settings.ig_rule,
                                 "ig_baseline": settings.ig_baseline},
    }[name]


def _paths(folder, name, settings):
    if name == "layer_skip":
        return {sub: os.path.join(folder, f"layer_skip_{sub}.npz") for sub in settings.skip_sublayers}
    return {None: os.path.join(folder, f"{name}.npz")}


def _load_matching(path, identity):
    if not os.path.isfile(path):
        return None
    try:
        result = load_result(path)
    except Exception:
        return None  # unreadable (e.g. from an older version): recompute
    return result if result.settings.get("identity") == _roundtrip(identity) else None


def _roundtrip(d):
    import json

    return json.loads(json.dumps(d))


def _batch_digest(batch: PromptBatch) -> str:
    import hashlib

    h = hashlib.sha256()
    for a in (batch.tokens, batch.valid, batch.answer_start):
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]
