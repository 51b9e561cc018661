"""AtP* on a hybrid (Qwen3.5: gated DeltaNet layers beside gated attention), on the variant with
more value heads (6) than query heads (4): a linear layer's value heads are heads, each one's
output and inputs a node. On the model made linear AtP of every head's output and value input is
exact node patching; with the attention layer's queries, keys and gate kept (the rest linear)
the QK fix is exact for its queries and keys, the gate included; a linear layer's heads' scores
are the edge graph's node scores of its heads and sum to the layer's attention output's
gradient times its change."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_hf_config
from test_edge_scores import make_pairs
from test_edges_linear_attention import made_linear
from jaxdepth.analyses.edges.atp_star import atp_star, node_shape
from jaxdepth.analyses.edges.graph import EdgeGraph
from jaxdepth.analyses.edges.pairs import logit_difference, prompt_pairs
from jaxdepth.analyses.edges.patching import node_effects
from jaxdepth.analyses.edges.readers import final_metric
from jaxdepth.analyses.edges.scores import edge_attribution
from jaxdepth.core import sites
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.execution import Execution
from jaxdepth.core.loops import run_layers
from jaxdepth.core.model import embed, random_params

pytestmark = pytest.mark.usefixtures("highest_precision")

HF_CONFIG, _ = tiny_hf_config("qwen3_5_hybrid")
# layers 0, 1, 3 linear (6 value heads over 2 key heads), layer 2 gated attention (4 heads)
CONFIG = dataclasses.replace(ModelConfig.from_hf(HF_CONFIG.to_dict()), linear_value_heads=6)
ATTENTION = 2


@pytest.fixture(scope="module")
def params():
    return random_params(CONFIG, 1, scale=0.15)


@pytest.fixture(scope="module")
def pairs():
    return prompt_pairs(*make_pairs())  # lengths 9 and 6 (padded)


def _exact(model, pairs, config, kind, nodes):
    return node_effects(
        model, pairs, config, logit_difference, kind, nodes, execution=Execution(chunk_size=len(nodes))
    ).T


def _nodes(kind, layers, seq_len, heads=None):
    """Every node of `kind` on `layers` (its first `heads` heads, default all)."""
    shape = node_shape(kind, CONFIG, seq_len)
    nodes = np.stack(np.unravel_index(np.arange(np.prod(shape)), shape), axis=1)
    keep = np.isin(nodes[:, 0], layers) & (nodes[:, 1] < (heads or shape[1]))
    return nodes[keep]


def test_on_the_hybrid_made_linear_atp_of_heads_and_values_is_exact(params, pairs, monkeypatch):
    """F linear in every head's output and value input (`made_linear`): AtP of them is their
    exact patching effect, on the linear layers' value heads (every one of the 6) and the
    attention layer's heads; the attention's padded rows (heads 4, 5) are 0."""
    flat, config = made_linear(params, CONFIG, monkeypatch)
    star = atp_star(flat, pairs, config, logit_difference, kinds=("heads", "values"), method="AtP")
    T = pairs.clean.shape[1]
    atol = 1e-5 * float(np.max(np.abs(star.f_clean)))
    for kind in ("heads", "values"):
        scores = star.of(kind)
        assert scores.shape == (2, 4, 6, T)
        np.testing.assert_array_equal(scores[:, ATTENTION, 4:], 0.0)
        # every linear layer's node at the changed positions, a sample of the attention's
        nodes = np.concatenate([_nodes(kind, (0, 1, 3), T)[::2], _nodes(kind, (ATTENTION,), T, heads=4)[::5]])
        exact = _exact(flat, pairs, config, kind, nodes)
        estimate = scores[:, nodes[:, 0], nodes[:, 1], nodes[:, 2]]
        linear = np.isin(nodes[:, 0], (0, 1, 3))
        assert np.abs(exact[:, linear]).max() > 1000 * atol, kind  # the value heads' nodes carry effects
        np.testing.assert_allclose(estimate, exact, rtol=1e-4, atol=atol, err_msg=kind)


def test_the_qk_fix_is_exact_on_the_gated_attention_layer_where_the_rest_is_linear(params, pairs, monkeypatch):
    """The attention layer keeps its query, key and gate weights; the rest is linear: the QK fix,
    which computes a patched query's (its gate's too) or key's head output exactly, is exact
    patching there. A linear layer's queries and keys (its constant q and k directions, no gates:
    no effect) are 0 in both."""
    flat, config = made_linear(params, CONFIG, monkeypatch)
    layers = dict(flat["layers"])
    for name in ("q", "k", "attn_gate"):  # stacked over the attention layers alone
        layers[name] = 50.0 * params["layers"][name]  # sharp attention, a gate far from 1/2
    layers["o"] = 30.0 * layers["o"]  # the attention's output on the linear layers' scale
    model = dict(flat, layers=layers)
    star = atp_star(model, pairs, config, logit_difference, kinds=("queries", "keys"), method="AtP+QK")
    T = pairs.clean.shape[1]
    atol = 1e-5 * float(np.max(np.abs(star.f_clean)))
    for kind in ("queries", "keys"):
        nodes = np.concatenate([_nodes(kind, (ATTENTION,), T, heads=4), _nodes(kind, (3,), T)[::7]])
        exact = _exact(model, pairs, config, kind, nodes)
        estimate = star.of(kind)[:, nodes[:, 0], nodes[:, 1], nodes[:, 2]]
        assert np.abs(exact).max() > 30 * atol, kind  # (a key moves one column: the smaller)
        np.testing.assert_allclose(estimate, exact, rtol=1e-4, atol=atol, err_msg=kind)


def test_a_linear_layers_head_scores_are_its_heads_node_scores_and_sum_to_its_output(params, pairs):
    """On the model as it is: AtP of a value head's output is the edge graph's node score of the
    head `a{l}.h{h}` (its out-edges' EAP scores summed: the head's result is linear in its
    output), and a linear layer's heads' scores sum over heads and positions to the gradient at
    the layer's attention output times its clean - corrupt change."""
    graph = EdgeGraph.of(CONFIG)
    star = atp_star(params, pairs, CONFIG, logit_difference, kinds=("heads",), method="AtP")
    node = edge_attribution(params, pairs, CONFIG, logit_difference).node_scores()
    for layer in range(CONFIG.num_layers):
        heads = [graph.head_writer(layer, h) for h in range(graph.heads_of(layer))]
        assert graph.writer_name(heads[-1]) == f"a{layer}.h{graph.heads_of(layer) - 1}"
        np.testing.assert_allclose(star.heads[:, layer, : len(heads)].sum(-1), node[:, heads], rtol=1e-4, atol=1e-6)

    def attention_outputs(tokens):
        h0 = embed(params, jnp.asarray(tokens), CONFIG)
        return run_layers(params, h0, CONFIG, valid=pairs.valid, tap=lambda r, _: r.attn)[1]

    change = attention_outputs(pairs.clean) - attention_outputs(pairs.corrupt)

    def f(rows):
        h0 = embed(params, pairs.clean, CONFIG)
        h, _ = run_layers(params, h0, CONFIG, valid=pairs.valid, interventions=sites.probe("attn_out", rows))
        return jnp.sum(final_metric(params, logit_difference, h, pairs, CONFIG))

    gradient = jax.grad(f)(jnp.zeros_like(change))
    by_layer = np.einsum("lbtd,lbtd->bl", gradient, change)
    assert np.abs(by_layer[:, 1]).max() > 1e-3
    np.testing.assert_allclose(star.heads.sum(axis=(2, 3)), by_layer, rtol=1e-4, atol=1e-6)
