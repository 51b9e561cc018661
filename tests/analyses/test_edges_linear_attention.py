"""The edge graph of a hybrid model (Qwen3.5: gated DeltaNet layers beside gated attention): a
linear-attention layer split per value head is the layer, each head's writer and q, k, v readers
read what `gated_delta_net_heads` says (the convolution's window, the key heads shared by their
value heads), exact patching of an edge into a linear layer is the run patched by hand, EAP is
exact patching on the model made linear, and circuits run. Each check also runs on a variant
with more value heads (6) than query heads (4), whose graph has layers of different head counts
(its runs compute in the padded layout, `EdgeGraph.padded`)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_hf_config
from test_edge_scores import make_pairs
from jaxdepth.analyses.edges.atp_star import atp_star
from jaxdepth.analyses.edges.circuit import CircuitSearch, circuit_figure, find_circuit
from jaxdepth.analyses.edges.graph import EdgeGraph
from jaxdepth.analyses.edges.pairs import logit_difference, prompt_pairs
from jaxdepth.analyses.edges.patching import edge_effects, node_effects, patched_metric
from jaxdepth.analyses.edges.scores import EdgeScores, Scoring, edge_attribution, ranked_edges
from jaxdepth.analyses.ig import FixedRule
from jaxdepth.core import layer as core_layer, linear_attention, model as core_model, sites
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.loops import run_layers
from jaxdepth.core.model import embed, forward, random_params

pytestmark = pytest.mark.usefixtures("highest_precision")

HF_CONFIG, _ = tiny_hf_config("qwen3_5_hybrid")
CONFIG = ModelConfig.from_hf(HF_CONFIG.to_dict())  # layers 0, 1, 3 linear; 4 query heads, 4 value heads
WIDE = dataclasses.replace(CONFIG, linear_value_heads=6)  # value heads in groups of 3 over 2 key heads


@pytest.fixture(scope="module", params=["hybrid", "six_value_heads"])
def model(request):
    config = CONFIG if request.param == "hybrid" else WIDE
    return config, random_params(config, 1, scale=0.15)


@pytest.fixture(scope="module")
def wide():
    """The variant whose graph has layers of different head counts (the padded layout's runs)."""
    return WIDE, random_params(WIDE, 1, scale=0.15)


@pytest.fixture(scope="module")
def pairs():
    return prompt_pairs(*make_pairs())  # lengths 9 and 6 (padded), a shared prefix of 2 positions


def _tokens():
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(0, 300, (2, 11)))
    return tokens, jnp.asarray(np.arange(11)[None] < np.array([[11], [8]]))


