"""Every figure of the suite keeps every label inside its image at any depth: for each analysis's
figures (`Analysis.figures`), drawn from made-up results of 2, 6, 30 and 64 layers, each visible
text (titles, axis and tick labels, colour-bar labels, legends) lies within the figure's canvas
once its layout has run, and so within the saved image."""

from __future__ import annotations

import numpy as np
import pytest
from matplotlib.text import Text

from jaxdepth.analyses import decision_depth, geometry, jacobians, layer_structure
from jaxdepth.lab.registry import ANALYSES

LAYER_COUNTS = (2, 6, 30, 64)
P, T, ANSWER = 2, 24, 16  # prompts, tokens (the second prompt shorter), answer start
LENGTHS = np.array([T, T - 5])
# the analyses of the package that join a study as plugins, beside the built-in ones
PLUGINS = {
    a.name: a for a in (decision_depth.ANALYSIS, geometry.ANALYSIS, jacobians.ANALYSIS, layer_structure.ANALYSIS)
}
SUITE = {**{name: ANALYSES[name] for name in sorted(ANALYSES)}, **PLUGINS}


class WordTokenizer:
    """Decodes each token id to a short word, as a real tokenizer's pieces read."""

    def decode(self, ids):
        return " ".join(f"w{int(i)}" for i in ids)


def _curves(rng, L, n=P):
    return rng.uniform(0.1, 1, L), rng.uniform(0.1, 1, (n, L))


def _per_token(rng, rows):
    """`[P, rows, T]`, zero beyond each prompt's length, one cell dominant (a clipped colour scale)."""
    values = rng.normal(size=(P, rows, T))
    values[:, 0, 0] = 50.0
    values[1, :, LENGTHS[1] :] = 0
    return values.astype(np.float32)


