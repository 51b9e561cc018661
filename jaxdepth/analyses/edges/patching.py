"""Exact edge patching: the metric when exactly a given set of edges carries the corrupt values,
for many edges or circuits as one vmapped computation.

Patching edge u -> v means that reader v reads u's output from the corrupt run instead of u's
output in this run, and nothing else changes: the other readers of u read what u writes. With a
set of edges patched, every patched edge does so in the same run
(`jaxdepth.analyses.edges.readers.patch_edges`: a patched edge upstream changes what later writers
write, and their other edges carry that). Every function takes `interventions`
(`jaxdepth.core.sites`; the edge functions as a `Patching`'s, with what a patched edge
carries), which act on the clean, the corrupt and every patched run. The metric is a
`jaxdepth.Metric` (`jaxdepth.analyses.edges.pairs`), and every function takes how it runs as
one `jaxdepth.Execution` (`chunk_size` runs vmapped at once, `memory_budget`, `progress`).

- `edge_effects`: each edge patched alone, F(clean) - F(patched) per pair: what EAP's score
  of the edge estimates (the same sign). An edge into a reader of layer l changes nothing
  before layer l, so each edge's run starts there, from the clean residual h_l.
- `patched_metric`: F with each of several edge sets patched.
- `node_effects`: each node (a head's query, key or value at a position, a head's or an MLP's
  output at a position, an MLP hidden unit) patched alone, F(clean) - F(patched): what AtP
  (`jaxdepth.analyses.edges.atp_star`) estimates; `neuron_effects`: hidden units, what their
  neuron scores estimate (every reader of the MLP reads the unit's corrupt value).
- `circuit_metric`, `faithfulness`: a circuit is a set of edges kept clean; its metric is F with
  every other edge patched, and its faithfulness (F(circuit) - F(corrupt)) / (F(clean) - F(corrupt)):
  1 for the whole graph, 0 for the empty circuit.
"""

from __future__ import annotations

from functools import partial
import jax
import jax.numpy as jnp
import numpy as np

from jaxdepth.analyses.edges.graph import EdgeGraph
from jaxdepth.analyses.edges.pairs import PromptPairs, edge_metric
from jaxdepth.analyses.edges.ablations import Patching
from jaxdepth.analyses.edges.readers import (
    check_interventions,
    edge_run,
    final_metric,
    move_reader,
    patched_sets,
    run_metric,
)
from jaxdepth.analyses.edges.atp_star import (
    PATCH_SITE,
    node_index,
    node_shape,
    refuse_mixed_neurons,
)
from jaxdepth.analyses.edges.scores import expert_units_on, hidden_units, pair_runs, suffix_run, with_clean_logits
from jaxdepth.analyses.metrics import Metric
from jaxdepth.core import sites
from jaxdepth.core.compilation import jit
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.execution import Execution, in_chunks
from jaxdepth.core.loops import run_layers
from jaxdepth.core.model import embed
from jaxdepth.core.sweep import member_bytes

__all__ = [
    "edge_effects",
    "patched_metric",
    "circuit_metric",
    "faithfulness",
    "neuron_effects",
    "node_effects",
]

MAX_CHUNK = 16


@partial(jit, static_argnames=("config", "metric"))
def _single_edges(params, pairs: PromptPairs, prefix, start, h_start, edges, delta, interventions, *, config, metric):
    """F `[c, B]` with edge (writers[i], readers[i]) of `edges = (writers, readers, at)` patched
    at the positions `at[i]` (`[c, T]` bool, positions after the shared prefix), for edges whose
    readers lie in layer `start` or later (the run starts from the clean layer input `h_start`
    there)."""

    graph = EdgeGraph.of(config)

    def one(w, r, at):
        ivs = (interventions, move_reader(graph, r, delta[w] * at[None, :, None].astype(delta.dtype)))
        run = edge_run(params, h_start, pairs.valid, pairs.last, config, start=start, interventions=ivs, prefix=prefix)
        return run_metric(params, metric, run, pairs, config)

    return jax.vmap(one)(*edges)


