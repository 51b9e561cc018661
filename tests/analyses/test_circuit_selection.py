"""Which edges a circuit takes and which can matter: dead edges on a hand-built circuit, pruning
them leaves the metric exactly as it is, the greedy search equals the EAP-IG package's
algorithm written out plainly, and `find_circuit(search='greedy')` takes its prefixes."""

import numpy as np
import pytest

from test_edge_scores import eap, pairs, params  # noqa: F401 (the edge tests' fixtures: the same tiny model and pairs)
from tiny_qwen import CONFIG
from jaxdepth.analyses.edges import (
    Circuit,
    EdgeGraph,
    circuit_metric,
    find_circuit,
    greedy_edges,
    live_edges,
    logit_difference,
    ordered_edges,
)
from jaxdepth.analyses.edges.circuit import CircuitSearch

GRAPH = EdgeGraph.of(CONFIG)


def _names(graph, mask):
    return {graph.edge_name(w, r) for w, r in np.argwhere(mask)}


def test_dead_edges_of_a_hand_built_circuit():
    graph = EdgeGraph(num_layers=2, num_heads=2)
    live = {"input->a0.h0<q>", "a0.h0->logits", "input->m1", "m1->logits", "a0.h0->a1.h1<v>", "a1.h1->logits"}
    dead = {
        "a0.h1->m1",  # a0.h1 is reached from no input
        "input->a1.h0<k>",  # a1.h0 writes nowhere
        "input->m0",  # m0 writes only into a1.h0, which reaches no logits
        "m0->a1.h0<q>",
    }
    mask = graph.edges_mask(sorted(live | dead))
    assert _names(graph, live_edges(mask, graph)) == live
    assert not live_edges(np.zeros_like(mask), graph).any()
    # where a layer's attention is one writer, every head's input feeds it
    post = EdgeGraph(num_layers=2, num_heads=2, post_norms=True)
    mask = post.edges_mask(["input->a0.h1<q>", "a0->logits", "input->a1.h0<v>", "m0->logits"])
    assert _names(post, live_edges(mask, post)) == {"input->a0.h1<q>", "a0->logits"}
    parallel = EdgeGraph(num_layers=1, num_heads=2, parallel=True)
    mask = parallel.edges_mask(["input->m0", "m0->logits", "a0.h0->logits"])
    assert _names(parallel, live_edges(mask, parallel)) == {"input->m0", "m0->logits"}


def test_pruning_the_dead_edges_leaves_the_metric_exactly(params, pairs):
    rng = np.random.default_rng(3)
    edges = np.argwhere(GRAPH.edge_mask)
    masks = []
    for n in (40, 120):
        mask = np.zeros(GRAPH.edge_mask.shape, bool)
        chosen = edges[rng.choice(len(edges), n, replace=False)]
        mask[chosen[:, 0], chosen[:, 1]] = True
        masks += [mask, live_edges(mask, GRAPH)]
    assert all(masks[i + 1].sum() < masks[i].sum() for i in (0, 2))  # dead edges were there to prune
    assert all(masks[i + 1].sum() > 0 for i in (0, 2))
    metric = circuit_metric(params, pairs, CONFIG, logit_difference, masks)
    np.testing.assert_allclose(metric[1], metric[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(metric[3], metric[2], rtol=1e-6, atol=1e-6)


def _package_greedy(key, graph):
    """The EAP-IG package's `apply_greedy`, plainly: the best candidate (ties by graph order) whose
    reader's node is in the circuit; its writer's node joins."""
    in_circuit = {-1}  # the logits' node
    taken, order = np.zeros(graph.edge_mask.shape, bool), []
    feeds = graph.reader_writers
    while True:
        candidates = graph.edge_mask & ~taken & np.isin(feeds, list(in_circuit))[None, :]
        if not candidates.any():
            return np.array(order)
        best = max(np.argwhere(candidates), key=lambda e: (key[e[0], e[1]], -e[0], -e[1]))
        taken[best[0], best[1]] = True
        order.append(tuple(best))
        in_circuit.add(int(best[0]))


@pytest.mark.parametrize("graph", [EdgeGraph(2, 2), EdgeGraph(2, 2, post_norms=True), EdgeGraph(2, 2, parallel=True)])
def test_the_greedy_search_is_the_packages(graph):
    rng = np.random.default_rng(0)
    scores = rng.normal(size=graph.edge_mask.shape)
    scores[:, ::3] = np.round(scores[:, ::3], 1)  # some ties
    for by, key in (("abs", np.abs(scores)), ("value", scores)):
        order = greedy_edges(scores, graph, by)
        assert np.array_equal(order, _package_greedy(key, graph))
        assert len(order) == graph.num_edges  # every writer reaches the logits: every edge is taken
        # every prefix is connected to the logits: each edge's reader feeds a writer taken before
        joined = {-1}
        for w, r in order:
            assert graph.reader_writers[r] in joined
            joined.add(int(w))
    assert np.array_equal(greedy_edges(scores, graph, count=5), greedy_edges(scores, graph)[:5])
    with pytest.raises(ValueError, match="search must be one of"):
        ordered_edges(scores, graph, search="best")


def test_a_greedy_circuit_takes_the_searchs_prefix(params, pairs, eap, tmp_path):
    circuit = find_circuit(params, pairs, CONFIG, logit_difference, eap, CircuitSearch(size=25, order="greedy"))
    order = greedy_edges(eap.mean, GRAPH)
    assert np.array_equal(circuit.edges, order[:25]) and circuit.search == "greedy"
    f = circuit_metric(params, pairs, CONFIG, logit_difference, [circuit.mask, circuit.live_mask])
    faithfulness = (f.mean(axis=1) - eap.f_corrupt.mean()) / (eap.f_clean.mean() - eap.f_corrupt.mean())
    assert circuit.faithfulness == pytest.approx(faithfulness[0], rel=1e-5)
    assert faithfulness[1] == pytest.approx(faithfulness[0], rel=1e-5)  # the live edges alone: the same circuit
    assert np.array_equal(circuit.live, circuit.live_mask[circuit.edges[:, 0], circuit.edges[:, 1]])
    assert circuit.num_live == circuit.live.sum() and circuit.live_sizes[-1] == circuit.num_live
    pruned = circuit.pruned()
    assert len(pruned.edges) == circuit.num_live and pruned.num_live == circuit.num_live
    back = Circuit.load(circuit.save(str(tmp_path / "c.npz")))
    assert back.search == "greedy" and np.array_equal(back.live, circuit.live)
    top = find_circuit(params, pairs, CONFIG, logit_difference, eap, CircuitSearch(size=25))
    assert top.search == "top" and top.num_live <= 25
