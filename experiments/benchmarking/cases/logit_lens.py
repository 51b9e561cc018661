"""Logit lens: one forward per prompt, then the final norm and the LM head at every layer."""

from __future__ import annotations

from ..agreement import diff_row, ed_row
from ..case import Case, via_registry
from ..flops import forward_flops, layer_flops, lm_head_flops

NAME = "logit_lens"


def agreement(jres, rres, w, c):
    from jaxdepth.analyses import effective_depth as ed

    import reference_torch as rt

    kl_ed, ov_ed = ed.kl_effective_depth(jres.kl).layer, ed.overlap_effective_depth(jres.overlap).layer
    return [
        diff_row(NAME, "KL(P_l||P) [L]", jres.kl, rres["kl"]),
        diff_row(NAME, "top-5 overlap [L]", jres.overlap, rres["overlap"]),
        ed_row(NAME, "KL ED", kl_ed, rt.ed_kl(rres["kl"]), jres.kl, rres["kl"]),
        ed_row(NAME, "overlap ED", ov_ed, rt.ed_overlap(rres["overlap"]), jres.overlap, rres["overlap"]),
    ]


CASE = Case(
    prompts=lambda a: a.prompts,
    cap=lambda a: a.max_tokens,
    jaxdepth=via_registry(NAME),
    reference=lambda ref, bench, w: ref.logit_lens(w.token_lists),
    model_flops=lambda c, T, splits, steps: forward_flops(c, T) + c.num_layers * lm_head_flops(c, T),
    executed_flops=lambda c, one, splits, steps: (
        layer_flops(c, one.tokens.shape[1], one.tokens.shape[1], c.num_layers)
        + (c.num_layers + 1) * lm_head_flops(c, one.tokens.shape[1])
    ),
    agreement=agreement,
)
