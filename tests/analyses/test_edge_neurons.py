"""Node and neuron granularity: an MLP's hidden units' scores sum to its node score under every
method, on a model made linear a unit's score is its exact patching effect, and patching all
of a node's out-edges is the node's output replaced by hand."""

import jax.numpy as jnp
import numpy as np
import pytest

from test_edge_patching import made_linear
from test_edge_scores import pairs, params  # noqa: F401  (the tiny model's fixtures)
from tiny_qwen import CONFIG
from jaxdepth.analyses.edges.graph import EdgeGraph
from jaxdepth.analyses.edges.pairs import logit_difference
from jaxdepth.analyses.edges.patching import neuron_effects, patched_metric
from jaxdepth.analyses.edges.scores import edge_attribution, pair_runs
from jaxdepth.analyses.ig import FixedRule
from jaxdepth.core import sites
from jaxdepth.core.model import forward
from edge_reference import logit_difference_of
from jaxdepth.core.execution import Execution
from jaxdepth.analyses.edges.ablations import Patching
from jaxdepth.analyses.edges.scores import Scoring

GRAPH = EdgeGraph.of(CONFIG)
MLP_WRITERS = [GRAPH.mlp_writer(layer) for layer in range(CONFIG.num_layers)]


@pytest.mark.parametrize(
    "method, rule",
    [
        ("eap", None),
        ("clean-corrupted", None),
        ("eap-ig-inputs", FixedRule("left", 3)),
        ("eap-ig-activations", FixedRule("midpoint", 2)),
    ],
)
def test_an_mlp_s_units_sum_to_its_node_score(params, pairs, method, rule):
    scores = edge_attribution(params, pairs, CONFIG, logit_difference, Scoring(method, rule, detail=["neurons"]))
    assert scores.neuron_scores.shape == (2, CONFIG.num_layers, CONFIG.intermediate_size)
    node = scores.node_scores()[:, MLP_WRITERS]  # [B, L]
    assert np.min(np.max(np.abs(node), axis=0)) > 1e-3
    np.testing.assert_allclose(scores.neuron_scores.sum(axis=-1), node, rtol=1e-4, atol=1e-5)


def test_on_a_linear_model_a_unit_s_score_is_its_exact_effect(params, pairs, monkeypatch):
    flat, linear = made_linear(params, monkeypatch)
    scores = edge_attribution(flat, pairs, linear, logit_difference, Scoring(detail=["neurons"]))
    mean = np.abs(scores.neuron_scores.mean(axis=0))
    best = np.stack(np.unravel_index(np.argsort(-mean, axis=None)[:12], mean.shape), axis=1)
    units = np.concatenate([best, [[0, 0], [3, 63], [2, 17]]])
    exact = neuron_effects(flat, pairs, linear, logit_difference, units, execution=Execution(chunk_size=5))
    estimated = scores.neuron_scores[:, units[:, 0], units[:, 1]].T
    assert np.max(np.abs(exact)) > 0.1
    atol = 1e-5 * float(np.max(np.abs(scores.f_clean)))  # rounding of two float32 values of F
    np.testing.assert_allclose(estimated, exact, rtol=1e-4, atol=atol)


def test_patching_a_node_s_out_edges_is_its_output_replaced_by_hand(params, pairs):
    """Head 2 of layer 1 and MLP 2 at their corrupt outputs in a plain forward: a head's row of
    `head_result`, the MLP's `mlp_out`."""
    _, corrupt = pair_runs(params, pairs, CONFIG)
    head, mlp = GRAPH.head_writer(1, 2), GRAPH.mlp_writer(2)
    head_value = corrupt.writers[head]

    def set_head(value, layer, data):  # head_result [B, T, H, D]
        return jnp.where((layer == 1) & (jnp.arange(value.shape[2]) == 2)[None, None, :, None], data[:, :, None], value)

    by_hand = [
        sites.Intervention("head_result", set_head, head_value),
        sites.replace("mlp_out", 2, np.ones(9), corrupt.writers[mlp]),
    ]
    for writer, iv in zip((head, mlp), by_hand):
        out_edges = np.zeros_like(GRAPH.edge_mask)
        out_edges[writer] = GRAPH.edge_mask[writer]
        patched = patched_metric(params, pairs, CONFIG, logit_difference, [out_edges])[0]
        logits = forward(params, pairs.clean, CONFIG, valid=pairs.valid, interventions=iv)
        expected = logit_difference_of(logits[jnp.arange(2), pairs.last], pairs.labels)
        np.testing.assert_allclose(patched, expected, rtol=1e-4, atol=1e-5)


def test_neurons_refuse_what_they_cannot_mean(params, pairs):
    with pytest.raises(ValueError, match="under the corrupt ablation only"):
        edge_attribution(
            params, pairs, CONFIG, logit_difference, Scoring(detail=["neurons"]), patching=Patching("zero")
        )
    with pytest.raises(ValueError, match="detail takes"):
        edge_attribution(params, pairs, CONFIG, logit_difference, Scoring(detail=["heads"]))
    with pytest.raises(ValueError, match=r"a node of neurons is \(layer in 0..3, unit in 0..63\)"):
        neuron_effects(params, pairs, CONFIG, logit_difference, [(4, 0)])
