"""Edge scores (EAP, EAP-IG) against finite differences of a forward written apart, against the
node attributions of `site_gradients`, and their own identities (one step, completeness, padding)."""

import types

import jax.numpy as jnp
import numpy as np
import pytest

from edge_reference import logit_difference_of, reference_run
from tiny_qwen import CONFIG
from jaxdepth.analyses.attribution import site_gradients
from jaxdepth.analyses.edges.graph import EdgeGraph
from jaxdepth.analyses.edges.pairs import logit_difference, prompt_pairs
from jaxdepth.analyses.edges.patching import patched_metric
from jaxdepth.analyses.edges.scores import EdgeScores, Scoring, edge_attribution
from jaxdepth.analyses.metrics import metric
from jaxdepth.analyses.ig import AdaptiveRule, Attribution, FixedRule, integrated_gradients
from jaxdepth.core.model import embed, random_params

GRAPH = EdgeGraph.of(CONFIG)


@pytest.fixture(scope="module")
def params():
    return random_params(CONFIG, 1, scale=0.2)


def make_pairs():
    """Two pairs of different lengths (the second padded), each corrupted at one position."""
    rng = np.random.default_rng(0)
    clean = [rng.integers(0, 97, 9).tolist(), rng.integers(0, 97, 6).tolist()]
    corrupt = [list(c) for c in clean]
    corrupt[0][3], corrupt[1][2] = 5, 7
    return clean, corrupt, np.array([[3, 4], [10, 11]])


@pytest.fixture(scope="module")
def pairs():
    return prompt_pairs(*make_pairs())


@pytest.fixture(scope="module")
def eap(params, pairs):
    return edge_attribution(params, pairs, CONFIG, logit_difference)


# One edge of every kind: (writer, reader) names.
EDGES_OF_EVERY_KIND = [
    "input->a0.h1<q>",
    "a0.h0->a2.h3<q>",
    "a0.h2->a1.h1<k>",
    "a1.h3->a3.h3<v>",
    "a1.h1->m1",
    "m0->a2.h2<k>",
    "m1->m3",
    "a3.h2->logits",
    "m2->logits",
    "input->m2",
]


def _reference_reader(name: str):
    if name == "logits":
        return "logits"
    if name.startswith("m"):
        return ("m", int(name[1:]))
    layer, rest = name[1:].split(".h")
    head, kind = rest[:-3], rest[-2]
    return (kind, int(layer), int(head))


def _reference_writer(name: str):
    if name == "input":
        return "input"
    if name.startswith("m"):
        return ("m", int(name[1:]))
    layer, head = name[1:].split(".h")
    return (int(layer), int(head))


@pytest.mark.parametrize("pair", [0, 1])
@pytest.mark.parametrize("edge", EDGES_OF_EVERY_KIND)
def test_eap_score_is_the_derivative_along_the_edge(params, eap, edge, pair):
    """EAP's score of u -> v is d/dε F(v reads ε (a_clean[u] - a_corrupt[u]) more) at ε = 0:
    checked by a central difference of a float64 forward written head by head."""
    clean, corrupt, labels = make_pairs()
    T = len(clean[pair])
    run = lambda tokens, **kw: reference_run(params, tokens, CONFIG, T - 1, labels[pair], **kw)
    _, clean_writers = run(clean[pair])
    _, corrupt_writers = run(corrupt[pair])
    u, v = edge.split("->")
    delta = clean_writers[_reference_writer(u)] - corrupt_writers[_reference_writer(u)]
    eps = 1e-4
    plus = run(clean[pair], reader=_reference_reader(v), change=eps * delta)[0]
    minus = run(clean[pair], reader=_reference_reader(v), change=-eps * delta)[0]
    derivative = (plus - minus) / (2 * eps)
    assert abs(derivative) > 1e-4, f"{edge}: a vacuous check"
    np.testing.assert_allclose(eap.score(edge)[pair], derivative, rtol=2e-3, atol=2e-5)


def test_scores_are_exactly_zero_off_the_graph(eap):
    assert eap.scores.shape == (2, GRAPH.num_writers, GRAPH.num_readers)
    assert np.all(eap.scores[:, ~GRAPH.edge_mask] == 0)
    assert np.count_nonzero(eap.scores[0]) > 0.9 * GRAPH.num_edges


@metric(reads="last")
def difference_by_hand(r):
    """The logit difference at each pair's last real position, written out (`logit_difference_of`)."""
    return logit_difference_of(r.logits[:, 0], r.labels)


def _prompts(pairs, side: str):
    """One side of the pairs as `site_gradients` takes prompts: tokens, their mask and the labels."""
    return types.SimpleNamespace(tokens=getattr(pairs, side), valid=pairs.valid, labels=pairs.labels)


SITES = ("head_out", "mlp_out", "resid_pre")


