"""Circuits of nodes: the first nodes by node score keep all their out-edges, and the circuit's
metric is a plain forward with every other node's output at its corrupt value, built by hand."""

import jax.numpy as jnp
import numpy as np
import pytest

from test_edge_scores import pairs, params  # noqa: F401  (the tiny model's fixtures)
from tiny_qwen import CONFIG
from jaxdepth.analyses.edges import circuit_figure, faithfulness, faithfulness_figure, find_circuit, ranked_nodes
from jaxdepth.analyses.edges.graph import EdgeGraph
from jaxdepth.analyses.edges.pairs import logit_difference
from jaxdepth.analyses.edges.scores import edge_attribution, pair_runs
from jaxdepth.core import sites
from jaxdepth.core.model import forward

GRAPH = EdgeGraph.of(CONFIG)
L, H = CONFIG.num_layers, CONFIG.num_heads


def _replace_rows(value, layer, data):  # head_result [B, T, H, D]: the removed heads' rows corrupt
    corrupt, removed = data
    return jnp.where(removed[layer][None, None, :, None], corrupt[layer], value)


def _replace_mlp(value, layer, data):  # mlp_out [B, T, D]
    corrupt, removed = data
    return jnp.where(removed[layer], corrupt[layer], value)


def test_a_circuit_of_nodes_is_every_other_node_at_its_corrupt_output(params, pairs):
    scores = edge_attribution(params, pairs, CONFIG, logit_difference)
    nodes = ranked_nodes(scores)
    mean = np.abs(scores.scores.sum(axis=-1).mean(axis=0))
    assert sorted(nodes.tolist()) == list(range(GRAPH.num_writers)) and np.all(np.diff(mean[nodes]) <= 0)
    circuit = find_circuit(params, pairs, CONFIG, logit_difference, scores, size=6, level="node")
    kept = set(circuit.nodes.tolist())
    assert circuit.level == "node" and kept == set(nodes[:6].tolist())
    expected_mask = np.zeros_like(GRAPH.edge_mask)
    expected_mask[list(kept)] = GRAPH.edge_mask[list(kept)]
    np.testing.assert_array_equal(circuit.mask, expected_mask)
    # by hand: each node outside the circuit writes its corrupt output, for all of its readers
    _, corrupt = pair_runs(params, pairs, CONFIG)
    heads = np.array([[GRAPH.head_writer(layer, h) for h in range(H)] for layer in range(L)])
    mlps = np.array([GRAPH.mlp_writer(layer) for layer in range(L)])
    writers = np.asarray(corrupt.writers)
    head_data = (jnp.asarray(np.moveaxis(writers[heads], 1, 3)), jnp.asarray(~np.isin(heads, list(kept))))
    mlp_data = (jnp.asarray(writers[mlps]), jnp.asarray(~np.isin(mlps, list(kept))))
    by_hand = [
        sites.Intervention("head_result", _replace_rows, head_data, layer_data=True),
        sites.Intervention("mlp_out", _replace_mlp, mlp_data, layer_data=True),
    ]
    tokens = pairs.clean if 0 in kept else pairs.corrupt  # the input node: the embeddings
    logits = forward(params, tokens, CONFIG, valid=pairs.valid, interventions=by_hand)
    f = np.asarray(logit_difference(logits[jnp.arange(2), pairs.last], pairs.labels))
    expected = faithfulness(f[None], scores.f_clean, scores.f_corrupt)[0]
    assert 0.05 < abs(expected - 1) and circuit.faithfulness == pytest.approx(expected, abs=1e-4)
    every = find_circuit(params, pairs, CONFIG, logit_difference, scores, size=GRAPH.num_writers, level="node")
    none = find_circuit(params, pairs, CONFIG, logit_difference, scores, size=0, level="node")
    assert every.faithfulness == pytest.approx(1.0, abs=1e-4) and none.faithfulness == pytest.approx(0.0, abs=1e-4)
    found = find_circuit(params, pairs, CONFIG, logit_difference, scores, target=0.8, level="node")
    assert found.faithfulness >= 0.8 and found.sizes.max() <= GRAPH.num_writers
    assert faithfulness_figure(found).axes[0].get_xlabel().startswith("nodes in the circuit")
    circuit_figure(found)  # its live edges, as any circuit's


def test_a_circuit_of_nodes_refuses_what_it_cannot_be(params, pairs):
    scores = edge_attribution(params, pairs, CONFIG, logit_difference)
    with pytest.raises(ValueError, match="by node score"):
        find_circuit(params, pairs, CONFIG, logit_difference, scores, size=3, level="node", search="greedy")
    with pytest.raises(ValueError, match="level must be one of"):
        find_circuit(params, pairs, CONFIG, logit_difference, scores, size=3, level="layer")
    with pytest.raises(ValueError, match=r"size must be an integer in 0..21 \(the graph's nodes\)"):
        find_circuit(params, pairs, CONFIG, logit_difference, scores, size=22, level="node")
