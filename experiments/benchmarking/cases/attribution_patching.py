"""Attribution patching and gradient x activation: one forward and one backward per prompt,
on the erasure's prompts and with its baseline. Both analyses come from the same pass; each is
registered as its own analysis, so each has a case."""

from __future__ import annotations

import dataclasses
from functools import partial

import numpy as np

from ..agreement import cut_to_lengths, diff_row
from ..case import Bench, Case
from ..flops import answers, forward_flops, layer_flops, lm_head_flops
from ..workload import Workload, combine_caps
from .erasure import prepare_baseline


def run_jaxdepth(bench: Bench, w: Workload):
    # Not through the registry, for the same reason as erasure: the baseline is shared, untimed.
    from jaxdepth.analyses.attribution import attribution_patching

    return attribution_patching(bench.model.params, w.batch, bench.config, bench.baseline)


def executed_flops(c, one, splits, steps):
    # forward, then a backward that pulls back through the stored activations (or, where
    # site_gradients would, recomputes each layer first); the LM head only at the answer positions
    from jaxdepth.analyses.attribution import recomputes_layers

    L, T, A = c.num_layers, one.tokens.shape[1], answers(one)
    passes = 3 if recomputes_layers(c, T) else 2
    return passes * layer_flops(c, T, T, L) + 2 * lm_head_flops(c, A)


def agreement(jres, rres, w, c, name="attribution_patching"):
    return [
        diff_row(
            name,
            "estimate [P,L+1,T]",
            cut_to_lengths(jres.patching, w.lengths),
            np.concatenate(rres["patching"], axis=1),
        ),
        diff_row(
            name,
            "grad x act [P,L+1,T]",
            cut_to_lengths(jres.grad_x_act, w.lengths),
            np.concatenate(rres["grad_x_act"], axis=1),
        ),
        diff_row(name, "F(x) [P]", jres.f_input, rres["f_input"]),
    ]


CASE = Case(
    prompts=lambda a: a.erasure_prompts,
    cap=lambda a: combine_caps(a.max_tokens, a.erasure_max_tokens),
    jaxdepth=run_jaxdepth,
    reference=lambda ref, bench, w: ref.attribution_patching(w.token_lists, w.answer_starts, bench.baseline),
    # one forward, one backward to the activations (about one forward again)
    model_flops=lambda c, T, splits, steps: 2 * forward_flops(c, T),
    executed_flops=executed_flops,
    agreement=agreement,
    prepare=prepare_baseline,
    passes=lambda bench, w: f"; {len(w.lengths)} forward+backward pass(es), the erasure's prompts",
)

# the same pass, registered as its own analysis
GRAD_X_ACT = dataclasses.replace(CASE, agreement=partial(agreement, name="grad_x_act"))
