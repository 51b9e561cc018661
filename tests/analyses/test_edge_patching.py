"""Exact edge patching: on a model made linear EAP is exact, single-edge runs (from the reader's
layer) equal patching that edge in a full run, and the whole graph and the empty circuit give the
clean and the corrupt metric."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import with_layers_silenced
from test_edge_scores import make_pairs
from tiny_qwen import CONFIG
from jaxdepth.analyses.edges.circuit import find_circuit
from jaxdepth.analyses.edges.graph import EdgeGraph
from jaxdepth.analyses.edges.pairs import logit_difference, prompt_pairs
from jaxdepth.analyses.edges.patching import circuit_metric, edge_effects, faithfulness, patched_metric
from jaxdepth.analyses.edges.scores import edge_attribution, ranked_edges
from jaxdepth.analyses.ig import FixedRule
from jaxdepth.core import layer as core_layer, model as core_model, sites
from jaxdepth.core.model import random_params
from jaxdepth.core.execution import Execution
from jaxdepth.analyses.edges.circuit import CircuitSearch
from jaxdepth.analyses.edges.ablations import Patching
from jaxdepth.analyses.edges.scores import Scoring
from jaxdepth.analyses.metrics import metric

GRAPH = EdgeGraph.of(CONFIG)


@pytest.fixture(scope="module")
def params():
    return random_params(CONFIG, 1, scale=0.2)


@pytest.fixture(scope="module")
def pairs():
    return prompt_pairs(*make_pairs())


def made_linear(params, monkeypatch):
    """`(params, config)` of the model made linear in every reader's input (for the test):
    no normalization, a linear MLP, and input-independent attention (zero query and key
    weights: each position averages the values before it)."""
    linear = dataclasses.replace(CONFIG, rms_norm_eps=0.25)  # a config of its own: fresh compilations
    for module in (core_layer, core_model):  # the layer's norms and the final one
        monkeypatch.setattr(module, "norm", lambda x, w, config, bias=None: x * w)
    monkeypatch.setattr(core_layer, "mlp_hidden", lambda p, x, config: x @ p["up"])
    layers = dict(params["layers"], q=0 * params["layers"]["q"], k=0 * params["layers"]["k"])
    return dict(params, layers=layers), linear


def test_on_a_linear_model_eap_is_exact_patching(params, monkeypatch):
    """No normalization, a linear MLP and input-independent attention (zero query and key
    weights: each position averages the values before it) make F linear in every reader's
    input: each edge's score equals its exact patching effect, and patching several edges into
    one reader removes the sum of their scores. (Not so for edges in series: patching u -> v
    replaces u's output as v reads it, including what an edge patched upstream of u changed.)"""
    flat, linear = made_linear(params, monkeypatch)
    pairs = prompt_pairs(*make_pairs())
    scores = edge_attribution(flat, pairs, linear, logit_difference)
    edges = ranked_edges(scores.mean, GRAPH)
    sample = np.concatenate([edges[:40], edges[-5:], edges[:: max(1, len(edges) // 40)]])
    exact = edge_effects(flat, pairs, linear, logit_difference, sample)
    estimated = scores.scores[:, sample[:, 0], sample[:, 1]].T
    assert np.max(np.abs(exact)) > 0.1
    # each exact effect is a difference of two float32 values of F: rounding of order 1e-6 |F|
    # (no normalization: F here is of order 10)
    atol = 1e-5 * float(np.max(np.abs(scores.f_clean)))
    np.testing.assert_allclose(estimated, exact, rtol=1e-4, atol=atol)
    # edges into one reader do not interact: patched together they remove the sum of their scores
    into_logits = edges[edges[:, 1] == GRAPH.logits_reader][:10]
    together = patched_metric(flat, pairs, linear, logit_difference, [[tuple(e) for e in into_logits]])[0]
    summed = scores.scores[:, into_logits[:, 0], into_logits[:, 1]].sum(axis=1)
    np.testing.assert_allclose(scores.f_clean - together, summed, rtol=1e-4, atol=atol)


def test_single_edge_runs_equal_patching_the_edge_in_a_full_run(params, pairs):
    """`edge_effects` starts each edge's run at its reader's layer and moves that reader's input;
    `patched_metric` runs every layer with the edge patched through the writers' buffer."""
    edges = np.array([GRAPH.edge_index(e) for e in ["input->a0.h1<q>", "a0.h2->a1.h1<k>", "m1->m3", "a3.h2->logits"]])
    effects = edge_effects(params, pairs, CONFIG, logit_difference, edges, execution=Execution(chunk_size=3))
    full = patched_metric(params, pairs, CONFIG, logit_difference, [[tuple(e)] for e in edges])
    f_clean = edge_attribution(params, pairs, CONFIG, logit_difference).f_clean
    assert np.max(np.abs(effects)) > 1e-2
    np.testing.assert_allclose(effects, f_clean[None] - full, rtol=1e-5, atol=1e-5)


def test_the_whole_graph_is_the_clean_run_and_the_empty_circuit_the_corrupt_one(params, pairs):
    scores = edge_attribution(params, pairs, CONFIG, logit_difference)
    f = circuit_metric(params, pairs, CONFIG, logit_difference, [GRAPH.edge_mask, np.zeros_like(GRAPH.edge_mask)])
    np.testing.assert_allclose(f[0], scores.f_clean, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(f[1], scores.f_corrupt, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(faithfulness(f, scores.f_clean, scores.f_corrupt), [1.0, 0.0], atol=1e-5)


def test_patching_a_padded_batch_equals_each_pair_alone(params, pairs):
    edges = ["a0.h2->a1.h1<k>", "m0->a2.h2<k>"]
    together = edge_effects(params, pairs, CONFIG, logit_difference, edges)
    clean, corrupt, labels = make_pairs()
    for i in range(2):
        alone = edge_effects(
            params, prompt_pairs([clean[i]], [corrupt[i]], labels[i : i + 1]), CONFIG, logit_difference, edges
        )
        np.testing.assert_allclose(together[:, i], alone[:, 0], rtol=1e-5, atol=1e-6)


def test_edges_that_do_not_exist_are_refused(params, pairs):
    with pytest.raises(ValueError, match="no edge"):
        edge_effects(params, pairs, CONFIG, logit_difference, ["m3->m1"])
    with pytest.raises(ValueError, match="not an edge"):
        edge_effects(params, pairs, CONFIG, logit_difference, [(0, GRAPH.num_readers)])
    with pytest.raises(ValueError, match="not an edge of the graph"):
        patched_metric(params, pairs, CONFIG, logit_difference, [~GRAPH.edge_mask])


def test_patching_refuses_what_the_scores_refuse(params, pairs):
    """The same checks as `edge_attribution`: a metric that is not floating, and answers that
    share their first token under logit_difference."""
    accuracy = metric(reads="last")(lambda r: jnp.argmax(r.logits[:, 0], axis=-1) == r.labels[:, 0])
    with pytest.raises(ValueError, match="returns bool values"):
        edge_effects(params, pairs, CONFIG, accuracy, ["m1->m3"])
    with pytest.raises(ValueError, match="returns bool values"):
        patched_metric(params, pairs, CONFIG, accuracy, [["m1->m3"]])
    clean, corrupt, _ = make_pairs()
    shared = prompt_pairs(clean, corrupt, [[7, 7], [10, 11]])
    with pytest.raises(ValueError, match="pair 0: token 7: the right and the wrong answer begin with the same token"):
        edge_effects(params, shared, CONFIG, logit_difference, ["m1->m3"])
    with pytest.raises(ValueError, match="pair 0: token 7"):
        circuit_metric(params, shared, CONFIG, logit_difference, [GRAPH.edge_mask])


def test_a_circuit_under_an_intervention_is_the_circuit_of_the_model_that_carries_it(params, pairs):
    """Layer 1 skipped by interventions (its heads' results and its MLP's output zeroed) against
    the same model with layer 1's o_proj and down_proj weights zeroed: the same EAP and EAP-IG
    scores, single-edge effects and circuit. (The runs differ: under interventions the shared
    prefix is not reused, so they agree to float rounding.)"""
    T = pairs.clean.shape[1]
    skip_layer_1 = (sites.skip("head_result", 1, np.ones(T)), sites.skip("mlp_out", 1, np.ones(T)))
    zeroed = with_layers_silenced(params, [1])
    assert pairs.shared_prefix() > 0  # the plain runs reuse it: another computation than under interventions
    for method in ("eap", "eap-ig-inputs"):
        scoring = Scoring(method) if method == "eap" else Scoring(method, FixedRule(steps=4))
        under = edge_attribution(
            params, pairs, CONFIG, logit_difference, scoring, patching=Patching(interventions=skip_layer_1)
        )
        carried = edge_attribution(zeroed, pairs, CONFIG, logit_difference, scoring)
        np.testing.assert_allclose(under.scores, carried.scores, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(under.f_clean, carried.f_clean, rtol=1e-5, atol=1e-5)
    assert np.max(np.abs(under.scores)) > 0.1 and np.all(under.scores[:, GRAPH.mlp_writer(1)] == 0)
    edges = ranked_edges(carried.mean, GRAPH)[:12]
    np.testing.assert_allclose(
        edge_effects(params, pairs, CONFIG, logit_difference, edges, patching=Patching(interventions=skip_layer_1)),
        edge_effects(zeroed, pairs, CONFIG, logit_difference, edges),
        rtol=1e-4,
        atol=1e-5,
    )
    circuit = find_circuit(
        params,
        pairs,
        CONFIG,
        logit_difference,
        under,
        CircuitSearch(target=0.8, patching=Patching(interventions=skip_layer_1)),
    )
    same = find_circuit(zeroed, pairs, CONFIG, logit_difference, carried, CircuitSearch(target=0.8))
    assert len(circuit.edges) == len(same.edges) and circuit.names == same.names
    np.testing.assert_allclose(circuit.curve, same.curve, rtol=1e-4, atol=1e-5)
    plain = edge_attribution(params, pairs, CONFIG, logit_difference)
    assert np.max(np.abs(plain.scores - under.scores)) > 0.1  # the intervention matters


@pytest.mark.parametrize("site", ["attn_out", "delta", "resid_post"])
def test_interventions_on_a_sum_of_writers_are_refused(params, pairs, site):
    """An edit of a sum of writers reaches the readers through no edge: refused by every edge
    function, before anything runs."""
    T = pairs.clean.shape[1]
    edit = sites.skip(site, 1, np.ones(T))
    calls = [
        lambda: edge_attribution(params, pairs, CONFIG, logit_difference, patching=Patching(interventions=edit)),
        lambda: edge_effects(
            params, pairs, CONFIG, logit_difference, ["m0->m1"], patching=Patching(interventions=edit)
        ),
        lambda: patched_metric(
            params, pairs, CONFIG, logit_difference, [["m0->m1"]], patching=Patching(interventions=[edit])
        ),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=f"an intervention at '{site}' edits a sum of the edge graph's writers"):
            call()
