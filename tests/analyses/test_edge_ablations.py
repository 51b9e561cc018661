"""Ablations other than the corrupt run (zero, mean, mean per position): the means are the
writers' outputs averaged by hand, an ablated edge is the intervention built by hand, EAP is
exact patching on a model made linear under every ablation (whole edges and per position), and
the 'activations' paths sum to the exact ablation of each node."""

import jax.numpy as jnp
import numpy as np
import pytest

from test_edge_patching import made_linear
from test_edge_scores import make_pairs, pairs, params  # noqa: F401  (the tiny model's fixtures)
from tiny_qwen import CONFIG
from jaxdepth.analyses.edges import ZERO, Ablation, find_circuit, mean_ablation
from jaxdepth.analyses.edges.graph import EdgeGraph
from jaxdepth.analyses.edges.pairs import logit_difference, prompt_pairs
from jaxdepth.analyses.edges.patching import circuit_metric, edge_effects, patched_metric
from jaxdepth.analyses.edges.readers import edge_run
from jaxdepth.analyses.edges.scores import edge_attribution, pair_runs, ranked_edges
from jaxdepth.analyses.ig import FixedRule
from jaxdepth.core import sites
from jaxdepth.core.model import embed, forward, unembed
from edge_reference import logit_difference_of
from jaxdepth.analyses.edges.circuit import CircuitSearch
from jaxdepth.analyses.edges.ablations import Patching
from jaxdepth.analyses.edges.scores import Scoring

GRAPH = EdgeGraph.of(CONFIG)
# 9 prompts of 5, 9 or 11 tokens (each length compiles once alone): two blocks of `PROMPTS_AT_ONCE`
PROMPTS = [np.random.default_rng(i).integers(0, 97, n).tolist() for i, n in enumerate([5, 9, 11, 9, 5, 11, 9, 5, 11])]


@pytest.fixture(scope="module")
def means(params):
    return mean_ablation(params, PROMPTS, CONFIG), mean_ablation(params, PROMPTS, CONFIG, per_position=True)


def test_the_means_are_each_writers_outputs_averaged_by_hand(params, means):
    """Each prompt run alone (no padding): the mean over all its tokens, and at each position
    over the prompts that reach it."""
    outputs = []
    for p in PROMPTS:
        tokens = jnp.asarray([p])
        run = edge_run(
            params, embed(params, tokens, CONFIG), jnp.ones_like(tokens, bool), jnp.array([len(p) - 1]), CONFIG
        )
        outputs.append(np.asarray(run.writers[:, 0]))  # [W, T_p, D]
    per_token, per_position = means
    close = dict(rtol=1e-4, atol=1e-5)  # padded in a batch of 8 or alone: float32 rounding in another order
    np.testing.assert_allclose(per_token.values, np.concatenate(outputs, axis=1).mean(axis=1), **close)
    assert per_position.values.shape == (GRAPH.num_writers, 11, CONFIG.hidden_size)
    for t in (0, 4, 8, 10):
        reaching = [o[:, t] for o in outputs if o.shape[1] > t]
        np.testing.assert_allclose(per_position.values[:, t], np.mean(reaching, axis=0), **close)


