"""The suite's analyses: the built-in ones, and those registered since (plugins, your own code).

Each analysis declares itself in its own module (`jaxdepth.analyses.suite.Analysis`: its name,
result type, settings and options, cache identity, how it runs, its figures and summary); this
module only lists the declarations. Every analysis of the package is here; those whose
declaration says `default` are what a run that names none runs (`default_analyses`). The study
runner, the command line, result loading and the summary iterate `ANALYSES`; nothing in the
shell keys on an analysis's name. A new analysis is one `register(Analysis(...))` call:
`study.run_study` then runs, caches and resumes it like the others and draws its figures.
`jaxdepth run` runs it too when a plugin brings it: an `Analysis` object named by `--plugin
MODULE:OBJECT` or by an entry point of the group `jaxdepth.analyses` (`jaxdepth.lab.plugins`
loads and registers them), and offers its options.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

from jaxdepth.analyses.suite import Analysis, RunInputs, Settings, option, option_fields

# Analysis, RunInputs, Settings and option are the declaration vocabulary (jaxdepth.analyses.suite), here
# too so that a plugin imports everything it declares with from one module.
__all__ = [
    "ANALYSES",
    "BUILT_IN",
    "Analysis",
    "RunInputs",
    "Settings",
    "analysis",
    "declared_options",
    "default_analyses",
    "option",
    "register",
]

ANALYSES: dict[str, Analysis] = {}


def register(analysis: Analysis) -> Analysis:
    """Add `analysis` to the suite (a name already taken is an error, not a silent override)."""
    if not isinstance(analysis, Analysis):
        raise TypeError(f"register takes a jaxdepth.lab.registry.Analysis, got {type(analysis).__name__}")
    if analysis.name in ANALYSES:
        raise ValueError(f"an analysis named {analysis.name!r} is already registered")
    ANALYSES[analysis.name] = analysis
    return analysis


def default_analyses() -> list[str]:
    """The names of the analyses a run names none of runs: each registered one whose declaration
    says `default` (the built-in ones the studies run, and plugins' unless they say otherwise)."""
    return [name for name, entry in ANALYSES.items() if entry.default]


def analysis(name: str) -> Analysis:
    """The registered analysis `name`, or a ValueError listing the known ones."""
    if name not in ANALYSES:
        raise ValueError(f"unknown analysis {name!r}; known: {', '.join(ANALYSES)}")
    return ANALYSES[name]


def declared_options(entries: Iterable[Analysis]) -> dict[str, dataclasses.Field]:
    """The options (`jaxdepth.analyses.suite.option` fields) of the settings of `entries`, by
    name, each once. Two analyses may share an option only by sharing its declaration (a
    settings class, or a field inherited from one); two different declarations of one name are
    an error naming both analyses."""
    found: dict[str, tuple[dataclasses.Field, str]] = {}
    for entry in entries:
        for field in option_fields(entry.settings):
            if field.name in found and found[field.name][0] is not field:
                other = found[field.name][1]
                raise ValueError(
                    f"the analyses {other!r} and {entry.name!r} both declare an option {field.name!r}: "
                    "an option name belongs to one declaration"
                )
            found.setdefault(field.name, (field, entry.name))
    return {name: field for name, (field, _) in found.items()}


def _register_builtins():
    from jaxdepth.analyses import (
        attribution,
        contributions,
        decision_depth,
        erasure,
        expert_depth,
        generated_depth,
        geometry,
        integrated_gradients,
        jacobians,
        layer_programs,
        layer_skip,
        layer_structure,
        logit_lens,
    )

    for entry in (
        contributions.ANALYSIS,
        logit_lens.ANALYSIS,
        layer_skip.ANALYSIS,
        erasure.ANALYSIS,
        integrated_gradients.ANALYSIS,
        attribution.ATTRIBUTION_PATCHING,
        attribution.GRAD_X_ACT,
        # in the suite, run when named (their declarations say they are not run by default)
        decision_depth.ANALYSIS,
        expert_depth.ANALYSIS,
        generated_depth.ANALYSIS,
        geometry.ANALYSIS,
        jacobians.ANALYSIS,
        layer_structure.ANALYSIS,
        layer_programs.ANALYSIS,
    ):
        register(entry)


_register_builtins()

BUILT_IN: frozenset[str] = frozenset(ANALYSES)  # the names of the suite's own analyses
