"""The logit lens and a tuned lens side by side: train a tuned lens on some prompts (resumable),
read held-out prompts through both, and report both lenses' KL and overlap effective depths.

`jaxdepth tuned-lens` runs it; the figure and the table are what the README shows.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Optional

import numpy as np

from jaxdepth.analyses import logit_lens, tuned_lens, uncertainty
from jaxdepth.analyses.effective_depth import kl_effective_depth, overlap_effective_depth
from jaxdepth.analyses.tuned_lens import LensTrainingSettings
from jaxdepth.core.batch import PromptBatch


@dataclasses.dataclass
class LensComparison:
    """Both lenses' results on the held-out prompts, the training loss per step run now and the
    seconds each stage took."""

    results: dict  # {"logit lens": LogitLensResult, "tuned lens": LogitLensResult} (logit_lens module)
    losses: np.ndarray
    seconds: dict


def parse_rows(spec: str) -> slice:
    """'10:250' -> slice(10, 250): which rows of a dataset file a stage uses."""
    try:
        start, stop = (int(x) if x else None for x in spec.split(":"))
    except ValueError:
        raise ValueError(f"rows must look like START:STOP (e.g. 10:250), got {spec!r}") from None
    return slice(start, stop)


def compare_lenses(
    model,
    train: PromptBatch,
    held_out: PromptBatch,
    settings: LensTrainingSettings,
    lens_dir: str,
    *,
    weighting: str = "prompt",
    progress: bool = True,
) -> LensComparison:
    """Train (or resume, or reuse) the tuned lens in `lens_dir` on `train`, then read `held_out`
    through the logit lens and the tuned lens. The lens folder records what it was trained on
    (the training tokens and the model's config): other data or another model is an error."""
    from jaxdepth.lab.study import batch_digest

    params, config, seconds = model.params, model.config, {}
    identity = {"train_tokens_sha": batch_digest(train), "model_config": config.to_dict()}
    lens, losses = tuned_lens.trained_lens(lens_dir, config, settings, identity), np.zeros(0, np.float32)
    if lens is None:
        start = time.perf_counter()
        data = tuned_lens.residual_tokens(params, train, config, progress=progress)
        seconds["residuals"] = time.perf_counter() - start
        start = time.perf_counter()
        lens, losses = tuned_lens.train_tuned_lens(
            params, data, config, settings, checkpoint_dir=lens_dir, data_identity=identity, progress=progress
        )
        seconds["training"] = time.perf_counter() - start
        del data
    start = time.perf_counter()
    meta = {
        "train_tokens": int(train.valid.sum()),
        "train_prompts": len(train),
        "training": dataclasses.asdict(settings),
    }
    results = {
        "logit lens": logit_lens.logit_lens(params, held_out, config, weighting=weighting, settings=meta),
        "tuned lens": logit_lens.logit_lens(
            params, held_out, config, weighting=weighting, settings=meta, translators=lens.translators()
        ),
    }
    seconds["evaluation"] = time.perf_counter() - start
    return LensComparison(results, losses, seconds)


def _cell(point, interval: Optional[uncertainty.DepthInterval]) -> str:
    if not point.found:
        return "none"
    bounds = (
        ""
        if interval is None
        else " [{}, {}]".format(*("none" if b is None else b for b in (interval.low, interval.high)))
    )
    return f"{point.layer}{bounds} ({point.ratio:.2f})"


def comparison_markdown(results: dict, *, resamples: int = uncertainty.DEFAULT_RESAMPLES) -> str:
    """One row per lens: its KL and overlap effective depths, with bootstrap intervals over the
    prompts when `resamples > 0`."""
    lines = [
        "| lens | KL ED [95%] (ratio) | overlap ED [95%] (ratio) | KL at l=0 | KL at l=L/2 |",
        "|---|---|---|---|---|",
    ]
    for name, r in results.items():
        intervals = uncertainty.effective_depth_intervals(r, resamples=resamples) if resamples else {}
        kl, overlap = kl_effective_depth(r.kl), overlap_effective_depth(r.overlap)
        lines.append(
            f"| {name} | {_cell(kl, intervals.get('kl'))} | {_cell(overlap, intervals.get('overlap'))} "
            f"| {r.kl[0]:.2f} | {r.kl[len(r.kl) // 2]:.2f} |"
        )
    return "\n".join(lines) + "\n"


def save_comparison(
    comparison: LensComparison, out_dir: str, *, figures: bool = True, resamples: int = uncertainty.DEFAULT_RESAMPLES
) -> list[str]:
    """Both results (`.npz`), the table (`.md`) and the figure (`.png`, `.pdf`) into `out_dir`,
    each written atomically; returns the paths."""
    from jaxdepth.core.atomic import atomic_write

    os.makedirs(out_dir, exist_ok=True)
    paths = [r.save(os.path.join(out_dir, name.replace(" ", "_") + ".npz")) for name, r in comparison.results.items()]
    table = os.path.join(out_dir, "lens_comparison.md")
    with atomic_write(table, "w") as f:
        f.write(comparison_markdown(comparison.results, resamples=resamples))
    paths.append(table)
    if figures:
        from jaxdepth.lab import plots

        fig = plots.lens_comparison_figure(comparison.results, resamples=resamples)
        paths.extend(plots.save_figure(fig, os.path.join(out_dir, "lens_comparison")))
    return paths