def edge_effects(
    params,
    pairs: PromptPairs,
    config: ModelConfig,
    metric: Metric,
    edges,
    *,
    positions=None,
    patching: Patching = Patching(),
    execution: Execution = Execution(),
) -> np.ndarray:
    """`[n, B]`: F(clean) - F(clean with edge i alone patched), per pair, for each of `edges`
    (names, `(writer, reader)` pairs, or an `[n, 2]` array as `ranked_edges` gives).
    `positions`: None (each edge patched at every position), or one position per edge (counted
    over all positions, as `EdgeScores.position_scores` and `top_positions` count them): edge i
    patched at `positions[i]` alone, what its per-position score estimates (an effect before
    the pairs' shared prefix ends, or past a pair's last position, is 0 up to rounding).
    `patching`: what a patched edge carries (its `ablation`, `jaxdepth.analyses.edges.ablations`;
    default the corrupt run's values) and the `interventions` on every run. Edges run
    `execution.chunk_size` at a time (vmapped; default what the memory allows), sorted by
    their readers' layers, each chunk from the layer of its first reader on."""
    graph = EdgeGraph.of(config)
    metric = edge_metric(metric, "edge_effects", pairs)
    ablation, interventions = patching.ablation, patching.interventions
    pairs.check(config, metric)
    check_interventions(interventions, graph)
    edges = _edge_indices(edges, graph)
    T = pairs.clean.shape[1]
    if positions is not None:
        positions = np.asarray(positions)
        if positions.shape != (len(edges),) or not np.issubdtype(positions.dtype, np.integer):
            raise ValueError(f"positions must be one integer position per edge ({len(edges)}), got {positions!r}")
        if np.any((positions < 0) | (positions >= T)):
            raise ValueError(f"positions must lie in 0..{T - 1} (the pairs' {T} positions), got {positions.tolist()}")
    clean, corrupt = pair_runs(params, pairs, config, interventions)
    pairs = with_clean_logits(params, pairs, clean.final, config, metric, "edge_effects")
    P, prefix = suffix_run(params, pairs, clean, config, metric, interventions, ablation)
    delta = (ablation.writers(graph, pairs, corrupt, config.hidden_size) - clean.writers)[:, :, P:]
    f_clean = run_metric(params, metric, clean, pairs, config, clean=True)
    chunk = _chunk(config, pairs, P, len(edges), execution)
    # Sorted by their readers' layers, the edges run in chunks that start at their first
    # reader's layer: the layers before it are the clean run's. The layer is data (one
    # compiled program for every chunk).
    order = np.argsort([graph.reader_layer(r) for r in edges[:, 1]], kind="stable")

    def run(part):  # part: indices of edges, in `order`
        w, r = (jnp.asarray(edges[part, k], jnp.int32) for k in (0, 1))
        at = np.ones((len(part), T - P), bool) if positions is None else np.arange(P, T) == positions[part, None]
        layer = graph.reader_layer(edges[part[0], 1])
        h = clean.residuals[layer][:, P:]
        f = _single_edges(
            params,
            pairs,
            prefix,
            jnp.int32(layer),
            h,
            (w, r, jnp.asarray(at)),
            delta,
            interventions,
            config=config,
            metric=metric,
        )
        return f_clean[None] - f

    out = np.zeros((len(edges), len(pairs)), np.float32)
    out[order] = in_chunks(run, order, chunk, execution, "exact edge patching (chunks)")
    return out


