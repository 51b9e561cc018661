"""Residual erasure: every boundary 0..L x position, one forward pass each on the reference's
side; jaxdepth runs each erasure from its boundary on, on its position block's suffix. Both use
one baseline (mean residuals), computed once outside the timings."""

from __future__ import annotations

import time

import numpy as np

from ..agreement import diff_row
from ..case import Bench, Case
from ..flops import answers, forward_flops, layer_flops, lm_head_flops
from ..report import log
from ..workload import Workload, combine_caps

NAME = "erasure"


def prepare_baseline(bench: Bench, w: Workload, full):
    """The mean residuals over the first --baseline-prompts prompts (full length), once, untimed;
    erasure and attribution patching share them."""
    from jaxdepth.analyses.erasure import mean_residuals

    if bench.baseline is not None:  # erasure and attribution patching share it
        return
    start = time.perf_counter()
    first = full.select(slice(0, bench.args.baseline_prompts))
    bench.baseline = mean_residuals(bench.model.params, first, bench.config)
    bench.excluded_s["erasure_baseline"] = seconds = time.perf_counter() - start
    log(
        f"erasure baseline: mean residuals over the first {min(bench.args.baseline_prompts, len(full))} prompts "
        f"(full length) by jaxdepth.analyses.erasure.mean_residuals in {seconds:.1f} s (excluded; both use it)"
    )


def run_jaxdepth(bench: Bench, w: Workload):
    # Not through the registry: its run computes the baseline's mean residuals first, which the
    # benchmark computes once outside the timings and hands to both sides.
    from jaxdepth.analyses.erasure import residual_erasure

    return residual_erasure(bench.model.params, w.batch, bench.config, bench.baseline)


def executed_flops(c, one, splits, steps):
    from jaxdepth.analyses.erasure import piece_width

    L, T, A = c.num_layers, one.tokens.shape[1], answers(one)
    width = piece_width(T)
    padded = -(-T // width) * width
    last_piece = int(one.answer_positions(0)[0].max()) // width
    kv = 2 * padded * L * 2 * c.hidden_size * c.num_kv_heads * c.head_dim
    total = layer_flops(c, padded, padded, L) + kv + lm_head_flops(c, A)
    # the erasures of piece k run pieces k..last_piece, each piece attending to the whole
    # key buffer and its own keys
    for k in range(last_piece + 1):
        rows = (last_piece + 1 - k) * width
        total += width * sum(layer_flops(c, rows, padded + width, L - l) + lm_head_flops(c, A) for l in range(L + 1))
    return total


def agreement(jres, rres, w, c):
    ours = [np.asarray(jres.effects)[i, :, :n] for i, n in enumerate(w.lengths)]
    rows = [diff_row(NAME, "effects [P,L+1,T]", np.concatenate(ours, axis=1), np.concatenate(rres, axis=1))]
    for i, n in enumerate(w.lengths):  # positions after the last answer prediction: exactly 0
        tail = slice(n - 1, n)
        rows.append(
            diff_row(NAME, f"prompt {i}: erasing t=T-1 (both exact 0)", ours[i][:, tail], rres[i][:, tail], exact=True)
        )
    return rows


CASE = Case(
    prompts=lambda a: a.erasure_prompts,
    cap=lambda a: combine_caps(a.max_tokens, a.erasure_max_tokens),
    jaxdepth=run_jaxdepth,
    reference=lambda ref, bench, w: ref.erasure(w.token_lists, w.answer_starts, bench.baseline),
    model_flops=lambda c, T, splits, steps: (1 + (c.num_layers + 1) * T) * forward_flops(c, T),
    executed_flops=executed_flops,
    agreement=agreement,
    prepare=prepare_baseline,
    passes=lambda bench, w: (
        f"; {(bench.config.num_layers + 1) * sum(w.lengths)} erasure passes (every boundary 0..L x position)"
    ),
)