def made_up_result(name: str, L: int):
    """A result of analysis `name` for a model of `L` layers, its arrays random but shaped and
    ranged as the analysis writes them."""
    rng = np.random.default_rng(L)
    tokens = rng.integers(0, 500, (P, T)).astype(np.int32)
    prompts = dict(tokens=tokens, lengths=LENGTHS, answer_start=np.array([ANSWER, ANSWER - 3]))
    result_type = SUITE[name].result_type
    if name == "contributions":
        fields = {}
        for stat in ("norm_attn", "norm_mlp", "norm_layer", "cos_attn", "cos_mlp", "cos_layer"):
            fields[stat], fields[f"{stat}_per_prompt"] = _curves(rng, L)
        return result_type(**fields, num_tokens=int(LENGTHS.sum()), tokens_per_prompt=LENGTHS, settings={})
    if name == "logit_lens":
        kl, kl_pp = _curves(rng, L)
        overlap, overlap_pp = _curves(rng, L)
        return result_type(
            kl=10 * kl, overlap=overlap, kl_per_prompt=10 * kl_pp, overlap_per_prompt=overlap_pp,
            tokens_per_prompt=LENGTHS, settings={"weighting": "token"},
        )  # fmt: skip
    if name == "layer_skip":  # the three sublayers' rows, each with one dominant cell (a clipped scale)
        later = np.triu(rng.uniform(0, 1, (3, P, L, L)))
        later[:, :, 0, -1] = 20.0
        return result_type(
            sublayers=["layer", "attn", "mlp"], later=later.max(1), output=rng.uniform(0, 1, (3, L)),
            later_per_prompt=later, output_per_prompt=rng.uniform(0, 1, (3, P, L)),
            split_positions=np.zeros((P, 4), np.int64), settings={"mode": "future", "splits": 4},
        )  # fmt: skip
    if name == "erasure":
        return result_type(effects=_per_token(rng, L + 1), settings={}, **prompts)
    if name == "integrated_gradients":
        return result_type(
            attributions=_per_token(rng, L), gap=rng.normal(0, 0.1, (P, L)).astype(np.float32),
            f_input=np.ones(P, np.float32), f_baseline=rng.uniform(0, 0.5, (P, L)).astype(np.float32),
            settings={"rule": "left", "steps": 8}, **prompts,
        )  # fmt: skip
    if name in ("attribution_patching", "grad_x_act"):
        return result_type(
            patching=_per_token(rng, L + 1), grad_x_act=_per_token(rng, L + 1), f_input=np.ones(P, np.float32),
            settings={}, **prompts,
        )  # fmt: skip
    if name == "decision_depth":
        depth = np.where(np.arange(T)[None] < LENGTHS[:, None], rng.integers(0, L + 1, (P, T)), -1)
        return result_type(
            depth=depth, predicted=tokens, rank=np.where(depth >= 0, tokens, -1), num_layers=L, tokens=tokens,
            answer_start=prompts["answer_start"], lengths=LENGTHS, settings={"frequency": "id", "lens": "logit"},
        )  # fmt: skip
    if name == "geometry":
        boundary = lambda low, high: rng.uniform(low, high, (P, L + 1))  # noqa: E731
        return result_type(
            entropy=boundary(0, 1), first_norm_ratio=boundary(1, 50), max_activation=boundary(1, 500),
            max_position=rng.integers(0, T, (P, L + 1)), max_dimension=rng.integers(0, 64, (P, L + 1)),
            max_ratio=boundary(1, 100), sink_scores=rng.uniform(0, 1, (P, L, 4)), lengths=LENGTHS, num_layers=L,
            settings={"sink_threshold": 0.3},
        )  # fmt: skip
    if name == "jacobians":
        M = 3
        positive = lambda: rng.uniform(0.5, 5, (P, M, L))  # noqa: E731
        return result_type(
            layer_frob2=positive(), layer_frob2_error=0.1 * positive(), layer_sigma=positive(),
            suffix_frob2=positive(), suffix_frob2_error=0.1 * positive(), suffix_sigma=positive(),
            positions=np.tile(np.array([4, 9, 14]), (P, 1)), width=64, num_layers=L,
            settings={"probes": 4, "iterations": 8, "exact": False},
        )  # fmt: skip
    if name == "layer_structure":
        family = layer_structure.structure_family(L, min(4, L - 1))
        K = max(s.size for s in family if s.kind == "drop")
        distance = np.full((K, L), -1.0)
        for n in range(1, K + 1):
            distance[n - 1, : L + 1 - n] = rng.uniform(0, 1, L + 1 - n)
        return result_type(
            kinds=[s.kind for s in family], starts=np.array([s.start for s in family]),
            sizes=np.array([s.size for s in family]), answer_logprob=-rng.uniform(0, 5, (len(family), P)),
            answer_token_accuracy=rng.uniform(0, 1, (len(family), P)),
            answer_correct=rng.integers(0, 2, (len(family), P)).astype(np.float32), angular_distance=distance,
            num_layers=L, settings={"max_block": K, "max_new_tokens": 8},
            generated_correct=rng.integers(0, 2, (len(family), P)).astype(np.float32),
        )  # fmt: skip
    if name == "generated_depth":
        S, G = 3, 6
        counted = np.arange(G)[None, None] < rng.integers(1, G + 1, (P, S, 1))
        return result_type(
            settling=np.where(counted, rng.integers(1, L + 1, (P, S, G)), 0),
            decision=np.where(counted, rng.integers(0, L + 1, (P, S, G)), 0), counted=counted,
            jsd=rng.uniform(0, 1, (P, L)), entropy=rng.uniform(0, 8, (P, L + 1)),
            entropy_forced=rng.uniform(0, 8, (P, L + 1)), dtr=rng.uniform(0, 1, (P, S)),
            correct=rng.integers(0, 2, (P, S)).astype(bool), answers=[["12", "7", "12"], ["3", "3", "4"]],
            num_layers=L, settings={"threshold": 0.5, "rho": 0.85, "keep": 0.5, "samples": S, "temperature": 0.7,
                                    "max_new_tokens": G, "lens": "logit"},
        )  # fmt: skip
    if name == "layer_programs":
        full = list(range(L))
        return result_type(
            intact_right=np.array([True, False]), intact_loglik=-rng.uniform(0, 5, P),
            shortest=[full[: max(1, L - 2)] + [0], None], fixes=[[], [full + [L - 1]]], answers=["w1", "w2"],
            gromov=[full[: max(1, L - 2)], None], gromov_right=np.array([True, False]),
            scored=np.array([3 * L, 5 * L]), num_layers=L,
            settings={"score": "generation", "rounds": 2, "keep": 2, "edits": ["skip", "repeat", "swap"]},
        )  # fmt: skip
    if name == "experts":
        E, k, M = 8, 2, 2
        counts = rng.integers(0, 40, (P, L, E))
        later = np.where(np.arange(L)[None, None, :] >= np.arange(L)[:, None, None], rng.uniform(0, 1, (M, L, E, L)), 0)
        later[:, 0, 0, -1] = 20.0  # one dominant cell: a clipped scale
        changed = np.triu(rng.integers(0, 30, (M, L, L)), k=1)
        return result_type(
            entropy_per_prompt=rng.uniform(0, 3, (P, L)), top_share_per_prompt=rng.uniform(0.5, 1, (P, L)),
            expert_counts=counts, lengths=LENGTHS, num_layers=L, num_experts=E, experts_per_token=k,
            settings={"sweeps": ["drop", "skip"], "mode": "current"}, drop_later_per_prompt=later,
            drop_output_per_prompt=rng.uniform(0, 1, (M, L, E)), routing_changed=changed,
            routing_measured=np.array([T, T - 5]),
        )  # fmt: skip
    raise AssertionError(f"no made-up result for the analysis {name!r}: add one")


