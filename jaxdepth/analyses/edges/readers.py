"""The edge graph on the core's layer: every reader's input and every writer's output are sites
of a split layer (`jaxdepth.core.sites`), so the runs edge attribution needs are ordinary runs
of `jaxdepth.core.loops.run_layers` under interventions built here.

Readers (`jaxdepth.analyses.edges.graph`) and their sites: a query head's query, key and value
inputs are `q_in`, `k_in`, `v_in` (head h's row), an MLP's input is `mlp_in`, the logits' input
is the final residual (`resid_pre` at layer L). Writers: the input is h_0 (`resid_pre` at layer
0), a head's output is its row of `head_result`, an MLP's output `mlp_out`; where a layer's
attention is one writer (`EdgeGraph.post_norms`), its output is `attn_out`, after the norm
(`attention_site`). Every function here reads the attention's writers of a layer as rows
`[A, B, T, D]` of that site (`EdgeGraph.attention_writers` of them: `_attention_rows`).

- `reader_probes` / `probe_readers`: zeros added at every reader's input; the gradient with
  respect to them is the gradient at every reader's input, from one backward pass (EAP);
- `move_reader`: one reader's input moved by a vector; patching edge u -> v alone is moving
  v by `a_corrupt[u] - a_clean[u]`, exact from v's layer on (`run_layers`' `start`);
- `patch_edges`: every edge u -> v of a `[W, R]` mask carries u's corrupt output: v reads
  `corrupt[u] - current[u]` more, where `current[u]` is what u writes in this very run (so
  patches compose: a patched edge upstream changes what later writers write). The missing part
  of every writer is the state a `StatefulIntervention` carries through the layers;
- `shift_node`: one node's output (the input, a layer's attention writers together, or an MLP)
  moved along its straight path: EAP-IG's 'activations' variant;
- `edge_run`: a run's logits at each pair's last position, every writer's output and every
  layer's input (`EdgeRun`), under any interventions.

Where the graph's layers have heads of different counts (`EdgeGraph.uniform` False: a hybrid
whose linear-attention layers have more or fewer value heads than attention's query heads), the
runs compute in the graph's `padded` layout (the split sites' rows): the functions here take the
graph's own writers, readers and masks and place them there (`padded_writers`, `padded_mask`),
and `edge_run` returns the graph's own writers.

With grouped-query attention a split layer projects the key and value inputs of the G query
heads of a group with that group's weights (no per-head copy). With no change at any reader the
runs equal `jaxdepth.core.model.forward` to float rounding (the per-head projections and the sum
over heads' results add in another order).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxdepth.analyses.edges.graph import EdgeGraph
from jaxdepth.analyses.edges.pairs import PromptPairs, pair_reads
from jaxdepth.analyses.metrics import Metric, Readout, readout
from jaxdepth.core import sites
from jaxdepth.core.compilation import jit
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.layer import LayerRecord, Params
from jaxdepth.core.loops import LayerRun, run_layers
from jaxdepth.core.model import embed, unembed

__all__ = [
    "reader_probes",
    "probe_readers",
    "move_reader",
    "shift_node",
    "patch_edges",
    "patched_sets",
    "check_interventions",
    "edge_run",
    "EdgeRun",
    "logits_at",
    "final_metric",
    "pair_readout",
    "run_metric",
    "SPLIT_LAYERS",
    "HEAD_INPUTS",
    "attention_site",
    "padded_writers",
    "padded_mask",
]

HEAD_INPUTS = ("q_in", "k_in", "v_in")  # the sites of a head's q, k and v readers, in the graph's order


def attention_site(graph: EdgeGraph) -> str:
    """The site whose value holds a layer's attention writers: `head_result` (each head's row),
    or `attn_out` (the layer's output after its norm) in a graph whose attention is one writer
    per layer (`EdgeGraph.post_norms`)."""
    return "attn_out" if graph.post_norms else "head_result"


def _attention_rows(graph: EdgeGraph, value):
    """The value at `attention_site` as the writers' rows `[A, B, T, D]`."""
    return value[None] if graph.post_norms else jnp.moveaxis(value, 2, 0)


def _attention_value(graph: EdgeGraph, rows):
    """Rows `[A, B, T, D]` of a layer's attention writers as a value of `attention_site`."""
    return rows[0] if graph.post_norms else jnp.moveaxis(rows, 0, 2)


def padded_writers(graph: EdgeGraph, rows):
    """Rows `[W, ...]` of the graph's writers as rows of its `padded` layout `[W', ...]` (zeros at
    the heads beyond a layer's own); `rows` itself in a `uniform` graph."""
    if graph.uniform:
        return rows
    padded = jnp.zeros((graph.padded.num_writers,) + rows.shape[1:], rows.dtype)
    return padded.at[jnp.asarray(graph.padded_writers)].set(rows)


def padded_mask(graph: EdgeGraph, mask):
    """An edge mask `[W, R]` of the graph as one of its `padded` layout (`mask` itself in a
    `uniform` graph)."""
    if graph.uniform:
        return mask
    padded = jnp.zeros((graph.padded.num_writers, graph.padded.num_readers), mask.dtype)
    return padded.at[graph.padded_writers[:, None], graph.padded_readers[None, :]].set(mask)


def reader_probes(config: ModelConfig, batch: int, seq_len: int, dtype=jnp.float32) -> dict:
    """Zeros of the shape of every reader's input: `q`, `k`, `v` `[L, B, T, H, D]` (per query
    head; per head of the padded layout, `EdgeGraph.padded`, where layers have heads of different
    counts), `mlp` `[L, B, T, D]`, `logits` `[B, T, D]`."""
    L, H, D = config.num_layers, config.split_heads, config.hidden_size
    head = jnp.zeros((L, batch, seq_len, H, D), dtype)
    mlp = jnp.zeros((L, batch, seq_len, D), dtype)
    return {"q": head, "k": head, "v": head, "mlp": mlp, "logits": head[0, :, :, 0]}


def probe_readers(probes: dict, num_layers: int) -> tuple[sites.Intervention, ...]:
    """Interventions adding `probes` (`reader_probes`' dict) at every reader's input."""
    per_layer = [
        sites.probe(site, probes[kind]) for site, kind in zip(HEAD_INPUTS + ("mlp_in",), ("q", "k", "v", "mlp"))
    ]
    return (*per_layer, sites.add("resid_pre", num_layers, probes["logits"], 1.0))


@dataclasses.dataclass(frozen=True)
class _MoveHeadInput:
    """Adds a vector `[B, T, D]` to the input of one head reader (data: its index in the graph's
    reader order minus the index of this site's first reader of layer 0); hashable, so one
    compilation serves every reader."""

    graph: EdgeGraph

    def __call__(self, value, layer, data):
        local, vector = data
        H = value.shape[2]
        hit = (layer * self.graph.readers_per_layer + jnp.arange(H)) == local
        return value + hit[None, None, :, None].astype(value.dtype) * vector[:, :, None, :].astype(value.dtype)


def move_reader(graph: EdgeGraph, reader, vector: Float[Array, "B T D"]) -> tuple:
    """Interventions moving the input of reader `reader` (an int, traced or not: one compilation
    for every reader) by `vector`, and no other reader's."""
    reader = jnp.asarray(reader, jnp.int32)
    if not graph.uniform:  # its index in the layout the run computes in
        reader = jnp.asarray(graph.padded_readers, jnp.int32)[reader]
    graph = graph.padded
    H, R = graph.num_heads, graph.readers_per_layer
    move = _MoveHeadInput(graph)
    heads = tuple(sites.Intervention(site, move, (reader - k * H, vector)) for k, site in enumerate(HEAD_INPUTS))
    is_mlp = (reader % R == 3 * H).astype(vector.dtype)
    is_logits = (reader == graph.logits_reader).astype(vector.dtype)
    mlp = sites.add("mlp_in", jnp.minimum(reader // R, graph.num_layers - 1), is_mlp * vector, 1.0)
    return (*heads, mlp, sites.add("resid_pre", graph.num_layers, is_logits * vector, 1.0))


@dataclasses.dataclass(frozen=True)
class _ShiftNode:
    """Adds `factor` times the rows of `delta [W, B, T, D]` of node `node` to the value of the
    node's site at its layer: a layer's attention writers (`attention_site`, node 2l + 1) or
    its MLP (`mlp_out`, node 2l + 2); nothing at other layers or nodes. `detach` (traced): the
    node's own output is a constant there (no gradient flows back through it)."""

    graph: EdgeGraph
    mlp: bool

    def __call__(self, value, layer, data):
        node, factor, delta, detach = data
        this = node == 2 * layer + (2 if self.mlp else 1)
        if self.mlp:
            rows = jax.lax.dynamic_index_in_dim(delta, self.graph.mlp_writer(layer), keepdims=False)
        else:
            A = self.graph.attention_writers
            rows = _attention_value(self.graph, jax.lax.dynamic_slice_in_dim(delta, self.graph.first_writer(layer), A))
        value = jnp.where(this & detach, jax.lax.stop_gradient(value), value)
        return value + jnp.where(this, factor, 0).astype(value.dtype) * rows.astype(value.dtype)


def shift_node(graph: EdgeGraph, node, factor, delta: Float[Array, "W B T D"], detach=False) -> tuple:
    """Interventions adding `factor * delta[u]` to the output of every writer u of node `node`
    (0: the input; 2l + 1: the attention of layer l, its heads or its one writer; 2l + 2: the MLP
    of layer l; traced or not): the paths of EAP-IG's 'activations' variant. `detach` (traced
    or not): the node's output is a constant on the path, as the EAP-IG package's hooks set it
    (no gradient reaches the readers before it through it)."""
    node = jnp.asarray(node, jnp.int32)
    on_input = jnp.where(node == 0, factor, 0)
    data = (node, factor, padded_writers(graph, delta), jnp.asarray(detach, bool))
    graph = graph.padded
    return (
        sites.add("resid_pre", 0, on_input * delta[0], 1.0),
        sites.Intervention(attention_site(graph), _ShiftNode(graph, mlp=False), data),
        sites.Intervention("mlp_out", _ShiftNode(graph, mlp=True), data),
    )


@dataclasses.dataclass(frozen=True)
class _PatchEdges:
    """The stateful intervention of `patch_edges`: data the edge mask `[W, R]`, state what each
    writer's output lacks of its corrupt value `[W, B, T, D]`, filled as the writers run."""

    graph: EdgeGraph

    def __call__(self, site, value, layer, mask, missing):
        H, R = self.graph.num_heads, self.graph.readers_per_layer
        A = self.graph.attention_writers

        def change(first: int, count: int):  # [count, B, T, D]: what readers first.. of this layer gain
            m = jax.lax.dynamic_slice_in_dim(mask, layer * R + first, count, axis=1).astype(missing.dtype)
            return jnp.einsum("wr,wbtd->rbtd", m, missing).astype(value.dtype)

        first = self.graph.first_writer(layer)
        if site in HEAD_INPUTS:
            return value + jnp.moveaxis(change(HEAD_INPUTS.index(site) * H, H), 0, 2), missing
        if site == attention_site(self.graph):
            own = jax.lax.dynamic_slice_in_dim(missing, first, A, axis=0)
            written = _attention_rows(self.graph, value)
            return value, jax.lax.dynamic_update_slice_in_dim(missing, own - written, first, 0)
        if site == "mlp_in":
            return value + change(3 * H, 1)[0], missing
        if site == "mlp_out":
            own = jax.lax.dynamic_index_in_dim(missing, first + A, keepdims=False)
            return value, jax.lax.dynamic_update_index_in_dim(missing, own - value, first + A, 0)
        # resid_pre: the logits reader, at the final residual (layer L) only
        final = lambda v: v + change(0, 1)[0]
        return jax.lax.cond(layer == self.graph.num_layers, final, lambda v: v, value), missing


def patch_edges(graph: EdgeGraph, mask, corrupt_writers: Float[Array, "W B T D"], h0: Float[Array, "B T D"]):
    """A stateful intervention under which every edge of `mask [W, R]` carries its writer's
    output `corrupt_writers` (the corrupt run's, `EdgeRun.writers`) and every other edge what
    its writer writes in this run, for a run from the embeddings `h0` (the input writer's
    output in this run). Vmap over stacks of masks to patch many edge sets at once."""
    missing = padded_writers(graph, corrupt_writers.astype(h0.dtype)).at[0].add(-h0)
    return sites.StatefulIntervention(
        ("resid_pre",) + HEAD_INPUTS + (attention_site(graph), "mlp_in", "mlp_out"),
        _PatchEdges(graph.padded),
        padded_mask(graph, mask),
        missing,
    )


@partial(jit, static_argnames=("config", "metric"))
def patched_sets(params, pairs: PromptPairs, prefix, sets, ablated, interventions, config, metric):
    """F `[c, B]` with the edges of each of the c edge sets patched at once. `sets`: the edge
    masks `[c, W, R]`, each edge carrying `ablated` (the writers' ablated outputs `[W, B, S, D]`,
    the S positions after the shared `prefix`); or, with MLP hidden units patched too, `sets =
    (masks, unit_masks [c, L, F])` and `ablated = (ablated_writers, ablated_hidden [L, B, S, F])`
    (a unit at every position: every reader of the MLP reads the unit's ablated value)."""
    P = 0 if prefix is None else prefix[0].shape[2]
    h0 = embed(params, pairs.clean[:, P:], config, offset=P)
    graph = EdgeGraph.of(config)
    units = isinstance(sets, tuple)
    writers, hidden = ablated if units else (ablated, None)

    def one(mask, unit_mask=None):
        ivs = (interventions, patch_edges(graph, mask, writers, h0))
        if unit_mask is not None:
            ivs += (sites.patch("mlp_hidden", hidden, unit_mask[:, None, None, :]),)
        run = edge_run(params, h0, pairs.valid, pairs.last, config, interventions=ivs, prefix=prefix)
        return run_metric(params, metric, run, pairs, config)

    return jax.vmap(one)(*sets) if units else jax.vmap(one)(sets)


# Sites whose value is a sum of writers' outputs, not a writer's: an edit there would reach the
# readers through no edge. `attn_out` is one where the heads write (not where a layer's attention
# is one writer, `attention_site`).
WRITER_SUMS = ("attn_out", "delta", "resid_post")


def check_interventions(interventions, graph: Optional[EdgeGraph] = None) -> None:
    """Refuse interventions at a site whose value is a sum of writers' outputs (`WRITER_SUMS`,
    less the attention writers' own site of `graph`, `attention_site`; a graph whose heads write
    when None): a reader's input is the sum of the writers' outputs. Edit the writers themselves
    (`head_out`, `head_result`, `mlp_hidden`, `mlp_out`, and `attn_out` where a layer's attention
    is one writer) or add to the stream at `resid_pre`."""
    site = "head_result" if graph is None else attention_site(graph)
    sums = set(WRITER_SUMS) - {site}
    attention = f"{site!r} for " + ("a head" if site == "head_result" else "a layer's attention")
    for iv in sites.as_interventions(interventions):
        hit = sorted(set(iv.sites if isinstance(iv, sites.StatefulIntervention) else (iv.site,)) & sums)
        if hit:
            raise ValueError(
                f"an intervention at {hit[0]!r} edits a sum of the edge graph's writers, which no edge carries: "
                f"intervene on the writers themselves ({attention}, 'mlp_out' for an MLP; to skip layer l, skip "
                "both) or add to the residual stream at 'resid_pre'"
            )


# A run under it computes every layer split per head, each head's result on its own, as the runs
# whose readers move do (every family's readers are per head), and its taps read every head's
# result.
SPLIT_LAYERS = sites.unchanged("head_result")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EdgeRun:
    """What `edge_run` returns: `logits [B, V]` at each row's `last` position, every writer's
    output `writers [W, B, T, D]` (in the order of `EdgeGraph.of(config)`; rows of layers before
    `start` are zeros, the input row is `h` when `start` is 0), every layer's input as the
    layer receives it, before its own interventions, `residuals [L+1, B, T, D]` (h_0..h_L
    without interventions; rows before `start` are zeros): a run from boundary l starts from
    `residuals[l]`; and `final [B, T, D]`, the final residual the logits read (after the
    interventions on it: the logits reader's patches)."""

    logits: Float[Array, "B V"]
    writers: Float[Array, "W B T D"]
    residuals: Float[Array, "Lp1 B T D"]
    final: Float[Array, "B T D"]


@dataclasses.dataclass(frozen=True)
class _WritersTap:
    """A layer's writers `[A + 1, B, T, D]` (its attention's, `_attention_rows` of the value at
    `attention_site`, then the MLP's output) and its output."""

    graph: EdgeGraph

    def __call__(self, record: LayerRecord, _):
        attention = getattr(record, attention_site(self.graph))
        return jnp.concatenate([_attention_rows(self.graph, attention), record.mlp[None]]), record.out


def logits_at(params: Params, h_last: Float[Array, "B S D"], last: Int[Array, " B"], config: ModelConfig, prefix=None):
    """`[B, V]`: the logits of each row's position `last` (counted over all positions; with a
    `prefix` of P positions, `h_last` holds the rows after it)."""
    offset = 0 if prefix is None else prefix[0].shape[2]
    return unembed(params, h_last[jnp.arange(h_last.shape[0]), last - offset], config)


def pair_readout(params: Params, metric: Metric, h_final, pairs: PromptPairs, config: ModelConfig) -> Readout:
    """The `Readout` `metric` reads from the final residual `h_final [B, S, D]`: the final norm
    and the LM head at its positions (`pair_reads`) only, `logits [B, P, V]`, with the pairs'
    labels and, for a metric with `clean=True`, the clean run's logits there
    (`PromptPairs.clean_logits`). Where S is less than the pairs' T, `h_final` holds the rows
    after a shared prefix of T - S positions (`suffix_run`), which a metric of every position
    never runs with."""
    reads = pair_reads(metric, pairs)
    offset = pairs.clean.shape[1] - h_final.shape[1]
    if offset and metric.reads == "all":
        raise ValueError("a metric of every position reads the prefix too: the runs must not reuse a shared prefix")
    clean = None
    if metric.clean:
        if pairs.clean_logits is None:
            raise ValueError(f"the metric {metric.__name__!r} reads the clean run's logits: the pairs carry none")
        clean = pairs.clean_logits
    shifted = dataclasses.replace(reads, positions=reads.positions - offset)
    out = readout(params, h_final, config, shifted, clean=clean, labels=pairs.labels)
    return dataclasses.replace(out, positions=reads.positions)


def final_metric(params: Params, metric: Metric, h_final, pairs: PromptPairs, config: ModelConfig):
    """F per pair `[B]` from the final residual `h_final [B, S, D]` (after a shared prefix where
    S < T): `metric` of its `pair_readout`."""
    return metric(pair_readout(params, metric, h_final, pairs, config))


def run_metric(params: Params, metric: Metric, run: EdgeRun, pairs: PromptPairs, config: ModelConfig, clean=False):
    """F per pair `[B]` of an `EdgeRun` (`final_metric` of its final residual). `clean`: the run
    is the clean one, whose logits a metric with `clean=True` reads from the pairs (the very
    numbers every other run compares with: the KL of the clean run is exactly 0)."""
    if clean and metric.clean:
        reads = pair_reads(metric, pairs)
        logits = pairs.clean_logits
        return metric(Readout(logits, reads.real, reads.positions, reads.targets, logits, pairs.labels))
    return final_metric(params, metric, run.final, pairs, config)


def edge_run(
    params: Params,
    h: Float[Array, "B T D"],
    valid,
    last: Int[Array, " B"],
    config: ModelConfig,
    *,
    start=0,
    interventions=None,
    prefix: Optional[tuple] = None,
) -> EdgeRun:
    """The run from boundary `start` (`h` = h_start; the embeddings for start 0) under
    `interventions`, as an `EdgeRun`. `last [B]`: the position whose logits each row returns.
    `prefix = (keys, values)` as in `jaxdepth.core.loops.run_layers` (every `[.., B, T, D]`
    argument and result then holds the suffix rows; `valid` and `last` count all positions)."""
    graph = EdgeGraph.of(config)
    h_last, (writers, outputs) = run_layers(
        params,
        h,
        config,
        valid=valid,
        interventions=(interventions, SPLIT_LAYERS),
        tap=_WritersTap(graph.padded),
        run=LayerRun(start=start, prefix=prefix),
    )
    logits = logits_at(params, h_last, last, config, prefix)
    first_row = h if isinstance(start, int) and start == 0 else jnp.zeros_like(h)
    writers = jnp.concatenate([first_row[None], writers.reshape((-1,) + h.shape)])
    if not graph.uniform:  # the padded layout's rows of the graph's writers
        writers = writers[jnp.asarray(graph.padded_writers)]
    residuals = jnp.concatenate([jnp.zeros_like(h)[None], outputs]).at[start].set(h)
    return EdgeRun(logits, writers, residuals, h_last)
