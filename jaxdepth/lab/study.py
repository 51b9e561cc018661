"""The whole suite of analyses on one model and one prompt set, with results on disk.

Each (model, dataset, analysis) result is written atomically to
`OUT/<model>/<dataset>/<analysis>.npz` together with the settings and software versions that
produced it. A rerun loads every finished result whose settings match and computes only the
rest, so an interrupted run resumes, and a changed setting is never confused with a cached one:
each analysis is a step of `jaxdepth.lab.runs`, the one way every command caches and resumes.

An analysis's error ends the study, unless the analysis is named in a `Failures` given to
`run_study` (in its `StudyRun`, and to `write_figures`): then its error is recorded there and the others go on, their
results saved and cached as usual. `jaxdepth run` isolates the plugins' analyses this way
(`jaxdepth.lab.plugins`); a built-in analysis's error still ends the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Optional, Sequence

import numpy as np

from jaxdepth.core.batch import PromptBatch
from jaxdepth.core.execution import refuse_moved, refuse_unknown
from jaxdepth.core.progress import ProgressLike
from jaxdepth.lab.loaded_model import Model
from jaxdepth.analyses.suite import Analysis, RunInputs, Settings
from jaxdepth.lab.registry import ANALYSES, analysis, default_analyses
from jaxdepth.core.sharding import is_writer
from jaxdepth.lab.results import RESULT_FORMAT, save_model_config
from jaxdepth.lab.runs import Step, batch_digest, hold_folders, produce

__all__ = [
    "StudySettings",
    "Failure",
    "Failures",
    "saved_model_name",
    "slug",
    "run_analysis",
    "result_folder",
    "FINGERPRINT_DIGITS",
    "results_key",
    "source_results_key",
    "model_results_key",
    "StudyPrompts",
    "StudyRun",
    "run_study",
    "write_figures",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class StudySettings(Settings):
    """Everything that changes a result: what every analysis sees (`Settings`: `num_prompts`,
    `detail_prompts`, `seed`, `memory_budget`) and `options`, the values of the analyses' own
    settings by name (`{"ig_steps": 8, "skip_mode": "current"}`; each analysis declares its
    own, `jaxdepth.analyses.suite.option`), each read by the analyses that declare it. An
    option no registered analysis declares is an error when the study runs."""

    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def for_analysis(self, entry: Analysis) -> Settings:
        """The settings `entry` runs with: an instance of its settings class, from the common
        settings and those of `options` it declares (checked by the class)."""
        common = {f.name: getattr(self, f.name) for f in dataclasses.fields(Settings)}
        own = _own_settings(entry)
        return entry.settings(**common, **{k: v for k, v in self.options.items() if k in own})

    def check(self, entries: Sequence[Analysis]) -> list[Settings]:
        """Each of `entries`' settings (`for_analysis`), after refusing an option that none of
        the registered analyses declares (a typo would otherwise be ignored)."""
        known = {name for entry in ANALYSES.values() for name in _own_settings(entry)}
        unknown = sorted(set(self.options) - known)
        if unknown:
            raise ValueError(
                f"unknown options {unknown}: no registered analysis declares them (known: {sorted(known)})"
            )
        return [self.for_analysis(entry) for entry in entries]


def _own_settings(entry: Analysis) -> set[str]:
    """The names of `entry`'s own settings: its settings class's fields beyond the common ones
    (which `StudySettings` holds itself, not among the options)."""
    common = {f.name for f in dataclasses.fields(Settings)}
    return {f.name for f in dataclasses.fields(entry.settings)} - common


class Failure(NamedTuple):
    """What an isolated analysis raised, and when: `stage` is "running", "drawing its figures" or
    "summing up its result"."""

    name: str
    stage: str
    error: Exception


class Failures:
    """The analyses named in `isolated` may fail without ending a run: `guard(name, stage)` keeps
    such an analysis's error (an `Exception`) in `records` and lets the run go on; any other
    analysis's error passes through unchanged. An empty `Failures()` isolates nothing."""

    def __init__(self, isolated: Iterable[str] = ()):
        self.isolated = frozenset(isolated)
        self.records: list[Failure] = []

    @contextlib.contextmanager
    def guard(self, name: str, stage: str):
        """A context in which an error of analysis `name` at `stage` is recorded (a `Failure`)
        and swallowed where `name` is isolated, and passes through where it is not."""
        if name not in self.isolated:
            yield
            return
        try:
            yield
        except Exception as error:
            self.records.append(Failure(name, stage, error))


