"""The analyses of the suite, each declared once: its name, its result type, the settings that
enter its cache identity, how it runs, its figures and its one-line summary.

The study runner, the CLI, result loading and the summary iterate `ANALYSES`; nothing else keys
on analysis names. A new analysis is one `register(Analysis(...))` call: `study.run_study` then
runs, caches and resumes it like the others and draws its figures. `jaxdepth run` runs it too
when a plugin brings it: an `Analysis` object named by `--plugin MODULE:OBJECT` or by an entry
point of the group `jaxdepth.analyses` (`jaxdepth.lab.plugins` loads and registers them).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Callable, Optional


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunInputs:
    """What an analysis runs on: the loaded model, the prompts (already cut to the detail prompts
    for a `detail` analysis), the study settings, the erasure baseline prompts (None: the prompts
    themselves) and whether to show progress bars."""

    model: Any  # jaxdepth.lab.loaded_model.Model
    batch: Any  # jaxdepth.core.batch.PromptBatch
    settings: Any  # jaxdepth.lab.study.StudySettings
    baseline_batch: Optional[Any] = None
    progress: bool = True


@dataclasses.dataclass(frozen=True, kw_only=True)
class Analysis:
    """One analysis of the suite.

    identity: settings -> the settings that change this analysis's result (a cached result is
        reused when these, the model, the prompts and the dataset match).
    run: `RunInputs` -> the result (a `jaxdepth.core.saved_result.SavedResult`).
    figures: (result, tokenizer, detail_prompts) -> `{figure name: matplotlib Figure}`.
    summary: result -> short phrases for the one-line summary of a run.
    detail: runs on the first `detail_prompts` prompts only (the per-position sweeps).
    uses_baseline: reads the erasure baseline (its prompts enter the cache identity).
    feeds_table: its results enter the effective-depth table.
    """

    name: str
    result_type: type
    identity: Callable[[Any], dict]
    run: Callable[[RunInputs], Any]
    figures: Callable[[Any, Any, int], dict]
    summary: Callable[[Any], list]
    detail: bool = False
    uses_baseline: bool = False
    feeds_table: bool = False


ANALYSES: dict[str, Analysis] = {}


def register(analysis: Analysis) -> Analysis:
    """Add `analysis` to the suite (a name already taken is an error, not a silent override)."""
    if analysis.name in ANALYSES:
        raise ValueError(f"an analysis named {analysis.name!r} is already registered")
    ANALYSES[analysis.name] = analysis
    return analysis


def analysis(name: str) -> Analysis:
    """The registered analysis `name`, or a ValueError listing the known ones."""
    if name not in ANALYSES:
        raise ValueError(f"unknown analysis {name!r}; known: {', '.join(ANALYSES)}")
    return ANALYSES[name]


# ----------------------------------------------------------------------------- the built-in suite


def _register_builtins():
    from jaxdepth.analyses import attribution, contributions, erasure, integrated_gradients, layer_skip, logit_lens
    from jaxdepth.lab import plots
    from jaxdepth.analyses import effective_depth as ed
    from jaxdepth.analyses.ig import rules as ig_rules

    def per_prompt_figures(draw):
        def figures(result, tokenizer, detail_prompts):
            count = min(detail_prompts, len(result.lengths))
            return {f"prompt{i}": draw(result, i, tokenizer=tokenizer) for i in range(count)}

        return figures

    register(
        Analysis(
            name="contributions",
            result_type=contributions.ContributionResult,
            identity=lambda s: {},
            run=lambda x: contributions.contributions(x.model.params, x.batch, x.model.config),
            figures=lambda r, tokenizer, n: {"": plots.contributions_figure(r)},
            summary=lambda r: [f"cosine ED {ed.cosine_effective_depth(r.mean_cosine)}"],
            feeds_table=True,
        )
    )
    register(
        Analysis(
            name="logit_lens",
            result_type=logit_lens.LogitLensResult,
            identity=lambda s: {"lens_weighting": s.lens_weighting},
            run=lambda x: logit_lens.logit_lens(
                x.model.params, x.batch, x.model.config, weighting=x.settings.lens_weighting
            ),
            figures=lambda r, tokenizer, n: {"": plots.logit_lens_figure(r)},
            summary=lambda r: [
                f"KL ED {ed.kl_effective_depth(r.kl)}",
                f"overlap ED {ed.overlap_effective_depth(r.overlap)}",
            ],
            feeds_table=True,
        )
    )
    register(
        Analysis(
            name="layer_skip",
            result_type=layer_skip.LayerSkipBySublayer,
            identity=lambda s: {
                "seed": s.seed,
                "skip_sublayers": list(s.skip_sublayers),
                "skip_mode": s.skip_mode,
                # only when not the default: earlier results stay valid
                **({} if s.skip_split == "sampled" else {"skip_split": s.skip_split}),
            },
            run=lambda x: layer_skip.layer_skip_sublayers(
                x.model.params,
                x.batch,
                x.model.config,
                sublayers=x.settings.skip_sublayers,
                seed=x.settings.seed,
                mode=x.settings.skip_mode,
                splits=x.settings.skip_split,
                memory_budget=x.settings.memory_budget,
                progress=x.progress,
            ),
            figures=lambda r, tokenizer, n: {"": plots.layer_skip_figure(r.parts())},
            summary=lambda r: [
                f"depth score ({s} skipped) {ed.depth_score(part.later):.2f}" for s, part in r.parts().items()
            ],
        )
    )

    def erasure_baseline(x):
        batch = x.baseline_batch if x.baseline_batch is not None else x.batch
        return erasure.mean_residuals(x.model.params, batch, x.model.config)

    def run_erasure(x):
        return erasure.residual_erasure(
            x.model.params,
            x.batch,
            x.model.config,
            erasure_baseline(x),
            memory_budget=x.settings.memory_budget,
            progress=x.progress,
        )

    register(
        Analysis(
            name="erasure",
            result_type=erasure.ErasureResult,
            identity=lambda s: {"detail_prompts": s.detail_prompts},
            run=run_erasure,
            figures=per_prompt_figures(plots.erasure_figure),
            summary=lambda r: [f"erasure max effect {float(r.effects.max()):.3g}"],
            detail=True,
            uses_baseline=True,
        )
    )

    def ig_identity(s):
        if s.ig_rule == "adaptive":  # its steps are its own: the tolerance and budget say what it ran
            budget = ig_rules.default_budget(s.ig_steps) if s.ig_max_evaluations is None else s.ig_max_evaluations
            rule = {
                "ig_rule": "adaptive",
                "ig_tolerance": s.ig_tolerance,
                "ig_max_evaluations": budget,
                "ig_rule_version": ig_rules.RULE_VERSION,
            }
        else:
            rule = {"ig_steps": s.ig_steps, "ig_rule": s.ig_rule}
        return {
            "detail_prompts": s.detail_prompts,
            **rule,
            "ig_baseline": s.ig_baseline,
            # only when not the default: earlier results stay valid
            **({} if s.ig_target == "layer" else {"ig_target": s.ig_target}),
        }

    def run_ig(x):
        s, m = x.settings, x.model
        common = dict(baseline=s.ig_baseline, target=s.ig_target, memory_budget=s.memory_budget, progress=x.progress)
        if s.ig_rule == "adaptive":
            common.update(tolerance=s.ig_tolerance, max_evaluations=s.ig_max_evaluations)
        return integrated_gradients.integrated_gradients(
            m.params, x.batch, m.config, steps=s.ig_steps, rule=s.ig_rule, **common
        )

    def ig_summary(r):
        line = [f"IG ({r.rule}) max |completeness gap| {abs(r.gap).max():.2g}"]
        if r.converged is not None:
            line.append(
                f"adaptive IG: {int(r.converged.sum())} of {r.converged.size} layers converged, "
                f"{int(r.evaluations.sum())} gradient evaluations"
            )
        return line

    register(
        Analysis(
            name="integrated_gradients",
            result_type=integrated_gradients.IntegratedGradientsResult,
            identity=ig_identity,
            run=run_ig,
            figures=per_prompt_figures(plots.integrated_gradients_figure),
            summary=ig_summary,
            detail=True,
        )
    )

    def run_attribution(x):
        return attribution.attribution_patching(
            x.model.params, x.batch, x.model.config, erasure_baseline(x), progress=x.progress
        )

    # One forward and one backward pass per prompt give both; each is its own analysis so either
    # can be asked for alone.
    register(
        Analysis(
            name="attribution_patching",
            result_type=attribution.AttributionResult,
            identity=lambda s: {"detail_prompts": s.detail_prompts},
            run=run_attribution,
            figures=per_prompt_figures(plots.attribution_patching_figure),
            summary=lambda r: [f"attribution patching (screening) max |estimate| {float(abs(r.patching).max()):.3g}"],
            detail=True,
            uses_baseline=True,
        )
    )
    register(
        Analysis(
            name="grad_x_act",
            result_type=attribution.AttributionResult,
            identity=lambda s: {"detail_prompts": s.detail_prompts},
            run=run_attribution,
            figures=per_prompt_figures(partial(plots.attribution_patching_figure, quantity="grad_x_act")),
            summary=lambda r: [f"grad x act max |value| {float(abs(r.grad_x_act).max()):.3g}"],
            detail=True,
        )
    )  # g . h does not read the baseline: it is no part of this cache identity


_register_builtins()

BUILT_IN: frozenset[str] = frozenset(ANALYSES)  # the names of the suite's own analyses
