"""AtP* (Kramár et al. 2024, arXiv 2403.00745): attribution patching of nodes, with its two fixes
for false negatives, the QK fix and GradDrop.

Nodes (`NODE_KINDS`; the index of a node in its score array, after the pair axis):

    queries  a head's query at a position, as the head reads it (rotated)   (layer, head, position)
    keys     a key at a position, as one query head reads it                (layer, head, position)
    values   a value at a position, as one query head reads it              (layer, head, position)
    heads    a head's output at a position (before o_proj)                  (layer, head, position)
    mlps     an MLP's output at a position                                  (layer, position)
    neurons  an MLP hidden unit at every position                           (layer, unit)
             a mixture's: an expert's hidden unit, wherever it runs         (layer, expert, unit)

In a model with linear-attention layers (Qwen3.5) a linear layer's heads are its value heads
(`a{l}.h{h}`, as the edge graph names them; head axes `ModelConfig.split_heads` long, zeros past
a layer's own heads): a head's output is its gated, normed output before the output projection
(site `head_out`), and its query, key and value are its inputs, the layer's input h_l at the
position as the value head reads it for its query channels and output gate, its key channels
and two gates (beta, the decay), and its value channels (sites `q_in`, `k_in`, `v_in`; through
the convolution the input at s reaches positions s..s+K-1). No softmax reads them: their
estimate is AtP under every method (the QK fix is attention's). A gated attention head's query
moves its output gate too, and the estimates of its query include the gate's.

A node is patched when it takes its value in the corrupt run and everything after it is
recomputed (`jaxdepth.analyses.edges.patching.node_effects` does so exactly). A key or value of
a grouped-query model is one query head's reading of its group's key: patched for that head
alone. An expert's hidden unit runs on the tokens the clean run routes to its expert: its
corrupt value there is the expert's unit on the corrupt input under the clean run's routing
(`jaxdepth.core.experts.follow_routing`), since the corrupt run may route those tokens
elsewhere.

Definitions (per pair; F the user's metric, as edge attribution's; every estimate is of the
drop F(clean) - F(clean with the node patched), the sign of EAP and of `node_effects`):

- AtP: (n_clean - n_corrupt) . dF/dn, the gradient taken in the clean run.
- QK fix: a query's or key's effect passes through the attention softmax, whose linear
  estimate misses where the softmax saturates. The fix computes the head's output with that
  one query (key) at its corrupt value exactly, o', and linearizes only from there on:
  sum over the head's positions of (o - o') . dF/do. A query at position s changes row s of the
  attention pattern; a key at position t changes column t of every row. A value needs no fix:
  the head's output is linear in its values, and its AtP is the same estimate.
- GradDrop: F's gradient with layer l's contribution to the residual (site `delta`) held
  constant in the backward pass (its forward value kept), for each layer l in turn, and the
  estimate I_l(n) under each of those gradients; the score is sum_l |I_l(n)| / (L - 1). A node
  of layer m has I_m(n) = 0 exactly (its own layer's contribution carries all of its effect)
  and I_l(n) = I(n) for l < m, so where nothing cancels downstream the score is |I(n)|; where a
  node's effects along two paths cancel, dropping one of them shows the other. GradDrop
  scores are magnitudes (>= 0).

AtP* is both fixes together (`atp_star`'s default, `method='AtP*'`); `method='AtP'` is neither,
'AtP+QK' and 'AtP+GD' one of them (`ATP_METHODS`).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxdepth.analyses.edges.graph import EdgeGraph
from jaxdepth.analyses.edges.pairs import PromptPairs, edge_metric
from jaxdepth.analyses.edges.readers import check_interventions, final_metric
from jaxdepth.analyses.edges.scores import expert_units_on, with_clean_logits
from jaxdepth.analyses.metrics import Metric
from jaxdepth.core.compilation import jit
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.execution import Execution
from jaxdepth.core.layer import attend, context_of_layer, gated_heads, layer_context, pre_norm
from jaxdepth.core.loops import run_layers
from jaxdepth.core.model import embed
from jaxdepth.core.parameters import kind_slots
from jaxdepth.core.saved_result import SavedResult
from jaxdepth.core.sharding import to_host
from jaxdepth.core.sites import Intervention, as_interventions, probe, site_shape
from jaxdepth.core.sweep import auto_chunk_size, sweep

__all__ = [
    "NODE_KINDS",
    "ATP_METHODS",
    "NodeAttribution",
    "atp_star",
    "node_shape",
    "node_index",
    "refuse_mixed_neurons",
    "missed_nodes",
]

NODE_KINDS = ("queries", "keys", "values", "heads", "mlps", "neurons")
# The estimates `atp_star` computes, by name: (the QK fix, GradDrop).
ATP_METHODS = {"AtP": (False, False), "AtP+QK": (True, False), "AtP+GD": (False, True), "AtP*": (True, True)}
ATTENTION_KINDS = ("queries", "keys", "values")
# The site each kind is patched at (`node_effects`), and the one whose gradient estimates it.
PATCH_SITE = {
    "queries": "q_in",
    "keys": "k_in",
    "values": "v_in",
    "heads": "head_out",
    "mlps": "mlp_out",
    "neurons": "mlp_hidden",
}
# What each axis of a node's index is (`node_shape`; a mixture's neurons: `node_index`).
NODE_INDEX = {kind: ("layer", "head", "position") for kind in ("queries", "keys", "values", "heads")} | {
    "mlps": ("layer", "position"),
    "neurons": ("layer", "unit"),
}
_GRADIENT_SITE = {"heads": "head_out", "mlps": "mlp_out", "neurons": "mlp_hidden"}


def node_index(kind: str, config: ModelConfig) -> tuple[str, ...]:
    """What each axis of a node of `kind` is in `config`'s model (`NODE_INDEX`; a mixture's
    neurons are (layer, expert, unit))."""
    _check_kind(kind)
    return ("layer", "expert", "unit") if kind == "neurons" and config.is_moe else NODE_INDEX[kind]


def node_shape(kind: str, config: ModelConfig, seq_len: int) -> tuple:
    """The shape of one pair's scores of `kind`: the index of a node (module docstring)."""
    _check_kind(kind)
    L = config.num_layers
    neurons = (L, config.num_experts, config.intermediate_size) if config.is_moe else (L, config.intermediate_size)
    shapes = {"mlps": (L, seq_len), "neurons": neurons}
    return shapes.get(kind, (L, config.split_heads, seq_len))