def saved_model_name(source: str, dtype: Optional[str] = None) -> str:
    """The name results of `source` loaded in `dtype` are saved and shown under: a local folder's
    or file's base name (where it lies is not what the model is: its fingerprint says that,
    `jaxdepth.lab.model_identity`), else the source as given (`smollm2`, a hub id), in float32;
    `NAME-bfloat16` in bf16, because a bf16 model is another model for the cache, the folders and
    the table."""
    name = os.path.basename(os.path.normpath(source)) if os.path.exists(source) else source
    return name if dtype in (None, "float32") else f"{name}-{dtype}"


def slug(text: str) -> str:
    """A folder name for a model source or dataset name."""
    base = os.path.basename(os.path.normpath(text)) if os.path.exists(text) else text
    return re.sub(r"[^A-Za-z0-9._-]+", "_", base).strip("_") or "model"


def run_analysis(
    name: str,
    model: Model,
    batch: PromptBatch,
    settings: StudySettings,
    baseline_batch: Optional[PromptBatch] = None,
    progress: bool = True,
):
    """Run the registered analysis `name` (`jaxdepth.lab.registry`) and return its result; a
    per-position sweep (erasure, IG) runs on the first `settings.detail_prompts` prompts only."""
    entry = analysis(name)
    if entry.detail and settings.detail_prompts is not None:
        batch = batch.select(slice(0, settings.detail_prompts))
    own = settings.for_analysis(entry)
    return entry.run(
        RunInputs(model=model, batch=batch, settings=own, baseline_batch=baseline_batch, progress=progress)
    )


def result_folder(out_dir: str, model_key: str, dataset: str) -> str:
    """`OUT/<model key>/<dataset>`: where a study of one model on one dataset writes, the model
    named by its `results_key` (its name and fingerprint), so two models never share a folder."""
    return os.path.join(out_dir, model_key, slug(dataset))


FINGERPRINT_DIGITS = 8  # of the fingerprint in a folder name: one in 4e9 for two models of one name


def results_key(name: str, fingerprint: str) -> str:
    """The folder name of a model's results: `name` as a folder name (`slug`) and the first
    `FINGERPRINT_DIGITS` hex digits of its fingerprint (`smollm2-f745e40a`)."""
    return f"{slug(name)}-{fingerprint[:FINGERPRINT_DIGITS]}"


def source_results_key(source: str, dtype: Optional[str] = None) -> tuple[str, str]:
    """`(key, fingerprint)` of the results of the model at `source` loaded in `dtype`, known before
    it loads (`jaxdepth.lab.sources.model_fingerprint`): what a command holds and writes."""
    from jaxdepth.lab.sources import model_fingerprint

    fingerprint = model_fingerprint(source, dtype)
    return results_key(saved_model_name(source, dtype), fingerprint), fingerprint


def model_results_key(model: Model, model_name: str) -> tuple[str, str]:
    """`(key, fingerprint)` of a loaded model's results: its `fingerprint` (`jaxdepth.load`'s, of
    the files it came from and the dtype it was loaded or cast in), else, for a model made in
    memory, the fingerprint of its params and config (`jaxdepth.lab.model_identity`)."""
    from jaxdepth.lab.model_identity import weights_fingerprint

    fingerprint = model.fingerprint or weights_fingerprint(model.params, model.config)
    return results_key(model_name, fingerprint), fingerprint


