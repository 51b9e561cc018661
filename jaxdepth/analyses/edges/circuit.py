"""Circuits: sets of edges chosen by their scores, checked by exact patching, and drawn.

A circuit is a set of edges kept clean; every other edge of the graph carries its ablated value,
the corrupt run's by default (`jaxdepth.analyses.edges.patching.circuit_metric`). Its faithfulness is
(F(circuit) - F(corrupt)) / (F(clean) - F(corrupt)) of the pairs' means.

`find_circuit` orders the edges by their mean score (`CircuitSearch(order='top')`), or as the
EAP-IG package's greedy search adds them (`'greedy'`: grown from the logits;
`jaxdepth.analyses.edges.selection`),
and evaluates the circuits of the first n edges for a grid of sizes n as one vmapped
computation; with a faithfulness target it takes the smallest size of the grid that reaches it,
then refines between that size and the one below (a second vmapped call), so the size is found
to within a few percent of the edges at the cost of two calls. Sizes are reported as the
circuit's live edges too (`Circuit.num_live`): under the corrupt ablation those on a path from
the input to the logits, under the others those on a path to the logits; the others are dead
and change nothing (`live_edges` says why), so a circuit and its `pruned()` form have the same
metric and faithfulness under the circuit's ablation.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np

from jaxdepth.analyses.edges.ablations import Patching
from jaxdepth.analyses.edges.graph import READER_KINDS, EdgeGraph
from jaxdepth.analyses.edges.pairs import PromptPairs, edge_metric
from jaxdepth.analyses.edges.patching import circuit_metric, faithfulness, patched_metric
from jaxdepth.analyses.edges.scores import EdgeScores, ranked_edges
from jaxdepth.analyses.edges.selection import SEARCHES, live_edges, ordered_edges
from jaxdepth.analyses.metrics import Metric
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.execution import Execution
from jaxdepth.core.saved_result import SavedResult

if TYPE_CHECKING:  # matplotlib is imported when a figure is drawn
    from matplotlib.figure import Figure

__all__ = [
    "Circuit",
    "CircuitSearch",
    "find_circuit",
    "top_circuits",
    "circuit_figure",
    "faithfulness_figure",
    "position_figure",
    "ranked_nodes",
    "ranked_members",
    "non_mlp_writers",
    "LEVELS",
]

LEVELS = ("edge", "node", "neuron")  # what a circuit is made of


@dataclasses.dataclass
class Circuit(SavedResult):
    """The chosen `edges [n, 2]` (writer, reader; best first) with their mean `scores [n]`, the
    circuit's `faithfulness`, and the curve it was chosen on: `sizes [k]` (top-n circuits
    evaluated) and their `curve [k]` of faithfulness. `target`: the faithfulness asked for
    (None when the size was given). `reached`: False when no circuit reached `target` (the
    circuit is then the whole graph, and `find_circuit` warned); True otherwise, and when the
    size was given. A caller that reports a circuit checks it: the command exits non-zero.
    `search`: how the edges were ordered ('top' or 'greedy'); `ablation`: what the edges outside
    the circuit carry (one of `ABLATIONS`); `live [n]`: whether each edge is live under it
    (`selection.live_edges`: under 'corrupt' on a path from the input to the logits through the
    circuit, under the others on a path to the logits); `live_sizes [k]`: the live edges of
    each evaluated circuit. `level` 'node': the circuit is `nodes` (writers, best
    first), `sizes` count nodes, and `edges` are all their out-edges (node by node). `level`
    'neuron': the circuit is `nodes` (the input and heads it keeps) and `units [m, 2]` (the MLP
    hidden units it keeps, (layer, unit)), `sizes` count both, and `edges` are the out-edges of
    its nodes and of every MLP with a unit in it."""

    edges: np.ndarray
    scores: np.ndarray
    faithfulness: float
    sizes: np.ndarray
    curve: np.ndarray
    num_layers: int
    num_heads: int
    target: Optional[float] = None
    reached: bool = True
    parallel: bool = False  # the graph's fields (`EdgeGraph.fields`): `graph` reads them
    post_norms: bool = False
    linear_layers: tuple = ()  # the layers of linear attention (`EdgeGraph.linear_layers`)
    linear_heads: int = 0  # their value heads (`EdgeGraph.linear_heads`)
    search: str = "top"
    live: Optional[np.ndarray] = None  # None in files saved before pruning was known: `live_mask` computes it
    live_sizes: Optional[np.ndarray] = None
    level: str = "edge"
    nodes: Optional[np.ndarray] = None  # [m] writers, best first, at levels 'node' and 'neuron'
    units: Optional[np.ndarray] = None  # [m, 2] (layer, unit) of the MLP hidden units kept, at level 'neuron'
    # None in files saved before the ablation was recorded: pruning then takes only the rule
    # that holds under every ablation (no path to the logits)
    ablation: Optional[str] = None

    @property
    def graph(self) -> EdgeGraph:
        """The graph of the model the circuit is of."""
        return EdgeGraph.of_result(self)

    @property
    def names(self) -> list[str]:
        """The edges' names, best first."""
        return [self.graph.edge_name(w, r) for w, r in self.edges]

    @property
    def mask(self) -> np.ndarray:
        """`[W, R]` bool: the circuit's edges."""
        return self.graph.edges_mask([tuple(e) for e in self.edges])

    @property
    def live_mask(self) -> np.ndarray:
        """`[W, R]` bool: the circuit's live edges under its ablation (`selection.live_edges`)."""
        return live_edges(self.mask, self.graph, self.ablation if self.ablation is not None else "zero")

    @property
    def num_live(self) -> int:
        """How many of the circuit's edges are live: its size with the dead ones pruned."""
        return int(self.live_mask.sum())

    def pruned(self) -> "Circuit":
        """The circuit without its dead edges: the same metric and faithfulness under the
        circuit's ablation (`selection.live_edges` proves it, rule by rule), to float32 rounding."""
        keep = self.live_mask[self.edges[:, 0], self.edges[:, 1]]
        return dataclasses.replace(
            self, edges=self.edges[keep], scores=self.scores[keep], live=np.ones(keep.sum(), bool)
        )