def refuse_mixed_neurons(config: ModelConfig) -> None:
    """Neurons of layers of two kinds (a dense MLP's units beside experts') have no one index:
    refused by name."""
    if config.mixed_mlps:
        raise ValueError(
            "node kind 'neurons' in a model with dense layers among its mixtures of experts "
            f"(dense_layers {config.dense_layers}) is not implemented: the two kinds' units have no one index"
        )


def _check_kind(kind: str) -> None:
    if kind not in NODE_KINDS:
        raise ValueError(f"unknown node kind {kind!r}; kinds: {', '.join(NODE_KINDS)}")


@dataclasses.dataclass
class NodeAttribution(SavedResult):
    """AtP's estimates per pair and node: one array per kind computed (`NODE_KINDS`; None for a
    kind not asked for), `[B, *node_shape(kind)]`, each the drop F(clean) - F(patched) it
    estimates (GradDrop: its magnitude), with F on the clean and the corrupt prompts
    (`f_clean`, `f_corrupt [B]`) and which fixes were applied."""

    f_clean: np.ndarray
    f_corrupt: np.ndarray
    qk_fix: bool
    grad_drop: bool
    queries: Optional[np.ndarray] = None
    keys: Optional[np.ndarray] = None
    values: Optional[np.ndarray] = None
    heads: Optional[np.ndarray] = None
    mlps: Optional[np.ndarray] = None
    neurons: Optional[np.ndarray] = None

    @property
    def method(self) -> str:
        """'AtP', 'AtP+QK', 'AtP+GD' or 'AtP*'."""
        return {fixes: name for name, fixes in ATP_METHODS.items()}[(self.qk_fix, self.grad_drop)]

    def of(self, kind: str) -> np.ndarray:
        """The scores of `kind`, `[B, *node_shape]`; an error if they were not computed."""
        _check_kind(kind)
        scores = getattr(self, kind)
        if scores is None:
            raise ValueError(f"no {kind} scores: pass kinds=[..., {kind!r}] to atp_star")
        return scores

    def top(self, kind: str, n: int) -> np.ndarray:
        """`[n, k]`: the indices of the `n` nodes of `kind` with the largest mean |score| over
        the pairs, largest first (each row a node index, as `node_effects` takes it)."""
        mean = np.abs(np.mean(self.of(kind), axis=0))
        best = np.argsort(-mean, axis=None, kind="stable")[:n]
        return np.stack(np.unravel_index(best, mean.shape), axis=1)


