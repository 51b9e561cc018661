"""The edge functions' metric is the package's one form (`jaxdepth.analyses.metrics`): the KL to
the clean run is 0 there and its input edges sum to minus the KL of the corrupt run computed by
hand; on a model made linear, a metric of every position's EAP scores are exact patching; the
shape check holds; the forms the edge functions took before are refused with the new one shown;
a metric of the last position reads each pair's own last position, whatever the padding; the
shared prefix is reused by what the metric declares it reads; and an `Execution`'s chunk size
changes nothing but the chunking."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_edge_patching import made_linear
from test_edge_scores import make_pairs, pairs, params  # noqa: F401  (the tiny model's fixtures)
from tiny_qwen import CONFIG
from jaxdepth.analyses.edges import (
    Patching,
    Scoring,
    answer_probability,
    atp_star,
    kl_clean_to_run,
    logit_difference,
    mean_kl_clean_to_run,
    node_effects,
    prompt_pairs,
)
from jaxdepth.analyses.edges.graph import EdgeGraph
from jaxdepth.analyses.edges.patching import circuit_metric, edge_effects, patched_metric
from jaxdepth.analyses.edges.scores import edge_attribution, pair_runs, ranked_edges, suffix_run
from jaxdepth.analyses.ig import FixedRule
from jaxdepth.analyses.metrics import metric
from jaxdepth.core.execution import Execution
from jaxdepth.core.model import forward

GRAPH = EdgeGraph.of(CONFIG)


@metric(reads="all", clean=True)
def expected_logit(r):
    """Each real position's logits averaged under the clean run's next-token distribution,
    summed over the positions: linear in the logits, and reading every position."""
    weights = jax.nn.softmax(r.clean, axis=-1) * r.real[..., None]
    return jnp.sum(weights * r.logits, axis=(1, 2))


@metric(reads="last")
def right_logit(r):
    """The right answer's logit at each pair's last position (`Readout.labels` the pairs')."""
    return r.logits[jnp.arange(r.logits.shape[0]), 0, r.labels[:, 0]]


def _kl_by_hand(p_logits, q_logits):
    p, q = jax.nn.log_softmax(p_logits, -1), jax.nn.log_softmax(q_logits, -1)
    return np.asarray(jnp.sum(jnp.exp(p) * (p - q), -1))


def test_the_kl_to_the_clean_run_is_zero_there_and_its_input_edges_sum_to_the_corrupt_kl(params, pairs):
    clean = forward(params, pairs.clean, CONFIG, valid=pairs.valid)
    corrupt = forward(params, pairs.corrupt, CONFIG, valid=pairs.valid)
    rows = np.arange(2)
    at_last = _kl_by_hand(clean[rows, pairs.last], corrupt[rows, pairs.last])
    valid = np.asarray(pairs.valid)
    mean = (_kl_by_hand(clean, corrupt) * valid).sum(1) / valid.sum(1)
    for kl, by_hand in ((kl_clean_to_run, at_last), (mean_kl_clean_to_run, mean)):
        scores = edge_attribution(params, pairs, CONFIG, kl, Scoring("eap-ig-inputs", FixedRule("gauss", 12)))
        assert np.all(scores.f_clean == 0)  # the clean run's own distribution
        np.testing.assert_allclose(scores.f_corrupt, by_hand, rtol=1e-4, atol=1e-6)
        assert np.min(by_hand) > 1e-3
        # completeness: the input's edges sum to F(clean) - F(corrupt) = -KL(clean || corrupt)
        np.testing.assert_allclose(scores.scores[:, 0].sum(-1), -by_hand, rtol=2e-3, atol=1e-5)
    # a KL's gradient at its minimum is zero: EAP sees nothing
    eap = edge_attribution(params, pairs, CONFIG, kl_clean_to_run)
    assert np.max(np.abs(eap.scores)) < 1e-5


def test_the_answer_probability_is_the_right_label_s_probability_at_the_last_position(params, pairs):
    logits = forward(params, pairs.clean, CONFIG, valid=pairs.valid)[np.arange(2), pairs.last]
    by_hand = jax.nn.softmax(logits, axis=-1)[np.arange(2), np.asarray(pairs.labels)[:, 0]]
    scores = edge_attribution(params, pairs, CONFIG, answer_probability)
    np.testing.assert_allclose(scores.f_clean, by_hand, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="knows no answer positions"):
        edge_attribution(params, prompt_pairs(*make_pairs()[:2]), CONFIG, answer_probability, patching=Patching("zero"))


def test_on_a_linear_model_a_metric_of_every_position_s_eap_is_exact_patching(params, pairs, monkeypatch):
    flat, linear = made_linear(params, monkeypatch)
    scores = edge_attribution(flat, pairs, linear, expected_logit)
    edges = ranked_edges(scores.mean, GRAPH)
    sample = np.concatenate([edges[:20], edges[-3:], edges[:: max(1, len(edges) // 20)]])
    exact = edge_effects(flat, pairs, linear, expected_logit, sample)
    atol = 1e-5 * float(np.max(np.abs(scores.f_clean)))  # rounding of two float32 values of F
    assert np.max(np.abs(exact)) > 0.1
    np.testing.assert_allclose(scores.scores[:, sample[:, 0], sample[:, 1]].T, exact, rtol=1e-4, atol=atol)
    whole, empty = circuit_metric(
        flat, pairs, linear, expected_logit, [GRAPH.edge_mask, np.zeros_like(GRAPH.edge_mask)]
    )
    np.testing.assert_allclose(whole, scores.f_clean, rtol=1e-5, atol=atol)
    np.testing.assert_allclose(empty, scores.f_corrupt, rtol=1e-5, atol=atol)


def test_a_metric_must_give_one_value_per_pair(params, pairs):
    per_position = metric(reads="all", clean=True)(lambda r: r.logits[..., 0])
    with pytest.raises(ValueError, match=r"must return one value per prompt, shape \(2,\)"):
        edge_attribution(params, pairs, CONFIG, per_position)


def _old_logit_difference(logits, labels):  # the form the edge functions took before
    rows = jnp.arange(logits.shape[0])
    return logits[rows, labels[:, 0]] - logits[rows, labels[:, 1]]


def _old_sequence_metric(logits, clean_logits, pairs):  # and their sequence metrics' form
    return jnp.sum(logits - clean_logits, axis=(1, 2))


@pytest.mark.parametrize("old", [_old_logit_difference, _old_sequence_metric])
def test_the_forms_taken_before_are_refused_with_the_new_one_shown(params, pairs, old):
    new_form = (
        r"is a plain function; a metric is now one form for every analysis(?s:.)*@jaxdepth\.metric\(reads='last'\)"
    )
    calls = {
        "edge_attribution": lambda: edge_attribution(params, pairs, CONFIG, old),
        "edge_effects": lambda: edge_effects(params, pairs, CONFIG, old, ["m0->m1"]),
        "patched_metric": lambda: patched_metric(params, pairs, CONFIG, old, [["m0->m1"]]),
        "node_effects": lambda: node_effects(params, pairs, CONFIG, old, "mlps", [(0, 1)]),
        "atp_star": lambda: atp_star(params, pairs, CONFIG, old),
    }
    for name, call in calls.items():
        with pytest.raises(TypeError, match=f"^{name}: the metric '{old.__name__}' {new_form}"):
            call()


def test_loose_execution_keywords_are_no_longer_taken(params, pairs):
    with pytest.raises(TypeError, match="chunk_size"):
        edge_effects(params, pairs, CONFIG, logit_difference, ["m0->m1"], chunk_size=2)
    with pytest.raises(ValueError, match="it has no use for backward"):
        edge_attribution(params, pairs, CONFIG, logit_difference, execution=Execution(backward="stored"))


def test_a_metric_of_the_last_position_reads_each_pair_s_own_last_position(params, pairs):
    """Pairs of 9 and 6 tokens, the second padded to 9: each pair's scores, effects and F equal
    the pair run alone, unpadded, for a metric of `reads='last'` (with and without the clean
    run's logits)."""
    clean, corrupt, labels = make_pairs()
    edges = ["a0.h1->m2", "m1->logits", "input->a2.h0<k>"]
    for m in (right_logit, kl_clean_to_run):
        scoring = Scoring("eap-ig-inputs", FixedRule("gauss", 3))
        together = edge_attribution(params, pairs, CONFIG, m, scoring)
        effects = edge_effects(params, pairs, CONFIG, m, edges)
        for i in range(2):
            one = prompt_pairs([clean[i]], [corrupt[i]], labels[i : i + 1])
            alone = edge_attribution(params, one, CONFIG, m, scoring)
            np.testing.assert_allclose(together.f_corrupt[i], alone.f_corrupt[0], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(together.scores[i], alone.scores[0], rtol=1e-4, atol=1e-6)
            np.testing.assert_allclose(effects[:, i], edge_effects(params, one, CONFIG, m, edges)[:, 0], atol=1e-5)
    assert np.max(np.abs(effects)) > 1e-3


def test_the_shared_prefix_is_reused_by_the_positions_the_metric_reads(params, pairs):
    """The pairs share 2 positions: a metric of the last position (the clean run's KL too) runs
    the positions after them only; one of every position runs them all."""
    clean, _ = pair_runs(params, pairs, CONFIG)
    assert suffix_run(params, pairs, clean, CONFIG, kl_clean_to_run)[0] == 2
    assert suffix_run(params, pairs, clean, CONFIG, logit_difference)[0] == 2
    assert suffix_run(params, pairs, clean, CONFIG, mean_kl_clean_to_run) == (0, None)


def test_a_chunk_size_changes_nothing_but_the_chunking(params, pairs):
    """`Execution(chunk_size=...)` reaches every sweep: the path points, the edges patched one
    by one, the edge sets and the nodes, vmapped 1 or 3 at a time, give the same numbers."""
    scoring = Scoring("eap-ig-inputs", FixedRule("gauss", 5))
    edges = ["a0.h1->m2", "m1->logits", "input->a2.h0<k>", "a1.h2->a3.h0<v>"]
    sets = [[e] for e in edges] + [edges]
    nodes = [(0, 1), (1, 2), (3, 4), (2, 0)]
    runs = {}
    for chunk in (1, 3):
        execution = Execution(chunk_size=chunk)
        runs[chunk] = (
            edge_attribution(params, pairs, CONFIG, logit_difference, scoring, execution=execution).scores,
            edge_effects(params, pairs, CONFIG, logit_difference, edges, execution=execution),
            patched_metric(params, pairs, CONFIG, logit_difference, sets, execution=execution),
            node_effects(params, pairs, CONFIG, logit_difference, "mlps", nodes, execution=execution),
        )
    for one, three in zip(runs[1], runs[3]):  # to float32 rounding of F (about 2) and of the sums' order
        assert np.max(np.abs(one)) > 1e-3
        np.testing.assert_allclose(one, three, rtol=1e-5, atol=1e-5)