def test_a_linear_layer_split_per_value_head_sums_to_its_output(model):
    """The value heads' results sum to the mixer's output; the split model is the model; rows past
    a layer's own heads (the attention layer's 4 of 6) are zeros."""
    config, params = model
    tokens, valid = _tokens()
    split = sites.unchanged("head_result")
    tap = lambda r, _: (r.attn, r.head_result)  # noqa: E731
    h0 = embed(params, tokens, config)
    _, (a, results) = run_layers(params, h0, config, valid=valid, tap=tap, interventions=split)
    _, plain_a = run_layers(params, h0, config, valid=valid, tap=lambda r, _: r.attn)
    assert results.shape[3] == max(config.num_heads, config.linear_value_heads)
    np.testing.assert_allclose(results.sum(axis=3), a, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(a, plain_a, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(results[2, :, :, config.num_heads :], 0.0)  # layer 2 attends: 4 heads
    for layer in config.linear_layers:  # every value head writes
        assert np.all(np.abs(results[layer]).max(axis=(0, 1, 3)) > 1e-3)
    plain = forward(params, tokens, config, valid=valid)
    split_forward = forward(params, tokens, config, valid=valid, interventions=split)
    np.testing.assert_allclose(split_forward, plain, rtol=1e-5, atol=1e-5)


def _moved_results(params, config, site, head, position):
    """Layer 1's value heads' results `[B, T, Hv, D]` with `site`'s row `head` moved at `position`
    alone, less the unmoved ones."""
    tokens, valid = _tokens()
    B, T, D = tokens.shape + (config.hidden_size,)
    vector = np.zeros((B, T, config.split_heads, D), np.float32)
    vector[:, position, head] = np.random.default_rng(0).normal(size=(B, D)) * 3
    tap = lambda r, _: r.head_result  # noqa: E731
    h0 = embed(params, tokens, config)
    runs = [
        run_layers(params, h0, config, valid=valid, tap=tap, interventions=sites.add(site, 1, v, 1.0))[1][1]
        for v in (np.zeros_like(vector), vector)
    ]
    return np.asarray(runs[1] - runs[0])[:, :, : config.linear_value_heads]


@pytest.mark.parametrize("site", ["q_in", "k_in", "v_in"])
def test_a_value_head_reads_its_own_inputs_through_the_convolution(model, site):
    """A value head's query input reaches its own result at the convolution's K positions from
    there (the query and the gate are read where the state is read); its key and value inputs at
    every later position (written into the state, as beta and the decay its key input gives). No
    other head moves, not even the value heads sharing its key head."""
    config, params = model
    head, t, K = 1, 3, config.linear_conv_kernel
    changed = np.abs(_moved_results(params, config, site, head, t)).max(axis=(0, 3))  # [T, Hv]
    others = np.delete(changed, head, axis=1)
    assert others.max() == 0.0  # the group's other heads too: their key head's channels are their own
    reach = np.flatnonzero(changed[:, head] > 1e-6)
    expected = np.arange(t, t + K) if site == "q_in" else np.arange(t, 11)
    np.testing.assert_array_equal(reach, expected)


def test_the_graph_of_a_hybrid_names_a_linear_layers_heads_as_attentions(model):
    config, _ = model
    graph = EdgeGraph.of(config)
    H, Hv, L = config.num_heads, config.linear_value_heads, config.num_layers
    heads = [Hv if layer in config.linear_layers else H for layer in range(L)]
    assert graph.num_writers == 1 + sum(h + 1 for h in heads)
    assert graph.num_readers == sum(3 * h + 1 for h in heads) + 1
    assert graph.uniform == (Hv == H)
    assert graph.writer_name(graph.head_writer(1, Hv - 1)) == f"a1.h{Hv - 1}"
    assert graph.reader_name(graph.head_reader(3, Hv - 1, "k")) == f"a3.h{Hv - 1}<k>"
    edge = (graph.head_writer(0, Hv - 1), graph.head_reader(2, H - 1, "v"))
    assert graph.edge_index(f"a0.h{Hv - 1}->a2.h{H - 1}<v>") == edge
    padded = graph.padded
    for w in range(graph.num_writers):
        assert padded.writer_name(graph.padded_writers[w]) == graph.writer_name(w)
    for r in range(graph.num_readers):
        assert padded.reader_name(graph.padded_readers[r]) == graph.reader_name(r)
        assert graph.reader_index(graph.reader_name(r)) == r
    if Hv > H:
        with pytest.raises(ValueError, match=f"heads 0..{H - 1}"):
            graph.edge_index(f"a0.h0->a2.h{H}<q>")


def _by_hand(params, config, pairs, edge):
    """F(clean) - F(clean with reader v's input moved by a_corrupt[u] - a_clean[u]) for the edge
    'u->a{l}.h{j}<kind>', from the runs' writers read off taps and one forward under `sites.add`."""
    writer, reader = edge.split("->")
    layer, rest = reader[1:].split(".h")
    head, kind = int(rest.split("<")[0]), rest[-2]
    split = sites.unchanged("head_result")

    def writes(tokens):
        tap = lambda r, _: (r.head_result, r.mlp)  # noqa: E731
        h0 = embed(params, jnp.asarray(tokens), config)
        _, (results, mlps) = run_layers(params, h0, config, valid=pairs.valid, tap=tap, interventions=split)
        if writer == "input":
            return h0
        if writer.startswith("m"):
            return mlps[int(writer[1:])]
        l, h = writer[1:].split(".h")
        return results[int(l), :, :, int(h)]

    moved = np.zeros(pairs.clean.shape + (config.split_heads, config.hidden_size), np.float32)
    moved[:, :, head] = writes(pairs.corrupt) - writes(pairs.clean)

    def f(ivs):
        logits = forward(params, jnp.asarray(pairs.clean), config, valid=pairs.valid, interventions=ivs)
        last = logits[jnp.arange(2), pairs.last]
        labels = np.asarray(pairs.labels)
        return np.asarray(last[jnp.arange(2), labels[:, 0]] - last[jnp.arange(2), labels[:, 1]])

    return f(split) - f(sites.add(f"{kind}_in", int(layer), moved, 1.0))


def test_patching_an_edge_into_a_linear_layer_is_the_run_patched_by_hand(model, pairs):
    """An edge into a linear layer's q, k or v reader moves that value head's input alone, by what
    its writer writes in the corrupt run less the clean: `edge_effects` (from the reader's layer,
    after the shared prefix: the linear layers' states carried) and `patched_metric` (the whole
    run) against the forward moved by hand."""
    config, params = model
    Hv = config.linear_value_heads
    edges = [f"a0.h{Hv - 1}->a1.h2<k>", "m0->a3.h0<q>", "input->a1.h1<v>", f"m1->a3.h{Hv - 1}<v>"]
    effects = edge_effects(params, pairs, config, logit_difference, edges)
    *full, f_clean = patched_metric(params, pairs, config, logit_difference, [[e] for e in edges] + [[]])
    for i, edge in enumerate(edges):
        hand = _by_hand(params, config, pairs, edge)
        assert np.abs(hand).max() > 1e-4, edge
        np.testing.assert_allclose(effects[i], hand, rtol=1e-4, atol=1e-5, err_msg=edge)
        np.testing.assert_allclose(f_clean - full[i], hand, rtol=1e-4, atol=1e-5, err_msg=edge)


def _linear_conv(x, weight, state=None, *, ends=None):
    """`causal_conv` without its SiLU: linear in its inputs, the state kept as `causal_conv` keeps it."""
    B, T, C = x.shape
    K = weight.shape[-1]
    state = jnp.zeros((B, C, K - 1), x.dtype) if state is None else state
    history = jnp.concatenate([jnp.swapaxes(state, 1, 2), x], axis=1)
    y = sum(history[:, j : j + T] * weight[:, j] for j in range(K))
    if ends is None:
        kept = history[:, T:]
    else:
        kept = jax.vmap(lambda row, end: jax.lax.dynamic_slice_in_dim(row, end, K - 1, axis=0))(history, ends)
    return y, jnp.swapaxes(kept, 1, 2)


def made_linear(params, config, monkeypatch):
    """The hybrid made linear in every reader's input (for the test): no normalization (the
    layers', the final and each value head's gated one, whose gate goes too), a linear MLP and
    convolution, input-independent attention (zero query, key and gate weights) and
    input-independent linear attention queries, keys and gates (the l2-normalised q and k a
    constant direction, zero b and a weights): each linear layer's output is then linear in its
    value inputs."""
    flat = dataclasses.replace(config, rms_norm_eps=0.25)  # a config of its own: fresh compilations
    for module in (core_layer, core_model):
        monkeypatch.setattr(module, "norm", lambda x, w, config, bias=None, eps=None: x * w)
    monkeypatch.setattr(core_layer, "mlp_hidden", lambda p, x, config: x @ p["up"])
    monkeypatch.setattr(linear_attention, "gated_rms_norm", lambda x, gate, weight, eps: x * weight)
    monkeypatch.setattr(linear_attention, "l2_normalize", lambda x, eps=1e-6: jnp.ones_like(x) / np.sqrt(x.shape[-1]))
    monkeypatch.setattr(linear_attention, "causal_conv", _linear_conv)
    zeroed = ("q", "k", "attn_gate", "linear_b", "linear_a")
    layers = dict(params["layers"], **{name: 0 * params["layers"][name] for name in zeroed})
    # (without its norms a linear layer writes 1e-4: its output scaled to the attention's, 1e-2)
    layers["linear_out"] = 100 * layers["linear_out"]
    return dict(params, layers=layers), flat


def test_on_the_hybrid_made_linear_eap_is_exact_patching(wide, pairs, monkeypatch):
    """F linear in every reader's input: each edge's EAP score is its exact patching effect,
    edges into the linear layers' value readers among them; EAP-IG along each node's path is
    EAP, and a linear layer's head's out-edges sum to patching the head."""
    flat, config = made_linear(wide[1], wide[0], monkeypatch)
    graph = EdgeGraph.of(config)
    scores = edge_attribution(flat, pairs, config, logit_difference)
    edges = ranked_edges(scores.mean, graph)
    into_values = [e for e in edges if graph.reader_name(e[1]).endswith("<v>") and graph.reader_layer(e[1]) in (1, 3)]
    sample = np.concatenate([edges[:20], np.array(into_values[:10]), edges[:: max(1, len(edges) // 20)]])
    exact = edge_effects(flat, pairs, config, logit_difference, sample)
    estimated = scores.scores[:, sample[:, 0], sample[:, 1]].T
    atol = 1e-5 * float(np.max(np.abs(scores.f_clean)))
    assert np.max(np.abs(exact[20:30])) > 1000 * atol  # the linear layers' value readers carry effects
    np.testing.assert_allclose(estimated, exact, rtol=1e-4, atol=atol)
    along = edge_attribution(flat, pairs, config, logit_difference, Scoring("eap-ig-activations", FixedRule("left", 2)))
    np.testing.assert_allclose(along.scores, scores.scores, rtol=1e-4, atol=atol)
    head = graph.head_writer(1, config.linear_value_heads - 1)
    patched = patched_metric(
        flat, pairs, config, logit_difference, [graph.edge_mask & (np.arange(graph.num_writers) == head)[:, None]]
    )
    np.testing.assert_allclose(scores.f_clean - patched[0], scores.node_scores()[:, head], rtol=1e-4, atol=atol)


def test_circuits_and_atp_star_run_on_a_hybrid(wide, pairs, tmp_path):
    """A circuit of the hybrid's graph (the whole graph faithful, by construction), its scores
    saved and read back with the graph's linear layers, and AtP* of the MLPs against their exact
    effects' signs (its per-head kinds: `test_atp_star_linear_attention`)."""
    config, params = wide
    scores = edge_attribution(params, pairs, config, logit_difference, Scoring("eap", detail=["positions"]))
    np.testing.assert_allclose(scores.position_scores.sum(axis=-1), scores.scores, rtol=1e-5, atol=1e-7)
    path = scores.save(str(tmp_path / "scores.npz"))
    assert EdgeScores.load(path).graph == EdgeGraph.of(config)
    circuit = find_circuit(params, pairs, config, logit_difference, scores, CircuitSearch(size=30))
    assert len(circuit.edges) == 30 and np.isfinite(circuit.faithfulness)
    assert circuit.graph == EdgeGraph.of(config)
    figure = circuit_figure(circuit)  # a row per head of the layer with the most (the linear ones' 6)
    assert [t.get_text() for t in figure.axes[0].get_yticklabels()][-2:] == ["h5", "MLP"]
    star = atp_star(params, pairs, config, logit_difference, kinds=("mlps",), method="AtP")
    largest = star.top("mlps", 3)
    exact = node_effects(params, pairs, config, logit_difference, "mlps", largest).mean(axis=1)
    estimate = star.mlps.mean(axis=0)[largest[:, 0], largest[:, 1]]
    assert np.abs(exact).max() > 1e-3 and np.all(np.sign(estimate) == np.sign(exact))