def _drawn_texts(fig, renderer):
    """`(what, extent)` of everything textual `fig` draws: each axis's drawn tick labels and
    label together (`Axis.get_tightbbox`: only the ticks inside the view limits are drawn), and
    every other visible text (titles, colour-bar and legend texts, annotations, the suptitle)."""
    found = []
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            box = axis.get_tightbbox(renderer)
            if box is not None and axis.get_visible():
                labels = [t.get_text() for t in axis.get_ticklabels()] + [axis.label.get_text()]
                found.append((f"{type(axis).__name__} of {ax.get_title()!r}: {labels}", box))
    ticks = {id(t) for ax in fig.axes for axis in (ax.xaxis, ax.yaxis) for t in axis.get_ticklabels(which="both")}
    ticks |= {id(ax.xaxis.label) for ax in fig.axes} | {id(ax.yaxis.label) for ax in fig.axes}
    ticks |= {id(ax.xaxis.offsetText) for ax in fig.axes} | {id(ax.yaxis.offsetText) for ax in fig.axes}
    for text in fig.findobj(Text):
        if id(text) in ticks or not text.get_visible() or not text.get_text().strip():
            continue
        found.append((repr(text.get_text()), text.get_window_extent(renderer)))
    return found


def _texts_outside(fig) -> list[str]:
    """The drawn texts of `fig` whose extent leaves the canvas (a pixel of slack for
    anti-aliasing), each with where it sits."""
    fig.canvas.draw()  # runs the constrained layout
    canvas = fig.bbox
    outside = []
    for what, box in _drawn_texts(fig, fig.canvas.get_renderer()):
        if box.x0 < canvas.x0 - 1 or box.y0 < canvas.y0 - 1 or box.x1 > canvas.x1 + 1 or box.y1 > canvas.y1 + 1:
            outside.append(f"{what} at {tuple(round(v) for v in box.extents)} (canvas {tuple(canvas.extents)})")
    return outside


@pytest.mark.parametrize("num_layers", LAYER_COUNTS)
@pytest.mark.parametrize("name", SUITE)
def test_every_label_of_every_figure_is_inside_the_image(name, num_layers):
    result = made_up_result(name, num_layers)
    figures = SUITE[name].figures(result, WordTokenizer(), 1)
    assert figures
    for key, fig in figures.items():
        assert not _texts_outside(fig), f"{name} {key or 'figure'} of {num_layers} layers: " + "; ".join(
            _texts_outside(fig)
        )


@pytest.mark.parametrize("num_layers", LAYER_COUNTS)
def test_the_comparisons_of_depth_measures_keep_their_labels_inside_the_image(num_layers):
    """`jaxdepth compare`'s figures, of every curve the suite's analyses declare: the comparison
    of models, and the measures by layer kind of a hybrid (linear attention but every 4th and
    the last layer)."""
    from conftest import tiny_config
    from jaxdepth.lab.depth_comparison import DepthProfile, depth_comparison_figure
    from jaxdepth.lab.kind_comparison import kind_comparison, kind_figure

    readings = [entry.depth(made_up_result(name, num_layers)) for name, entry in SUITE.items() if entry.depth]
    linear = tuple(i for i in range(num_layers - 1) if i % 4 != 3)
    shape = dict(linear_key_heads=2, linear_value_heads=2, linear_key_dim=8, linear_value_dim=8, linear_conv_kernel=4)
    profile = DepthProfile(
        model="made-up",
        dataset="prompts",
        num_layers=num_layers,
        ratios={k: ratio for r in readings for k, (_, ratio) in r.ratios.items()},
        labels={k: label for r in readings for k, (label, _) in r.ratios.items()},
        curves={k: curve for r in readings for k, curve in r.curves.items()},
        config=tiny_config(num_layers=num_layers, linear_layers=linear, **shape),
    )
    for what, fig in (
        ("comparison", depth_comparison_figure([profile])),
        ("by kind", kind_figure(kind_comparison(profile))),
    ):
        assert not _texts_outside(fig), f"the {what} of {num_layers} layers: " + "; ".join(_texts_outside(fig))