def _node_where(kind: str, node, config: ModelConfig, seq_len: int, choice=None):
    """Where `sites.patch` patches node `node` of `kind` (`atp_star.NODE_KINDS`): one row per
    layer, true at the node alone (a mixture's neuron: in the slots of the tokens `choice`, the
    clean run's `[L, B, T, k]`, routes to its expert)."""
    L, H, F = config.num_layers, config.split_heads, config.intermediate_size
    hot = lambda n, i: jnp.arange(n) == i  # noqa: E731
    layer = hot(L, node[0])
    if kind == "neurons" and config.is_moe:  # [L, B, T, k, F]: the expert's unit wherever it runs
        return layer[:, None, None, None, None] & (choice == node[1])[..., None] & hot(F, node[2])
    if kind == "neurons":  # [L, 1, 1, F]: the unit at every position
        return layer[:, None, None, None] & hot(F, node[1])[None, None, None, :]
    if kind == "mlps":  # [L, 1, T, 1]
        return layer[:, None, None, None] & hot(seq_len, node[1])[None, None, :, None]
    # [L, 1, T, H, 1]: one head at one position
    return (
        layer[:, None, None, None, None]
        & hot(seq_len, node[2])[None, None, :, None, None]
        & hot(H, node[1])[None, None, None, :, None]
    )


@partial(jit, static_argnames=("config", "metric", "kind"))
def _node_runs(params, pairs: PromptPairs, nodes, cached, choice, interventions, *, config, metric, kind):
    """F `[c, B]` with node `nodes[i]` of `kind` at its corrupt value (`cached`, every layer's
    values at the kind's site in the corrupt run; `choice` the clean run's experts, or None)."""
    h0 = embed(params, pairs.clean, config)
    site = "expert_hidden" if kind == "neurons" and config.is_moe else PATCH_SITE[kind]

    def one(node):
        where = _node_where(kind, node, config, pairs.clean.shape[1], choice)
        ivs = (interventions, sites.patch(site, cached, where))
        h, _ = run_layers(params, h0, config, valid=pairs.valid, interventions=ivs)
        return final_metric(params, metric, h, pairs, config)

    return jax.vmap(one)(nodes)


def _corrupt_values(params, pairs: PromptPairs, config: ModelConfig, kind: str, interventions, choice=None):
    """`[L, B, T, ...]`: what `kind`'s site holds in the corrupt run (a head's query, key and
    value inputs: the layer's input h_l, as each head reads it; a mixture's neurons: the
    experts' units on the corrupt input under the clean routing `choice`)."""
    if kind == "neurons" and config.is_moe:
        return expert_units_on(params, pairs.corrupt, pairs.valid, choice, config, interventions)
    tap = {
        "heads": lambda r, _: r.head_out,
        "mlps": lambda r, _: r.mlp,
        "neurons": lambda r, _: r.mlp_hidden,
    }.get(kind, lambda r, _: jnp.broadcast_to(r.h[:, :, None], r.h.shape[:2] + (config.split_heads, r.h.shape[-1])))
    h0 = embed(params, pairs.corrupt, config)
    return run_layers(params, h0, config, valid=pairs.valid, interventions=interventions, tap=tap)[1]


def _clean_choice(params, pairs: PromptPairs, config: ModelConfig, interventions):
    """`[L, B, T, k]`: the experts the clean run routes each token to, at every layer."""
    tap = lambda r, _: r.expert_choice  # noqa: E731
    h0 = embed(params, pairs.clean, config)
    return run_layers(params, h0, config, valid=pairs.valid, interventions=interventions, tap=tap)[1]