def test_node_scores_equal_the_node_attribution_of_site_gradients(params, pairs, eap):
    """A writer's edges summed over its readers are gradient x activation difference at the
    writer: `site_gradients` at head_out (each head's output before o_proj, which is linear), at
    mlp_out and, for the input, at resid_pre of layer 0, from the plain forward."""
    clean = site_gradients(params, _prompts(pairs, "clean"), CONFIG, difference_by_hand, SITES)
    corrupt = site_gradients(params, _prompts(pairs, "corrupt"), CONFIG, difference_by_hand, SITES)
    delta = {s: clean.activations[s] - corrupt.activations[s] for s in SITES}
    heads = np.einsum("lbthe,lbthe->blh", delta["head_out"], clean.gradients["head_out"])
    mlps = np.einsum("lbtd,lbtd->bl", delta["mlp_out"], clean.gradients["mlp_out"])
    nodes = eap.node_scores()
    for layer in range(CONFIG.num_layers):
        for head in range(CONFIG.num_heads):
            np.testing.assert_allclose(
                nodes[:, GRAPH.head_writer(layer, head)], heads[:, layer, head], rtol=1e-4, atol=1e-6
            )
        np.testing.assert_allclose(nodes[:, GRAPH.mlp_writer(layer)], mlps[:, layer], rtol=1e-4, atol=1e-6)
    inputs = np.einsum("btd,btd->b", delta["resid_pre"][0], clean.gradients["resid_pre"][0])
    np.testing.assert_allclose(nodes[:, 0], inputs, rtol=1e-4, atol=1e-6)


