"""A circuit's reported faithfulness is its own, and pruning keeps it, under every ablation: on
the tiny GQA model, a circuit and its pruned form (`live_edges` under the circuit's ablation)
have the same patched metric under the corrupt, zero, mean and mean-per-position ablations, and
`find_circuit` (top and greedy) reports the faithfulness of the circuit it returns. Under zero
and mean ablations a writer that no circuit path reaches from the input computes from ablated
inputs, which is not its ablated value: dropping its edges (the corrupt ablation's rule) changes
the metric, so that rule is not taken there."""

import dataclasses

import numpy as np
import pytest

from test_edge_ablations import PROMPTS
from test_edge_scores import make_pairs, pairs, params  # noqa: F401  (the tiny model's fixtures)
from tiny_qwen import CONFIG
from jaxdepth.analyses.edges import (
    CORRUPT,
    ZERO,
    EdgeGraph,
    circuit_metric,
    edge_attribution,
    faithfulness,
    find_circuit,
    live_edges,
    logit_difference,
    mean_ablation,
)
from jaxdepth.analyses.edges.circuit import CircuitSearch
from jaxdepth.analyses.edges.ablations import Patching

GRAPH = EdgeGraph.of(CONFIG)
KINDS = ("corrupt", "zero", "mean", "mean-per-position")


def rounding(kind: str) -> dict:
    """Float32 rounding: a patched reader reads its run's residual plus (ablated - current) of
    each patched writer, and pruning changes the current output of writers that reach no logits.
    Under the zero ablation a reader with few circuit edges reads a vector near zero, the
    residue of that cancellation, and its RMSNorm divides by about sqrt(eps) (1e-3 here):
    measured, 7.8e-5 at eps 1e-6 and 1.1e-6 at eps 1e-4 for the same circuits."""
    return dict(rtol=1e-6, atol=1e-4 if kind == "zero" else 1e-6)


@pytest.fixture(scope="module")
def ablations(params):
    return {
        "corrupt": CORRUPT,
        "zero": ZERO,
        "mean": mean_ablation(params, PROMPTS, CONFIG),
        "mean-per-position": mean_ablation(params, PROMPTS, CONFIG, per_position=True),
    }


@pytest.fixture(scope="module")
def scores(params, pairs, ablations):
    """EAP scores under each ablation: F(clean) and F(every edge ablated) for faithfulness."""
    return {
        kind: edge_attribution(params, pairs, CONFIG, logit_difference, "eap", patching=Patching(ablation))
        for kind, ablation in ablations.items()
    }


def _random_circuits(n_edges=(40, 120), seed=3):
    rng = np.random.default_rng(seed)
    edges = np.argwhere(GRAPH.edge_mask)
    masks = []
    for n in n_edges:
        mask = np.zeros(GRAPH.edge_mask.shape, bool)
        chosen = edges[rng.choice(len(edges), n, replace=False)]
        mask[chosen[:, 0], chosen[:, 1]] = True
        masks.append(mask)
    return masks


@pytest.mark.parametrize("kind", KINDS)
def test_a_circuit_and_its_live_edges_have_the_same_metric(params, pairs, ablations, kind):
    ablation = ablations[kind]
    circuits = _random_circuits()
    pruned = [live_edges(mask, GRAPH, ablation) for mask in circuits]
    assert all(0 < p.sum() < m.sum() for p, m in zip(pruned, circuits))  # edges were there to prune
    f = circuit_metric(params, pairs, CONFIG, logit_difference, circuits + pruned, patching=Patching(ablation))
    np.testing.assert_allclose(f[2:], f[:2], **rounding(kind))