def top_circuits(scores: EdgeScores, sizes: Sequence[int], by: str = "abs", search: str = "top") -> list[np.ndarray]:
    """The `[W, R]` masks of the circuits of the first n edges, for each n of `sizes`, in the
    order of `search` ('top': by mean score; 'greedy': as the greedy search adds them)."""
    ranked = ordered_edges(scores.mean, scores.graph, by, search)
    return [_first(ranked, n, scores.graph) for n in sizes]


@dataclasses.dataclass(frozen=True, eq=False)
class CircuitSearch:
    """What circuit `find_circuit` looks for, how, and under what. `size`: the circuit's size (its
    first `size` edges; at level 'node' nodes, at 'neuron' members), or `target`: the fewest
    first edges (to within the refinement) whose faithfulness reaches it (in (0, 1], e.g. 0.8),
    one of the two. `order`: the order the circuits take the
    edges in ('top': by the scores, `by` 'abs' (|score|) or 'value'; 'greedy': grown from the
    logits, module docstring). `grid`: how many sizes, geometric from 1 to every edge, are
    evaluated at once. `level`: 'edge', 'node' (the first nodes by node score; the size then
    counts nodes, `order` 'top'), or 'neuron' (the input, the heads and the MLP hidden units
    ranked together by their scores, `ranked_members`; the scores need
    `Scoring(detail=['neurons'])`; every head and input outside the circuit is patched for all
    its readers, every unit outside it at its corrupt value). `patching`: the edges outside the
    circuit carry its `ablation`'s values, the ablation the scores were computed under, and
    its `interventions` act on every run, as in the scores (`edge_attribution(...,
    patching=...)`)."""

    size: Optional[int] = None
    target: Optional[float] = None
    order: str = "top"
    by: str = "abs"
    grid: int = 12
    level: str = "edge"
    patching: Patching = Patching()

    def __post_init__(self):
        if (self.size is None) == (self.target is None):
            raise ValueError("give the circuit's size or its faithfulness target, one of the two")
        if self.target is not None and not (np.isfinite(self.target) and 0 < self.target <= 1):
            raise ValueError(
                f"target must be a faithfulness in (0, 1], got {self.target!r}: faithfulness is the share of "
                "F(clean) - F(corrupt) that a circuit recovers, 1 for the whole graph"
            )
        if self.order not in SEARCHES:
            raise ValueError(f"search must be one of {SEARCHES}, got {self.order!r}")
        if self.by not in ("abs", "value"):
            raise ValueError(f"by must be 'abs' or 'value', got {self.by!r}")
        if self.level not in LEVELS:
            raise ValueError(f"level must be one of {LEVELS}, got {self.level!r}")
        if self.level != "edge" and self.order != "top":
            raise ValueError(
                f"the greedy search grows edges: a circuit of {self.level}s takes its members by their scores "
                "(search 'top')"
            )
        if not isinstance(self.patching, Patching):
            raise TypeError(f"patching must be a Patching, got {type(self.patching).__name__}")


