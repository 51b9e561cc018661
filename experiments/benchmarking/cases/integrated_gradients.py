"""Integrated gradients: per prompt and layer, `--ig-steps` left-Riemann steps. The reference
runs the layers after each one and the head on blocks of 16 steps, forward and backward, as the
published code does; jaxdepth keeps the later layers' matmul outputs for the backward where
memory allows, or recomputes each layer in it. Also the adaptive rule
(`--ig-tolerance`), timed on jaxdepth's side only: the published code has no such rule."""

from __future__ import annotations

from typing import Optional

import numpy as np

from ..agreement import cut_to_lengths, diff_row
from ..case import Bench, Case, via_registry
from ..flops import answers, forward_flops, layer_flops, lm_head_flops
from ..machine import Clock
from ..report import log, study_total
from ..workload import Workload, combine_caps

NAME = "integrated_gradients"
IG_BLOCK = 16  # reference_torch.IG_BLOCK (not imported here: that module needs torch)


def model_flops(c, T, splits, steps):
    # As the published code runs it: one clean forward; per layer l, F(b) and `steps` forward and
    # backward passes of the layers after l and the head, in blocks of 16 steps. Weights need no
    # gradient, so a backward costs about one forward of the layers it crosses.
    suffix = lambda l: layer_flops(c, T, T, c.num_layers - l - 1) + lm_head_flops(c, T)  # noqa: E731
    return forward_flops(c, T) + sum((2 * steps + 1) * suffix(l) for l in range(c.num_layers))


def gradient_flops(c, one, layer: int, steps: int) -> float:
    """Matmul FLOPs of one gradient evaluation on the path of `layer`: the layers after it
    forward, then a backward that pulls back through them (from their kept matmul outputs, or,
    where the default 'auto' backward recomputes, after running each of them again: all of
    them, or those whose outputs do not fit in memory), and the LM head at the answer positions
    forward and back."""
    from jaxdepth.analyses.ig.path import choose_backward
    from jaxdepth.core.loops import stored_layers

    T, A = one.tokens.shape[1], answers(one)
    later = c.num_layers - layer - 1
    kept = min(stored_layers(choose_backward("auto", c, T), c.num_layers), later)  # the last layers store
    return 2 * layer_flops(c, T, T, kept) + 3 * layer_flops(c, T, T, later - kept) + 2 * lm_head_flops(c, A)


def executed_flops(c, one, splits, steps):
    L, T, A = c.num_layers, one.tokens.shape[1], answers(one)
    total = layer_flops(c, T, T, L) + lm_head_flops(c, A)
    for l in range(L):
        # the steps' gradients, and F(b): one forward of the layers after l and the head
        total += steps * gradient_flops(c, one, l, steps) + layer_flops(c, T, T, L - l - 1) + lm_head_flops(c, A)
    return total


def agreement(jres, rres, w, c):
    return [
        diff_row(
            NAME,
            "attributions [P,L,T]",
            cut_to_lengths(jres.attributions, w.lengths),
            np.concatenate(rres["attributions"], axis=1),
            tol_rel=3e-3,
        ),
        diff_row(NAME, "F(x) [P]", jres.f_input, rres["f_input"]),
        diff_row(NAME, "F(b) [P,L]", jres.f_baseline, np.stack(rres["f_baseline"])),
        diff_row(NAME, "completeness gap [P,L]", jres.gap, np.stack(rres["gap"]), tol_rel=3e-2),
    ]


def passes(bench: Bench, w: Workload) -> str:
    steps, L = bench.args.ig_steps, bench.config.num_layers
    return (
        f"; {steps} steps x {L} layers; the reference runs them in blocks of {IG_BLOCK} steps, "
        f"{-(-steps // IG_BLOCK) * L * len(w.lengths)} forward+backward passes"
    )


CASE = Case(
    prompts=lambda a: a.ig_prompts,
    cap=lambda a: combine_caps(a.max_tokens, a.ig_max_tokens),
    jaxdepth=via_registry(NAME),
    reference=lambda ref, bench, w: ref.integrated_gradients(w.token_lists, w.answer_starts, bench.args.ig_steps),
    model_flops=model_flops,
    executed_flops=executed_flops,
    agreement=agreement,
    passes=passes,
    padding=lambda c, batch, steps: _ig_lengths(c, batch, steps),
)


