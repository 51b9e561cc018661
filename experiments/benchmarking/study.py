"""The full study workload (10 prompts at full length, layer skip at 4 split positions each,
erasure at every boundary x position, IG at 256 steps x every layer), extrapolated from the
rates measured on the benchmark's workloads."""

from __future__ import annotations

from .cases import executed_flops, workload_flops
from .report import study_total


def full_study(rows: list, full, c, seed: int) -> dict:
    """jaxdepth from the FLOPs it would execute at its measured executed rate (its savings grow
    with prompt length), the reference from its model FLOPs at its measured rate."""
    from jaxdepth.analyses.layer_skip import sample_split_positions

    study_batch = full.select(slice(0, 10))  # the studies: 10 prompts, full length
    study_lengths = [int(n) for n in study_batch.lengths]
    study_splits = sample_split_positions(study_lengths, seed=seed)
    study = []
    for r in rows:
        a = r["analysis"]
        f = workload_flops(a, c, study_lengths, splits=study_splits, steps=256)
        e = executed_flops(a, c, study_batch, splits=study_splits, steps=256)
        study.append(
            dict(
                analysis=a,
                model_flops=f,
                executed_flops=e,
                jax_s=e / r["executed_flops_per_s"],
                ref_s=None if r["ref_flops_per_s"] is None else f / r["ref_flops_per_s"],
            )
        )
    return dict(
        description=f"{len(study_lengths)} prompts at full length (lengths {study_lengths}), layer skip with "
        "4 split positions each, erasure at every boundary x position, IG 256 steps x every layer",
        rows=study,
        total=study_total(study),
    )