def find_circuit(
    params,
    pairs: PromptPairs,
    config: ModelConfig,
    metric: Metric,
    scores: EdgeScores,
    search: CircuitSearch,
    *,
    execution: Execution = Execution(),
) -> Circuit:
    """A circuit of the first edges in the order of `search` (a `CircuitSearch`; its `order`
    'top': by `scores`, an `EdgeScores` of these pairs; 'greedy': grown from the logits, module
    docstring) at its `level`, under its `patching`: the first `search.size` edges, or the
    fewest first edges (to within the refinement) whose faithfulness reaches `search.target`
    (e.g. `CircuitSearch(target=0.8)`), of `search.grid` sizes evaluated at once. `metric`:
    the scores' (a `jaxdepth.Metric`).
    Scores of another kind of ablation than `search.patching`'s are refused. `execution`: how
    the patched runs run (`patched_metric`'s). Returns a `Circuit` (`edges [n, 2]`).

    A ValueError, before anything is computed (`CircuitSearch` refuses the rest), when `size` is
    not in 0..(the graph's edges). A target that no circuit reaches (rounding, with a target of
    1; or a faithfulness that is not finite) gives the whole graph with `reached` False, and a
    warning."""
    if not isinstance(search, CircuitSearch):
        raise TypeError(f"search must be a CircuitSearch, got {search!r}")
    metric = edge_metric(metric, "find_circuit", pairs)
    graph = EdgeGraph.of(config)
    if scores.graph != graph:
        raise ValueError(f"the scores are of another model's graph ({scores.graph}; this model's: {graph})")
    size, target, by, grid, level = search.size, search.target, search.by, search.grid, search.level
    ablation = search.patching.ablation
    if scores.ablation != ablation.kind:  # F(empty circuit) is `scores.f_corrupt`: of the scores' ablation
        raise ValueError(
            f"the scores were computed under a {scores.ablation!r} ablation and the circuit would patch under a "
            f"{ablation.kind!r} one: pass the scores' ablation (faithfulness divides by their F(clean) - F(ablated))"
        )
    taken = ordered_edges(scores.mean, graph, by, search.order)
    if level == "node":
        nodes = ranked_nodes(scores, by)
        total, first, unit = graph.num_writers, lambda n: _out_edges(nodes[:n], graph), "nodes"
    elif level == "neuron":
        if scores.neuron_scores is None:
            raise ValueError(
                "a circuit of neurons ranks MLP hidden units by their scores: score with Scoring(detail=['neurons'])"
            )
        if config.is_moe:  # its units patch at the MLP's hidden units, which a mixture routes per token
            raise ValueError(
                "a circuit of neurons of a mixture of experts is not implemented: its experts' units are scored "
                "(Scoring(detail=['neurons']), atp_star) and patched one at a time (node_effects)"
            )
        members = ranked_members(scores, by)
        total, first, unit = len(members), lambda n: _kept_members(members[:n], graph, config), "members"
        outside = lambda kept: graph.edge_mask & ~_out_edges(np.concatenate([kept[0], _mlp_writers(graph)]), graph)  # noqa: E731
    else:
        total, first, unit = graph.num_edges, lambda n: _first(taken, n, graph), "edges"
    if size is not None and not (isinstance(size, (int, np.integer)) and 0 <= size <= total):
        raise ValueError(f"size must be an integer in 0..{total} (the graph's {unit}), got {size!r}")

    def evaluate(ns):
        run = dict(patching=search.patching, execution=execution)
        if level == "neuron":  # the members outside: heads and input for all their readers, units
            kept = [first(n) for n in ns]
            sets, units = [outside(k) for k in kept], [~k[1] for k in kept]
            f = patched_metric(params, pairs, config, metric, sets, unit_sets=units, **run)
        else:
            f = circuit_metric(params, pairs, config, metric, [first(n) for n in ns], **run)
        return faithfulness(f, scores.f_clean, scores.f_corrupt)

    reached = True
    if size is not None:
        sizes = np.array([size])
        curve = evaluate(sizes)
        chosen = size
    else:
        sizes = np.unique(np.round(np.geomspace(1, total, grid)).astype(int))
        curve = evaluate(sizes)
        hits = np.flatnonzero(curve >= target)
        reached = bool(len(hits))
        chosen = int(sizes[hits[0]]) if reached else total
        if reached and hits[0] > 0:  # refine between the size below and the one that reached
            below = int(sizes[hits[0] - 1])
            finer = np.unique(np.linspace(below, chosen, grid).astype(int))[1:-1]
            if len(finer):
                finer_curve = evaluate(finer)
                sizes, curve = np.concatenate([sizes, finer]), np.concatenate([curve, finer_curve])
                order = np.argsort(sizes)
                sizes, curve = sizes[order], curve[order]
                passing = sizes[(curve >= target) & (sizes >= below)]
                chosen = int(passing.min())
        if not reached:  # say so rather than pass the whole graph off as the answer
            best = np.nanmax(curve) if np.isfinite(curve).any() else float("nan")
            warnings.warn(
                f"no circuit reaches faithfulness {target:g}: the best of the {len(sizes)} evaluated has "
                f"{best:.6g}; the circuit returned is the whole graph ({total} {unit}, faithfulness {curve[-1]:.6g}), "
                "with reached=False",
                RuntimeWarning,
                stacklevel=2,
            )
    kept = first(chosen)
    circuit_edges, writers, kept_nodes, kept_units = first, None, None, None
    if level == "node":
        writers = kept_nodes = nodes[:chosen]
    elif level == "neuron":  # its nodes, then the MLPs it keeps units of, with every out-edge of each
        writers_of = lambda kept: np.concatenate([kept[0], _mlp_writers(graph)[kept[1].any(axis=1)]])  # noqa: E731
        circuit_edges = lambda n: _out_edges(writers_of(first(n)), graph)  # noqa: E731
        writers, kept_nodes, kept_units = writers_of(kept), kept[0], np.argwhere(kept[1])
    if writers is not None:  # node by node, each node's best first
        chosen_edges = np.concatenate([taken[taken[:, 0] == w] for w in writers] or [np.zeros((0, 2), taken.dtype)])
    else:
        chosen_edges = taken[:chosen]
    live = live_edges(circuit_edges(chosen), graph, ablation)
    return Circuit(
        edges=chosen_edges,
        scores=scores.mean[chosen_edges[:, 0], chosen_edges[:, 1]].astype(np.float32),
        faithfulness=float(curve[np.flatnonzero(sizes == chosen)[0]]),
        sizes=sizes,
        curve=np.asarray(curve, np.float32),
        target=target,
        reached=reached,
        search=search.order,
        live=live[chosen_edges[:, 0], chosen_edges[:, 1]],
        live_sizes=np.array([live_edges(circuit_edges(n), graph, ablation).sum() for n in sizes], np.int64),
        level=level,
        nodes=kept_nodes,
        units=kept_units,
        ablation=ablation.kind,
        **graph.fields(),
    )


