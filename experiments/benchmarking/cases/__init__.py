"""One case per registered analysis (`jaxdepth.lab.registry.ANALYSES`; a test checks they
match), each in its own module, and the FLOP counts of a workload by its case's models."""

from __future__ import annotations

from . import attribution_patching, contributions, erasure, integrated_gradients, layer_skip, logit_lens

CASES = {
    "contributions": contributions.CASE,
    "logit_lens": logit_lens.CASE,
    "layer_skip": layer_skip.CASE,
    "erasure": erasure.CASE,
    "integrated_gradients": integrated_gradients.CASE,
    "attribution_patching": attribution_patching.CASE,
    "grad_x_act": attribution_patching.GRAD_X_ACT,
}


def _splits_of(name: str, splits, n: int) -> list:
    """Each of the case's n prompts' split positions: `splits` (layer skip's, one list per
    prompt of its workload) for the case that uses them, none for the others, whose workloads
    have other prompt counts."""
    if not CASES[name].uses_splits:
        return [[] for _ in range(n)]
    if len(splits or []) != n:
        raise ValueError(f"{name}: {len(splits or [])} prompts' split positions for {n} prompts")
    return splits


def workload_flops(name: str, c, lengths, *, splits=None, steps: int = 0) -> float:
    """Model FLOPs of an analysis' workload as the reference approach runs it (one pass per
    intervention, each prompt at its own length; matmul FLOPs only)."""
    per_prompt = _splits_of(name, splits, len(lengths))
    return sum(CASES[name].model_flops(c, T, per_prompt[i], steps) for i, T in enumerate(lengths))


def executed_flops(name: str, c, batch, *, splits=None, steps: int = 0) -> float:
    """Matmul FLOPs jaxdepth actually executes for an analysis: each prompt at its padded length,
    interventions starting at their boundary, erasures on their position block's suffix, the LM
    head only where it is read, and IG's backward as the default 'auto' chooses it (2 layer
    passes per gradient from the kept activations, 3 where it recomputes each layer; weights
    take no gradient). What
    `% peak` is computed from; `workload_flops` is the work as the reference formulation
    defines it, which makes the ratios comparable."""
    per_prompt = _splits_of(name, splits, len(batch))
    padding = CASES[name].padding(c, batch, steps)  # each prompt at its length, as the analysis pads it
    return sum(CASES[name].executed_flops(c, batch.single(i, padding), per_prompt[i], steps) for i in range(len(batch)))
