"""What a case declares (`Case`: how each side runs an analysis, its FLOP models, its agreement
check) and what every case reads (`Bench`)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Callable

from .workload import Workload


@dataclasses.dataclass
class Bench:
    """What every case reads: the loaded jaxdepth model, the arguments, the layer-skip split
    positions per prompt and the erasure baseline (both computed once, shared by both sides)."""

    model: object
    args: argparse.Namespace
    splits: list = dataclasses.field(default_factory=list)
    baseline: object = None
    excluded_s: dict = dataclasses.field(default_factory=dict)  # untimed preparation, by what it was

    @property
    def config(self):
        return self.model.config


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    """How the benchmark runs, counts and checks one registered analysis.

    prompts, cap: args -> its prompt count and token cap.
    jaxdepth: (bench, workload) -> jaxdepth's result.
    reference: (reference, bench, workload) -> the reference's result.
    model_flops: (config, T, splits of the prompt, steps) -> the work of one prompt of length T
        as the reference formulation defines it (one pass per intervention).
    executed_flops: (config, one-prompt batch, splits of the prompt, steps) -> the matmul FLOPs
        jaxdepth executes for it.
    agreement: (jaxdepth result, reference result, workload, config) -> agreement rows.
    passes: (bench, workload) -> what the workload line adds about the passes it runs.
    prepare: (bench, workload, every encoded prompt) -> None; computes, untimed, what both
        sides share (the layer-skip split positions, the erasure baseline) into `bench`.
    uses_splits: whether its FLOP models read `bench.splits` (one list per prompt of its own
        workload); the other cases' prompts have none.
    padding: (config, batch, steps) -> the lengths jaxdepth pads each prompt to (anything with
        `padded(length)`); default the batch's length buckets.
    """

    prompts: Callable
    cap: Callable
    jaxdepth: Callable
    reference: Callable
    model_flops: Callable
    executed_flops: Callable
    agreement: Callable
    passes: Callable = lambda bench, w: ""
    prepare: Callable = lambda bench, w, full: None
    uses_splits: bool = False
    padding: Callable = lambda c, batch, steps: batch.buckets


def settings(bench: Bench):
    from jaxdepth.lab.study import StudySettings

    return StudySettings(seed=bench.args.seed, options={"skip_sublayers": ("layer",), "ig_steps": bench.args.ig_steps})


def via_registry(name: str):
    """jaxdepth's side of a case: the registered analysis, run as `jaxdepth run` runs it."""

    def run(bench: Bench, w: Workload):
        from jaxdepth.lab.registry import RunInputs, analysis

        entry = analysis(name)
        inputs = RunInputs(
            model=bench.model, batch=w.batch, settings=settings(bench).for_analysis(entry), progress=False
        )
        return entry.run(inputs)

    return run