def missed_nodes(estimated: np.ndarray, exact: np.ndarray, k: int) -> float:
    """The false-negative rate at `k`: the fraction of the `k` nodes with the largest |exact|
    effect (any shape, one value per node, e.g. the mean over pairs) that are not among the `k`
    nodes with the largest |estimated| score."""
    estimated, exact = np.abs(np.ravel(estimated)), np.abs(np.ravel(exact))
    if estimated.shape != exact.shape:
        raise ValueError(f"estimated has {estimated.size} nodes, exact {exact.size}")
    if not 0 < k <= exact.size:
        raise ValueError(f"k must be in 1..{exact.size}, got {k}")
    true = set(np.argsort(-exact, kind="stable")[:k].tolist())
    found = set(np.argsort(-estimated, kind="stable")[:k].tolist())
    return len(true - found) / k


def atp_star(
    params,
    pairs: PromptPairs,
    config: ModelConfig,
    metric: Metric,
    *,
    kinds: Sequence[str] = ("queries", "keys", "values", "heads", "mlps"),
    method: str = "AtP*",
    interventions=None,
    execution: Execution = Execution(),
) -> NodeAttribution:
    """AtP's estimate of every node of `kinds` (module docstring) for the B prompt pairs, each
    estimating F(clean) - F(clean with the node at its corrupt value), `[B, *node_shape(kind)]`
    per kind, under `metric` (a `jaxdepth.Metric`, as edge attribution's). `method` (one of
    `ATP_METHODS`): 'AtP*' (the QK fix and GradDrop, the default), 'AtP+QK', 'AtP+GD' or 'AtP'
    (neither). One clean and one corrupt forward, and one backward (GradDrop: one per layer,
    `execution.chunk_size` of them vmapped at a time, default what `memory_budget` allows); the
    QK fix recomputes each head's output once per query row set and once per key position.
    `interventions` act on every run."""
    if method not in ATP_METHODS:
        raise ValueError(f"method must be one of {tuple(ATP_METHODS)}, got {method!r}")
    qk_fix, grad_drop = ATP_METHODS[method]
    metric = edge_metric(metric, "atp_star", pairs)
    kinds = tuple(dict.fromkeys(kinds))
    for kind in kinds:
        _check_kind(kind)
    if not kinds:
        raise ValueError(f"no node kinds given; kinds: {', '.join(NODE_KINDS)}")
    if "neurons" in kinds:
        refuse_mixed_neurons(config)
    pairs.check(config, metric)
    check_interventions(interventions, EdgeGraph.of(config))
    B, T = pairs.clean.shape
    L = config.num_layers
    if grad_drop and L < 2:
        raise ValueError("GradDrop drops one layer's gradient while others carry it: it needs 2 layers or more")
    dropped = np.arange(L) if grad_drop else np.array([L])  # layer L holds no delta: nothing dropped
    chunk = execution.chunk_size or auto_chunk_size(
        config, B * T, len(dropped), grad=True, memory_budget=execution.memory_budget
    )
    out = jax.tree.map(
        to_host,
        _estimates(
            params,
            pairs,
            jnp.asarray(dropped, jnp.int32),
            interventions,
            config=config,
            metric=metric,
            kinds=kinds,
            qk_fix=qk_fix,
            chunk=min(chunk, len(dropped)),
        ),
    )
    f_clean, f_corrupt, per_drop = out
    scores = {}
    for kind, value in per_drop.items():  # [G, B, ...]
        scores[kind] = np.abs(value).sum(axis=0) / (L - 1) if grad_drop else value[0]
    return NodeAttribution(f_clean=f_clean, f_corrupt=f_corrupt, qk_fix=qk_fix, grad_drop=grad_drop, **scores)


def _hold_delta(value, layer, dropped):
    """Layer `dropped`'s contribution to the residual, its gradient stopped (GradDrop)."""
    return jnp.where(layer == dropped, jax.lax.stop_gradient(value), value)


def _node_values(params, tokens, valid, config: ModelConfig, interventions):
    """Every layer's values the estimates read, `[L, B, T, ...]` each (float32; a mixture's
    expert hidden units and choice in place of `mlp_hidden`), and the final residual."""

    def tap(r, _):
        units = dict(expert_hidden=r.expert_hidden, choice=r.expert_choice) if config.is_moe else {}
        return dict(h=r.h, q=r.q, k=r.k, v=r.v, head_out=r.head_out, mlp_out=r.mlp, mlp_hidden=r.mlp_hidden, **units)

    h, values = run_layers(
        params, embed(params, tokens, config), config, valid=valid, interventions=interventions, tap=tap
    )
    return h, jax.tree.map(lambda x: x if x.dtype == jnp.int32 else x.astype(jnp.float32), values)


