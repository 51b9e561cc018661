"""Edges of the families with norms after the sublayers (Gemma 2/3, OLMo 2): a layer's attention
is one writer, its output after the norm (`EdgeGraph.post_norms`), so that the residual stream is
still exactly the sum of the writers. Each check is against the model's sites driven by hand:
exact patching of an edge is the run in which the reader's input is replaced by its clean value
minus the writer's clean output plus its corrupt one, EAP's score is the gradient at the reader's
input times the writer's difference, and a node's edges sum to its own attribution."""

import dataclasses
import types
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdepth

from test_edge_scores import pairs  # noqa: F401 (the edge tests' pairs: one padded, a shared prefix)
from jaxdepth.analyses.attribution import site_gradients
from jaxdepth.analyses.edges.circuit import Circuit, find_circuit
from jaxdepth.analyses.edges.graph import EdgeGraph
from jaxdepth.analyses.edges.pairs import logit_difference
from jaxdepth.analyses.edges.patching import circuit_metric, edge_effects, faithfulness, patched_metric
from jaxdepth.analyses.edges.scores import EdgeScores, edge_attribution, ranked_edges
from jaxdepth.analyses.ig import FixedRule
from jaxdepth.core import sites
from conftest import tiny_config, with_layers_silenced
from jaxdepth.core.loops import run_layers
from jaxdepth.core.model import embed, forward, random_params
from edge_reference import logit_difference_of
from jaxdepth.analyses.edges.circuit import CircuitSearch
from jaxdepth.analyses.edges.ablations import Patching
from jaxdepth.analyses.edges.scores import Scoring

pytestmark = pytest.mark.usefixtures("highest_precision")

# Gemma 2 (norms before and after both sublayers, 1 + w norm weights, soft-caps, a sliding layer)
# and OLMo 2 (norms after the sublayers only, q/k norms over the whole projection), tiny.
GEMMA = tiny_config(
    model_type="gemma2",
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
    norm_offset=1.0,
    norm_scale_in_float32=True,
    post_norms=True,
    attn_scale=0.25,
    attn_softcap=3.0,
    final_softcap=5.0,
    sliding_window=4,
    layer_types=("sliding", "full", "sliding"),
    embed_scale=32**0.5,
    activation="gelu_tanh",
)
OLMO = dataclasses.replace(
    GEMMA,
    model_type="olmo2",
    norm_offset=0.0,
    pre_norms=False,
    qk_norm=True,
    qk_norm_scope="projection",
    attn_scale=0.0,
    attn_softcap=0.0,
    final_softcap=0.0,
    sliding_window=0,
    layer_types=(),
    embed_scale=1.0,
    activation="silu",
    tie_word_embeddings=False,
)
CONFIGS = {"gemma2": GEMMA, "olmo2": OLMO}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request):
    """Each family's tiny model: the exactness checks run on both."""
    config = CONFIGS[request.param]
    return config, random_params(config, 2, scale=0.3)


@pytest.fixture(scope="module")
def gemma():
    """The checks whose code is the same in both families run on Gemma's model alone."""
    return GEMMA, random_params(GEMMA, 2, scale=0.3)


@pytest.fixture(scope="module")
def gemma_eap(gemma, pairs):  # noqa: F811 (the imported fixture)
    config, params = gemma
    return edge_attribution(params, pairs, config, logit_difference)


def test_the_graph_has_one_attention_writer_per_layer():
    """L attention writers beside the embedding and the L MLPs; the readers are the heads' q/k/v
    inputs, the MLPs' inputs and the logits, as in every family."""
    graph = EdgeGraph.of(GEMMA)
    L, H = GEMMA.num_layers, GEMMA.num_heads
    assert graph.post_norms and graph.attention_writers == 1 and graph.writers_per_layer == 2
    assert graph.num_writers == 1 + L + L and graph.num_readers == L * (3 * H + 1) + 1
    assert [graph.writer_name(w) for w in range(graph.num_writers)] == ["input", "a0", "m0", "a1", "m1", "a2", "m2"]
    assert [graph.attention_writer(l) for l in range(L)] == [1, 3, 5]
    assert list(graph.layer_attention_writers(1)) == [3] and graph.mlp_writer(1) == 4
    later = lambda l: (L - l - 1) * (3 * H + 1) + 1  # noqa: E731 (the readers after layer l)
    assert graph.num_edges == graph.num_readers + sum((1 + later(l)) + later(l) for l in range(L))
    for w in range(graph.num_writers):
        assert graph.writer_index(graph.writer_name(w)) == w
    assert graph.edge_index("a1->a2.h3<v>") == (3, graph.head_reader(2, 3, "v"))
    assert graph.edge_index("a1->m1") == (3, graph.mlp_reader(1))  # the layer's attention feeds its MLP
    with pytest.raises(ValueError, match="no edge"):
        graph.edge_index("a1->a1.h0<q>")
    with pytest.raises(ValueError, match="writes as one, 'a1'"):  # no head writes a vector of its own
        graph.edge_index("a1.h2->m2")
    with pytest.raises(ValueError, match="writes as one"):
        graph.head_writer(1, 2)
    per_head = EdgeGraph.of(dataclasses.replace(GEMMA, post_norms=False))
    assert per_head.attention_writers == H and per_head.num_writers == 1 + L * (H + 1)
    with pytest.raises(ValueError, match="'a1' is no writer: each head of a layer writes its own output, a1.h<head>"):
        per_head.edge_index("a1->m2")