def test_eap_ig_with_one_right_step_is_eap(params, pairs, eap):
    """The 'right' rule's single node is α = 1, the clean input: EAP's gradient."""
    one = edge_attribution(params, pairs, CONFIG, logit_difference, Scoring("eap-ig-inputs", FixedRule("right", 1)))
    np.testing.assert_allclose(one.scores, eap.scores, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rule", [FixedRule("gauss", 6), AdaptiveRule(tolerance=0.05, max_evaluations=40)])
def test_eap_ig_inputs_is_integrated_gradients_at_the_input_with_the_corrupt_baseline(params, pairs, rule):
    """The input's edges of one pair, summed over its readers, are integrated gradients at
    `resid_pre` of layer 0 with the corrupt embeddings as the baseline: the same integrator,
    the same rule (the adaptive one placing the same nodes), summed over positions."""
    one = pairs.select([0])
    edges = edge_attribution(params, one, CONFIG, logit_difference, Scoring("eap-ig-inputs", rule))
    assert bool(one.valid.all())  # its last real position is its last: what the edges read
    site = integrated_gradients(
        params,
        _prompts(one, "clean"),
        CONFIG,
        Attribution(
            difference_by_hand, site="resid_pre", layers=[0], baseline=embed(params, one.corrupt, CONFIG)[None]
        ),
        rule=rule,
    )
    np.testing.assert_allclose(edges.node_scores()[0, 0], site.per_position[0, 0].sum(), rtol=1e-4, atol=1e-6)
    if isinstance(rule, AdaptiveRule):  # the same rounds place the same nodes; the readers' pass adds one per node
        assert edges.converged[0] == site.converged[0, 0]
        assert edges.evaluations[0] == 2 * site.evaluations[0, 0]


def test_adaptive_completeness_of_the_input_edges_is_within_the_certified_bound(params, pairs):
    """The input's edges sum to F(clean) - F(corrupt) within the adaptive rule's bound, itself
    within the tolerance (relative to |F(clean) - F(corrupt)| or its floor)."""
    result = edge_attribution(
        params,
        pairs,
        CONFIG,
        logit_difference,
        Scoring("eap-ig-inputs", AdaptiveRule(tolerance=1e-3, max_evaluations=400)),
    )
    assert result.converged.all()
    gap = np.abs(result.completeness_gap())
    assert np.all(gap <= result.bound + 1e-5), (gap, result.bound)
    scale = np.maximum(np.abs(result.f_clean - result.f_corrupt), 0.1 * np.abs(result.f_clean))
    assert np.all(result.bound <= 1e-3 * scale)
    # a fixed rule of few steps is visibly off: the certificate is not vacuous
    coarse = edge_attribution(params, pairs, CONFIG, logit_difference, Scoring("eap-ig-inputs", FixedRule(steps=4)))
    assert np.max(np.abs(coarse.completeness_gap())) > 10 * np.max(result.bound)


def test_activation_paths_sum_to_the_exact_effect_of_corrupting_each_node(params, pairs):
    """EAP-IG 'activations': the edges out of a node sum to F(clean) - F(that node's output
    corrupt), which is exact patching of all its edges at once."""
    result = edge_attribution(
        params, pairs, CONFIG, logit_difference, Scoring("eap-ig-activations", FixedRule("gauss", 24))
    )
    nodes = {"input": [0], "attention 1": [GRAPH.head_writer(1, h) for h in range(4)], "mlp 2": [GRAPH.mlp_writer(2)]}
    for name, writers in nodes.items():
        out_edges = np.zeros_like(GRAPH.edge_mask)
        out_edges[writers] = GRAPH.edge_mask[writers]
        exact = result.f_clean - patched_metric(params, pairs, CONFIG, logit_difference, [out_edges])[0]
        summed = result.scores[:, writers].sum(axis=(1, 2))
        assert np.max(np.abs(exact)) > 1e-2, name
        np.testing.assert_allclose(summed, exact, rtol=1e-3, atol=1e-4, err_msg=name)


@pytest.mark.parametrize("method", ["eap", "eap-ig-inputs"])
def test_a_padded_batch_of_pairs_equals_each_pair_alone(params, pairs, method):
    together = edge_attribution(params, pairs, CONFIG, logit_difference, **_kw(method))
    clean, corrupt, labels = make_pairs()
    for i in range(2):
        alone = edge_attribution(
            params, prompt_pairs([clean[i]], [corrupt[i]], labels[i : i + 1]), CONFIG, logit_difference, **_kw(method)
        )
        np.testing.assert_allclose(together.scores[i], alone.scores[0], rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(together.f_clean[i], alone.f_clean[0], rtol=1e-5)


def _kw(method):
    return {"scoring": Scoring(method) if method == "eap" else Scoring(method, FixedRule(steps=5))}


def test_scores_save_and_load(tmp_path, eap):
    path = eap.save(str(tmp_path / "edges.npz"))
    back = EdgeScores.load(path)
    np.testing.assert_array_equal(back.scores, eap.scores)
    assert back.top(3) == eap.top(3) and back.method == "eap"


def test_clear_errors(params, pairs):
    clean, corrupt, labels = make_pairs()
    with pytest.raises(ValueError, match="same length"):
        prompt_pairs([clean[0]], [corrupt[0][:-1]])
    with pytest.raises(ValueError, match=r"must return one value per prompt, shape \(2,\)"):
        edge_attribution(params, pairs, CONFIG, metric(reads="last")(lambda r: jnp.sum(r.logits)))
    with pytest.raises(ValueError, match="no edge"):
        GRAPH.edge_index("m2->a1.h0<q>")
    with pytest.raises(ValueError, match="method must be"):
        edge_attribution(params, pairs, CONFIG, logit_difference, "acdc")
    with pytest.raises(ValueError, match="a rule is EAP-IG's"):
        edge_attribution(params, pairs, CONFIG, logit_difference, Scoring(rule=FixedRule(steps=8)))
    with pytest.raises(ValueError, match="one tolerance"):
        edge_attribution(params, pairs, CONFIG, logit_difference, Scoring("eap-ig-inputs", AdaptiveRule((0.1, 0.2))))
    with pytest.raises(ValueError, match="adaptive rule certifies"):
        edge_attribution(params, pairs, CONFIG, logit_difference, Scoring("eap-ig-activations", "adaptive"))
    with pytest.raises(ValueError, match="exceeds the model's context"):
        edge_attribution(params, prompt_pairs([[1] * 300], [[2] * 300], [[1, 2]]), CONFIG, logit_difference)


@metric(reads="last")
def argmax_metric(r):  # the model's answer: an integer, whose gradient is zero everywhere
    return jnp.argmax(r.logits[:, 0], axis=-1)


@metric(reads="last")
def accuracy_metric(r):
    return jnp.argmax(r.logits[:, 0], axis=-1) == r.labels[:, 0]


@pytest.mark.parametrize("metric, dtype", [(argmax_metric, "int32"), (accuracy_metric, "bool")])
def test_a_metric_that_is_not_floating_is_refused(params, pairs, metric, dtype):
    """Its gradient is zero, so every score would be exactly 0: refused, naming the dtype."""
    with pytest.raises(ValueError, match=f"returns {dtype} values: a metric must be floating point.*zero gradient"):
        edge_attribution(params, pairs, CONFIG, metric)
    with pytest.raises(ValueError, match=f"returns {dtype} values"):
        edge_attribution(params, pairs, CONFIG, metric, Scoring("eap-ig-inputs", FixedRule(steps=2)))


def test_answers_that_share_their_first_token_are_refused_with_the_logit_difference(params):
    """logit_difference reads each answer's first token: with the same token for both, F is 0 on
    both runs and the pair would be averaged into the scores as if it had no circuit."""
    clean, corrupt, _ = make_pairs()
    shared = prompt_pairs(clean, corrupt, [[3, 4], [10, 10]])
    with pytest.raises(ValueError, match=r"^pair 1: token 10: the right and the wrong answer begin with the same"):
        edge_attribution(params, shared, CONFIG, logit_difference)
    with pytest.raises(ValueError, match=r"logit_difference reads labels \[B, 2\]"):
        edge_attribution(params, prompt_pairs(clean, corrupt), CONFIG, logit_difference)


def test_running_only_the_positions_after_the_shared_prefix_changes_nothing(params, pairs, eap, monkeypatch):
    """The pairs share their first 2 tokens, so scores run positions 2.. with the clean keys
    and values of the prefix: the same as running every position."""
    assert pairs.shared_prefix() == 2
    monkeypatch.setattr(type(pairs), "shared_prefix", lambda self: 0)
    full = edge_attribution(params, pairs, CONFIG, logit_difference)
    np.testing.assert_allclose(full.scores, eap.scores, rtol=1e-4, atol=1e-6)
