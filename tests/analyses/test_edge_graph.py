"""The graph of writers and readers, and the runs over its edges on the core's split layer."""

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config
from tiny_qwen import CONFIG
from jaxdepth.analyses.edges.graph import EdgeGraph
from jaxdepth.analyses.edges.readers import edge_run, probe_readers, reader_probes
from jaxdepth.core.model import embed, forward, random_params

GRAPH = EdgeGraph.of(CONFIG)


def test_sizes_and_edge_count():
    L, H = CONFIG.num_layers, CONFIG.num_heads
    assert GRAPH.num_writers == 1 + L * (H + 1) and GRAPH.num_readers == L * (3 * H + 1) + 1
    # the input feeds every reader; layer l's heads feed its MLP and every later reader; its
    # MLP every later reader
    later = lambda l: (L - l - 1) * (3 * H + 1) + 1
    expected = GRAPH.num_readers + sum(H * (1 + later(l)) + later(l) for l in range(L))
    assert GRAPH.num_edges == expected


def test_names_round_trip():
    for w in range(GRAPH.num_writers):
        assert GRAPH.writer_index(GRAPH.writer_name(w)) == w
    for r in range(GRAPH.num_readers):
        assert GRAPH.reader_index(GRAPH.reader_name(r)) == r
    assert GRAPH.edge_index("a1.h2->a3.h0<v>") == (GRAPH.head_writer(1, 2), GRAPH.head_reader(3, 0, "v"))
    assert GRAPH.edge_name(*GRAPH.edge_index("m0->logits")) == "m0->logits"


@pytest.mark.parametrize(
    "name, message",
    [
        ("a1.h0->a1.h2<q>", "no edge"),  # a head does not feed its own layer's attention
        ("m1->m1", "no edge"),
        ("a9.h0->logits", "outside the model"),
        ("a0.h7->logits", "outside the model"),
        ("x->logits", "unknown writer"),
        ("a0.h0->a2.h1", "reads its query, key or value"),
        ("a0.h0", "writer->reader"),
    ],
)
def test_bad_edge_names_are_refused(name, message):
    with pytest.raises(ValueError, match=message):
        GRAPH.edge_index(name)


# Gemma 2's norms after the sublayers (a layer's attention one writer, after its norm), its
# embedding scale and 1 + w norm weights.
POST_NORMS = tiny_config(
    model_type="gemma2", post_norms=True, norm_offset=1.0, norm_scale_in_float32=True, embed_scale=32**0.5
)


@pytest.mark.parametrize("config", [CONFIG, tiny_config(), tiny_config(num_kv_heads=4, qk_norm=True), POST_NORMS])
def test_the_edge_runs_are_the_model(config):
    """With no reader changed, a run whose layers are split per head (zero probes at every
    reader) gives the model's logits, its writers sum to the residual stream (with norms after
    the sublayers too: there a layer's attention writes its output after the norm), and a run
    from a later boundary continues the run from 0."""
    params = random_params(config, 3, scale=0.2)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, config.vocab_size, (2, 8)))
    valid, last = jnp.ones((2, 8), bool), jnp.array([7, 7])
    probes = probe_readers(reader_probes(config, 2, 8), config.num_layers)
    run = edge_run(params, embed(params, tokens, config), valid, last, config, interventions=probes)
    np.testing.assert_allclose(run.logits, forward(params, tokens, config)[:, -1], rtol=1e-4, atol=1e-4)
    plain = edge_run(params, embed(params, tokens, config), valid, last, config)
    np.testing.assert_allclose(plain.writers, run.writers, rtol=1e-4, atol=1e-5)
    graph = EdgeGraph.of(config)
    per_layer = np.asarray(run.writers[1:]).reshape(config.num_layers, graph.writers_per_layer, 2, 8, -1).sum(1)
    stream = np.concatenate([run.writers[:1], run.writers[:1] + np.cumsum(per_layer, axis=0)])
    np.testing.assert_allclose(run.residuals, stream, rtol=1e-4, atol=1e-5)
    later = edge_run(params, run.residuals[2], valid, last, config, start=jnp.int32(2), interventions=probes)
    np.testing.assert_allclose(later.logits, run.logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(later.residuals[2], run.residuals[2])
    np.testing.assert_allclose(later.residuals[3:], run.residuals[3:], rtol=1e-5, atol=1e-5)


def test_the_graph_is_the_roles_the_sites_declare():
    """A layer's readers and writers are the sites whose role holds in it, in the order of the
    site table, a per-head role once per query head: the heads' q, k, v inputs and the MLP's
    input read; the heads' results (or, behind a norm after the attention, its one output) and
    the MLP's output write."""
    from jaxdepth.core.sites import SITE_TABLE

    H = CONFIG.num_heads
    reading = [site for site in SITE_TABLE if site.role is not None and site.role.acts == "reads"]
    assert [site.name for site in reading] == ["q_in", "k_in", "v_in", "mlp_in"]
    expected = [f"a1.h{h}<{site.role.tag}>" for site in reading if site.role.per_head for h in range(H)] + ["m1"]
    first = GRAPH.readers_per_layer
    assert [GRAPH.reader_name(r) for r in range(first, 2 * first)] == expected
    for post_norms, attention in ((False, "head_result"), (True, "attn_out")):
        graph = EdgeGraph(2, H, post_norms=post_norms)
        writing = [
            s.name for s in SITE_TABLE if s.role is not None and s.role.acts == "writes" and s.role.holds(post_norms)
        ]
        assert writing == [attention, "mlp_out"]
        heads = [f"a0.h{h}" for h in range(H)] if not post_norms else ["a0"]
        assert [graph.writer_name(w) for w in range(1, 1 + graph.writers_per_layer)] == heads + ["m0"]
