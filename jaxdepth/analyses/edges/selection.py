"""Which edges a circuit takes, and which of them can matter.

A circuit's edge carries the writer's output as the circuit run computes it; every other edge
the corrupt run's. So an edge whose writer no path of circuit edges reaches from the input
carries the corrupt value anyway (its writer computes from corrupt inputs only), and an edge
into a reader whose writer reaches the logits by no path of circuit edges changes nothing the
metric reads. Such edges are **dead**: removing them leaves the circuit's metric exactly as it
is. `live_edges` keeps the others: the edges on some path input -> ... -> logits, as the EAP-IG
package's `prune_dead_nodes` (childless, then parentless) keeps them.

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

from jaxdepth.analyses.edges.graph import EdgeGraph
from jaxdepth.analyses.edges.scores import ranked_edges

__all__ = ["SEARCHES", "live_edges", "greedy_edges", "ordered_edges"]

SEARCHES = ("top", "greedy")


def live_edges(mask: np.ndarray, graph: EdgeGraph) -> np.ndarray:
    """`[W, R]` bool: the edges of `mask` that lie on a path of `mask`'s edges from the input to
    the logits (module docstring); the others are dead."""
    mask = graph.edges_mask(np.asarray(mask, bool))
    feeds = graph.reader_writers
    nodes = graph.writer_nodes
    reached = np.zeros(graph.num_writers, bool)
    reached[0] = True
    # Edges run from earlier nodes to later ones: one pass in node order settles reachability.
    for node in range(1, nodes.max() + 1):
        for w in np.flatnonzero(nodes == node):
            reached[w] = np.any(mask[reached][:, feeds == w])
    useful = np.zeros(graph.num_writers, bool)
    to_logits = feeds < 0
    for node in range(nodes.max(), -1, -1):
        for w in np.flatnonzero(nodes == node):
            into = to_logits | np.where(feeds >= 0, useful[np.maximum(feeds, 0)], False)
            useful[w] = np.any(mask[w] & into)
    into_useful = to_logits | np.where(feeds >= 0, useful[np.maximum(feeds, 0)], False)
    return mask & reached[:, None] & into_useful[None, :]


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