@partial(jit, static_argnames=("config", "metric", "kinds", "qk_fix", "chunk"))
def _estimates(params, pairs: PromptPairs, dropped, interventions, *, config, metric, kinds, qk_fix, chunk):
    """`(f_clean, f_corrupt, {kind: [G, B, *node_shape]})`: each kind's estimate under the
    gradient with layer `dropped[g]`'s delta held (L: none)."""
    ivs = as_interventions(interventions)
    h_clean, clean = _node_values(params, pairs.clean, pairs.valid, config, ivs)
    h_corrupt, corrupt = _node_values(params, pairs.corrupt, pairs.valid, config, ivs)
    pairs = with_clean_logits(params, pairs, h_clean, config, metric)
    f_corrupt = final_metric(params, metric, h_corrupt, pairs, config)
    B, T = pairs.clean.shape
    if "neurons" in kinds and config.is_moe:  # the clean run's experts on the corrupt input
        corrupt["expert_hidden"] = expert_units_on(params, pairs.corrupt, pairs.valid, clean["choice"], config, ivs)
    gradient_site = lambda kind: (
        "expert_hidden" if kind == "neurons" and config.is_moe else _GRADIENT_SITE.get(kind, "head_out")
    )  # noqa: E731
    # a linear layer's queries, keys and values: F's gradient at the value heads' inputs
    inputs = {kind: PATCH_SITE[kind] for kind in kinds if kind in ATTENTION_KINDS and config.mixed_mixers}
    sites = sorted({gradient_site(kind) for kind in kinds} | set(inputs.values()))
    h0 = embed(params, pairs.clean, config)

    def per_drop(layer):
        def value(probes):
            probed = tuple(probe(s, probes[s]) for s in sites)
            h, _ = run_layers(
                params,
                h0,
                config,
                valid=pairs.valid,
                interventions=(*ivs, *probed, Intervention("delta", _hold_delta, layer)),
            )
            f = final_metric(params, metric, h, pairs, config)
            return jnp.sum(f), f

        zeros = {s: jnp.zeros((config.num_layers,) + site_shape(s, config, B, T), jnp.float32) for s in sites}
        grads, f = jax.grad(value, has_aux=True)(zeros)
        drops = _output_estimates(grads, clean, corrupt, kinds, config)
        for kind, site in inputs.items():  # [L, B, T, Hs, D] . [L, B, T, D] -> [B, L, Hs, T]
            drops[f"linear {kind}"] = jnp.einsum("lbthd,lbtd->blht", grads[site], clean["h"] - corrupt["h"])
        if any(kind in ATTENTION_KINDS for kind in kinds):
            drops["head_out_gradient"] = grads["head_out"]
        return drops, f

    drops, f = sweep(per_drop, dropped, chunk)
    g_o = drops.pop("head_out_gradient", None)
    if g_o is not None:
        attention = _attention_estimates(g_o, clean, corrupt, pairs.valid, h0, params, config, kinds, qk_fix=qk_fix)
        linear = jnp.asarray(np.isin(np.arange(config.num_layers), config.linear_layers))[:, None, None]
        for kind, value in attention.items():  # [G, B, L, H, T]; a linear layer's rows from its inputs
            if kind in inputs:
                value = jnp.pad(value, ((0, 0),) * 3 + ((0, config.split_heads - value.shape[3]), (0, 0)))
                value = jnp.where(linear, drops.pop(f"linear {kind}"), value)
            drops[kind] = value
    return f[0], f_corrupt, drops


def _output_estimates(grads: dict, clean: dict, corrupt: dict, kinds, config: ModelConfig) -> dict:
    """AtP of heads, MLPs and neurons from F's gradients at their sites: `[B, *node_shape]` (an
    expert's unit summed over the slots of the tokens routed to it)."""
    drop = lambda site: grads[site] * (clean[site] - corrupt[site])  # noqa: E731
    out = {}
    if "heads" in kinds:  # [L, B, T, H, Dh] -> [B, L, H, T]
        out["heads"] = jnp.einsum("lbthd->blht", drop("head_out"))
    if "mlps" in kinds:
        out["mlps"] = jnp.einsum("lbtd->blt", drop("mlp_out"))
    if "neurons" in kinds and config.is_moe:
        routed = jax.nn.one_hot(clean["choice"], config.num_experts, dtype=jnp.float32)  # [L, B, T, k, E]
        out["neurons"] = jnp.einsum("lbtkf,lbtke->blef", drop("expert_hidden"), routed)
    elif "neurons" in kinds:
        out["neurons"] = jnp.einsum("lbtf->blf", drop("mlp_hidden"))
    return out