@dataclasses.dataclass(frozen=True)
class StudyPrompts:
    """The prompts of a study: what is measured on.

    dataset: their name (the results folder's, `result_folder`, and every result's identity).
    batch: the prompts (a `jaxdepth.core.batch.PromptBatch`, `[N, T]` tokens and mask).
    baseline: the prompts whose mean residual is the erasure baseline (None: `batch` itself).
    baseline_name: which prompts `baseline` holds, in the erasure result's settings."""

    dataset: str
    batch: PromptBatch
    baseline: Optional[PromptBatch] = None
    baseline_name: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class StudyRun:
    """How a study runs and reports; nothing here changes a result.

    progress: a progress bar per analysis (`jaxdepth.core.progress`: True, False, or a
        tqdm-like callable); the analyses' sweeps get it in `RunInputs.execution`, with the
        settings' `memory_budget`.
    log: called with a line per analysis (reused, computed, failed).
    failures: the analyses whose errors are recorded instead of ending the study (`Failures`;
        None: none isolated)."""

    progress: ProgressLike = True
    log: Callable[[str], None] = print
    failures: Optional[Failures] = None


# Where each keyword `run_study` once took on its own now lives.
_STUDY_KEYWORDS = {
    "dataset": "prompts=StudyPrompts(dataset, batch)",
    "batch": "prompts=StudyPrompts(dataset, batch)",
    "baseline_batch": "prompts=StudyPrompts(dataset, batch, baseline=...)",
    "baseline_name": "prompts=StudyPrompts(dataset, batch, baseline_name=...)",
    "progress": "run=StudyRun(progress=...)",
    "log": "run=StudyRun(log=...)",
    "failures": "run=StudyRun(failures=...)",
}


def _refuse_study_keywords(options: dict) -> None:
    """A `TypeError` for a keyword `run_study` once took, showing the value that holds it now."""
    refuse_moved("run_study", options, _STUDY_KEYWORDS, "jaxdepth.lab.study.StudyPrompts, StudyRun")
    refuse_unknown("run_study", options)


def run_study(
    model: Model,
    model_name: str,
    prompts: StudyPrompts,
    out_dir: str,
    *,
    analyses: Optional[Sequence[str]] = None,
    settings: StudySettings = StudySettings(),
    model_key: Optional[tuple[str, str]] = None,
    run: StudyRun = StudyRun(),
    **loose,
) -> dict:
    """Run `analyses` for one (model, dataset), reusing saved results with identical settings,
    and return them by analysis name. With several processes (multi-host), every process
    computes and only process 0 saves. Results go to `result_folder(out_dir, key,
    prompts.dataset)`, the model's `key, fingerprint` given as `model_key` (a command computes
    them from its source before loading it) or else `model_results_key(model, model_name)`; the
    fingerprint is part of every result's identity. The model's config goes beside its results,
    in the model's folder (`jaxdepth.lab.results.MODEL_CONFIG`), once a result is there.

    `prompts` (a `StudyPrompts`) holds the dataset's name, its prompts `[N, T]` and the erasure
    baseline's (None: the dataset's own prompts, `baseline_name` saying which in the erasure
    result's settings). `analyses` None: every registered analysis run by default
    (`default_analyses`). `run` (a `StudyRun`) says how it runs and reports: the progress, the
    log, and the `failures` it isolates. An analysis that raises ends the study, unless
    `run.failures` isolates it: then its error goes to `failures.records`, it has no entry in
    the returned results, and the study goes on with the others. The keywords this function
    once took on their own (`baseline_batch=`, `baseline_name=`, `progress=`, `log=`,
    `failures=`) are refused with the value that holds them now."""
    _refuse_study_keywords(loose)
    if not isinstance(prompts, StudyPrompts):
        raise TypeError(
            "run_study(model, model_name, prompts, out_dir, ...) takes the prompts as one value: "
            f"StudyPrompts(dataset, batch), got {type(prompts).__name__}"
        )
    failures, log = Failures() if run.failures is None else run.failures, run.log
    batch, dataset = prompts.batch, prompts.dataset
    entries = [analysis(name) for name in (default_analyses() if analyses is None else analyses)]
    settings.check(entries)
    key, fingerprint = model_key or model_results_key(model, model_name)
    folder = result_folder(out_dir, key, dataset)
    common = {
        "model": model_name,
        "model_fingerprint": fingerprint[:16],
        "dataset": dataset,
        "num_prompts": settings.num_prompts,
        "prompt_tokens_sha": batch_digest(batch),
        "result_format": RESULT_FORMAT,
    }
    weights = str(np.dtype(model.params["embed"].dtype))
    if weights != "float32":  # only then, so float32 results saved before this key existed stay valid
        common["weights_dtype"] = weights
    baseline_sha = None if prompts.baseline is None else batch_digest(prompts.baseline)
    inputs = (model, batch, settings, prompts.baseline, run.progress)
    results = {}
    # Process 0 alone writes; it holds the folder so that a second run cannot interleave its
    # results with these (a command may hold it already, for its figures too).
    with hold_folders([folder]):
        for entry in entries:
            failed_before = len(failures.records)
            with failures.guard(entry.name, "running"):
                produced = produce(_step(entry, common, baseline_sha, prompts.baseline_name, inputs), folder)
                if produced.reused:
                    log(f"{entry.name}: reusing {folder}")
                else:
                    clock = produced.compiling
                    log(
                        f"{entry.name}: {produced.seconds:.1f} s ({clock.seconds:.1f} s compiling "
                        f"{clock.compilations} programs, {clock.cache_hits} read from the compilation cache) "
                        f"-> {folder}"
                    )
                results[entry.name] = produced.result
            if len(failures.records) > failed_before:
                error = failures.records[-1].error
                log(f"{entry.name}: failed ({type(error).__name__}: {error}); going on with the others")
        if results and is_writer():  # the model's config beside its results: its layers' kinds, for the shell
            save_model_config(os.path.dirname(folder), model.config)
    return results


