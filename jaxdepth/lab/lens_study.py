"""The logit lens and a tuned lens side by side: train a tuned lens on some prompts (resumable),
read held-out prompts through both, and report both lenses' KL and overlap effective depths.
The lens lives on disk here: orbax checkpoints and the `lens.json` that says what it was trained
on (`train_resumably`, `trained_lens`, `load_tuned_lens`; its identity recorded and checked by
`jaxdepth.lab.runs`, the one way every command caches and resumes); the training itself is
`jaxdepth.analyses.tuned_lens`.

`jaxdepth tuned-lens` runs it; the figure and the table are what the README shows.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Optional

import jax
import numpy as np

from jaxdepth.analyses import logit_lens, tuned_lens, uncertainty
from jaxdepth.analyses.effective_depth import kl_effective_depth, overlap_effective_depth
from jaxdepth.analyses.tuned_lens import LensTrainingSettings, TunedLens, load_tuned_lens  # noqa: F401 (its home before)
from jaxdepth.analyses.tuned_lens import WITH_PROGRESS
from jaxdepth.core.batch import PromptBatch
from jaxdepth.core.execution import Execution
from jaxdepth.core.config import ModelConfig
from jaxdepth.lab.runs import batch_digest, check_recorded_identity

__all__ = [
    "LensComparison",
    "parse_rows",
    "compare_lenses",
    "comparison_markdown",
    "save_comparison",
    "train_resumably",
    "trained_lens",
    "COMPARISON",
]


COMPARISON = "lens_comparison"  # the stem of every file of a comparison (`save_comparison`)


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
    execution: Execution = WITH_PROGRESS,
) -> LensComparison:
    """Train (or resume, or reuse) the tuned lens in `lens_dir` on `train`, then read `held_out`
    through the logit lens and the tuned lens. The lens folder records what it was trained on
    (the training tokens and the model's config): other data or another model is an error."""
    params, config, seconds = model.params, model.config, {}
    identity = {"train_tokens_sha": batch_digest(train), "model_config": config.to_dict()}
    lens, losses = trained_lens(lens_dir, config, settings, identity), np.zeros(0, np.float32)
    if lens is None:
        start = time.perf_counter()
        data = tuned_lens.residual_tokens(params, train, config, execution=execution)
        seconds["residuals"] = time.perf_counter() - start
        start = time.perf_counter()
        lens, losses = train_resumably(
            params, data, config, settings, lens_dir, data_identity=identity, execution=execution
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
    """Both results (`lens_comparison_logit_lens.npz`, `lens_comparison_tuned_lens.npz`), the table
    (`lens_comparison.md`) and the figure (`lens_comparison.png`, `.pdf`) into `out_dir`, each
    written atomically; returns the paths. The results' names are not `jaxdepth run`'s: its
    `logit_lens.npz`, of other prompts and settings, may sit in the same folder."""
    from jaxdepth.core.atomic import atomic_write

    os.makedirs(out_dir, exist_ok=True)
    paths = [
        r.save(os.path.join(out_dir, f"{COMPARISON}_{name.replace(' ', '_')}.npz"))
        for name, r in comparison.results.items()
    ]
    table = os.path.join(out_dir, f"{COMPARISON}.md")
    with atomic_write(table, "w") as f:
        f.write(comparison_markdown(comparison.results, resamples=resamples))
    paths.append(table)
    if figures:
        from jaxdepth.lab import plots

        fig = plots.lens_comparison_figure(comparison.results, resamples=resamples)
        paths.extend(plots.save_figure(fig, os.path.join(out_dir, COMPARISON)))
    return paths


# ----------------------------------------------------------------------------- the lens on disk


def train_resumably(
    params,
    data: tuned_lens.ResidualTokens,
    config: ModelConfig,
    settings: LensTrainingSettings,
    lens_dir: str,
    *,
    data_identity: Optional[dict] = None,
    stop_after: Optional[int] = None,
    execution: Execution = WITH_PROGRESS,
) -> tuple[TunedLens, np.ndarray]:
    """`tuned_lens.train_tuned_lens`, checkpointed in `lens_dir`: the translators and optimizer
    state are saved there (orbax, every `settings.checkpoint_every` steps and after the last)
    and a rerun resumes from the latest checkpoint. The folder's `lens.json` records `settings`
    and `data_identity` (what the lens is trained on, e.g. a digest of the training tokens and
    the model): a rerun with either different is an error, so a lens is never silently reused
    on other data. `stop_after` ends the run after that step without a final save, as an
    interruption would (tests use it)."""
    import orbax.checkpoint as ocp

    manager = _checkpoint_manager(lens_dir, settings, data_identity)
    state = tuned_lens.initial_state(config, settings)
    if manager.latest_step() is not None:
        saved = {"translators": state.translators, "opt_state": state.opt_state}
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, saved)
        saved = manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(abstract))
        state = tuned_lens.LensTrainingState(manager.latest_step(), saved["translators"], saved["opt_state"])

    def checkpoint(state: tuned_lens.LensTrainingState, loss: float) -> None:
        if state.step % settings.checkpoint_every == 0 or state.step == settings.steps:
            saved = {"translators": state.translators, "opt_state": state.opt_state}
            manager.save(state.step, args=ocp.args.StandardSave(saved))

    try:
        return tuned_lens.train_tuned_lens(
            params, data, config, settings, state=state, on_step=checkpoint, stop_after=stop_after, execution=execution
        )
    finally:
        manager.wait_until_finished()
        manager.close()


def trained_lens(
    path: str, config: ModelConfig, settings: LensTrainingSettings, data_identity: Optional[dict] = None
) -> Optional[TunedLens]:
    """The finished lens in `path` when it was trained to `settings.steps` with these settings on
    this data, else None (nothing there yet, or unfinished: train or resume). Different settings
    or data are an error, as in `train_resumably`."""
    import orbax.checkpoint as ocp

    if not _check_lens_json(path, settings, data_identity):
        return None
    with ocp.CheckpointManager(os.path.abspath(path)) as manager:
        finished = manager.latest_step() == settings.steps
    return load_tuned_lens(path, config) if finished else None


def _check_lens_json(path: str, settings, data_identity: Optional[dict], *, record: bool = False) -> bool:
    """Whether the lens folder `path` records what its lens is trained with (`lens.json`); other
    settings or data are an error. With `record`, a folder without one gets it."""
    return check_recorded_identity(
        os.path.join(path, "lens.json"),
        {"settings": dataclasses.asdict(settings), "data": data_identity or {}},
        record=record,
        what="a lens trained",
        names={"settings": "other settings", "data": "other data"},
    )


def _checkpoint_manager(path: str, settings: LensTrainingSettings, data_identity: Optional[dict]):
    import orbax.checkpoint as ocp

    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    _check_lens_json(path, settings, data_identity, record=True)
    return ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(max_to_keep=1))