def node_effects(
    params,
    pairs: PromptPairs,
    config: ModelConfig,
    metric: Metric,
    kind: str,
    nodes,
    *,
    interventions=None,
    execution: Execution = Execution(),
) -> np.ndarray:
    """`[n, B]`: F(clean) - F(clean with node `nodes[i]` of `kind` at its value in the corrupt
    run), per pair: the exact effect that AtP (`atp_star`) estimates. Nodes as
    `jaxdepth.analyses.edges.atp_star` indexes them: (layer, head, position) for queries, keys,
    values and heads, (layer, position) for MLPs, (layer, unit) for neurons (a hidden unit at
    every position; a mixture's: (layer, expert, unit), the expert's unit wherever the clean run
    routes to it, at its value on the corrupt input under the clean routing). In a model with
    linear-attention layers a linear layer's heads are its value heads, its queries, keys and
    values their inputs (`atp_star`'s module docstring). `interventions` act on every run;
    `execution.chunk_size` nodes are vmapped at once (default what the memory allows)."""
    graph = EdgeGraph.of(config)
    metric = edge_metric(metric, "node_effects", pairs)
    pairs.check(config, metric)
    check_interventions(interventions, graph)
    if kind == "neurons":
        refuse_mixed_neurons(config)
    shape = node_shape(kind, config, pairs.clean.shape[1])
    index = np.asarray(nodes, np.int64).reshape(-1, len(shape))
    if len(index) == 0:
        raise ValueError("no nodes given")
    bad = np.any((index < 0) | (index >= np.array(shape)), axis=1)
    if bad.any():
        ranges = ", ".join(f"{name} in 0..{n - 1}" for name, n in zip(node_index(kind, config), shape))
        raise ValueError(f"a node of {kind} is ({ranges}); got {index[bad][0].tolist()}")
    clean, _ = pair_runs(params, pairs, config, interventions)
    pairs = with_clean_logits(params, pairs, clean.final, config, metric, "node_effects")
    f_clean = run_metric(params, metric, clean, pairs, config, clean=True)
    choice = _clean_choice(params, pairs, config, interventions) if kind == "neurons" and config.is_moe else None
    cached = _corrupt_values(params, pairs, config, kind, interventions, choice)
    chunk = _chunk(config, pairs, 0, len(index), execution)
    run = lambda part: (
        f_clean[None]
        - _node_runs(
            params,
            pairs,
            jnp.asarray(part, jnp.int32),
            cached,
            choice,
            interventions,
            config=config,
            metric=metric,
            kind=kind,
        )
    )
    return in_chunks(run, index, chunk, execution, f"exact patching of {kind} (chunks)")


def neuron_effects(
    params,
    pairs: PromptPairs,
    config: ModelConfig,
    metric: Metric,
    neurons,
    *,
    interventions=None,
    execution: Execution = Execution(),
) -> np.ndarray:
    """`[n, B]`: F(clean) - F(clean with MLP hidden unit `neurons[i] = (layer, unit)` at its
    value in the corrupt run), per pair: the exact effect that its neuron score
    (`edge_attribution(..., Scoring(detail=['neurons']))`) estimates. `interventions` and
    `execution` as `node_effects`."""
    return node_effects(
        params, pairs, config, metric, "neurons", neurons, interventions=interventions, execution=execution
    )


def patched_metric(
    params,
    pairs: PromptPairs,
    config: ModelConfig,
    metric: Metric,
    edge_sets,
    *,
    unit_sets=None,
    patching: Patching = Patching(),
    execution: Execution = Execution(),
) -> np.ndarray:
    """`[n, B]`: F with every edge of `edge_sets[i]` patched at once (each set: edge names,
    index pairs or a `[W, R]` bool mask; or an `[n, W, R]` bool array), each patched edge
    carrying `patching.ablation`'s values (default the corrupt run's), under its
    `interventions`. `unit_sets`: for each set, an `[L, F]` bool array of the MLP hidden units
    patched with it, at their values in the corrupt run (the corrupt ablation only).
    `execution.chunk_size` sets are vmapped at once (default what the memory allows)."""
    graph = EdgeGraph.of(config)
    metric = edge_metric(metric, "patched_metric", pairs)
    ablation, interventions = patching.ablation, patching.interventions
    pairs.check(config, metric)
    check_interventions(interventions, graph)
    masks = np.stack([graph.edges_mask(s) for s in edge_sets])
    units = None if unit_sets is None else _unit_masks(unit_sets, len(masks), config, ablation)
    clean, corrupt = pair_runs(params, pairs, config, interventions)
    pairs = with_clean_logits(params, pairs, clean.final, config, metric, "patched_metric")
    P, prefix = suffix_run(params, pairs, clean, config, metric, interventions, ablation)
    ablated = ablation.writers(graph, pairs, corrupt, config.hidden_size)
    writers = jnp.broadcast_to(ablated, clean.writers.shape)[:, :, P:]
    hidden = (
        None if units is None else hidden_units(params, pairs.corrupt, pairs.valid, config, interventions)[:, :, P:]
    )
    chunk = _chunk(config, pairs, P, len(masks), execution, patch=True)

    def run(part):  # part: the sets' indices
        sets, ablated = jnp.asarray(masks[part]), writers
        if units is not None:
            sets, ablated = (sets, jnp.asarray(units[part])), (writers, hidden)
        return patched_sets(params, pairs, prefix, sets, ablated, interventions, config, metric)

    return in_chunks(run, np.arange(len(masks)), chunk, execution, "exact patching of edge sets (chunks)")