def test_an_ablated_edge_is_that_intervention_built_by_hand(params, pairs, means):
    """Edge m0 -> m2 under each ablation: the input of MLP 2 moved by the ablated minus the clean
    output of MLP 0, in a plain forward. With every edge zeroed, every reader reads zero: F is
    the metric of the logits of a zero residual."""
    clean, _ = pair_runs(params, pairs, CONFIG)
    f_clean = np.asarray(logit_difference_of(clean.logits, pairs.labels))
    m0 = GRAPH.mlp_writer(0)
    per_token, per_position = means
    ablated = {
        "zero": (ZERO, 0.0),
        "mean": (per_token, per_token.values[m0]),
        "mean-per-position": (per_position, per_position.values[m0, :9]),
    }
    for kind, (ablation, value) in ablated.items():
        vector = value - clean.writers[m0]
        logits = forward(
            params, pairs.clean, CONFIG, valid=pairs.valid, interventions=sites.add("mlp_in", 2, vector, 1.0)
        )
        by_hand = f_clean - np.asarray(logit_difference_of(logits[jnp.arange(2), pairs.last], pairs.labels))
        effect = edge_effects(params, pairs, CONFIG, logit_difference, ["m0->m2"], patching=Patching(ablation))[0]
        assert np.max(np.abs(effect)) > 1e-2, kind
        np.testing.assert_allclose(effect, by_hand, rtol=1e-4, atol=1e-5, err_msg=kind)
    scores = edge_attribution(params, pairs, CONFIG, logit_difference, patching=Patching(ZERO))
    zero_logits = unembed(params, jnp.zeros((2, CONFIG.hidden_size)), CONFIG)
    # each reader's input is its clean input minus every writer's output: zero up to that sum's rounding
    np.testing.assert_allclose(scores.f_corrupt, logit_difference_of(zero_logits, pairs.labels), atol=1e-4)
    assert np.min(np.abs(scores.f_clean)) > 0.1
    np.testing.assert_allclose(scores.f_clean, f_clean, rtol=1e-6)
    whole, empty = circuit_metric(
        params,
        pairs,
        CONFIG,
        logit_difference,
        [GRAPH.edge_mask, np.zeros_like(GRAPH.edge_mask)],
        patching=Patching(ZERO),
    )
    np.testing.assert_allclose(whole, f_clean, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(empty, scores.f_corrupt, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["corrupt", "zero", "mean-per-position"])
def test_on_a_linear_model_eap_is_exact_patching_under_every_ablation(params, pairs, means, monkeypatch, kind):
    """F linear in every reader's input: each edge's score is its exact effect, and so is each
    edge's score at a position its effect when patched there alone."""
    ablation = {"corrupt": None, "zero": ZERO, "mean-per-position": means[1]}[kind]
    flat, linear = made_linear(params, monkeypatch)
    scores = edge_attribution(
        flat, pairs, linear, logit_difference, Scoring(detail=["positions"]), patching=Patching(ablation)
    )
    edges = ranked_edges(scores.mean, GRAPH)
    sample = np.concatenate([edges[:20], edges[-3:], edges[:: max(1, len(edges) // 20)]])
    atol = 1e-5 * float(np.max(np.abs(scores.f_clean)))  # rounding of two float32 values of F
    exact = edge_effects(flat, pairs, linear, logit_difference, sample, patching=Patching(ablation))
    assert np.max(np.abs(exact)) > 0.1
    np.testing.assert_allclose(scores.scores[:, sample[:, 0], sample[:, 1]].T, exact, rtol=1e-4, atol=atol)
    best = scores.top_positions(24)
    at = [t for _, t, _ in best]
    exact = edge_effects(
        flat, pairs, linear, logit_difference, [n for n, _, _ in best], positions=at, patching=Patching(ablation)
    )
    estimated = np.stack([scores.at_positions(name)[:, t] for name, t, _ in best])
    assert np.max(np.abs(exact)) > 0.1
    np.testing.assert_allclose(estimated, exact, rtol=1e-4, atol=atol)


def test_activation_paths_sum_to_the_exact_ablation_of_each_node(params, pairs, means):
    """Under a mean ablation the edges out of a node sum to F(clean) - F(that node's output
    ablated): each node's path runs from its mean output to its clean one."""
    result = edge_attribution(
        params,
        pairs,
        CONFIG,
        logit_difference,
        Scoring("eap-ig-activations", FixedRule("gauss", 24)),
        patching=Patching(means[0]),
    )
    assert result.ablation == "mean"
    nodes = {"input": [0], "attention 1": [GRAPH.head_writer(1, h) for h in range(4)], "mlp 2": [GRAPH.mlp_writer(2)]}
    for name, writers in nodes.items():
        out_edges = np.zeros_like(GRAPH.edge_mask)
        out_edges[writers] = GRAPH.edge_mask[writers]
        exact = (
            result.f_clean
            - patched_metric(params, pairs, CONFIG, logit_difference, [out_edges], patching=Patching(means[0]))[0]
        )
        summed = result.scores[:, writers].sum(axis=(1, 2))
        assert np.max(np.abs(exact)) > 1e-2, name
        np.testing.assert_allclose(summed, exact, rtol=1e-3, atol=1e-4, err_msg=name)


def test_what_an_ablation_cannot_mean_is_refused(params, pairs, means):
    with pytest.raises(ValueError, match="no path to a 'zero' ablation"):
        edge_attribution(params, pairs, CONFIG, logit_difference, "eap-ig-inputs", patching=Patching("zero"))
    with pytest.raises(ValueError, match="build it with edges.mean_ablation"):
        edge_effects(params, pairs, CONFIG, logit_difference, ["m0->m2"], patching=Patching("mean"))
    with pytest.raises(ValueError, match=r"takes its means \[W, D\]"):
        Ablation("mean")
    short = mean_ablation(params, [p[:6] for p in PROMPTS], CONFIG, per_position=True)
    with pytest.raises(ValueError, match=r"covers positions 0..5 .* the pairs have 9"):
        edge_attribution(params, pairs, CONFIG, logit_difference, patching=Patching(short))
    clean_only = prompt_pairs(make_pairs()[0], labels=make_pairs()[2])
    assert edge_attribution(params, clean_only, CONFIG, logit_difference, patching=Patching(ZERO)).ablation == "zero"
    with pytest.raises(ValueError, match="the corrupt ablation patches in the corrupt prompts"):
        edge_attribution(params, clean_only, CONFIG, logit_difference)
    corrupt_scores = edge_attribution(params, pairs, CONFIG, logit_difference)
    with pytest.raises(
        ValueError, match="computed under a 'corrupt' ablation and the circuit would patch under a 'zero'"
    ):
        find_circuit(
            params, pairs, CONFIG, logit_difference, corrupt_scores, CircuitSearch(size=5, patching=Patching(ZERO))
        )