@partial(jax.jit, static_argnums=2)
def _runs(params, pairs, config):  # noqa: F811
    """Per run (clean, corrupt): the embeddings, each layer's input, attention output, MLP output
    and MLP input `[L, B, T, D]` and the final residual, read off the plain forward (no layer
    split per head)."""
    tap = lambda r, _: (r.h, r.attn, r.mlp, r.mlp_in)  # noqa: E731
    out = []
    for tokens in (pairs.clean, pairs.corrupt):
        h0 = embed(params, tokens, config)
        h_last, (h, a, m, mlp_in) = run_layers(params, h0, config, valid=pairs.valid, tap=tap)
        out.append(dict(input=h0, h=h, a=a, m=m, mlp_in=mlp_in, final=h_last))
    return out


def _writer(graph: EdgeGraph, run: dict, w: int):
    """Writer w's output in `run` (`_runs`): the embeddings, a layer's attention output after its
    norm, or an MLP's output after its norm."""
    name = graph.writer_name(w)
    if name == "input":
        return run["input"]
    return run["m" if name.startswith("m") else "a"][int(name[1:])]


def _reader(graph: EdgeGraph, run: dict, r: int):
    """`(site, layer, head, input)`: reader r's site, layer and head (None for the MLP and the
    logits) and its input in `run` (`_runs`): a head's q/k/v input is the layer's input."""
    name = graph.reader_name(r)
    if name == "logits":
        return "resid_pre", graph.num_layers, None, run["final"]
    if name.startswith("m"):
        return "mlp_in", int(name[1:]), None, run["mlp_in"][int(name[1:])]
    layer, rest = name[1:].split(".h")
    site = {"q": "q_in", "k": "k_in", "v": "v_in"}[rest[-2]]
    return site, int(layer), int(rest[:-3]), run["h"][int(layer)]


def _replace(value, layer, data):
    """At layer `data['layer']`, the value becomes `data['value']` (`[B, T, D]`; at a per-head
    site, head `data['head']`'s row alone)."""
    if value.ndim == 4:
        hit = (layer == data["layer"]) & (jnp.arange(value.shape[2]) == data["head"])
        return jnp.where(hit[None, None, :, None], data["value"][:, :, None, :].astype(value.dtype), value)
    return jnp.where(layer == data["layer"], data["value"].astype(value.dtype), value)


def _at_reader(site: str, layer: int, head, value) -> sites.Intervention:
    """`_replace` at reader (site, layer, head) with `value`."""
    return sites.Intervention(site, _replace, dict(layer=jnp.int32(layer), head=jnp.int32(head or 0), value=value))


@partial(jax.jit, static_argnums=2)
def _metric(params, pairs, config, interventions):  # noqa: F811
    """F per pair of the plain forward of the clean prompts under `interventions`."""
    logits = forward(params, pairs.clean, config, valid=pairs.valid, interventions=interventions)
    return logit_difference_of(logits[jnp.arange(len(pairs)), pairs.last], pairs.labels)


# An attention writer into a head of a later layer (past the clean layer between them), into
# its own layer's MLP, and into the logits.
EDGES = ["a0->a2.h1<k>", "a1->m1", "a2->logits"]