@pytest.mark.parametrize("kind", ["zero", "mean", "mean-per-position"])
def test_under_zero_and_mean_ablations_a_writer_unreached_from_the_input_is_not_dead(params, pairs, ablations, kind):
    """The corrupt ablation's rule would drop the edges of writers no path reaches from the input:
    under these ablations those writers compute f(ablated inputs), and dropping their edges moves F."""
    ablation = ablations[kind]
    circuits = _random_circuits()
    by_corrupt_rule = [live_edges(mask, GRAPH, "corrupt") for mask in circuits]
    by_own_rule = [live_edges(mask, GRAPH, ablation) for mask in circuits]
    assert all((c.sum() < o.sum()) for c, o in zip(by_corrupt_rule, by_own_rule))  # the rules differ here
    f = circuit_metric(params, pairs, CONFIG, logit_difference, circuits + by_corrupt_rule, patching=Patching(ablation))
    assert np.max(np.abs(f[2:] - f[:2])) > 1e-3


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("search", ["top", "greedy"])
def test_find_circuit_reports_the_faithfulness_of_the_circuit_and_of_its_pruned_form(
    params, pairs, ablations, scores, kind, search
):
    ablation, scored = ablations[kind], scores[kind]
    circuit = find_circuit(
        params,
        pairs,
        CONFIG,
        logit_difference,
        scored,
        CircuitSearch(size=20, order=search, patching=Patching(ablation)),
    )
    assert circuit.ablation == kind
    pruned = circuit.pruned()
    if search == "top":  # the top 20 hold edges of writers that no circuit path reaches from the input
        assert live_edges(circuit.mask, GRAPH, "corrupt").sum() < len(circuit.edges)
    f = circuit_metric(
        params, pairs, CONFIG, logit_difference, [circuit.mask, pruned.mask], patching=Patching(ablation)
    )
    both = faithfulness(f, scored.f_clean, scored.f_corrupt)
    np.testing.assert_allclose(both, [circuit.faithfulness] * 2, **rounding(kind))
    assert pruned.num_live == len(pruned.edges) == circuit.num_live


@pytest.mark.parametrize("kind", ["corrupt", "mean"])
def test_a_circuit_found_for_a_target_has_the_faithfulness_it_reports(params, pairs, ablations, scores, kind):
    """Found on a grid (several circuits vmapped at once), then evaluated alone."""
    ablation, scored = ablations[kind], scores[kind]
    circuit = find_circuit(
        params, pairs, CONFIG, logit_difference, scored, CircuitSearch(target=0.8, patching=Patching(ablation))
    )
    assert circuit.reached and circuit.faithfulness >= 0.8
    both = [circuit.mask, circuit.pruned().mask]
    f = circuit_metric(params, pairs, CONFIG, logit_difference, both, patching=Patching(ablation))
    reported = [circuit.faithfulness] * 2
    np.testing.assert_allclose(faithfulness(f, scored.f_clean, scored.f_corrupt), reported, **rounding(kind))
    chosen = np.flatnonzero(circuit.sizes == len(circuit.edges))[0]
    assert circuit.live_sizes[chosen] == circuit.num_live


def test_a_circuit_saved_without_its_ablation_prunes_by_the_rule_of_every_ablation(params, pairs, scores):
    """Files saved before circuits recorded their ablation: only the edges with no path to the
    logits are pruned, which is exact whatever the ablation was."""
    circuit = find_circuit(
        params, pairs, CONFIG, logit_difference, scores["zero"], CircuitSearch(size=20, patching=Patching("zero"))
    )
    unknown = dataclasses.replace(circuit, ablation=None)
    np.testing.assert_array_equal(unknown.live_mask, live_edges(circuit.mask, GRAPH, "zero"))
    assert unknown.num_live >= live_edges(circuit.mask, GRAPH, "corrupt").sum()


@pytest.mark.parametrize("kind", ["corrupt", "mean-per-position"])
def test_a_circuit_of_nodes_has_the_faithfulness_it_reports_pruned_or_not(params, pairs, ablations, scores, kind):
    ablation, scored = ablations[kind], scores[kind]
    circuit = find_circuit(
        params,
        pairs,
        CONFIG,
        logit_difference,
        scored,
        CircuitSearch(size=4, level="node", patching=Patching(ablation)),
    )
    assert circuit.num_live < len(circuit.edges)  # the nodes' out-edges into nodes outside reach no logits
    f = circuit_metric(
        params, pairs, CONFIG, logit_difference, [circuit.mask, circuit.pruned().mask], patching=Patching(ablation)
    )
    reported = [circuit.faithfulness] * 2
    np.testing.assert_allclose(faithfulness(f, scored.f_clean, scored.f_corrupt), reported, **rounding(kind))
