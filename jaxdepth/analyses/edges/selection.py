"""Which edges a circuit takes, and which of them can matter.

A circuit's edge carries the writer's output as the circuit run computes it; every other edge
carries its ablated value (`jaxdepth.analyses.edges.ablations`), a value fixed before the run:
the writer's output in the corrupt run, zero, or its mean. An edge is **dead** when removing it
from the circuit provably leaves the circuit's metric as it is; `live_edges` keeps the others.
Which edges are dead depends on the ablation:

- **No path to the logits** (dead under every ablation). Let U be the writers from which a path
  of circuit edges reaches the logits. The logits read their circuit edges, whose writers are in
  U, and fixed values; a writer of U computes from its readers' inputs, each the sum of circuit
  edges from writers that are then in U too, and of fixed values. So, in the order of
  computation, the metric is a function of the circuit edges into the logits and into the
  readers of U's writers alone, and an edge into a reader of a writer outside U enters none of
  them: patching it changes nothing the metric reads.
- **No path from the input** (dead under the corrupt ablation only). Under the corrupt ablation a
  writer that no path of circuit edges reaches from the input reads circuit edges from writers
  that are unreached too, and corrupt values: in the order of computation each such writer
  computes exactly its output in the corrupt run, so its circuit edges carry what they would
  carry patched. Under zero and mean ablations the argument fails: an unreached writer computes
  f(ablated inputs), which is not its ablated value (f of the means is not the mean of f, and
  f(0) is not 0: biases and norms see to that), so its edges carry values of their own, and
  removing them changes the metric.

So under the corrupt ablation the live edges are those on some path input -> ... -> logits, as
the EAP-IG package's `Graph.prune()` (formerly `prune_dead_nodes`; parentless and childless
nodes removed) keeps them, and under zero and mean ablations those on some path to the logits.
Pruned either way, the metric is the same up to float32 rounding (a patched reader reads
its run's residual plus the ablated value minus the writer's current output, and a pruned dead
writer's current output differs; under the zero ablation a reader fed almost nothing normalises
that residue, which its norm magnifies by up to 1/sqrt(eps)). The package prunes parentless
nodes under every ablation.

Two ways to order the edges, the circuits of a size n being the first n:
- `'top'`: by mean score (`scores.ranked_edges`), anywhere in the graph;
- `'greedy'` (the EAP-IG package's `apply_greedy`): grow from the logits, each step taking the
  best-scoring edge whose reader's writer is already in the circuit (the logits at first); the
  edge's writer then joins, and the edges into its readers become candidates. Every prefix is
  connected to the logits, so none of its edges is dead by the childless rule.
"""

from __future__ import annotations

import heapq

import numpy as np

from jaxdepth.analyses.edges.ablations import ABLATIONS, Ablation
from jaxdepth.analyses.edges.graph import EdgeGraph
from jaxdepth.analyses.edges.scores import ranked_edges

__all__ = ["SEARCHES", "live_edges", "greedy_edges", "ordered_edges"]

SEARCHES = ("top", "greedy")


def live_edges(mask: np.ndarray, graph: EdgeGraph, ablation="corrupt") -> np.ndarray:
    """`[W, R]` bool: the edges of `mask` that are live when the edges outside it carry
    `ablation`'s values (an `Ablation` or its kind, one of `ABLATIONS`): under 'corrupt' those on
    a path of `mask`'s edges from the input to the logits, under 'zero', 'mean' and
    'mean-per-position' those on a path to the logits (module docstring: removing the others
    leaves the metric as it is)."""
    mask = graph.edges_mask(np.asarray(mask, bool))
    feeds = graph.reader_writers
    nodes = graph.writer_nodes
    reached = _reached_from_input(mask, graph) if _ablation_kind(ablation) == "corrupt" else np.ones(len(nodes), bool)
    useful = np.zeros(graph.num_writers, bool)
    to_logits = feeds < 0
    for node in range(nodes.max(), -1, -1):
        for w in np.flatnonzero(nodes == node):
            into = to_logits | np.where(feeds >= 0, useful[np.maximum(feeds, 0)], False)
            useful[w] = np.any(mask[w] & into)
    into_useful = to_logits | np.where(feeds >= 0, useful[np.maximum(feeds, 0)], False)
    return mask & reached[:, None] & into_useful[None, :]


def _ablation_kind(ablation) -> str:
    """The kind (one of `ABLATIONS`) of `ablation`: an `Ablation`, or its kind as a string."""
    kind = ablation.kind if isinstance(ablation, Ablation) else ablation
    if kind not in ABLATIONS:
        raise ValueError(f"ablation must be an Ablation or one of {ABLATIONS}, got {ablation!r}")
    return kind


def _reached_from_input(mask: np.ndarray, graph: EdgeGraph) -> np.ndarray:
    """`[W]` bool: the writers a path of `mask`'s edges reaches from the input."""
    feeds, nodes = graph.reader_writers, graph.writer_nodes
    reached = np.zeros(graph.num_writers, bool)
    reached[0] = True
    # Edges run from earlier nodes to later ones: one pass in node order settles reachability.
    for node in range(1, nodes.max() + 1):
        for w in np.flatnonzero(nodes == node):
            reached[w] = np.any(mask[reached][:, feeds == w])
    return reached


def greedy_edges(scores: np.ndarray, graph: EdgeGraph, by: str = "abs", count: int | None = None) -> np.ndarray:
    """`[n, 2]` (writer, reader) in the order the greedy search adds them (module docstring), by
    `scores [W, R]` ('abs': |score|, 'value': score; ties by the graph's order), `count` of them
    (default: until no candidate is left, every edge connected to the logits)."""
    if by not in ("abs", "value"):
        raise ValueError(f"by must be 'abs' or 'value', got {by!r}")
    key = np.abs(scores) if by == "abs" else np.asarray(scores)
    feeds = graph.reader_writers
    readers_of = {w: np.flatnonzero(feeds == w) for w in np.unique(feeds[feeds >= 0])}
    edge_mask = graph.edge_mask
    heap: list = []

    def offer(readers):
        for r in readers:
            for w in np.flatnonzero(edge_mask[:, r]):
                # a min-heap: the best score first, then the graph's order (writer, reader)
                heapq.heappush(heap, (-float(key[w, r]), int(w), int(r)))

    offer([graph.logits_reader])
    joined = np.zeros(graph.num_writers, bool)
    order = []
    limit = graph.num_edges if count is None else count
    while heap and len(order) < limit:
        _, w, r = heapq.heappop(heap)
        order.append((w, r))
        if not joined[w]:
            joined[w] = True
            offer(readers_of.get(w, ()))
    return np.array(order, np.int64).reshape(-1, 2)


def ordered_edges(scores: np.ndarray, graph: EdgeGraph, by: str = "abs", search: str = "top") -> np.ndarray:
    """Every edge a circuit of `search` can take, in the order it takes them: `'top'` by score,
    `'greedy'` as the greedy search adds them (module docstring)."""
    if search not in SEARCHES:
        raise ValueError(f"search must be one of {SEARCHES}, got {search!r}")
    return ranked_edges(scores, graph, by) if search == "top" else greedy_edges(scores, graph, by)
