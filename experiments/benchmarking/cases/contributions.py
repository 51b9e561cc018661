"""Contributions and cosine: one forward per prompt on both sides (no LM head needed)."""

from __future__ import annotations

from ..agreement import diff_row, ed_row
from ..case import Case, via_registry
from ..flops import forward_flops, layer_flops

NAME = "contributions"
STATS = ("norm_attn", "norm_mlp", "norm_layer", "cos_attn", "cos_mlp", "cos_layer")


def agreement(jres, rres, w, c):
    from jaxdepth.analyses import effective_depth as ed

    import reference_torch as rt

    rows = [diff_row(NAME, f"curve {stat} [L]", getattr(jres, stat), rres["curves"][stat]) for stat in STATS]
    mean_cos = sum(rres["curves"][k] for k in ("cos_attn", "cos_mlp", "cos_layer")) / 3
    ours = ed.cosine_effective_depth(jres.mean_cosine).layer
    rows.append(ed_row(NAME, "cosine ED", ours, rt.ed_cosine(mean_cos), jres.mean_cosine, mean_cos))
    return rows


CASE = Case(
    prompts=lambda a: a.prompts,
    cap=lambda a: a.max_tokens,
    jaxdepth=via_registry(NAME),
    reference=lambda ref, bench, w: ref.contributions(w.token_lists),
    model_flops=lambda c, T, splits, steps: forward_flops(c, T, lm_head=False),  # no LM head needed
    executed_flops=lambda c, one, splits, steps: layer_flops(c, one.tokens.shape[1], one.tokens.shape[1], c.num_layers),
    agreement=agreement,
)
