"""Metrics of the whole sequence and the clean run (`SequenceMetric`): the KL to the clean run is
0 there and its input edges sum to minus the KL of the corrupt run computed by hand; on a model
made linear, a sequence metric's EAP scores are exact patching; the shape check holds."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_edge_patching import made_linear
from test_edge_scores import pairs, params  # noqa: F401  (the tiny model's fixtures)
from tiny_qwen import CONFIG
from jaxdepth.analyses.edges import kl_to_clean, mean_kl_to_clean, sequence_metric
from jaxdepth.analyses.edges.graph import EdgeGraph
from jaxdepth.analyses.edges.patching import circuit_metric, edge_effects
from jaxdepth.analyses.edges.scores import edge_attribution, ranked_edges
from jaxdepth.analyses.ig import FixedRule
from jaxdepth.core.model import forward

GRAPH = EdgeGraph.of(CONFIG)


@sequence_metric
def expected_logit(logits, clean_logits, pairs):
    """Each real position's logits averaged under the clean run's next-token distribution,
    summed over the positions: linear in the logits, and reading every position."""
    weights = jax.nn.softmax(clean_logits, axis=-1) * pairs.valid[..., None]
    return jnp.sum(weights * logits, axis=(1, 2))


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
    for metric, by_hand in ((kl_to_clean, at_last), (mean_kl_to_clean, mean)):
        scores = edge_attribution(params, pairs, CONFIG, metric, method="eap-ig-inputs", rule=FixedRule("gauss", 12))
        assert np.all(scores.f_clean == 0)  # the clean run's own distribution
        np.testing.assert_allclose(scores.f_corrupt, by_hand, rtol=1e-4, atol=1e-6)
        assert np.min(by_hand) > 1e-3
        # completeness: the input's edges sum to F(clean) - F(corrupt) = -KL(clean || corrupt)
        np.testing.assert_allclose(scores.scores[:, 0].sum(-1), -by_hand, rtol=2e-3, atol=1e-5)
    # a KL's gradient at its minimum is zero: EAP sees nothing
    eap = edge_attribution(params, pairs, CONFIG, kl_to_clean)
    assert np.max(np.abs(eap.scores)) < 1e-5


def test_on_a_linear_model_a_sequence_metric_s_eap_is_exact_patching(params, pairs, monkeypatch):
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


def test_a_sequence_metric_must_give_one_value_per_pair(params, pairs):
    per_position = sequence_metric(lambda logits, clean_logits, pairs: logits[..., 0])
    with pytest.raises(ValueError, match=r"one value per pair, shape \[B\]"):
        edge_attribution(params, pairs, CONFIG, per_position)