def test_patching_an_edge_is_replacing_what_its_reader_reads_of_its_writer(model, pairs):  # noqa: F811
    """Exact patching of u -> v (alone, from v's layer: `edge_effects`; and in a full run through
    the writers' buffer: `patched_metric`) is the forward in which v's input, and nothing else,
    is its clean value minus u's clean output plus u's corrupt output, u's output being what the
    residual receives (a layer's attention output after its norm)."""
    config, params = model
    graph = EdgeGraph.of(config)
    clean, corrupt = _runs(params, pairs, config)
    f_clean = np.asarray(_metric(params, pairs, config, None))
    by_hand = []
    for edge in EDGES:
        w, r = graph.edge_index(edge)
        site, layer, head, clean_input = _reader(graph, clean, r)
        patched = clean_input - _writer(graph, clean, w) + _writer(graph, corrupt, w)
        by_hand.append(f_clean - np.asarray(_metric(params, pairs, config, _at_reader(site, layer, head, patched))))
    by_hand = np.array(by_hand)
    effects = edge_effects(params, pairs, config, logit_difference, EDGES)
    full = f_clean[None] - patched_metric(params, pairs, config, logit_difference, [[e] for e in EDGES])
    assert np.min(np.max(np.abs(by_hand), axis=1)) > 1e-2, "an edge whose patching changes nothing: a vacuous check"
    np.testing.assert_allclose(effects, by_hand, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(full, by_hand, rtol=1e-5, atol=1e-5)


def _add(value, layer, data):
    """At layer `data['layer']`, `data['probe']` (`[B, T, D]`) added (at a per-head site, to head
    `data['head']`'s row alone)."""
    return value + _replace(jnp.zeros_like(value), layer, dict(data, value=data["probe"]))


def test_eap_scores_are_the_gradient_at_the_reader_times_the_writers_difference(model, pairs):  # noqa: F811
    """EAP's score of u -> v per pair: dF/d in_v (by hand: a zero added at v's input of the
    plain forward, differentiated) times u's clean minus corrupt output, summed over positions
    and channels."""
    config, params = model
    graph = EdgeGraph.of(config)
    eap = edge_attribution(params, pairs, config, logit_difference)
    clean, corrupt = _runs(params, pairs, config)
    for edge in EDGES[:2]:
        w, r = graph.edge_index(edge)
        site, layer, head, _ = _reader(graph, clean, r)
        data = dict(layer=jnp.int32(layer), head=jnp.int32(head or 0))

        def total(probe, site=site, data=data):
            return jnp.sum(_metric(params, pairs, config, sites.Intervention(site, _add, dict(data, probe=probe))))

        gradient = jax.grad(total)(jnp.zeros_like(clean["input"]))
        delta = _writer(graph, clean, w) - _writer(graph, corrupt, w)
        by_hand = np.einsum("btd,btd->b", np.asarray(gradient), np.asarray(delta))
        assert np.max(np.abs(by_hand)) > 1e-3, f"{edge}: a vacuous check"
        np.testing.assert_allclose(eap.score(edge), by_hand, rtol=1e-4, atol=1e-6, err_msg=edge)


def test_node_scores_equal_the_node_attribution_of_site_gradients(gemma, pairs, gemma_eap):  # noqa: F811
    """A writer's edges summed over its readers are gradient x activation difference at the
    writer: at attn_out for a layer's attention (after its norm), mlp_out for an MLP and
    resid_pre of layer 0 for the input, from the plain forward."""
    config, params = gemma
    graph = EdgeGraph.of(config)
    metric = jaxdepth.metric(reads="last")(lambda r: logit_difference_of(r.logits[:, 0], r.labels))
    names = ("attn_out", "mlp_out", "resid_pre")
    side = lambda tokens: types.SimpleNamespace(tokens=tokens, valid=pairs.valid, labels=pairs.labels)  # noqa: E731
    clean = site_gradients(params, side(pairs.clean), config, metric, names)
    corrupt = site_gradients(params, side(pairs.corrupt), config, metric, names)
    node = {
        s: np.einsum("lbtd,lbtd->bl", clean.activations[s] - corrupt.activations[s], clean.gradients[s]) for s in names
    }
    scores = gemma_eap.node_scores()
    for layer in range(config.num_layers):
        attention, mlp = graph.attention_writer(layer), graph.mlp_writer(layer)
        np.testing.assert_allclose(scores[:, attention], node["attn_out"][:, layer], rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(scores[:, mlp], node["mlp_out"][:, layer], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(scores[:, 0], node["resid_pre"][:, 0], rtol=1e-4, atol=1e-6)
    assert np.max(np.abs(node["attn_out"])) > 1e-2


def test_the_whole_graph_is_the_clean_run_and_a_node_s_edges_sum_to_corrupting_it(gemma, pairs, gemma_eap):  # noqa: F811
    """The circuit of every edge is the clean run, the empty one the corrupt run (faithfulness 1
    and 0); EAP-IG 'activations': the edges out of a node (the input, a layer's attention, an
    MLP) sum to F(clean) - F(that node's output corrupt), its out-edges patched exactly."""
    config, params = gemma
    graph = EdgeGraph.of(config)
    eap = gemma_eap
    f = circuit_metric(params, pairs, config, logit_difference, [graph.edge_mask, np.zeros_like(graph.edge_mask)])
    np.testing.assert_allclose(f[0], eap.f_clean, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(f[1], eap.f_corrupt, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(faithfulness(f, eap.f_clean, eap.f_corrupt), [1.0, 0.0], atol=1e-5)
    result = edge_attribution(
        params, pairs, config, logit_difference, Scoring("eap-ig-activations", FixedRule("gauss", 24))
    )
    nodes = {"input": [0], "attention 1": [graph.attention_writer(1)], "mlp 1": [graph.mlp_writer(1)]}
    out_edges = []
    for writers in nodes.values():
        mask = np.zeros_like(graph.edge_mask)
        mask[writers] = graph.edge_mask[writers]
        out_edges.append(mask)
    exact = result.f_clean[None] - patched_metric(params, pairs, config, logit_difference, out_edges)
    for (name, writers), corrupted in zip(nodes.items(), exact):
        summed = result.scores[:, writers].sum(axis=(1, 2))
        assert np.max(np.abs(corrupted)) > 1e-2, name
        np.testing.assert_allclose(summed, corrupted, rtol=1e-3, atol=1e-4, err_msg=name)


def test_an_attention_layer_skipped_by_interventions_is_the_layer_with_its_weights_zeroed(gemma, pairs):  # noqa: F811
    """Where a layer's attention is one writer, `attn_out` is that writer: an intervention there
    is taken (not refused as a sum of writers), and skipping layer 1 (its attention's and its
    MLP's outputs zeroed) gives the scores and effects of the model with that layer's o_proj and
    down_proj zeroed (a norm of zeros is zero). `delta` is still a sum of writers: refused."""
    config, params = gemma
    graph = EdgeGraph.of(config)
    T = pairs.clean.shape[1]
    skip_layer_1 = (sites.skip("attn_out", 1, np.ones(T)), sites.skip("mlp_out", 1, np.ones(T)))
    zeroed = with_layers_silenced(params, [1])
    under = edge_attribution(params, pairs, config, logit_difference, patching=Patching(interventions=skip_layer_1))
    carried = edge_attribution(zeroed, pairs, config, logit_difference)
    np.testing.assert_allclose(under.scores, carried.scores, rtol=1e-4, atol=1e-5)
    assert np.all(under.scores[:, [graph.attention_writer(1), graph.mlp_writer(1)]] == 0)
    assert np.max(np.abs(under.scores)) > 1e-2
    edges = ranked_edges(carried.mean, graph)[:6]
    np.testing.assert_allclose(
        edge_effects(params, pairs, config, logit_difference, edges, patching=Patching(interventions=skip_layer_1)),
        edge_effects(zeroed, pairs, config, logit_difference, edges),
        rtol=1e-4,
        atol=1e-5,
    )
    edit = sites.skip("delta", 1, np.ones(T))
    with pytest.raises(ValueError, match=r"at 'delta' edits a sum .* \('attn_out' for a layer's attention"):
        edge_attribution(params, pairs, config, logit_difference, patching=Patching(interventions=edit))


def test_results_record_their_graph_and_circuits_refuse_another_model_s_scores(tmp_path, gemma_eap, pairs):  # noqa: F811
    """Scores and circuits saved and loaded keep the graph whose writers their indices count;
    the scores of a model whose heads write choose no circuit of a post-norm model."""
    eap = gemma_eap
    back = EdgeScores.load(eap.save(str(tmp_path / "edges.npz")))
    assert back.post_norms and back.graph == eap.graph and back.top(3) == eap.top(3)
    ranked = ranked_edges(eap.mean, eap.graph)[:5]
    circuit = Circuit(
        edges=ranked,
        scores=eap.mean[ranked[:, 0], ranked[:, 1]],
        faithfulness=0.5,
        sizes=np.array([5]),
        curve=np.array([0.5], np.float32),
        **eap.graph.fields(),
    )
    loaded = Circuit.load(circuit.save(str(tmp_path / "circuit.npz")))
    assert loaded.graph == eap.graph and loaded.names == circuit.names
    assert all("." not in name.split("->")[0] for name in loaded.names)  # no head is a writer
    per_head = EdgeGraph.of(dataclasses.replace(GEMMA, post_norms=False))
    scores = np.zeros((len(pairs), per_head.num_writers, per_head.num_readers), np.float32)
    heads_write = dataclasses.replace(eap, scores=scores, post_norms=False)
    with pytest.raises(ValueError, match="the scores are of another model's graph"):
        find_circuit(None, pairs, GEMMA, logit_difference, heads_write, CircuitSearch(size=3))