def _ig_lengths(c, batch, steps: int):
    """The lengths the studies' IG pads the prompts to (by cost, `ig_lengths`)."""
    from jaxdepth.analyses.ig import FixedRule
    from jaxdepth.analyses.integrated_gradients import ig_lengths

    return ig_lengths(batch, c, FixedRule("left", max(steps, 1)))


# ----------------------------------------------------------------------------- the adaptive rule


def adaptive_jaxdepth(bench: Bench, w: Workload):
    from jaxdepth.analyses.ig import AdaptiveRule, Execution
    from jaxdepth.analyses.integrated_gradients import integrated_gradients_of_answers

    rule = AdaptiveRule(tolerance=bench.args.ig_tolerance)
    return integrated_gradients_of_answers(
        bench.model.params, w.batch, bench.config, rule=rule, execution=Execution(progress=False)
    )


def time_adaptive(clock: Clock, bench: Bench, w: Workload, fixed_run_s: float) -> dict:
    """The adaptive preset on the IG workload, compiled then timed as jaxdepth's side of every
    case is, beside the fixed rule's measured time `fixed_run_s`: evaluations, milliseconds per
    gradient evaluation of each rule (same prompts and machine), convergence, and each rule's
    executed FLOP rate. An evaluation of an early layer crosses more layers than one of a late
    layer, and the adaptive rule spends most of its evaluations early: the FLOP rates compare
    the two per unit of work on the same layers, where milliseconds per evaluation do not."""

    t = clock.compiled("jaxdepth adaptive IG", lambda: adaptive_jaxdepth(bench, w))
    tolerance, result, c = bench.args.ig_tolerance, t.result, bench.config
    steps = bench.args.ig_steps
    fixed_evaluations = steps * c.num_layers * len(w.lengths)
    evaluations = int(result.evaluations.sum())
    fixed_ms = 1e3 * fixed_run_s / fixed_evaluations
    ones = [w.batch.single(i) for i in range(len(w.lengths))]
    # the gradient evaluations only, for both rules: the clean forward and F(b) passes aside
    adaptive_flops = sum(
        int(n) * gradient_flops(c, one, l, steps)
        for one, row in zip(ones, result.evaluations)
        for l, n in enumerate(row)
    )
    fixed_flops = sum(steps * gradient_flops(c, one, l, steps) for one in ones for l in range(c.num_layers))
    adaptive = dict(
        tolerance=tolerance,
        jax_first_s=t.first_s,
        jax_run_s=t.run_s,
        evaluations=evaluations,
        fixed_evaluations=fixed_evaluations,
        layer_evaluations=result.evaluations.tolist(),
        ms_per_evaluation=1e3 * t.run_s / evaluations,
        fixed_ms_per_evaluation=fixed_ms,
        gflops_per_s=adaptive_flops / t.run_s / 1e9,
        fixed_gflops_per_s=fixed_flops / fixed_run_s / 1e9,
        converged=int(result.converged.sum()),
        layers=int(result.converged.size),
        max_relative_gap=float(np.nanmax(np.abs(result.relative_gap))),
        others_cores=t.others_all,
    )
    log(
        f"jaxdepth adaptive IG at tolerance {tolerance}: first call {t.first_s:.2f} s, then {t.run_s:.2f} s; "
        f"{adaptive['evaluations']} gradient evaluations ({adaptive['converged']}/{adaptive['layers']} layers "
        f"converged, largest |gap| {100 * adaptive['max_relative_gap']:.2f}% of |F(x) - F(b)|); "
        f"{adaptive['ms_per_evaluation']:.1f} ms per gradient evaluation against the fixed rule's {fixed_ms:.1f} ms; "
        f"{adaptive['gflops_per_s']:.0f} GFLOP/s of gradient work against the fixed rule's "
        f"{adaptive['fixed_gflops_per_s']:.0f}"
    )
    return adaptive


def study_with_adaptive(study: list, rows: list, adaptive: Optional[dict], steps: int) -> Optional[dict]:
    """The full-study extrapolation with the adaptive IG preset in place of the published rule:
    jaxdepth's IG time scaled by the measured adaptive time over the measured fixed-rule time
    scaled to 256 steps (both on the IG workload); the reference keeps the published rule."""
    if adaptive is None:
        return None
    fixed = next(r for r in rows if r["analysis"] == NAME)
    share = adaptive["jax_run_s"] / (fixed["jax_run_s"] * 256 / steps)
    out = [dict(r, jax_s=r["jax_s"] * share) if r["analysis"] == NAME else dict(r) for r in study]
    return dict(share_of_published_ig_time=share, rows=out, total=study_total(out))