def _step(entry: Analysis, common: dict, baseline_sha, baseline_name, inputs: tuple) -> Step:
    """`entry` as a step of a study (`jaxdepth.lab.runs`): `<name>.npz`, its identity the study's
    common one, its own (`Analysis.identity`) and the baseline's prompts where it reads them."""
    settings = inputs[2]
    identity = {**common, **entry.identity(settings.for_analysis(entry))}
    if entry.uses_baseline:
        identity["baseline_tokens_sha"] = baseline_sha

    def run():
        result = run_analysis(entry.name, *inputs)
        _check_finite(entry.name, result)
        if entry.uses_baseline:
            result.settings["baseline"] = baseline_name or "the dataset's own prompts"
        return result

    return Step(file=f"{entry.name}.npz", result_type=entry.result_type, identity=identity, run=run)


def write_figures(
    results: dict, folder: str, tokenizer=None, *, detail_prompts: int = 1, failures: Optional[Failures] = None
) -> list[str]:
    """Every registered figure of `results` (analysis name -> result) as PNG and PDF under
    `folder/figures`; the per-prompt heatmaps (erasure, IG) for the first `detail_prompts`. An
    analysis that `failures` isolates may fail to draw (its error recorded) without stopping the others."""
    from jaxdepth.lab import plots

    failures = Failures() if failures is None else failures
    paths = []
    for name, result in results.items():
        with failures.guard(name, "drawing its figures"):
            for key, fig in analysis(name).figures(result, tokenizer, detail_prompts).items():
                path = os.path.join(folder, "figures", f"{name}_{key}" if key else name)
                paths.extend(plots.save_figure(fig, path))
    return paths


def _check_finite(name: str, result) -> None:
    """Refuse to save a result holding NaN or infinity: it would poison every table and figure."""
    for field in dataclasses.fields(result):
        value = getattr(result, field.name)
        if isinstance(value, np.ndarray) and value.dtype.kind == "f" and not np.all(np.isfinite(value)):
            raise ValueError(
                f"{name}: {field.name} contains NaN or infinite values (check the model's "
                "weights, its dtype, and the prompts); nothing was saved"
            )
