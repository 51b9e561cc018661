"""Edge attribution: a score for every edge of the graph (`jaxdepth.analyses.edges.graph`) from a
clean and a corrupt run and backward passes, for a batch of prompt pairs.

Definitions (per pair; F is the user's metric of the logits at the pair's last position):

- EAP (Syed et al. 2023): score(u -> v) = (a_clean[u] - a_corrupt[u]) . dF/d in_v, the
  gradient taken in the clean run at v's input (before v's normalization). It is the
  first-order estimate of F(clean) - F(clean with edge u -> v carrying u's corrupt output),
  the drop of F when the edge is corrupted (`jaxdepth.analyses.edges.patching` computes that
  exactly). Summed over the readers of u it is gradient x activation difference at u.
- EAP-IG, 'inputs' (Hanna et al. 2024): the gradient at v is integrated along the straight
  path of the input embeddings from the corrupt to the clean prompt, sum_k w_k dF/d in_v at
  h_0 = e_corrupt + α_k (e_clean - e_corrupt). The edges out of the input then sum to
  F(clean) - F(corrupt) up to the quadrature error (completeness), which the adaptive rule
  certifies.
- EAP-IG, 'activations': for each writer u the path interpolates the output of u's own node
  (the input, all writers of u's attention layer together, or u's MLP) from corrupt to clean,
  with everything after it recomputed; the gradient at v is integrated along that path. The
  edges out of a node then sum to F(clean) - F(clean with that node's output corrupt).
- The EAP-IG package's definitions, for comparison with work that used them:
  'clean-corrupted': (a_clean[u] - a_corrupt[u]) . (dF/d in_v (clean) + dF/d in_v (corrupt)) / 2,
  the two ends of the input path (its trapezoid rule of one interval);
  'eap-ig-activations-pooled': every reader's gradient averaged over all nodes' paths together
  (each node's output a constant on its path, as the package's hooks set it; its rule 'right',
  α_k = k/n, k = 1..n), and every edge scored with that one average. Its out-edges of a node
  have no sum identity.

The paths are integrated by integrated gradients' integrator (`jaxdepth.analyses.ig.integrator`)
with its rules (`jaxdepth.analyses.ig.rules`): a `FixedRule`, 'left' (α_k = k/n, the EAP-IG
package's), 'midpoint', 'gauss' or 'right' (with one step: EAP), or an `AdaptiveRule` (per pair,
Simpson refined until the completeness bound meets its tolerance). Only the evaluations are
edge attribution's own: every reader's gradient at a path point, and F and the input's
integrand along the input path.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxdepth.analyses.edges.ablations import CORRUPT, Patching
from jaxdepth.analyses.edges.graph import EdgeGraph
from jaxdepth.analyses.edges.pairs import PromptPairs, edge_metric, pair_reads
from jaxdepth.analyses.metric_inputs import refuse_readout_padding
from jaxdepth.analyses.metrics import Metric, readout
from jaxdepth.analyses.edges.readers import (
    EdgeRun,
    check_interventions,
    edge_run,
    final_metric,
    pair_readout,
    patched_sets,
    probe_readers,
    reader_probes,
    run_metric,
    shift_node,
)
from jaxdepth.analyses.ig import rules
from jaxdepth.analyses.ig.integrator import Paths, adapt, integrate_final, integrate_fixed
from jaxdepth.core.compilation import jit
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.execution import Execution
from jaxdepth.core.experts import follow_routing
from jaxdepth.core.loops import LayerRun, clean_prefix, run_layers
from jaxdepth.core.model import embed
from jaxdepth.core.progress import track
from jaxdepth.core.saved_result import SavedResult
from jaxdepth.core.sharding import to_host
from jaxdepth.core.sites import as_interventions
from jaxdepth.core.sweep import auto_chunk_size, available_memory_budget, sweep, weighted_sum

__all__ = [
    "edge_attribution",
    "Scoring",
    "EdgeScores",
    "ranked_edges",
    "edge_scores",
    "position_scores",
    "neuron_scores",
    "expert_units_on",
    "expert_unit_differences",
    "expert_neuron_scores",
    "hidden_units",
    "input_paths",
    "node_paths",
    "METHODS",
    "DETAILS",
    "DEFAULT_STEPS",
    "pair_runs",
    "with_clean_logits",
    "input_path_gradients",
    "node_path_gradients",
    "suffix_run",
    "clean_gradients",
    "input_path_points",
    "as_scoring",
]

METHODS = ("eap", "eap-ig-inputs", "eap-ig-activations", "clean-corrupted", "eap-ig-activations-pooled")
# Methods of one evaluation each, of no rule: the clean run's gradient; both ends' gradients averaged.
RULELESS = ("eap", "clean-corrupted")
DETAILS = ("positions", "neurons")  # what edge_attribution resolves besides the edges, on request
DEFAULT_STEPS = 16  # EAP-IG's default rule: FixedRule('left', 16), the EAP-IG package's
# Path points vmapped at once at most: wider vmaps gain little, and each point holds every
# reader's gradient.
MAX_PATH_CHUNK = 32


@dataclasses.dataclass
class EdgeScores(SavedResult):
    """Edge scores of a batch of prompt pairs: `scores [B, W, R]`, per pair, writer and reader
    (exact zeros where there is no edge; `graph.edge_mask`), F on the clean and the corrupt
    prompts (`f_clean`, `f_corrupt [B]`), and for the integrated methods the gradient
    `evaluations [B]` spent per pair, the adaptive rule's certified `bound` and `converged`
    (`[B]`; NaN and False for the fixed rules). `method`, `rule` (for EAP 'clean': the clean
    run's gradient; for clean-corrupted 'ends'), `steps`, `tolerance` and `ablation` say how
    they were computed; under an
    ablation other than 'corrupt', `f_corrupt` is F with every edge ablated. `position_scores
    [B, W, R, T]` (with `edge_attribution(..., detail=['positions'])`, else None): each edge's
    score at each position, summing over positions to `scores` (exact zeros before the pairs'
    shared prefix ends and after a pair's last position, where F reads nothing). `neuron_scores
    [B, L, F]` (with detail 'neurons'): each MLP hidden unit's activation difference times F's
    gradient at it, a layer's units summing to its MLP's node score (`node_scores`)."""

    scores: np.ndarray
    f_clean: np.ndarray
    f_corrupt: np.ndarray
    evaluations: np.ndarray
    bound: np.ndarray
    converged: np.ndarray
    num_layers: int
    num_heads: int
    method: str
    rule: str
    steps: int
    tolerance: Optional[float] = None
    parallel: bool = False  # the model's MLPs read their layer's input (`EdgeGraph.parallel`)
    post_norms: bool = False  # a layer's attention is one writer (`EdgeGraph.post_norms`)
    linear_layers: tuple = ()  # the layers of linear attention (`EdgeGraph.linear_layers`)
    linear_heads: int = 0  # their value heads (`EdgeGraph.linear_heads`)
    position_scores: Optional[np.ndarray] = None  # [B, W, R, T] with detail 'positions', else None
    ablation: str = "corrupt"  # what the clean run was measured against (`ablations.ABLATIONS`)
    neuron_scores: Optional[np.ndarray] = None  # [B, L, F] ([B, L, E, F] of experts) with 'neurons'

    @property
    def graph(self) -> EdgeGraph:
        """The graph of the model the scores are of."""
        return EdgeGraph.of_result(self)

    def at_positions(self, edge: str) -> np.ndarray:
        """`[B, T]`: the edge named `edge`'s score at each position (detail 'positions')."""
        w, r = self.graph.edge_index(edge)
        return self._positions()[:, w, r]

    def top_positions(self, k: int, by: str = "abs") -> list[tuple[str, int, float]]:
        """The `k` (edge, position) pairs of largest mean score over the pairs (`by` as `top`),
        as `(name, position, mean score)`: where along the prompt each edge carries the task."""
        if by not in ("abs", "value"):
            raise ValueError(f"by must be 'abs' or 'value', got {by!r}")
        mean = self._positions().mean(axis=0)
        key = np.where(self.graph.edge_mask[..., None], np.abs(mean) if by == "abs" else mean, -np.inf)
        best = np.argsort(-key, axis=None, kind="stable")[: min(k, int(self.graph.edge_mask.sum()) * mean.shape[-1])]
        return [
            (self.graph.edge_name(w, r), int(t), float(mean[w, r, t]))
            for w, r, t in zip(*np.unravel_index(best, mean.shape))
        ]

    def _positions(self) -> np.ndarray:
        if self.position_scores is None:
            raise ValueError(
                "these scores hold no positions: compute them with edge_attribution(..., detail=['positions'])"
            )
        return self.position_scores

    @property
    def mean(self) -> np.ndarray:
        """`[W, R]`: the scores averaged over the pairs (what circuits are chosen by)."""
        return self.scores.mean(axis=0)

    def node_scores(self) -> np.ndarray:
        """`[B, W]`: each writer's edges summed over its readers. For EAP, gradient x activation
        difference at the writer's output."""
        return self.scores.sum(axis=-1)

    def completeness_gap(self) -> np.ndarray:
        """`[B]`: the input's edges summed, minus F(clean) - F(corrupt). For 'eap-ig-inputs' the
        quadrature error (within `bound` under the adaptive rule); for EAP the first-order
        error."""
        return self.scores[:, 0].sum(axis=-1) - (self.f_clean - self.f_corrupt)

    def top(self, k: int, by: str = "abs") -> list[tuple[str, float]]:
        """The `k` edges of largest mean score (`by` 'abs': largest |score|; 'value': largest
        score), as `(name, mean score)`."""
        order = ranked_edges(self.mean, self.graph, by)[:k]
        return [(self.graph.edge_name(w, r), float(self.mean[w, r])) for w, r in order]

    def score(self, edge: str) -> np.ndarray:
        """`[B]`: the scores of the edge named `edge` (e.g. `'a1.h0->m3'`)."""
        w, r = self.graph.edge_index(edge)
        return self.scores[:, w, r]


def ranked_edges(scores: np.ndarray, graph: EdgeGraph, by: str = "abs") -> np.ndarray:
    """`[n, 2]` (writer, reader) of every edge of `graph`, best first by `scores [W, R]` ('abs':
    |score|, 'value': score); ties keep the graph's order."""
    if by not in ("abs", "value"):
        raise ValueError(f"by must be 'abs' or 'value', got {by!r}")
    edges = np.argwhere(graph.edge_mask)
    key = scores[edges[:, 0], edges[:, 1]]
    key = np.abs(key) if by == "abs" else key
    return edges[np.argsort(-key, kind="stable")]


# ----------------------------------------------------------------------------- device side


@partial(jit, static_argnames="config")
def pair_runs(params, pairs: PromptPairs, config: ModelConfig, interventions=None):
    """The clean and the corrupt run of every pair under `interventions` (`edge_run`): their
    `EdgeRun`s."""
    run = lambda tokens: edge_run(
        params, embed(params, tokens, config), pairs.valid, pairs.last, config, interventions=interventions
    )
    return run(pairs.clean), run(pairs.corrupt)


def with_clean_logits(
    params, pairs: PromptPairs, clean_final, config: ModelConfig, metric: Metric, analysis: str = "edge attribution"
) -> PromptPairs:
    """`pairs` carrying what `metric` reads of the clean run (its final residual `clean_final
    [B, T, D]`): for a metric with `clean=True`, the clean logits at the metric's positions
    (`PromptPairs.clean_logits [B, P, V]`, the LM head run there only); `pairs` as they are for
    any other. A metric of every position is checked here, where the clean run is concrete, not
    to read the pairs' padding (`jaxdepth.analyses.metric_inputs`, refused naming `analysis`):
    at 'last' and 'answer' no padded position reaches a metric."""
    if metric.clean:
        logits = readout(params, clean_final, config, pair_reads(metric, pairs)).logits
        pairs = dataclasses.replace(pairs, clean_logits=logits)
    if metric.reads == "all" and not isinstance(clean_final, jax.core.Tracer):
        clean = pair_readout(params, metric, clean_final, pairs, config)
        jax.eval_shape(lambda: metric(clean))  # its own refusals first (one floating value per pair)
        refuse_readout_padding(metric, clean.real, clean, analysis=analysis)
    return pairs


@partial(jit, static_argnames=("config", "metric", "chunk"))
def input_path_gradients(
    params, pairs: PromptPairs, prefix, nodes, config: ModelConfig, metric, chunk: int, *, interventions=None
):
    """`sum_k w_k` of the gradient of F at every reader's input (`reader_probes`' dict) at
    h_0 = e_corrupt + α_k (e_clean - e_corrupt), `nodes = (alphas [n], weights [n])`, `chunk`
    nodes vmapped at a time; positions after the shared `prefix` only (`suffix_run`)."""
    e_clean, e_corrupt = _suffix_embeddings(params, pairs, prefix, config)

    def gradient(alpha):
        h0 = e_corrupt + alpha.astype(e_clean.dtype) * (e_clean - e_corrupt)
        return _reader_gradient(params, h0, pairs, config, metric, (), prefix, interventions)

    return weighted_sum(gradient, *nodes, chunk)


@partial(jit, static_argnames=("config", "metric", "chunk"))
def node_path_gradients(params, pairs: PromptPairs, prefix, path, nodes, *, config, metric, chunk: int):
    """As `input_path_gradients` on the path of one node of the 'activations' variant, `path =
    (node, delta, detach, interventions)`: the output of node `node` (0 the input, 2l + 1
    attention layer l, its heads or its one writer, 2l + 2 MLP l) is a_corrupt + α_k `delta`
    (`delta = a_clean - a_corrupt`, `[W, B, S, D]`, after the shared `prefix`), everything after
    it recomputed (`detach`: the node's output a constant, as `shift_node` says), under
    `interventions`. All are traced: one compilation serves every node."""
    e_clean, _ = _suffix_embeddings(params, pairs, prefix, config)
    node, delta, detach, interventions = path

    def gradient(alpha):
        shift = shift_node(EdgeGraph.of(config), node, alpha - 1, delta, detach)
        return _reader_gradient(params, e_clean, pairs, config, metric, shift, prefix, interventions)

    return weighted_sum(gradient, *nodes, chunk)


def _reader_gradient(params, h0, pairs, config, metric, shift=(), prefix=None, interventions=None):
    """The gradient of F summed over the pairs at every reader's input (`reader_probes`' dict),
    from `h0` under `interventions` and then the edge interventions `shift`."""

    def value(probes):
        ivs = (interventions, shift, probe_readers(probes, config.num_layers))
        h, _ = run_layers(params, h0, config, valid=pairs.valid, interventions=ivs, run=LayerRun(prefix=prefix))
        return jnp.sum(final_metric(params, metric, h, pairs, config))

    return jax.grad(value)(reader_probes(config, *h0.shape[:2]))


def _suffix_embeddings(params, pairs: PromptPairs, prefix, config: ModelConfig):
    """The clean and corrupt embeddings of the positions after `prefix` (all without one)."""
    P = 0 if prefix is None else prefix[0].shape[2]
    return embed(params, pairs.clean[:, P:], config, offset=P), embed(params, pairs.corrupt[:, P:], config, offset=P)


_prefix_key_values = jit(clean_prefix, static_argnames=("config", "length"))


def suffix_run(
    params, pairs: PromptPairs, clean: EdgeRun, config, metric: Metric, interventions=None, ablation=CORRUPT
):
    """`(P, prefix)`: the positions every pair shares (`PromptPairs.shared_prefix`) and the clean
    run's keys and values there (`run_layers`' `prefix`; None when P is 0). Every edge's
    activation difference is zero before P, so scores and patching need only positions P..:
    one computation for the prefix instead of one per gradient or patched run. Under
    `interventions` P is 0: their data covers every position, and the keys of a layer under
    them are not read off its input alone. Under an `ablation` other than the corrupt run's, P
    is 0: the ablated values differ from the clean ones everywhere; and for a `metric` that
    reads every position (`reads='all'`): only one of the last position runs on the suffix."""
    whole = as_interventions(interventions) or ablation.kind != "corrupt" or metric.reads == "all"
    P = 0 if whole else pairs.shared_prefix()
    if P == 0:
        return 0, None
    return P, _prefix_key_values(params, clean.residuals, P, config, valid=pairs.valid)


@partial(jit, static_argnames=("config", "metric"))
def clean_gradients(params, pairs: PromptPairs, prefix, config: ModelConfig, metric, interventions=None):
    """The gradient of F at every reader's input in the clean run (EAP), as `reader_probes`;
    positions after the shared `prefix` only."""
    e_clean = _suffix_embeddings(params, pairs, prefix, config)[0]
    return _reader_gradient(params, e_clean, pairs, config, metric, (), prefix, interventions)


@partial(jit, static_argnames="per_position")
def edge_scores(delta, gradients: dict, edge_mask, per_position: bool = False, readers=None):
    """`[B, W, R]`: `delta[w] . gradients[r]` summed over positions and channels, for every
    writer w (`delta [W, B, T, D]`) and reader r (`gradients` as `reader_probes`; stacked in
    the graph's reader order), zero where `edge_mask` has no edge. With `per_position`,
    `[B, W, R, T]`: the terms of each position apart (summed over channels only). `readers`:
    where layers have heads of different counts, each reader's index in the padded layout the
    gradients are in (`EdgeGraph.padded_readers`); None where they are the graph's."""
    t = "t" if per_position else ""
    delta = delta.astype(jnp.float32)
    head = lambda g: jnp.einsum(f"wbtd,lbthd->bwlh{t}", delta, g.astype(jnp.float32))
    mlp = jnp.einsum(f"wbtd,lbtd->bwl{t}", delta, gradients["mlp"].astype(jnp.float32))
    # [B, W, L, 3H + 1(, T)]: each layer's readers in the graph's order (q, k, v heads, the MLP)
    per_layer = jnp.concatenate(
        [head(gradients["q"]), head(gradients["k"]), head(gradients["v"]), mlp[:, :, :, None]], 3
    )
    B, W, positions = per_layer.shape[0], per_layer.shape[1], per_layer.shape[4:]
    logits = jnp.einsum(f"wbtd,btd->bw{t}", delta, gradients["logits"].astype(jnp.float32))
    scores = jnp.concatenate([per_layer.reshape(B, W, -1, *positions), logits[:, :, None]], axis=2)
    if readers is not None:
        scores = jnp.take(scores, readers, axis=2)
    return jnp.where(edge_mask[(...,) + (None,) * len(positions)], scores, 0.0)


@partial(jit, static_argnames="config")
def hidden_units(params, tokens, valid, config: ModelConfig, interventions=None):
    """`[L, B, T, F]`: every MLP's hidden units (`mlp_hidden`) on `tokens`, under `interventions`."""
    tap = lambda record, _: record.mlp_hidden
    return run_layers(params, embed(params, tokens, config), config, valid=valid, interventions=interventions, tap=tap)[
        1
    ]


def expert_units_on(params, tokens, valid, choice, config: ModelConfig, interventions):
    """`[L, B, T, k, F]` (float32): the experts' hidden units on `tokens` with the routing
    `choice` `[L, B, T, k]` (another run's, slot by slot: `follow_routing`), where an expert
    neuron's patch reads its corrupt value."""
    tap = lambda r, _: r.expert_hidden  # noqa: E731
    ivs = (*as_interventions(interventions), follow_routing(choice))
    units = run_layers(params, embed(params, tokens, config), config, valid=valid, interventions=ivs, tap=tap)[1]
    return units.astype(jnp.float32)


@partial(jit, static_argnames="config")
def expert_unit_differences(params, pairs: PromptPairs, config: ModelConfig, interventions=None):
    """A mixture's neurons, clean minus corrupt: `(delta [L, B, T, k, F], choice [L, B, T, k],
    weights [L, B, T, k])`, each chosen expert's hidden units on the clean prompt less its units
    on the corrupt prompt under the clean routing (`expert_units_on`), and the clean run's
    choice and weights, through which the units reach the MLP's output."""

    def tap(r, _):
        return r.expert_hidden, r.expert_choice, jnp.take_along_axis(r.expert_weights, r.expert_choice, axis=-1)

    h0 = embed(params, pairs.clean, config)
    hidden, choice, weights = run_layers(params, h0, config, valid=pairs.valid, interventions=interventions, tap=tap)[1]
    corrupt = expert_units_on(params, pairs.corrupt, pairs.valid, choice, config, interventions)
    return hidden.astype(jnp.float32) - corrupt, choice, weights.astype(jnp.float32)


@partial(jit, static_argnames="num_experts")
def expert_neuron_scores(differences, gradients: dict, down, num_experts: int):
    """`[B, L, E, F]`: each expert's hidden unit's activation difference times F's gradient at
    it, summed over the tokens routed to the expert (`differences` from
    `expert_unit_differences`, its positions those the gradients have): the gradient at the
    MLP's output (as `neuron_scores`) through the expert's down projection (`down [L, E, F, D]`)
    and its weight. Unlike a dense MLP's, a layer's units need not sum to its MLP's node score:
    the corrupt prompt's MLP output is also routed otherwise, which no unit carries."""
    delta, choice, weights = differences
    routed = jax.nn.one_hot(choice, num_experts, dtype=jnp.float32) * weights[..., None]  # [L, B, T, k, E]
    per_expert = jnp.einsum("lbtkf,lbtke->lbtef", delta, routed)
    return jnp.einsum("lbtef,lbtd,lefd->blef", per_expert, _gradient_after_mlps(gradients), down.astype(jnp.float32))


def _gradient_after_mlps(gradients: dict):
    """`[L, B, T, D]`: F's gradient at each layer's MLP output, the sum of the gradients at
    every reader after it (the readers of layers l + 1.. and the logits)."""
    per_layer = sum(gradients[k].astype(jnp.float32).sum(axis=3) for k in ("q", "k", "v"))
    per_layer = per_layer + gradients["mlp"].astype(jnp.float32)  # [L, B, T, D]: each layer's readers
    from_layer = jnp.cumsum(per_layer[::-1], axis=0)[::-1]  # [l]: the readers of layers l..
    return jnp.concatenate([from_layer[1:], jnp.zeros_like(from_layer[:1])]) + gradients["logits"][None]


@jit
def neuron_scores(delta_hidden, gradients: dict, down):
    """`[B, L, F]`: each MLP hidden unit's activation difference (`delta_hidden [L, B, T, F]`)
    times F's gradient at it, summed over positions. The gradient at MLP l's output is the sum
    of the gradients at every reader after it (the readers of layers l + 1.. and the logits),
    and through the down projection (`down [L, F, D]`) it is the gradient at the hidden units:
    a layer's units sum to its MLP's node score."""
    at_hidden = jnp.einsum("lbtd,lfd->lbtf", _gradient_after_mlps(gradients), down.astype(jnp.float32))
    return jnp.einsum("lbtf,lbtf->blf", delta_hidden.astype(jnp.float32), at_hidden)


def position_scores(delta, gradients: dict, edge_mask, prefix_length: int = 0, readers=None) -> np.ndarray:
    """`[B, W, R, P + T]` on the host: `edge_scores(..., per_position=True)` of the positions
    after a shared prefix of `prefix_length` (P) positions (`delta` and `gradients` hold the T
    after it), with exact zeros at the prefix's, where no writer's output differs. Computed a
    block of positions at a time, each block's `[B, W, R, c]` within an eighth of the free
    memory (a model of many heads has hundreds of thousands of edges per position). `readers`
    as `edge_scores`'."""
    W, B, T = delta.shape[:3]
    per_position = B * W * edge_mask.shape[-1] * 4 * 2  # the block and the einsums' partial products
    block = int(np.clip(available_memory_budget() // 8 // per_position, 1, T))
    out = np.zeros((B, W, edge_mask.shape[-1], prefix_length + T), np.float32)
    for start in range(0, T, block):
        at = slice(start, start + block)
        part = {k: g[:, at] if k == "logits" else g[:, :, at] for k, g in gradients.items()}
        out[..., prefix_length + start : prefix_length + start + block] = to_host(
            edge_scores(delta[:, :, at], part, edge_mask, per_position=True, readers=readers)
        )
    return out


@partial(jit, static_argnames=("config", "metric", "chunk"))
def input_path_points(params, pairs: PromptPairs, alphas, config: ModelConfig, metric, chunk: int, interventions=None):
    """The adaptive rule's evaluations on the input path of one pair (`integrator.Paths.points`):
    φ(α) = F(h_0(α)) `[n]` and the integrand per position `[n, T]`, sum_c (e_clean - e_corrupt)
    dF/dh_0 (the plain forward: the input's edges sum to exactly this), `chunk` at a time.
    Interventions act on h_0 as on the readers' runs (`input_path_gradients`): at `resid_pre` of
    layer 0 after the input writes, where a site's path (`jaxdepth.analyses.ig.path`) would set
    the value after them."""
    e_clean, e_corrupt = embed(params, pairs.clean, config), embed(params, pairs.corrupt, config)

    def one(alpha):
        def f(h0):
            h, _ = run_layers(params, h0, config, valid=pairs.valid, interventions=interventions)
            return jnp.sum(final_metric(params, metric, h, pairs, config))

        phi, g = jax.value_and_grad(f)(e_corrupt + alpha.astype(e_clean.dtype) * (e_clean - e_corrupt))
        return phi, jnp.sum(g.astype(jnp.float32) * (e_clean - e_corrupt).astype(jnp.float32), axis=-1)[0]

    return sweep(one, alphas, chunk)


def input_paths(params, pairs: PromptPairs, prefix, config: ModelConfig, metric, chunk: int, interventions=None):
    """EAP-IG 'inputs' as paths of the integrator (`jaxdepth.analyses.ig.integrator`): the input
    embeddings' path of pair b, keyed b (None: every pair at once, a fixed rule's one sweep).
    `weighted` integrates every reader's gradient (`input_path_gradients`), `points` evaluates F
    and the input's integrand (`input_path_points`)."""

    def select(b):
        if b is None:
            return pairs, prefix
        return pairs.select([b]), None if prefix is None else jax.tree.map(lambda x: x[:, b : b + 1], prefix)

    def weighted(b, alphas, weights, size):
        one, one_prefix = select(b)
        return input_path_gradients(
            params, one, one_prefix, (alphas, weights), config, metric, size, interventions=interventions
        )

    def points(b, alphas, grad, size):  # every evaluation is a gradient: `grad` (the forward grid's False) aside
        return input_path_points(params, select(b)[0], alphas, config, metric, size, interventions)

    return Paths(weighted=weighted, points=points, chunk=chunk, call_size=chunk)


def node_paths(params, pairs: PromptPairs, prefix, shift, config: ModelConfig, metric, chunk: int, interventions=None):
    """EAP-IG 'activations' as paths of the integrator: node n's output path, keyed n
    (`node_path_gradients`; `shift = (delta, detach)` as there); fixed rules only."""
    delta, detach = shift

    def weighted(node, alphas, weights, size):
        path = (jnp.int32(node), delta, jnp.bool_(detach), interventions)
        return node_path_gradients(
            params, pairs, prefix, path, (alphas, weights), config=config, metric=metric, chunk=size
        )

    return Paths(weighted=weighted, chunk=chunk, call_size=chunk)


# ----------------------------------------------------------------------------- the driver


@dataclasses.dataclass(frozen=True)
class Scoring:
    """What `edge_attribution` computes. `method`: 'eap' (one backward pass, gradients of the
    clean run; no rule), 'clean-corrupted' (the clean and the corrupt run's gradients averaged;
    no rule), 'eap-ig-inputs', 'eap-ig-activations' or 'eap-ig-activations-pooled' (the module
    docstring) with `rule`: a `FixedRule` (default `FixedRule('left', 16)`, the EAP-IG
    package's; for the pooled activations `FixedRule('right', 16)`, its rule) or, for
    'eap-ig-inputs', an `AdaptiveRule` (one tolerance; per pair, its budget of gradient
    evaluations plus one per final node); a rule's name stands for that rule with its defaults
    (`jaxdepth.analyses.ig.rules.as_rule`: 256 steps). The rule is resolved and checked here
    (`Scoring('eap-ig-inputs').rule` is the default one). `detail`: what to resolve besides the
    edges (`DETAILS`): 'positions', each edge's score at each position
    (`EdgeScores.position_scores [B, W, R, T]`, the terms that sum to `scores`: the edge
    carrying its writer's ablated output at that position alone, to first order); 'neurons',
    each MLP hidden unit's score (`EdgeScores.neuron_scores [B, L, F]`, summing over a layer's
    units to its MLP's node score)."""

    method: str = "eap"
    rule: Union[rules.Rule, str, None] = None
    detail: Sequence[str] = ()

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        object.__setattr__(self, "rule", _edge_rule(self.method, self.rule))
        detail = (self.detail,) if isinstance(self.detail, str) else tuple(self.detail)
        unknown = [d for d in detail if d not in DETAILS]
        if unknown:
            raise ValueError(f"detail takes {DETAILS}, got {unknown}")
        object.__setattr__(self, "detail", detail)


def as_scoring(scoring) -> Scoring:
    """`scoring` as a `Scoring`: a method's name stands for `Scoring(method)`."""
    if isinstance(scoring, Scoring):
        return scoring
    if isinstance(scoring, str):
        return Scoring(scoring)
    raise TypeError(f"scoring must be a Scoring or a method's name (one of {METHODS}), got {type(scoring).__name__}")


def edge_attribution(
    params,
    pairs: PromptPairs,
    config: ModelConfig,
    metric: Metric,
    scoring: Union[Scoring, str] = "eap",
    *,
    patching: Patching = Patching(),
    execution: Execution = Execution(),
) -> EdgeScores:
    """Scores of every edge for every pair of `pairs` (`jaxdepth.analyses.edges.pairs.prompt_pairs`,
    B pairs of T positions) under `metric`, a `jaxdepth.Metric` (one value per pair `[B]`; at
    each pair's last position, 'last' or 'answer', or at every position, 'all'; with the clean
    run's logits where it says `clean=True`; `jaxdepth.analyses.metrics`: `logit_difference`,
    `kl_clean_to_run`, ...); static: define it once to reuse compilations. A plain function of
    the logits, the form this took before, is refused with the form to write.

    scoring: what is computed, a `Scoring` (the method, its rule and the detail), or a method's
    name (`Scoring(method)`). `patching` (`jaxdepth.analyses.edges.ablations.Patching`): what
    the clean run is measured against, its `ablation` (the pair's corrupt run, the default;
    `ZERO`; `mean_ablation(...)`; 'eap-ig-inputs' and 'clean-corrupted' take the corrupt run
    only), and its `interventions` (`jaxdepth.core.sites`), which act on every run, clean,
    corrupt and along the paths: the edges of the model as they intervene on it (a skipped
    layer, a steering vector). `execution`: how it runs (`jaxdepth.Execution`), of which edges
    read `chunk_size` (the path points vmapped at once; default: what `memory_budget`
    allows) and `progress`. Returns an `EdgeScores` (`scores [B, W, R]`)."""
    scoring = as_scoring(scoring)
    method, rule = scoring.method, scoring.rule
    metric = edge_metric(metric, "edge_attribution", pairs)
    execution = _edge_execution(execution)
    ablation, interventions = patching.ablation, patching.interventions
    if ablation.kind != "corrupt" and method in ("eap-ig-inputs", "clean-corrupted"):
        raise ValueError(
            f"{method!r} takes gradients along the input embeddings from the corrupt prompt to the clean one: it has "
            f"no path to a {ablation.kind!r} ablation (as in the EAP-IG package); use 'eap' or 'eap-ig-activations'"
        )
    graph = EdgeGraph.of(config)
    pairs.check(config, metric)
    check_interventions(interventions, graph)
    B, T = pairs.clean.shape
    clean, corrupt = pair_runs(params, pairs, config, interventions)
    pairs = with_clean_logits(params, pairs, clean.final, config, metric)
    P, prefix = suffix_run(params, pairs, clean, config, metric, interventions, ablation)
    ablated = jnp.broadcast_to(ablation.writers(graph, pairs, corrupt, config.hidden_size), clean.writers.shape)
    delta = (clean.writers - ablated)[:, :, P:]
    f_clean = to_host(run_metric(params, metric, clean, pairs, config, clean=True))
    if ablation.kind == "corrupt":
        f_corrupt = to_host(run_metric(params, metric, corrupt, pairs, config))
    else:  # every edge ablated: the empty circuit
        every = jnp.asarray(graph.edge_mask)[None]
        f_corrupt = to_host(patched_sets(params, pairs, None, every, ablated, interventions, config, metric))[0]
    tokens = B * (T - P)
    chunk = execution.chunk_size or auto_chunk_size(
        config,
        tokens,
        MAX_PATH_CHUNK,
        grad=True,
        memory_budget=execution.memory_budget,
        extra_bytes=_reader_bytes(config, tokens) + _logit_bytes(config, tokens, metric),
    )
    mask = jnp.asarray(graph.edge_mask)
    bound, converged = np.full(B, np.nan), np.zeros(B, bool)
    scores = np.zeros((B, graph.num_writers, graph.num_readers), np.float32)
    detail = _edge_detail(scoring.detail, ablation, graph, config)
    positions = np.zeros(scores.shape + (T,), np.float32) if "positions" in detail else None
    neurons, delta_hidden = None, None
    if "neurons" in detail and config.is_moe:  # the experts' units, under the clean routing
        differences = expert_unit_differences(params, pairs, config, interventions)
        delta_hidden = jax.tree.map(lambda x: x[:, :, P:], differences)
        neurons = np.zeros((B, config.num_layers, config.num_experts, config.intermediate_size), np.float32)
    elif "neurons" in detail:
        hidden = lambda tokens: hidden_units(params, tokens, pairs.valid, config, interventions)
        delta_hidden = (hidden(pairs.clean) - hidden(pairs.corrupt))[:, :, P:]
        neurons = np.zeros((B, config.num_layers, delta_hidden.shape[-1]), np.float32)
    mlp_writers = np.array([graph.mlp_writer(layer) for layer in range(config.num_layers)])
    readers = None if graph.uniform else jnp.asarray(graph.padded_readers)

    def score(writers, batch, grads):  # the scores of `writers` of the pairs `batch`, from the readers' gradients
        part = delta[writers][:, batch]
        scores[batch, writers] = to_host(edge_scores(part, grads, mask[writers], readers=readers))
        if positions is not None:
            positions[batch, writers] = position_scores(part, grads, mask[writers], P, readers)
        layers = np.flatnonzero(np.isin(mlp_writers, np.arange(graph.num_writers)[writers]))
        if neurons is not None and len(layers) and config.is_moe:
            part = jax.tree.map(lambda x: x[:, batch], delta_hidden)
            units = to_host(expert_neuron_scores(part, grads, params["layers"]["expert_down"], config.num_experts))
            neurons[batch, layers] = units[:, layers]
        elif neurons is not None and len(layers):
            units = to_host(neuron_scores(delta_hidden[:, batch], grads, params["layers"]["down"]))
            neurons[batch, layers] = units[:, layers]

    every_writer, every_pair = slice(None), slice(None)
    nodes = range(2 * config.num_layers + 1)
    if method == "eap":
        score(every_writer, every_pair, clean_gradients(params, pairs, prefix, config, metric, interventions))
        evaluations = np.ones(B, np.int64)
    elif method == "clean-corrupted":  # the gradients at both ends of the input path, averaged
        paths = input_paths(params, pairs, prefix, config, metric, 2, interventions)
        ends, halves = np.array([0.0, 1.0], np.float32), np.array([0.5, 0.5], np.float32)
        score(every_writer, every_pair, paths.weighted(None, ends, halves, 2))
        evaluations = np.full(B, 2, np.int64)
    elif method == "eap-ig-activations":
        paths = node_paths(params, pairs, prefix, (delta, False), config, metric, chunk, interventions)
        for node in track(nodes, execution.progress, "EAP-IG, activations (nodes)"):
            # the node's writers score along its own path
            score(np.flatnonzero(graph.writer_nodes == node), every_pair, integrate_fixed(paths, node, rule))
        evaluations = np.full(B, rule.steps * len(nodes), np.int64)
    elif method == "eap-ig-activations-pooled":  # every writer scores along every node's path, averaged
        paths = node_paths(params, pairs, prefix, (delta, True), config, metric, chunk, interventions)
        pooled = None
        for node in track(nodes, execution.progress, "EAP-IG, activations pooled (nodes)"):
            grads = integrate_fixed(paths, node, rule)
            pooled = grads if pooled is None else jax.tree.map(jnp.add, pooled, grads)
        score(every_writer, every_pair, jax.tree.map(lambda g: g / len(nodes), pooled))
        evaluations = np.full(B, rule.steps * len(nodes), np.int64)
    elif isinstance(rule, rules.AdaptiveRule):
        paths = input_paths(params, pairs, prefix, config, metric, chunk, interventions)
        evaluations = np.zeros(B, np.int64)
        for b in track(range(B), execution.progress, "EAP-IG, adaptive (pairs)"):
            (finished,) = adapt(paths, [b], float(f_clean[b]), rule)  # the nodes, by plain gradients
            score(every_writer, slice(b, b + 1), integrate_final(paths, b, finished))  # readers' gradients there
            evaluations[b] = finished.evaluations + len(finished.node_weights()[0])
            bound[b], converged[b] = finished.bound, finished.converged
    else:
        paths = input_paths(params, pairs, prefix, config, metric, chunk, interventions)
        score(every_writer, every_pair, integrate_fixed(paths, None, rule))
        evaluations = np.full(B, rule.steps, np.int64)
    return EdgeScores(
        scores=scores,
        position_scores=positions,
        neuron_scores=neurons,
        f_clean=np.asarray(f_clean, np.float32),
        f_corrupt=np.asarray(f_corrupt, np.float32),
        evaluations=evaluations,
        bound=bound,
        converged=converged,
        method=method,
        rule=("clean" if method == "eap" else "ends") if rule is None else rule.name,
        steps=int(evaluations[0]) if rule is None else rule.evaluations,
        tolerance=rule.tolerance if isinstance(rule, rules.AdaptiveRule) else None,
        ablation=ablation.kind,
        **graph.fields(),
    )


def _edge_rule(method: str, rule) -> Optional[rules.Rule]:
    """The rule `method` runs: None for EAP and clean-corrupted (their gradients are at the
    path's ends), else `rule` as a value (default `FixedRule('left', DEFAULT_STEPS)`; for the
    pooled activations, the EAP-IG package's `FixedRule('right', DEFAULT_STEPS)`), refused
    where the method cannot run it."""
    if method in RULELESS:
        if rule is not None:
            raise ValueError(f"a rule is EAP-IG's: method {method!r} takes the gradients at the path's ends, no rule")
        return None
    default = "right" if method == "eap-ig-activations-pooled" else "left"
    rule = rules.FixedRule(default, DEFAULT_STEPS) if rule is None else rules.as_rule(rule)
    if isinstance(rule, rules.AdaptiveRule):
        if method != "eap-ig-inputs":
            raise ValueError("the adaptive rule certifies the input path's completeness: use it with 'eap-ig-inputs'")
        if isinstance(rule.tolerance, tuple):
            raise ValueError("EAP-IG's adaptive rule takes one tolerance (a tuple is one per attributed layer)")
    return rule


def _edge_detail(detail: tuple, ablation, graph: EdgeGraph, config: ModelConfig) -> tuple[str, ...]:
    """`detail` (names of `DETAILS`, `Scoring` checked them) checked against the ablation and
    the graph: 'neurons' needs the corrupt run's hidden units and an MLP output linear in them
    (no norm after the MLP), and units of one kind (a dense MLP's, or a mixture's experts')."""
    if "neurons" in detail and config.mixed_mlps:
        raise ValueError(
            "neuron scores of a model with dense layers among its mixtures of experts are not implemented: the two "
            "kinds' units have no one index"
        )
    if "neurons" in detail and (ablation.kind != "corrupt" or graph.post_norms):
        why = "under the corrupt ablation only" if ablation.kind != "corrupt" else "without a norm after the MLP"
        raise ValueError(
            f"neuron scores are the hidden units' activation differences times their gradients, {why}: an MLP's "
            "output must be linear in its hidden units, and the units' ablated values are the corrupt run's"
        )
    return detail


def _edge_execution(execution: Execution) -> Execution:
    """`execution`, refused where it sets what edge attribution does not read: its chunk size,
    memory budget and progress are all it reads (no backward is chosen, no layer counted)."""
    if not isinstance(execution, Execution):
        raise TypeError(f"execution must be a jaxdepth.Execution, got {type(execution).__name__}")
    defaults = Execution()
    own = [f for f in ("backward", "nonfinite", "on_layer") if getattr(execution, f) != getattr(defaults, f)]
    if own:
        raise ValueError(
            f"edge attribution reads an Execution's chunk_size, memory_budget and progress; it has no use for "
            f"{', '.join(own)}"
        )
    return execution


def _logit_bytes(config: ModelConfig, tokens: int, metric: Metric) -> int:
    """What a metric of every position adds to a path point: the logits at every position, their
    softmax and their gradient (float32)."""
    return config.vocab_size * tokens * 4 * 3 if metric.reads == "all" else 0


def _reader_bytes(config: ModelConfig, tokens: int) -> int:
    """What one path point holds beyond its layers' activations: every reader's input, its stored
    copy and its gradient (`[L, tokens, 3H + 1, D]` each, float32; H the heads of a split layer)."""
    return config.num_layers * tokens * (3 * config.split_heads + 1) * config.hidden_size * 4 * 3