def _unit_masks(unit_sets, n: int, config: ModelConfig, ablation) -> np.ndarray:
    """`[n, L, F]` bool, checked: one array of units per edge set, under the corrupt ablation."""
    if ablation.kind != "corrupt":
        raise ValueError(f"units are patched at their corrupt values: the corrupt ablation only, not {ablation.kind!r}")
    units = np.asarray(unit_sets, bool)
    shape = (n, config.num_layers, config.intermediate_size)
    if units.shape != shape:
        raise ValueError(f"unit_sets must be one [L, F] = {shape[1:]} bool array per edge set ({n}), got {units.shape}")
    return units


def circuit_metric(
    params,
    pairs: PromptPairs,
    config: ModelConfig,
    metric: Metric,
    circuits,
    *,
    patching: Patching = Patching(),
    execution: Execution = Execution(),
) -> np.ndarray:
    """`[n, B]`: F with every edge outside circuit i patched (each circuit: edge names, index
    pairs or a `[W, R]` bool mask of the edges kept clean). `patching` and `execution` as
    `patched_metric` (`patching.ablation`: what the patched edges carry)."""
    graph = EdgeGraph.of(config)
    complements = [graph.edge_mask & ~graph.edges_mask(c) for c in circuits]
    return patched_metric(params, pairs, config, metric, complements, patching=patching, execution=execution)


def faithfulness(circuit_f: np.ndarray, f_clean: np.ndarray, f_corrupt: np.ndarray) -> np.ndarray:
    """(F(circuit) - F(corrupt)) / (F(clean) - F(corrupt)) of the pairs' means (`circuit_f
    [n, B]`, `f_clean`, `f_corrupt [B]`): 1 recovers the whole model, 0 the corrupt run."""
    gap = float(np.mean(f_clean) - np.mean(f_corrupt))
    if gap == 0:
        raise ValueError("F(clean) equals F(corrupt) on average: faithfulness is undefined for these pairs")
    return (np.mean(circuit_f, axis=-1) - np.mean(f_corrupt)) / gap


def _edge_indices(edges, graph: EdgeGraph) -> np.ndarray:
    if isinstance(edges, np.ndarray) and edges.ndim == 2 and edges.shape[1] == 2 and edges.dtype != object:
        rows = edges.astype(np.int64)
    else:
        rows = np.array([graph.edge_index(e) if isinstance(e, str) else tuple(e) for e in edges], np.int64).reshape(
            -1, 2
        )
    if len(rows) == 0:
        raise ValueError("no edges given")
    for w, r in rows:
        graph.check_edge(w, r)
    return rows


def _chunk(config: ModelConfig, pairs: PromptPairs, prefix_length: int, n: int, execution: Execution, patch=False):
    """Runs of n to vmap at once: `execution.chunk_size`, or what fits in its memory budget
    (`Execution.chunk`; a patched run also holds the `[W, B, T, D]` buffer (in the padded layout) of what each writer
    lacks of its corrupt value), at most `MAX_CHUNK`."""
    B, T = pairs.clean.shape
    T -= prefix_length
    per = member_bytes(config, B * T)
    if patch:
        per += 2 * EdgeGraph.of(config).padded.num_writers * B * T * config.hidden_size * 4
    chunk = execution.chunk(n, per)
    return chunk if execution.chunk_size is not None else min(chunk, MAX_CHUNK)