def ranked_members(scores: EdgeScores, by: str = "abs") -> np.ndarray:
    """`[M]` the members of a circuit of neurons, best first by their mean score over the pairs
    (`by` as `ranked_edges`; ties keep this order): an id m < N is the N-th writer that is not an
    MLP (`non_mlp_writers`: the input and the heads), scored by its node score; an id m >= N is
    the MLP hidden unit (layer, unit) = divmod(m - N, F), scored by its neuron score."""
    if by not in ("abs", "value"):
        raise ValueError(f"by must be 'abs' or 'value', got {by!r}")
    graph = scores.graph
    mean = np.concatenate(
        [scores.node_scores().mean(axis=0)[non_mlp_writers(graph)], scores.neuron_scores.mean(axis=0).ravel()]
    )
    return np.argsort(-(np.abs(mean) if by == "abs" else mean), kind="stable")


def non_mlp_writers(graph: EdgeGraph) -> np.ndarray:
    """The writers that are not MLPs (the input, the heads or attention layers), in the graph's order."""
    return np.setdiff1d(np.arange(graph.num_writers), _mlp_writers(graph))


def _mlp_writers(graph: EdgeGraph) -> np.ndarray:
    return np.array([graph.mlp_writer(layer) for layer in range(graph.num_layers)], np.int64)


