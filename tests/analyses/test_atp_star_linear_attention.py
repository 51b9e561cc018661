"""AtP* on a hybrid (Qwen3.5: gated DeltaNet layers beside gated attention), on the variant with
more value heads (6) than query heads (4): a linear layer's value heads are heads, each one's
output and inputs a node. AtP of a head's output and of its inputs is exact node patching where
the model after it is linear (the attention layer's queries, keys and
gate kept: the QK fix is exact for them, the gate included); a layer's heads' scores sum to its
attention output's gradient times its change."""

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


def test_atp_is_exact_patching_where_the_model_after_a_node_is_linear(params, pairs, monkeypatch):
    """The model made linear (`made_linear`) but for the attention layer's query, key and gate
    weights: F is linear in every node of the layers from the attention layer on. AtP of a linear
    layer's value heads' outputs and value inputs (all 6 heads) and of the attention's heads and
    values is their exact patching effect, and so is the QK fix of the attention's queries (their
    gate included) and keys; a linear layer's queries and keys (constant q and k directions, no
    gates) have none in either. Rows past the attention layer's 4 heads are 0."""
    flat, config = made_linear(params, CONFIG, monkeypatch)
    layers = dict(flat["layers"])
    for name in ("q", "k", "attn_gate"):  # stacked over the attention layers alone
        layers[name] = 50.0 * params["layers"][name]  # sharp attention, a gate far from 1/2
    layers["o"] = 30.0 * layers["o"]  # the attention's output on the linear layers' scale
    model = dict(flat, layers=layers)
    kinds = ("heads", "values", "queries", "keys")
    star = atp_star(model, pairs, config, logit_difference, kinds=kinds, method="AtP+QK")
    T = pairs.clean.shape[1]
    atol = 1e-5 * float(np.max(np.abs(star.f_clean)))
    for kind in kinds:
        scores = star.of(kind)
        assert scores.shape == (2, 4, 6, T)
        np.testing.assert_array_equal(scores[:, ATTENTION, 4:], 0.0)
        nodes = np.concatenate([_nodes(kind, (ATTENTION,), T, heads=4), _nodes(kind, (3,), T)[1::2]])
        exact = _exact(model, pairs, config, kind, nodes)
        estimate = scores[:, nodes[:, 0], nodes[:, 1], nodes[:, 2]]
        linear = nodes[:, 0] == 3
        if kind in ("heads", "values"):  # the value heads' nodes carry effects
            assert np.abs(exact[:, linear]).max() > 300 * atol, kind
        else:
            assert np.abs(exact[:, ~linear]).max() > 30 * atol, kind  # (a key moves one column: the smaller)
        np.testing.assert_allclose(estimate, exact, rtol=1e-4, atol=atol, err_msg=kind)


def test_a_layers_head_scores_sum_to_its_attention_outputs_gradient_times_its_change(params, pairs):
    """On the model as it is: each layer's heads, the edge graph's (`a{l}.h{h}`, `heads_of(l)`),
    have scores, the rows past them none, and a layer's heads' scores sum over heads and positions
    to the gradient at its attention output times its clean - corrupt change (the output
    projection is linear in the heads' outputs; a linear layer's, its value heads')."""
    graph = EdgeGraph.of(CONFIG)
    star = atp_star(params, pairs, CONFIG, logit_difference, kinds=("heads",), method="AtP")
    for layer in range(CONFIG.num_layers):  # the graph's heads of each layer, the rest zeros
        n = graph.heads_of(layer)
        assert graph.writer_name(graph.head_writer(layer, n - 1)) == f"a{layer}.h{n - 1}"
        np.testing.assert_array_equal(star.heads[:, layer, n:], 0.0)
        assert np.all(np.abs(star.heads[:, layer, :n]).max(axis=(0, 2)) > 0)

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
