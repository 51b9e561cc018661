"""AtP* of nodes: the QK fix is exact where the rest of the model is linear, GradDrop at a layer is
the gradient of a run whose layer holds its clean contribution (built by hand), AtP of heads,
MLPs and neurons is EAP's node and neuron scores, and exact node patching is the patch built by
hand."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_edge_patching import made_linear
from test_edge_scores import pairs, params  # noqa: F401  (the tiny model's fixtures)
from tiny_qwen import CONFIG
from jaxdepth.analyses.edges.atp_star import NODE_KINDS, atp_star, missed_nodes, node_shape
from jaxdepth.analyses.edges.graph import EdgeGraph
from jaxdepth.analyses.edges.pairs import logit_difference
from jaxdepth.analyses.edges.patching import node_effects
from jaxdepth.analyses.edges.readers import final_metric
from jaxdepth.analyses.edges.scores import edge_attribution
from jaxdepth.core import sites
from jaxdepth.core.loops import run_layers
from jaxdepth.core.model import embed
from jaxdepth.core.execution import Execution
from jaxdepth.analyses.edges.scores import Scoring

GRAPH = EdgeGraph.of(CONFIG)
L, H = CONFIG.num_layers, CONFIG.num_heads


def every_node(kind, seq_len, layer=None):
    shape = node_shape(kind, CONFIG, seq_len)
    nodes = np.stack(np.unravel_index(np.arange(np.prod(shape)), shape), axis=1)
    return nodes if layer is None else nodes[nodes[:, 0] == layer]


def taps(params, tokens, pairs, config, interventions=None):
    tap = lambda r, _: dict(h=r.h, head_out=r.head_out, mlp=r.mlp, delta=r.delta)  # noqa: E731
    h0 = embed(params, jnp.asarray(tokens), config)
    return run_layers(params, h0, config, valid=pairs.valid, interventions=interventions, tap=tap)[1]


def test_qk_fixed_scores_of_queries_and_keys_are_exact_where_the_rest_is_linear(params, pairs, monkeypatch):
    """Layer 1 keeps its query and key weights; everything else is linear (`made_linear`): F is
    then affine in layer 1's head outputs, and the QK fix, which computes a patched query's or
    key's head output exactly, is exact patching. AtP's linear estimate is not."""
    flat, linear = made_linear(params, monkeypatch)
    layers = dict(flat["layers"])
    for name in ("q", "k"):
        layers[name] = np.array(layers[name])
        layers[name][1] = 4.0 * np.asarray(params["layers"][name][1])  # sharper attention
    model = dict(flat, layers=layers)
    fixed = atp_star(model, pairs, linear, logit_difference, kinds=("queries", "keys"), method="AtP+QK")
    plain = atp_star(model, pairs, linear, logit_difference, kinds=("queries", "keys"), method="AtP")
    T = pairs.clean.shape[1]
    atol = 1e-5 * float(np.max(np.abs(fixed.f_clean)))
    for kind in ("queries", "keys"):
        nodes = every_node(kind, T, layer=1)
        exact = node_effects(
            model, pairs, linear, logit_difference, kind, nodes, execution=Execution(chunk_size=len(nodes))
        ).T
        estimated = fixed.of(kind)[:, nodes[:, 0], nodes[:, 1], nodes[:, 2]]
        assert np.max(np.abs(exact)) > 0.05, kind
        np.testing.assert_allclose(estimated, exact, rtol=1e-4, atol=atol, err_msg=kind)
        linear_error = np.abs(plain.of(kind)[:, nodes[:, 0], nodes[:, 1], nodes[:, 2]] - exact)
        assert linear_error.max() > 100 * atol, kind  # the softmax's curvature: the fix matters here
        assert missed_nodes(estimated, exact, 5) == 0.0


def test_on_a_linear_model_atp_of_values_heads_mlps_and_neurons_is_exact(params, pairs, monkeypatch):
    flat, linear = made_linear(params, monkeypatch)
    kinds = ("values", "heads", "mlps", "neurons")
    scores = atp_star(flat, pairs, linear, logit_difference, kinds=kinds, method="AtP")
    atol = 1e-5 * float(np.max(np.abs(scores.f_clean)))
    T = pairs.clean.shape[1]
    for kind in kinds:
        nodes = np.concatenate([scores.top(kind, 6), every_node(kind, T)[:: 17 if kind != "neurons" else 41]])
        exact = node_effects(flat, pairs, linear, logit_difference, kind, nodes, execution=Execution(chunk_size=8)).T
        estimated = scores.of(kind)[(slice(None),) + tuple(nodes.T)]
        assert np.max(np.abs(exact)) > 0.05, kind
        np.testing.assert_allclose(estimated, exact, rtol=1e-4, atol=atol, err_msg=kind)


def test_atp_of_heads_mlps_and_neurons_is_eap_s_node_and_neuron_scores(params, pairs):
    """Independent code: EAP's scores of a writer's out-edges sum to gradient x activation
    difference at its output; a head's output through its slice of o_proj is linear in it."""
    atp = atp_star(params, pairs, CONFIG, logit_difference, kinds=("heads", "mlps", "neurons"), method="AtP+QK")
    eap = edge_attribution(params, pairs, CONFIG, logit_difference, Scoring(detail=["neurons"]))
    node = eap.node_scores()
    heads = np.array([[GRAPH.head_writer(layer, h) for h in range(H)] for layer in range(L)])
    mlps = np.array([GRAPH.mlp_writer(layer) for layer in range(L)])
    np.testing.assert_allclose(atp.heads.sum(-1), node[:, heads], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(atp.mlps.sum(-1), node[:, mlps], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(atp.neurons, eap.neuron_scores, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(atp.f_clean, eap.f_clean, atol=1e-5)  # two programs: rounding
    np.testing.assert_allclose(atp.f_corrupt, eap.f_corrupt, atol=1e-5)


def _dropped_by_hand(params, pairs, clean, layer, site, node_layer, positions, changed):
    """d/dε of F (per pair) in a run where layer `layer`'s delta is its clean value (a constant:
    no gradient passes through it) and `site` of `node_layer` is clean + ε (changed - clean) at
    `positions`, at ε = 0."""
    T = pairs.clean.shape[1]
    held = sites.replace("delta", layer, jnp.ones(T), clean["delta"][layer])
    base = clean["mlp" if site == "mlp_out" else site][node_layer]

    def f(eps):
        moved = sites.replace(site, node_layer, positions, base + eps * (changed - base))
        h, _ = run_layers(
            params, embed(params, pairs.clean, CONFIG), CONFIG, valid=pairs.valid, interventions=(held, moved)
        )
        return final_metric(params, logit_difference, h, pairs, CONFIG)

    return jax.jvp(f, (jnp.float32(0.0),), (jnp.float32(1.0),))[1]


def test_grad_drop_is_the_gradient_with_each_layer_held_by_hand(params, pairs):
    """AtP* of an MLP's output at a position and of a key (QK fix: the head's output with that
    key corrupt, from a patched run): sum over layers l of |dF/dε| in runs where layer l's
    contribution is replaced by its clean value, / (L - 1). Layer m of the node adds an exact 0."""
    T = pairs.clean.shape[1]
    star = atp_star(params, pairs, CONFIG, logit_difference, kinds=("keys", "mlps"))
    clean = taps(params, pairs.clean, pairs, CONFIG)
    corrupt = taps(params, pairs.corrupt, pairs, CONFIG)
    at = lambda t: (jnp.arange(T) == t).astype(jnp.float32)  # noqa: E731

    m, t = 1, 3  # the MLP of layer 1 at the corrupted position of pair 0
    per_layer = [
        _dropped_by_hand(params, pairs, clean, layer, "mlp_out", m, at(t), corrupt["mlp"][m]) for layer in range(L)
    ]
    assert np.all(np.asarray(per_layer[m]) == 0.0)
    np.testing.assert_allclose(star.mlps[:, m, t], np.sum(np.abs(per_layer), axis=0) / (L - 1), rtol=1e-4, atol=1e-6)

    m, head, t = 0, 1, 3  # the key of head 1 at position 3 in layer 0: the head's output with it corrupt
    where = np.zeros((L, 1, T, H, 1), bool)
    where[m, 0, t, head] = True
    k_in = jnp.broadcast_to(corrupt["h"][:, :, :, None], corrupt["h"].shape[:3] + (H, CONFIG.hidden_size))
    patched = taps(params, pairs.clean, pairs, CONFIG, sites.patch("k_in", k_in, where))["head_out"][m]
    per_layer = [
        _dropped_by_hand(params, pairs, clean, layer, "head_out", m, jnp.ones(T), patched) for layer in range(L)
    ]
    assert np.all(np.asarray(per_layer[m]) == 0.0)
    np.testing.assert_allclose(
        star.keys[:, m, head, t], np.sum(np.abs(per_layer), axis=0) / (L - 1), rtol=1e-4, atol=1e-6
    )


def test_grad_drop_of_a_last_layer_node_is_its_magnitude(params, pairs):
    """Nothing follows the last layer: every dropped layer before it leaves the gradient as it
    is, its own gives 0, and the score is |AtP+QK|."""
    star = atp_star(params, pairs, CONFIG, logit_difference, kinds=NODE_KINDS)
    qk = atp_star(params, pairs, CONFIG, logit_difference, kinds=NODE_KINDS, method="AtP+QK")
    assert star.method == "AtP*" and qk.method == "AtP+QK"
    for kind in NODE_KINDS:
        last = np.abs(qk.of(kind)[:, L - 1])
        assert last.max() > 1e-3, kind
        np.testing.assert_allclose(star.of(kind)[:, L - 1], last, rtol=1e-5, atol=1e-7, err_msg=kind)
        assert np.all(star.of(kind) >= 0)


def test_node_effects_are_the_patches_built_by_hand(params, pairs):
    """A query node: that head's query input (h_l) from the corrupt run at one position, every
    other head's and position's clean; an MLP node: its output at one position."""
    T = pairs.clean.shape[1]
    clean = taps(params, pairs.clean, pairs, CONFIG)
    corrupt = taps(params, pairs.corrupt, pairs, CONFIG)
    f_clean = final_metric(
        params,
        logit_difference,
        run_layers(params, embed(params, pairs.clean, CONFIG), CONFIG, valid=pairs.valid)[0],
        pairs,
        CONFIG,
    )

    def f(iv):
        h, _ = run_layers(params, embed(params, pairs.clean, CONFIG), CONFIG, valid=pairs.valid, interventions=iv)
        return np.asarray(f_clean - final_metric(params, logit_difference, h, pairs, CONFIG))

    layer, head, t = 2, 3, 5
    per_head = np.broadcast_to(np.asarray(clean["h"][layer])[:, :, None], (2, T, H, CONFIG.hidden_size)).copy()
    per_head[:, :, head] = np.asarray(corrupt["h"][layer])
    hand = f(sites.replace("q_in", layer, (np.arange(T) == t).astype(np.float32), per_head))
    np.testing.assert_allclose(
        node_effects(params, pairs, CONFIG, logit_difference, "queries", [(layer, head, t)])[0], hand, atol=1e-5
    )
    hand = f(sites.replace("mlp_out", layer, (np.arange(T) == t).astype(np.float32), corrupt["mlp"][layer]))
    np.testing.assert_allclose(
        node_effects(params, pairs, CONFIG, logit_difference, "mlps", [(layer, t)])[0], hand, atol=1e-5
    )
    assert np.max(np.abs(hand)) > 1e-3


def test_bad_requests_are_refused(params, pairs):
    with pytest.raises(ValueError, match="unknown node kind 'edges'"):
        atp_star(params, pairs, CONFIG, logit_difference, kinds=("edges",))
    with pytest.raises(
        ValueError, match=r"a node of keys is \(layer in 0..3, head in 0..3, position in 0..8\); got \[0, 4, 0\]"
    ):
        node_effects(params, pairs, CONFIG, logit_difference, "keys", [(0, H, 0)])
    with pytest.raises(ValueError, match="no nodes given"):
        node_effects(params, pairs, CONFIG, logit_difference, "mlps", [])
    scores = atp_star(params, pairs, CONFIG, logit_difference, kinds=("mlps",), method="AtP+QK")
    with pytest.raises(ValueError, match="no keys scores"):
        scores.of("keys")
    with pytest.raises(ValueError, match="k must be in"):
        missed_nodes(scores.mlps[0], scores.mlps[0], 0)


def test_a_mixtures_neurons_are_its_experts_units_exact_where_the_rest_is_linear(pairs, monkeypatch):  # noqa: F811
    """A mixture's neurons are (layer, expert, unit): an expert's hidden unit wherever the clean
    run routes to it, patched to its value on the corrupt input under the clean routing. With
    the norms linear, everything after the last layer's expert units is linear (its routing is
    computed before them), so AtP of those neurons is their exact patching effect."""
    from conftest import tiny_moe_config
    from jaxdepth.core import layer as core_layer, model as core_model
    from jaxdepth.core.experts import follow_routing
    from jaxdepth.core.model import random_params

    config = tiny_moe_config(rms_norm_eps=0.25)  # a config of its own: fresh compilations
    for module in (core_layer, core_model):
        monkeypatch.setattr(module, "norm", lambda x, w, config, bias=None: x * w)
    model = random_params(config, 4, scale=0.3)
    E, F, last = config.num_experts, config.intermediate_size, config.num_layers - 1
    scores = atp_star(model, pairs, config, logit_difference, kinds=("neurons",), method="AtP")
    assert scores.neurons.shape == (2, config.num_layers, E, F) and np.all(np.isfinite(scores.neurons))
    nodes = np.stack(np.unravel_index(np.arange(E * F), (E, F)), axis=1)
    nodes = np.concatenate([np.full((E * F, 1), last), nodes], axis=1)[::3]
    exact = node_effects(model, pairs, config, logit_difference, "neurons", nodes, execution=Execution(chunk_size=16)).T
    estimated = scores.neurons[:, nodes[:, 0], nodes[:, 1], nodes[:, 2]]
    assert np.max(np.abs(exact)) > 0.05
    atol = 1e-5 * float(np.max(np.abs(scores.f_clean)))
    np.testing.assert_allclose(estimated, exact, rtol=1e-4, atol=atol)
    # the clean run's choice, followed by the corrupt run: the same experts in the same slots
    tap = lambda r, _: r.expert_choice  # noqa: E731
    clean = run_layers(model, embed(model, pairs.clean, config), config, valid=pairs.valid, tap=tap)[1]
    forced = run_layers(
        model,
        embed(model, pairs.corrupt, config),
        config,
        valid=pairs.valid,
        interventions=follow_routing(clean),
        tap=tap,
    )[1]
    np.testing.assert_array_equal(forced, clean)
    with pytest.raises(ValueError, match="atp_star"):  # edge attribution's neurons are a dense MLP's
        edge_attribution(model, pairs, config, logit_difference, Scoring(detail=["neurons"]))