def _gate_weights(params, config: ModelConfig):
    """What a gated head's gate reads (Qwen3.5): the attention's norm and gate weights, one row
    per layer `[L, ...]` (a linear layer's the first attention layer's, which it never reads);
    None where heads are not gated."""
    if not config.attention_gate:
        return None
    slots = kind_slots(config)
    names = [name for name in params["layers"] if name == "attn_gate" or name.startswith("attn_norm")]
    rows = lambda name: params["layers"][name][np.maximum(slots[name], 0)] if name in slots else params["layers"][name]  # noqa: E731
    return {name: rows(name) for name in names}


def _per_head_input(weights, h, num_heads: int, config: ModelConfig):
    """The attention's normed input `[B, T, H, D]` as each of the H heads reads it (its gate's
    input) from the layer's input `h [B, T, D]`."""
    x = pre_norm(weights, "attn_norm", h, config).astype(jnp.float32)
    return jnp.broadcast_to(x[:, :, None], x.shape[:2] + (num_heads, x.shape[-1]))


def _per_query_head(x, num_heads: int):
    """Keys or values `[B, T, K, Dh]` as each of the H query heads reads them, `[B, T, H, Dh]`."""
    return jnp.repeat(x, num_heads // x.shape[2], axis=2)


def _attention_estimates(
    g_o, clean: dict, corrupt: dict, valid, h0, params, config: ModelConfig, kinds, *, qk_fix: bool
) -> dict:
    """Queries', keys' and values' estimates `[G, B, L, H, T]` from F's gradients at every head's
    output `g_o [G, L, B, T, H, Dh]` (one per dropped layer), layer by layer. A gated head's
    output (Qwen3.5) is its attention times its gate, which its query input moves too."""
    context = layer_context(h0, valid, config)
    H, Dh = config.num_heads, config.v_head_dim
    sinks = params["layers"].get("sinks")

    def one_layer(xs):
        layer, weights, g, q, k, v, q2, k2, v2, h, h2 = xs  # g [G, B, T, H, Dh]; q.. [B, T, H|K, Dh]
        if config.mixed_mixers:  # head_out is as wide as the linear layers' value heads too
            g = g[..., :H, :Dh]
        k, v, k2, v2 = (_per_query_head(x, H) for x in (k, v, k2, v2))
        _, _, mask = context_of_layer(context, layer, config)
        own_sinks = None if sinks is None else sinks[layer]  # (GPT-OSS: each head's sink logit)
        # each head's gate input: its query input, normed (None without gates)
        x, x2 = (None if weights is None else _per_head_input(weights, r, H, config) for r in (h, h2))

        def heads(q, k, v, x):
            o = attend(q, k, v, mask, config, sinks=own_sinks)[1]
            return (o if x is None else gated_heads(weights, x, o, config)).astype(jnp.float32)

        o, pull = jax.vjp(heads, q, k, v, x)
        # the linear estimates: -(gradient at the query, key or value) . (corrupt - clean)
        linear = jax.vmap(pull)(g)
        drop_of = lambda grad, x, x2: jnp.einsum("gbthd,bthd->gbht", grad, x - x2)  # noqa: E731
        out = {}
        if "values" in kinds:
            out["values"] = drop_of(linear[2], v, v2)
        if "queries" in kinds:
            # a query's row of the pattern: every row at its corrupt query at once (rows are independent)
            if qk_fix:
                out["queries"] = jnp.einsum("gbshd,bshd->gbhs", g, o - heads(q2, k, v, x2))
            else:
                out["queries"] = drop_of(linear[0], q, q2) + (0 if x is None else drop_of(linear[3], x, x2))
        if "keys" in kinds:
            if qk_fix:  # a key's column of the pattern: one recomputation per key position

                def key_at(t):
                    patched = heads(q, k.at[:, t].set(k2[:, t]), v, x)
                    return jnp.einsum("gbshd,bshd->gbh", g, o - patched)

                out["keys"] = jnp.moveaxis(jax.lax.map(key_at, jnp.arange(q.shape[1]), batch_size=8), 0, -1)
            else:
                out["keys"] = drop_of(linear[1], k, k2)
        return out

    L = config.num_layers
    per_layer = jax.lax.map(
        one_layer,
        (
            jnp.arange(L),
            _gate_weights(params, config),
            jnp.moveaxis(g_o, 1, 0),
            clean["q"],
            clean["k"],
            clean["v"],
            corrupt["q"],
            corrupt["k"],
            corrupt["v"],
            clean["h"],
            corrupt["h"],
        ),
    )
    return {kind: jnp.moveaxis(value, 0, 2) for kind, value in per_layer.items()}  # [L, G, B, H, T] -> [G, B, L, H, T]
