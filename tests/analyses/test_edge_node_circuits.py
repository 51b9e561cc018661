"""Circuits of nodes: the first nodes by node score keep all their out-edges, and the circuit's
metric is a plain forward with every other node's output at its corrupt value, built by hand."""

import jax.numpy as jnp
import numpy as np
import pytest

from test_edge_scores import pairs, params  # noqa: F401  (the tiny model's fixtures)
from tiny_qwen import CONFIG
from jaxdepth.analyses.edges import circuit_figure, faithfulness, faithfulness_figure, find_circuit, ranked_nodes
from jaxdepth.analyses.edges.circuit import non_mlp_writers, ranked_members
from jaxdepth.analyses.edges.graph import EdgeGraph
from jaxdepth.analyses.edges.pairs import logit_difference
from jaxdepth.analyses.edges.scores import edge_attribution, hidden_units, pair_runs
from jaxdepth.core import sites
from jaxdepth.core.model import forward
from edge_reference import logit_difference_of
from jaxdepth.analyses.edges.circuit import CircuitSearch
from jaxdepth.analyses.edges.scores import Scoring

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
    circuit = find_circuit(params, pairs, CONFIG, logit_difference, scores, CircuitSearch(size=6, level="node"))
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
    f = np.asarray(logit_difference_of(logits[jnp.arange(2), pairs.last], pairs.labels))
    expected = faithfulness(f[None], scores.f_clean, scores.f_corrupt)[0]
    assert 0.05 < abs(expected - 1) and circuit.faithfulness == pytest.approx(expected, abs=1e-4)
    every = find_circuit(
        params, pairs, CONFIG, logit_difference, scores, CircuitSearch(size=GRAPH.num_writers, level="node")
    )
    none = find_circuit(params, pairs, CONFIG, logit_difference, scores, CircuitSearch(size=0, level="node"))
    assert every.faithfulness == pytest.approx(1.0, abs=1e-4) and none.faithfulness == pytest.approx(0.0, abs=1e-4)
    found = find_circuit(params, pairs, CONFIG, logit_difference, scores, CircuitSearch(target=0.8, level="node"))
    assert found.faithfulness >= 0.8 and found.sizes.max() <= GRAPH.num_writers
    assert faithfulness_figure(found).axes[0].get_xlabel().startswith("nodes in the circuit")
    circuit_figure(found)  # its live edges, as any circuit's


def test_a_circuit_of_nodes_refuses_what_it_cannot_be(params, pairs):
    scores = edge_attribution(params, pairs, CONFIG, logit_difference)
    with pytest.raises(ValueError, match="takes its members by their scores"):
        find_circuit(
            params, pairs, CONFIG, logit_difference, scores, CircuitSearch(size=3, level="node", order="greedy")
        )
    with pytest.raises(ValueError, match="level must be one of"):
        find_circuit(params, pairs, CONFIG, logit_difference, scores, CircuitSearch(size=3, level="layer"))
    with pytest.raises(ValueError, match=r"size must be an integer in 0..21 \(the graph's nodes\)"):
        find_circuit(params, pairs, CONFIG, logit_difference, scores, CircuitSearch(size=22, level="node"))


def test_a_circuit_of_neurons_is_every_other_head_and_unit_at_its_corrupt_value(params, pairs):
    """The input, heads and MLP hidden units ranked together; outside the circuit, a head
    writes its corrupt output and a unit takes its corrupt value (in a plain forward by hand)."""
    scores = edge_attribution(params, pairs, CONFIG, logit_difference, Scoring(detail=["neurons"]))
    members = ranked_members(scores)
    N, F = len(non_mlp_writers(GRAPH)), CONFIG.intermediate_size
    assert N == 1 + L * H and sorted(members.tolist()) == list(range(N + L * F))
    size = np.concatenate(
        [np.abs(scores.node_scores().mean(0))[non_mlp_writers(GRAPH)], np.abs(scores.neuron_scores.mean(0)).ravel()]
    )
    assert np.all(np.diff(size[members]) <= 0)
    circuit = find_circuit(params, pairs, CONFIG, logit_difference, scores, CircuitSearch(size=40, level="neuron"))
    assert circuit.level == "neuron" and len(circuit.nodes) + len(circuit.units) == 40
    chosen = members[:40]
    assert set(circuit.nodes.tolist()) == set(non_mlp_writers(GRAPH)[chosen[chosen < N]].tolist())
    assert {tuple(u) for u in circuit.units.tolist()} == {divmod(int(m) - N, F) for m in chosen[chosen >= N]}
    assert len(circuit.units) > 5 and len(circuit.nodes) > 2
    # by hand: heads outside at their corrupt outputs, units outside at their corrupt values
    _, corrupt = pair_runs(params, pairs, CONFIG)
    heads = np.array([[GRAPH.head_writer(layer, h) for h in range(H)] for layer in range(L)])
    writers = np.asarray(corrupt.writers)
    head_data = (jnp.asarray(np.moveaxis(writers[heads], 1, 3)), jnp.asarray(~np.isin(heads, circuit.nodes)))
    kept_units = np.zeros((L, F), bool)
    kept_units[circuit.units[:, 0], circuit.units[:, 1]] = True
    hidden = hidden_units(params, pairs.corrupt, pairs.valid, CONFIG)
    by_hand = [
        sites.Intervention("head_result", _replace_rows, head_data, layer_data=True),
        sites.patch("mlp_hidden", hidden, ~kept_units[:, None, None, :]),
    ]
    tokens = pairs.clean if 0 in circuit.nodes else pairs.corrupt  # the input node: the embeddings
    logits = forward(params, tokens, CONFIG, valid=pairs.valid, interventions=by_hand)
    f = np.asarray(logit_difference_of(logits[jnp.arange(2), pairs.last], pairs.labels))
    expected = faithfulness(f[None], scores.f_clean, scores.f_corrupt)[0]
    assert 0.05 < abs(expected - 1) and circuit.faithfulness == pytest.approx(expected, abs=1e-4)
    every = find_circuit(
        params, pairs, CONFIG, logit_difference, scores, CircuitSearch(size=len(members), level="neuron")
    )
    none = find_circuit(params, pairs, CONFIG, logit_difference, scores, CircuitSearch(size=0, level="neuron"))
    assert every.faithfulness == pytest.approx(1.0, abs=1e-4) and none.faithfulness == pytest.approx(0.0, abs=1e-4)
    found = find_circuit(params, pairs, CONFIG, logit_difference, scores, CircuitSearch(target=0.8, level="neuron"))
    assert found.faithfulness >= 0.8 and found.sizes.max() <= len(members)
    assert faithfulness_figure(found).axes[0].get_xlabel().startswith("members of the circuit")
    circuit_figure(found)
    with pytest.raises(ValueError, match=r"score with Scoring\(detail=\['neurons'\]\)"):
        find_circuit(
            params,
            pairs,
            CONFIG,
            logit_difference,
            edge_attribution(params, pairs, CONFIG, logit_difference),
            CircuitSearch(size=3, level="neuron"),
        )