def _kept_members(members: np.ndarray, graph: EdgeGraph, config: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """The writers (not MLPs) and the `[L, F]` mask of the MLP hidden units among `members`
    (`ranked_members`' ids), the writers in the members' order."""
    writers = non_mlp_writers(graph)
    N = len(writers)
    units = np.zeros(config.num_layers * config.intermediate_size, bool)
    units[members[members >= N] - N] = True
    return writers[members[members < N]], units.reshape(config.num_layers, config.intermediate_size)


def ranked_nodes(scores: EdgeScores, by: str = "abs") -> np.ndarray:
    """`[W]` the writers (nodes) best first by their mean node score (`EdgeScores.node_scores`,
    averaged over the pairs; `by` as `ranked_edges`); ties keep the graph's order."""
    if by not in ("abs", "value"):
        raise ValueError(f"by must be 'abs' or 'value', got {by!r}")
    mean = scores.node_scores().mean(axis=0)
    return np.argsort(-(np.abs(mean) if by == "abs" else mean), kind="stable")


def _out_edges(nodes: np.ndarray, graph: EdgeGraph) -> np.ndarray:
    """The `[W, R]` mask of every out-edge of `nodes`."""
    mask = np.zeros(graph.edge_mask.shape, bool)
    mask[nodes] = graph.edge_mask[nodes]
    return mask


def _first(order: np.ndarray, n: int, graph: EdgeGraph) -> np.ndarray:
    """The `[W, R]` mask of the first `n` edges of `order`."""
    mask = np.zeros(graph.edge_mask.shape, bool)
    mask[order[:n, 0], order[:n, 1]] = True
    return mask


# ----------------------------------------------------------------------------- the figure


NODE_FONT = 7  # points: the node labels' size, legible at the figure's printed size
# Points between the circles of neighbouring nodes. The arrows run in the gaps between the rows
# and the columns of nodes, each within `ROUTE_SPREAD` of a gap's middle: a gap of a circle's
# radius on either side of that band keeps every circle off every arrow that is not its own.
NODE_GAP = 4
ROUTE_SPREAD = 0.18  # of a step: how far an arrow may run from the middle of its gap
# Inches around the axes that constrained layout gives the title, tick labels, axis labels and
# the legend below: the figure is the axes' size plus these.
FIGURE_MARGINS = (1.2, 2.0)
MAX_ASPECT = 2.0  # the figure is at most twice as wide as high, or as high as wide


def _node_of(
    graph: EdgeGraph, writer: Optional[int] = None, reader: Optional[int] = None
) -> tuple[str, str, int, float]:
    """(name, label, column, row) of the node a writer or reader belongs to: a column per layer
    (0..L-1; the input in column -1, the logits in column L), its heads in rows 0..H-1, its MLP
    in row H, and, where a layer's attention is one writer (`EdgeGraph.post_norms`), that writer
    in row H + 1 (its heads' inputs stay at their heads' rows); the input and the logits in the
    middle row. The label is what the circle holds: the column names the layer."""
    H = graph.slots  # the most heads of any layer (a linear-attention layer's value heads may be more)
    name = graph.writer_name(writer) if writer is not None else graph.reader_name(reader).split("<")[0]
    if name in ("input", "logits"):
        return name, "in" if name == "input" else "out", -1 if name == "input" else graph.num_layers, (H - 1) / 2
    if name.startswith("m"):
        return name, "m", int(name[1:]), float(H)
    if ".h" not in name:  # a layer's attention as one writer
        return name, "a", int(name[1:]), float(H + 1)
    layer, head = name[1:].split(".h")
    return name, f"h{head}", int(layer), float(head)


def _route(u: tuple[int, float], v: tuple[int, float], spread: tuple[float, float]) -> np.ndarray:
    """`[k, 2]` the polyline of an arrow from the node at (column, row) `u` to the one at `v`,
    in grid units, through gaps only: out of u to the right, into the gap column beside it
    (x = column + 1/2), along it to the gap row next to u's row (y = row +- 1/2), along that
    row to the gap column before v, along it to v's row, and into v from the side. Gap columns
    and rows hold no node, and the two stubs run along a row between a node and its gap column,
    where no other node is; `spread` (dx, dy), each within +-`ROUTE_SPREAD`, moves the arrow
    within its gaps so that arrows side by side stay apart."""
    (a, y1), (b, y2) = u, v
    dx, dy = spread
    out_x = a + 0.5 + dx
    if b <= a + 1:  # v in the same column (an MLP after its heads) or the next: one gap column
        return np.array([(a, y1), (out_x, y1), (out_x, y2), (b, y2)], float)
    # the gap row next to u's row toward v (the input's and the logits' rows may be gap rows)
    lane = (np.floor(y1) + 0.5 if y2 >= y1 else np.ceil(y1) - 0.5) + dy
    in_x = b - 0.5 + dx
    return np.array([(a, y1), (out_x, y1), (out_x, lane), (in_x, lane), (in_x, y2), (b, y2)], float)


def _spread(i: int) -> tuple[float, float]:
    """Arrow i's offsets within its gaps: a low-discrepancy sequence in +-`ROUTE_SPREAD`, so
    arrows sharing a gap spread evenly over it."""
    golden = (np.sqrt(5) - 1) / 2
    return tuple(ROUTE_SPREAD * (2 * ((i * golden + shift) % 1.0) - 1) for shift in (0.0, 0.5))


def circuit_figure(circuit: Circuit, *, title: Optional[str] = None, max_edges: int = 200) -> Figure:
    """The circuit as a graph: a column per layer (the input left, the logits right), the
    layer's heads and MLP (and its attention where it is one writer, `EdgeGraph.post_norms`)
    in rows; its live edges (at most `max_edges`, the best; dead ones change nothing and are
    left out) as arrows coloured by the sign of their mean score (red raises F, blue lowers it)
    and as wide as its magnitude; an arrow into a head says which of its inputs it feeds (q, k
    or v) by its line style. Each node is a circle that holds its label (at `NODE_FONT`
    points). The arrows run in the gaps between the rows and columns of nodes (`_route`), so
    no circle lies on an arrow that neither starts nor ends at it; the figure is at most
    `MAX_ASPECT` times as wide as high (or high as wide), the rows or columns spread to make it
    so. The title gives the faithfulness of the whole circuit (every edge the figure names)."""
    from matplotlib.patches import FancyArrowPatch
    from matplotlib.path import Path

    from jaxdepth.analyses import drawing as d

    d.expect(circuit, Circuit, "circuit_figure")
    graph = circuit.graph
    live = circuit.live_mask[circuit.edges[:, 0], circuit.edges[:, 1]]  # dead edges change nothing: not drawn
    edges, scores = circuit.edges[live][:max_edges], circuit.scores[live][:max_edges]
    fig = d.new_figure(6.0, 6.0)
    ax = fig.add_subplot()
    nodes = {}
    for w, r in edges:
        for name, label, x, y in (_node_of(graph, writer=w), _node_of(graph, reader=r)):
            nodes[name] = (label, x, y)
    labels = []
    for name, (label, x, y) in nodes.items():
        labels.append(ax.text(x, y, label, ha="center", va="center", fontsize=NODE_FONT, zorder=4, gid=name))
    # The circles' diameter, in points, from the widest label's extent (a diagonal of its box):
    # text sizes are in points, whatever the figure's size.
    renderer = fig.canvas.get_renderer()
    extents = [t.get_window_extent(renderer) for t in labels]
    diagonal = max([np.hypot(e.width, e.height) for e in extents], default=0.0) * 72 / fig.dpi
    diameter = max(diagonal, NODE_FONT * 2) + 3
    # A step (node to node) holds a circle and, on each side of the arrows' band in the gap
    # between two nodes, a radius and half a gap: no circle reaches an arrow that passes it.
    step = (diameter + NODE_GAP) / (1 - 2 * ROUTE_SPREAD)
    rows = graph.slots + (2 if graph.post_norms else 1)
    x_range, y_range = (-1.7, graph.num_layers + 0.7), (-0.7, rows - 0.3)
    width = (x_range[1] - x_range[0]) * step / 72
    height = (y_range[1] - y_range[0]) * step / 72
    # Spread the shorter side until the figure's aspect is within MAX_ASPECT (margins included).
    width, height = width + FIGURE_MARGINS[0], height + FIGURE_MARGINS[1]
    width, height = max(width, height / MAX_ASPECT, 6.0), max(height, width / MAX_ASPECT, 4.0)
    fig.set_size_inches(width, height)
    if nodes:
        xy = np.array([(x, y) for _, x, y in nodes.values()])
        ax.scatter(xy[:, 0], xy[:, 1], s=diameter**2, color="white", edgecolor="black", linewidth=0.8, zorder=3)
    styles = {kind: style for kind, style in zip(READER_KINDS, ("solid", "dashed", "dotted"))}
    biggest = float(np.max(np.abs(scores))) if len(scores) else 1.0
    fig.canvas.draw()  # the axes' final size: the stubs end on the circles, whose size is in points
    unit = ax.transData.transform([(1, 0), (0, 0)])
    radius = (diameter / 2 + 1) * fig.dpi / 72 / (unit[0, 0] - unit[1, 0])  # in x grid units
    for i, ((w, r), score) in enumerate(zip(edges, scores)):
        u_name, _, a, y1 = _node_of(graph, writer=w)
        v_name, _, b, y2 = _node_of(graph, reader=r)
        reader_name = graph.reader_name(r)
        kind = reader_name[-2] if reader_name.endswith(">") else "q"
        points = _route((a, y1), (b, y2), _spread(i))
        points[0, 0] += radius  # from circle edge to circle edge (the stubs are horizontal)
        points[-1, 0] += radius if points[-2, 0] > b else -radius
        arrow = FancyArrowPatch(
            path=Path(points),
            arrowstyle="-|>",
            mutation_scale=6 + 4 * abs(score) / biggest,
            color="tab:red" if score > 0 else "tab:blue",
            lw=0.4 + 2.0 * abs(score) / biggest,
            alpha=0.6,
            linestyle=styles[kind],
            zorder=2,
            gid=f"{u_name}|{v_name}",
        )
        ax.add_patch(arrow)
    ax.set_xlim(*x_range)
    ax.set_ylim(*y_range)
    every = max(1, graph.num_layers // 15)
    layers = list(range(0, graph.num_layers, every))
    ax.set_xticks([-1] + layers + [graph.num_layers], ["input"] + [str(layer) for layer in layers] + ["logits"])
    row_names = [f"h{h}" for h in range(graph.slots)] + ["MLP"] + (["attn"] if graph.post_norms else [])
    ax.set_yticks(range(rows), row_names)
    ax.set_xlabel("layer")
    ax.set_ylabel("head, MLP" + (", attention (one writer)" if graph.post_norms else ""))
    for kind, style in styles.items():
        ax.plot([], [], color="gray", linestyle=style, label=f"into a head's {kind} input")
    ax.plot([], [], color="tab:red", label="raises F (score > 0)")
    ax.plot([], [], color="tab:blue", label="lowers F (score < 0)")
    fig.legend(loc="outside lower center", ncols=3, fontsize=8, frameon=False)  # below the axes: over no node
    shown = f"{len(edges)} of {int(live.sum())} live edges" if live.sum() > len(edges) else f"{len(edges)} live edges"
    if live.sum() < len(circuit.edges):
        shown += f" ({len(circuit.edges) - int(live.sum())} dead left out)"
    ax.set_title(
        title or f"Circuit of {len(circuit.edges)} edges, faithfulness {circuit.faithfulness:.2f}: {shown} drawn"
    )
    return fig


def faithfulness_figure(circuit: Circuit, *, title: Optional[str] = None) -> Figure:
    """Faithfulness of the circuits of the first n edges against n (log scale), the chosen size
    marked with its live edges."""
    from jaxdepth.analyses import drawing as d

    d.expect(circuit, Circuit, "faithfulness_figure")
    fig = d.new_figure(6, 4)
    ax = fig.add_subplot()
    ax.plot(circuit.sizes, circuit.curve, marker="o")
    edges = f"{len(circuit.edges)} edges ({circuit.num_live} live)"
    size, chosen, unit = len(circuit.edges), f"chosen: {edges}", "edges in the circuit"
    if circuit.level == "node":
        size, chosen, unit = len(circuit.nodes), f"chosen: {len(circuit.nodes)} nodes, {edges}", "nodes in the circuit"
    elif circuit.level == "neuron":
        size = len(circuit.nodes) + len(circuit.units)
        chosen = f"chosen: {len(circuit.nodes)} heads or input, {len(circuit.units)} MLP units, {edges}"
        unit = "members of the circuit (heads, input, MLP units)"
    ax.axvline(size, color="gray", linestyle="--", label=chosen)
    if circuit.target is not None:
        ax.axhline(circuit.target, color="tab:red", linestyle=":", label=f"target {circuit.target:g}")
    ax.set_xscale("log")
    ax.set_xlabel(f"{unit} (top n by score)" if circuit.search == "top" else f"{unit} (greedy)")
    ax.set_ylabel("faithfulness")
    ax.legend(frameon=False)
    ax.set_title(title or f"Faithfulness of the first-n circuits ({circuit.search}; exact patching)")
    return fig


def position_figure(
    scores: EdgeScores,
    *,
    edges=None,
    k: int = 30,
    labels: Optional[Sequence[str]] = None,
    title: Optional[str] = None,
) -> Figure:
    """A circuit laid out over the prompt's positions: one row per edge (`edges`: a `Circuit`,
    edge names or `(writer, reader)` pairs; default the `k` edges of largest mean |score|), one
    column per position, each cell the edge's mean score at that position over the pairs
    (`EdgeScores.position_scores`; red raises F, blue lowers it, one scale for all). `labels`:
    the positions' tokens as text (default their indices)."""
    from jaxdepth.analyses import drawing as d

    d.expect(scores, EdgeScores, "position_figure")
    graph, positions = scores.graph, scores._positions().mean(axis=0)  # [W, R, T]
    if edges is None:
        rows = ranked_edges(scores.mean, graph)[:k]
    elif isinstance(edges, Circuit):
        rows = edges.edges[:k]
    else:
        rows = np.array([graph.edge_index(e) if isinstance(e, str) else tuple(e) for e in edges]).reshape(-1, 2)
    T = positions.shape[-1]
    if labels is not None and len(labels) != T:
        raise ValueError(f"labels must name the {T} positions, got {len(labels)}")
    cells = positions[rows[:, 0], rows[:, 1]]  # [n, T]
    fig = d.new_figure(max(5.0, 1.5 + 0.35 * T), max(3.0, 1.0 + 0.22 * len(rows)))
    ax = fig.add_subplot()
    limit = float(np.max(np.abs(cells))) or 1.0
    image = ax.imshow(cells, cmap="RdBu_r", vmin=-limit, vmax=limit, aspect="auto", interpolation="nearest")
    ax.set_yticks(range(len(rows)), [graph.edge_name(w, r) for w, r in rows], fontsize=7)
    ax.set_xticks(range(T), list(labels) if labels is not None else [str(t) for t in range(T)], rotation=90, fontsize=7)
    ax.set_xlabel("position")
    fig.colorbar(image, ax=ax, label="mean score at the position")
    ax.set_title(title or f"{len(rows)} edges over the prompt's positions ({scores.method})")
    return fig
