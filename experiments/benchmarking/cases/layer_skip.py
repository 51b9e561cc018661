"""Layer skip: per prompt, skipped layer and split position, one forward pass on the reference's
side; jaxdepth runs each skip from its layer on, with the split positions of a prompt as members."""

from __future__ import annotations

import numpy as np

from ..agreement import diff_row, value_row
from ..case import Bench, Case, via_registry
from ..flops import forward_flops, layer_flops, lm_head_flops
from ..workload import Workload, combine_caps

NAME = "layer_skip"


def sample_splits(bench: Bench, w: Workload, full):
    """The split positions of each prompt, drawn once (untimed) and given to both sides."""
    from jaxdepth.analyses.layer_skip import sample_split_positions

    bench.splits = sample_split_positions(w.lengths, seed=bench.args.seed)


def executed_flops(c, one, splits, steps):
    from jaxdepth.analyses.layer_skip import measured_rows, member_masks

    L, T = c.num_layers, one.tokens.shape[1]
    if not splits:  # a prompt without split positions is not run; the others run 4 (padded)
        return 0.0
    # the LM head runs on each split's measured positions only, the rows `output_shifts` gets
    padded = list(splits) + [splits[0]] * (4 - len(splits))
    _, measure = member_masks(int(one.lengths[0]), T, padded, "future")
    rows = len(measured_rows(np.stack(measure), one.valid[0])[0])
    return (
        layer_flops(c, T, T, L)
        + (L + 1) * lm_head_flops(c, rows)
        + 4 * sum(layer_flops(c, T, T, L - s) for s in range(L))
    )


def agreement(jres, rres, w, c):
    from jaxdepth.analyses import effective_depth as ed

    import reference_torch as rt

    jres, L = jres.part("layer"), c.num_layers
    low = np.tril(np.ones((L, L), bool))
    ours, theirs = ed.depth_score(jres.later), rt.depth_score(rres["later"])
    return [
        diff_row(NAME, "D[s,j] later [L,L]", jres.later, rres["later"]),
        diff_row(NAME, "output L2 [L]", jres.output, rres["output"]),
        diff_row(NAME, "D per prompt [P,L,L]", jres.later_per_prompt, rres["later_per_prompt"]),
        diff_row(
            NAME, "D[s,j<=s] (both exact 0)", np.asarray(jres.later)[low], np.asarray(rres["later"])[low], exact=True
        ),
        value_row(NAME, "depth score", round(ours, 4), round(theirs, 4), ok=abs(ours - theirs) < 1e-3),
    ]


CASE = Case(
    prompts=lambda a: a.skip_prompts,
    cap=lambda a: combine_caps(a.max_tokens, a.skip_max_tokens),
    jaxdepth=via_registry(NAME),
    reference=lambda ref, bench, w: ref.layer_skip(w.token_lists, bench.splits),
    model_flops=lambda c, T, splits, steps: (1 + c.num_layers * len(splits)) * forward_flops(c, T),
    executed_flops=executed_flops,
    agreement=agreement,
    prepare=sample_splits,
    uses_splits=True,
    passes=lambda bench, w: (
        f"; split positions {bench.splits}; "
        f"{sum(len(s) for s in bench.splits) * bench.config.num_layers} skip passes + "
        f"{len(bench.splits)} clean"
    ),
)
