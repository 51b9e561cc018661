"""Circuits: `find_circuit` refuses an impossible target or size before computing anything, says
when no circuit reaches its target, and reaches a reachable one on the tiny model; the circuit
figure's labels fit their circles and nothing is clipped, and at 400 edges no circle lies on an
arrow that is not its own, its aspect is one a page holds and every text lies inside it."""

import itertools

import numpy as np
import pytest

from test_edge_scores import eap, pairs, params  # noqa: F401 (the edge tests' fixtures: the same tiny model and pairs)
from tiny_qwen import CONFIG
from jaxdepth.analyses.edges import circuit as circuit_module
from jaxdepth.analyses.edges import Circuit, EdgeGraph, circuit_figure, find_circuit, greedy_edges, logit_difference
from jaxdepth.analyses.edges.circuit import CircuitSearch

GRAPH = EdgeGraph.of(CONFIG)


def test_an_impossible_target_or_size_is_refused_before_anything_runs(pairs, eap, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("a circuit was evaluated")

    monkeypatch.setattr(circuit_module, "circuit_metric", never)
    for target in (1.5, 0.0, -0.2, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"target must be a faithfulness in \(0, 1\]"):
            find_circuit(None, pairs, CONFIG, logit_difference, eap, CircuitSearch(target=target))
    for size in (-1, GRAPH.num_edges + 1, 2.5):
        with pytest.raises(ValueError, match=rf"size must be an integer in 0..{GRAPH.num_edges}"):
            find_circuit(None, pairs, CONFIG, logit_difference, eap, CircuitSearch(size=size))


def test_a_target_no_circuit_reaches_is_reported_not_reached(pairs, eap, monkeypatch):
    """Every circuit (the whole graph too) recovers half of F(clean) - F(corrupt) here: the
    circuit returned is the whole graph, marked not reached, with a warning."""
    half = lambda params, pairs, config, metric, circuits, **kw: np.stack(
        [(eap.f_clean + eap.f_corrupt) / 2 for _ in circuits]
    )
    monkeypatch.setattr(circuit_module, "circuit_metric", half)
    with pytest.warns(
        RuntimeWarning, match="no circuit reaches faithfulness 0.8: the best of the 12 evaluated has 0.5"
    ):
        circuit = find_circuit(None, pairs, CONFIG, logit_difference, eap, CircuitSearch(target=0.8))
    assert not circuit.reached and len(circuit.edges) == GRAPH.num_edges and circuit.faithfulness == pytest.approx(0.5)
    circuit = find_circuit(None, pairs, CONFIG, logit_difference, eap, CircuitSearch(target=0.4))
    assert circuit.reached and len(circuit.edges) == 1  # the smallest circuit of the grid reaches it
    assert find_circuit(None, pairs, CONFIG, logit_difference, eap, CircuitSearch(size=3)).reached


def test_a_reachable_target_is_reached_by_the_fewest_edges_evaluated(params, pairs, eap, tmp_path):
    circuit = find_circuit(params, pairs, CONFIG, logit_difference, eap, CircuitSearch(target=0.6))
    assert circuit.reached and circuit.faithfulness >= 0.6
    assert np.all(
        circuit.curve[circuit.sizes < len(circuit.edges)] < 0.6
    )  # every smaller circuit evaluated falls short
    assert 0 < np.sum(circuit.sizes < len(circuit.edges)) and len(circuit.edges) < GRAPH.num_edges
    back = Circuit.load(circuit.save(str(tmp_path / "circuit.npz")))
    assert back.reached and back.target == 0.6


# ----------------------------------------------------------------------------- the figure


def crowded_circuit(num_layers: int, num_heads: int, post_norms: bool = False) -> Circuit:
    """Edges among every node of the first and the last two layers, and from the input to the
    logits: neighbouring heads, neighbouring layers, the input and the logits, all drawn (with
    `post_norms`, each layer's attention as one writer, beside its heads' inputs)."""
    graph = EdgeGraph(num_layers, num_heads, post_norms=post_norms)
    layers = sorted({0, 1, num_layers - 2, num_layers - 1} & set(range(num_layers)))
    writers = [w for l in layers for w in graph.layer_attention_writers(l)] + [graph.mlp_writer(l) for l in layers]
    readers = [graph.mlp_reader(l) for l in layers] + [graph.logits_reader]
    edges = [(w, r) for w, r in itertools.product([0] + writers, readers) if graph.edge_mask[w, r]]
    edges += [(0, graph.head_reader(l, h, "q")) for l in layers for h in range(num_heads)]
    scores = np.linspace(1.0, -0.5, len(edges)).astype(np.float32)
    return Circuit(
        edges=np.array(edges),
        scores=scores,
        faithfulness=0.8,
        sizes=np.array([len(edges)]),
        curve=np.array([0.8], np.float32),
        **graph.fields(),
    )


@pytest.mark.parametrize(
    "num_layers, num_heads, post_norms", [(30, 9, False), (4, 4, False), (24, 14, False), (26, 8, True)]
)
def test_every_node_label_fits_its_circle_and_no_circle_is_clipped_or_overlaps(num_layers, num_heads, post_norms):
    """SmolLM2's graph (30 layers, 9 heads), the tiny model's, a wide one (labels 'a23.h13'), and
    Gemma 2 2B's (26 layers, 8 heads; norms after the sublayers: each layer's attention a node
    'a{l}' of its own, left of the MLPs)."""
    circuit = crowded_circuit(num_layers, num_heads, post_norms)
    fig = circuit_figure(circuit, max_edges=len(circuit.edges))
    fig.canvas.draw()
    ax = fig.axes[0]
    scale = fig.dpi / 72  # pixels a point
    circles = [
        (center, np.sqrt(size) / 2 * scale)
        for collection in ax.collections
        for center, size in zip(
            ax.transData.transform(collection.get_offsets()),
            np.broadcast_to(collection.get_sizes(), len(collection.get_offsets())),
        )
    ]
    labels = [t for t in ax.texts if t.get_text()]
    assert len(labels) == len(circles) == len({t.get_gid() for t in labels}) > 4 * num_heads
    box = ax.get_window_extent()
    for label in labels:
        assert label.get_fontsize() >= 7
        extent = label.get_window_extent()
        center, radius = min(circles, key=lambda c: np.hypot(*(c[0] - ax.transData.transform(label.get_position()))))
        corners = np.array([[x, y] for x in (extent.x0, extent.x1) for y in (extent.y0, extent.y1)])
        assert np.all(np.hypot(*(corners - center).T) <= radius), f"{label.get_text()!r} spills out of its circle"
        assert box.x0 <= center[0] - radius and center[0] + radius <= box.x1, f"{label.get_text()!r} is clipped"
        assert box.y0 <= center[1] - radius and center[1] + radius <= box.y1, f"{label.get_text()!r} is clipped"
    centers = np.array([c for c, _ in circles])
    gaps = np.hypot(*(centers[:, None] - centers[None]).transpose(2, 0, 1)) + np.eye(len(centers)) * 1e9
    assert gaps.min() >= 2 * circles[0][1], "two circles overlap"


def connected_circuit(num_layers: int, num_heads: int, size: int, post_norms: bool = False) -> Circuit:
    """`size` edges grown greedily from the logits on random scores: every edge has a path to
    the logits, so under the zero ablation every edge is live and drawn."""
    graph = EdgeGraph(num_layers, num_heads, post_norms=post_norms)
    scores = np.random.default_rng(0).normal(size=graph.edge_mask.shape) * graph.edge_mask
    edges = greedy_edges(scores, graph, count=size)
    return Circuit(
        edges=edges,
        scores=scores[edges[:, 0], edges[:, 1]].astype(np.float32),
        faithfulness=0.8,
        sizes=np.array([size]),
        curve=np.array([0.8], np.float32),
        ablation="zero",
        **graph.fields(),
    )


def _distance_to_polyline(point: np.ndarray, vertices: np.ndarray) -> float:
    a, b = vertices[:-1], vertices[1:]
    along = np.clip(
        np.einsum("ij,ij->i", point - a, b - a) / np.maximum(np.einsum("ij,ij->i", b - a, b - a), 1e-12), 0, 1
    )
    return float(np.min(np.hypot(*(a + along[:, None] * (b - a) - point).T)))


@pytest.mark.parametrize("num_layers, num_heads, post_norms", [(30, 9, False), (26, 8, True)])
def test_a_circuit_of_400_edges_keeps_every_node_off_every_foreign_arrow(num_layers, num_heads, post_norms):
    """SmolLM2's graph and Gemma 2 2B's: the arrows run between the rows and columns of nodes."""
    circuit = connected_circuit(num_layers, num_heads, 400, post_norms)
    assert circuit.num_live == 400
    fig = circuit_figure(circuit, max_edges=400)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    width, height = fig.get_size_inches()
    assert 0.5 <= width / height <= 2.0, f"{width:.1f} x {height:.1f} inches"
    ax = fig.axes[0]
    (radius,) = {np.sqrt(s) / 2 * fig.dpi / 72 for s in ax.collections[0].get_sizes()}
    nodes = {t.get_gid(): ax.transData.transform(t.get_position()) for t in ax.texts}
    arrows = [p for p in ax.patches if p.get_gid() and "|" in p.get_gid()]
    assert len(arrows) == 400
    for arrow in arrows:
        own = set(arrow.get_gid().split("|"))
        path = arrow.get_transform().transform_path(arrow.get_path())  # display coordinates, in pixels
        for polygon in path.to_polygons(closed_only=False):
            for name, center in nodes.items():
                if name not in own:
                    gap = _distance_to_polyline(center, polygon)
                    assert gap > radius, (
                        f"{name} lies on the arrow {arrow.get_gid()} ({gap:.1f} px, radius {radius:.1f})"
                    )
    texts = [
        t for t in fig.findobj(lambda a: hasattr(a, "get_text") and hasattr(a, "get_window_extent")) if t.get_text()
    ]
    assert len(texts) > len(nodes)
    box = fig.bbox
    for text in texts:
        extent = text.get_window_extent(renderer)
        inside = box.x0 <= extent.x0 and extent.x1 <= box.x1 and box.y0 <= extent.y0 and extent.y1 <= box.y1
        assert inside, f"{text.get_text()!r} lies outside the figure"
