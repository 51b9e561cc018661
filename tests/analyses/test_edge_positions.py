"""Edge scores per position: they sum over positions to the edge scores of every method, are
exact zeros where no writer differs or F reads nothing, and a patch at one position equals an
intervention built by hand at that position."""

import jax.numpy as jnp
import numpy as np
import pytest

from test_edge_scores import make_pairs, pairs, params  # noqa: F401  (the tiny model's fixtures)
from tiny_qwen import CONFIG
from jaxdepth.analyses.edges.circuit import position_figure
from jaxdepth.analyses.edges.graph import EdgeGraph
from jaxdepth.analyses.edges.pairs import logit_difference
from jaxdepth.analyses.edges.patching import edge_effects
from jaxdepth.analyses.edges.scores import edge_attribution, pair_runs
from jaxdepth.analyses.ig import AdaptiveRule, FixedRule
from jaxdepth.core import sites
from jaxdepth.core.model import forward
from edge_reference import logit_difference_of
from jaxdepth.analyses.edges.scores import Scoring

GRAPH = EdgeGraph.of(CONFIG)


@pytest.mark.parametrize(
    "method, rule",
    [
        ("eap", None),
        ("eap-ig-inputs", FixedRule("left", 3)),
        ("eap-ig-inputs", AdaptiveRule(tolerance=0.05)),
        ("eap-ig-activations", FixedRule("midpoint", 2)),
    ],
)
def test_position_scores_sum_to_the_scores_and_are_zero_where_nothing_differs(params, pairs, method, rule):
    """Pair 0 has 9 positions and pair 1 has 6 (padded to 9); pair 0's prompts differ from
    position 3 on, pair 1's from position 2."""
    scores = edge_attribution(params, pairs, CONFIG, logit_difference, Scoring(method, rule, detail=["positions"]))
    plain = edge_attribution(params, pairs, CONFIG, logit_difference, Scoring(method, rule))
    positions = scores.position_scores
    assert positions.shape == scores.scores.shape + (9,) and plain.position_scores is None
    np.testing.assert_array_equal(scores.scores, plain.scores)  # the same computation, positions aside
    np.testing.assert_allclose(positions.sum(axis=-1), scores.scores, rtol=1e-5, atol=1e-6)
    assert pairs.shared_prefix() == 2 and np.all(positions[..., :2] == 0)  # no writer differs there
    assert np.all(positions[1, ..., 6:] == 0)  # pair 1's padding: F reads nothing there
    assert np.all(positions[:, ~GRAPH.edge_mask] == 0)  # no edge, no score
    assert np.all(positions[0, ..., 2] == 0)  # pair 0's prompts differ from position 3 on
    assert np.count_nonzero(positions[0, ..., 3:].sum(axis=(0, 1))) == 6  # and each position after carries some
    name, t, value = scores.top_positions(1)[0]
    mean = positions.mean(axis=0)
    assert abs(value) == np.max(np.abs(mean)) and scores.at_positions(name).mean(axis=0)[t] == value


def test_a_patch_at_one_position_is_that_intervention_built_by_hand(params, pairs):
    """Edge m0 -> m2 at position 4 and a2.h1 -> logits at each pair's last position: the reader's
    input (`mlp_in` of layer 2, the final residual) moved by the writer's corrupt minus clean
    output at that position only, in a plain forward. Elsewhere than the last position the edge
    into the logits changes nothing."""
    clean, corrupt = pair_runs(params, pairs, CONFIG)
    delta = corrupt.writers - clean.writers  # [W, B, T, D]
    f_clean = np.asarray(logit_difference_of(clean.logits, pairs.labels))

    def by_hand(site, layer, writer, at):  # at: [B] the position of each pair
        vector = delta[writer] * (np.arange(9)[None, :] == np.asarray(at)[:, None])[..., None]
        logits = forward(
            params, pairs.clean, CONFIG, valid=pairs.valid, interventions=sites.add(site, layer, vector, 1.0)
        )
        last = logits[jnp.arange(2), pairs.last]
        return f_clean - np.asarray(logit_difference_of(last, pairs.labels))

    edges = ["m0->m2", "a2.h1->logits", "a2.h1->logits"]
    m0, a2h1 = GRAPH.edge_index(edges[0])[0], GRAPH.edge_index(edges[1])[0]
    effects = edge_effects(params, pairs, CONFIG, logit_difference, edges, positions=[4, 8, 3])
    np.testing.assert_allclose(effects[0], by_hand("mlp_in", 2, m0, [4, 4]), rtol=1e-4, atol=1e-5)
    assert np.max(np.abs(effects[0])) > 1e-2
    # position 8 is pair 0's last (pair 1's is 5: padding, nothing read); position 3 is neither's
    np.testing.assert_allclose(effects[1], by_hand("resid_pre", CONFIG.num_layers, a2h1, [8, 8]), atol=1e-5)
    assert abs(effects[1, 0]) > 1e-2 and abs(effects[1, 1]) < 1e-5
    np.testing.assert_allclose(effects[2], 0.0, atol=1e-5)
    every = edge_effects(params, pairs, CONFIG, logit_difference, ["a2.h1->logits"])[0]
    np.testing.assert_allclose(effects[1, 0], every[0], rtol=1e-5, atol=1e-6)  # only the last position counts


def test_positions_are_checked_and_drawn(params, pairs, tmp_path):
    with pytest.raises(ValueError, match="one integer position per edge"):
        edge_effects(params, pairs, CONFIG, logit_difference, ["m0->m2"], positions=[1, 2])
    with pytest.raises(ValueError, match=r"positions must lie in 0..8"):
        edge_effects(params, pairs, CONFIG, logit_difference, ["m0->m2"], positions=[9])
    scores = edge_attribution(params, pairs, CONFIG, logit_difference)
    with pytest.raises(ValueError, match=r"detail=\[.positions.\]"):
        scores.top_positions(3)
    scores = edge_attribution(params, pairs, CONFIG, logit_difference, Scoring(detail=["positions"]))
    loaded = type(scores).load(scores.save(str(tmp_path / "scores.npz")))
    np.testing.assert_array_equal(loaded.position_scores, scores.position_scores)
    fig = position_figure(scores, k=5, labels=[f"t{t}" for t in range(9)])
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == [name for name, _ in scores.top(5)]
    with pytest.raises(ValueError, match="name the 9 positions"):
        position_figure(scores, labels=["a"])
