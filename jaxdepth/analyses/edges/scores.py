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
  (the input, all heads of u's attention layer together, or u's MLP) from corrupt to clean,
  with everything after it recomputed; the gradient at v is integrated along that path. The
  edges out of a node then sum to F(clean) - F(clean with that node's output corrupt). (The
  EAP-IG package instead averages every reader's gradient over all nodes' paths together.)

The quadrature is the integrated-gradients engine's (`jaxdepth.analyses.ig.rules`): 'left'
(α_k = k/n, the EAP-IG package's), 'midpoint', 'gauss', 'right' (with one step: EAP), or
'adaptive' (per pair, Simpson refined until the completeness bound meets `tolerance`).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxdepth.analyses.edges.graph import EdgeGraph
from jaxdepth.analyses.edges.pairs import PromptPairs, metric_values
from jaxdepth.analyses.edges.readers import (
    EdgeRun,
    check_interventions,
    edge_run,
    logits_at,
    probe_readers,
    reader_probes,
    shift_node,
)
from jaxdepth.analyses.ig import rules
from jaxdepth.analyses.ig.checks import check_rule
from jaxdepth.core.compilation import jit
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.loops import clean_key_values, run_layers
from jaxdepth.core.model import embed
from jaxdepth.core.progress import ProgressLike, track
from jaxdepth.core.saved_result import SavedResult
from jaxdepth.core.sharding import to_host
from jaxdepth.core.sites import as_interventions
from jaxdepth.core.sweep import available_memory_budget, member_bytes, sweep_sum

METHODS = ("eap", "eap-ig-inputs", "eap-ig-activations")
DEFAULT_STEPS = 16


@dataclasses.dataclass
class EdgeScores(SavedResult):
    """Edge scores of a batch of prompt pairs: `scores [B, W, R]`, per pair, writer and reader
    (exact zeros where there is no edge; `graph.edge_mask`), F on the clean and the corrupt
    prompts (`f_clean`, `f_corrupt [B]`), and for the integrated methods the gradient
    `evaluations [B]` spent per pair, the adaptive rule's certified `bound` and `converged`
    (`[B]`; NaN and False for the fixed rules). `method`, `rule` (for EAP 'clean': the clean
    run's gradient), `steps` and `tolerance` say how they were computed."""

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

    @property
    def graph(self) -> EdgeGraph:
        """The graph of the model the scores are of."""
        return EdgeGraph(self.num_layers, self.num_heads)

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
        params, embed(params, tokens), pairs.valid, pairs.last, config, interventions=interventions
    )
    return run(pairs.clean), run(pairs.corrupt)


@partial(jit, static_argnames=("config", "metric", "chunk"))
def input_path_gradients(
    params, pairs: PromptPairs, prefix, alphas, weights, config: ModelConfig, metric, chunk: int, *, interventions=None
):
    """`sum_k w_k` of the gradient of F at every reader's input (`reader_probes`' dict) at
    h_0 = e_corrupt + α_k (e_clean - e_corrupt), `chunk` nodes vmapped at a time; positions
    after the shared `prefix` only (`suffix_run`)."""
    e_clean, e_corrupt = _suffix_embeddings(params, pairs, prefix)

    def one(node):
        alpha, weight = node
        h0 = e_corrupt + alpha.astype(e_clean.dtype) * (e_clean - e_corrupt)
        return _scaled(weight, _reader_gradient(params, h0, pairs, config, metric, (), prefix, interventions))

    return sweep_sum(one, (alphas, weights), chunk)


@partial(jit, static_argnames=("config", "metric", "chunk"))
def node_path_gradients(
    params, pairs: PromptPairs, prefix, delta, node, alphas, weights, *, config, metric, chunk: int, interventions=None
):
    """As `input_path_gradients` on the path of one node of the 'activations' variant: the
    output of node `node` (0 the input, 2l + 1 attention layer l, 2l + 2 MLP l; traced, so one
    compilation serves every node) is a_corrupt + α_k `delta` (`delta = a_clean - a_corrupt`,
    `[W, B, S, D]`, after the shared `prefix`), everything after it recomputed."""
    e_clean, _ = _suffix_embeddings(params, pairs, prefix)

    def one(point):
        alpha, weight = point
        shift = shift_node(EdgeGraph.of(config), node, alpha - 1, delta)
        return _scaled(weight, _reader_gradient(params, e_clean, pairs, config, metric, shift, prefix, interventions))

    return sweep_sum(one, (alphas, weights), chunk)


def _scaled(weight, tree):
    return jax.tree.map(lambda x: weight.astype(x.dtype) * x, tree)


def _reader_gradient(params, h0, pairs, config, metric, shift=(), prefix=None, interventions=None):
    """The gradient of F summed over the pairs at every reader's input (`reader_probes`' dict),
    from `h0` under `interventions` and then the edge interventions `shift`."""

    def value(probes):
        ivs = (interventions, shift, probe_readers(probes, config.num_layers))
        h, _ = run_layers(params, h0, config, valid=pairs.valid, interventions=ivs, prefix=prefix)
        return jnp.sum(metric_values(metric, logits_at(params, h, pairs.last, config, prefix), pairs.labels))

    return jax.grad(value)(reader_probes(config, *h0.shape[:2]))


def _suffix_embeddings(params, pairs: PromptPairs, prefix):
    """The clean and corrupt embeddings of the positions after `prefix` (all without one)."""
    P = 0 if prefix is None else prefix[0].shape[2]
    return embed(params, pairs.clean[:, P:]), embed(params, pairs.corrupt[:, P:])


@partial(jit, static_argnames=("config", "length"))
def _prefix_key_values(params, residuals, valid, config: ModelConfig, length: int):
    keys, values = clean_key_values(params, residuals, config, valid=valid)
    return keys[:, :, :length], values[:, :, :length]


def suffix_run(params, pairs: PromptPairs, clean: EdgeRun, config: ModelConfig, interventions=None):
    """`(P, prefix)`: the positions every pair shares (`PromptPairs.shared_prefix`) and the clean
    run's keys and values there (`run_layers`' `prefix`; None when P is 0). Every edge's
    activation difference is zero before P, so scores and patching need only positions P..:
    one computation for the prefix instead of one per gradient or patched run. Under
    `interventions` P is 0: their data covers every position, and the keys of a layer under
    them are not read off its input alone."""
    P = 0 if as_interventions(interventions) else pairs.shared_prefix()
    if P == 0:
        return 0, None
    return P, _prefix_key_values(params, clean.residuals, pairs.valid, config, P)


@partial(jit, static_argnames=("config", "metric"))
def clean_gradients(params, pairs: PromptPairs, prefix, config: ModelConfig, metric, interventions=None):
    """The gradient of F at every reader's input in the clean run (EAP), as `reader_probes`;
    positions after the shared `prefix` only."""
    e_clean = _suffix_embeddings(params, pairs, prefix)[0]
    return _reader_gradient(params, e_clean, pairs, config, metric, (), prefix, interventions)


@jit
def edge_scores(delta, gradients: dict, edge_mask):
    """`[B, W, R]`: `delta[w] . gradients[r]` summed over positions and channels, for every
    writer w (`delta [W, B, T, D]`) and reader r (`gradients` as `reader_probes`; stacked in
    the graph's reader order), zero where `edge_mask` has no edge."""
    delta = delta.astype(jnp.float32)
    head = lambda g: jnp.einsum("wbtd,lbthd->bwlh", delta, g.astype(jnp.float32))
    mlp = jnp.einsum("wbtd,lbtd->bwl", delta, gradients["mlp"].astype(jnp.float32))
    per_layer = jnp.concatenate([head(gradients["q"]), head(gradients["k"]), head(gradients["v"]), mlp[..., None]], -1)
    B, W = per_layer.shape[:2]
    logits = jnp.einsum("wbtd,btd->bw", delta, gradients["logits"].astype(jnp.float32))
    scores = jnp.concatenate([per_layer.reshape(B, W, -1), logits[..., None]], axis=-1)
    return jnp.where(edge_mask, scores, 0.0)


@partial(jit, static_argnames=("config", "metric"))
def _path_values(params, pairs: PromptPairs, alphas, config: ModelConfig, metric, interventions=None):
    """The adaptive rule's evaluations on the input path of one pair: φ(α) = F(h_0(α)) `[n]` and
    the integrand per position `[n, T]`, sum_c (e_clean - e_corrupt) dF/dh_0 (the plain forward:
    the input's edges sum to exactly this)."""
    e_clean, e_corrupt = embed(params, pairs.clean), embed(params, pairs.corrupt)

    def one(alpha):
        def f(h0):
            h, _ = run_layers(params, h0, config, valid=pairs.valid, interventions=interventions)
            return jnp.sum(metric_values(metric, logits_at(params, h, pairs.last, config), pairs.labels))

        phi, g = jax.value_and_grad(f)(e_corrupt + alpha.astype(e_clean.dtype) * (e_clean - e_corrupt))
        return phi, jnp.sum(g.astype(jnp.float32) * (e_clean - e_corrupt).astype(jnp.float32), axis=-1)[0]

    return jax.vmap(one)(alphas)


# ----------------------------------------------------------------------------- the driver


def edge_attribution(
    params,
    pairs: PromptPairs,
    config: ModelConfig,
    metric: Callable,
    *,
    method: str = "eap",
    rule: str = "left",
    steps: int = DEFAULT_STEPS,
    tolerance: Optional[float] = None,
    max_evaluations: Optional[int] = None,
    chunk_size: Optional[int] = None,
    memory_budget: Optional[int] = None,
    interventions=None,
    progress: ProgressLike = False,
) -> EdgeScores:
    """Scores of every edge for every pair of `pairs` (`jaxdepth.analyses.edges.pairs.prompt_pairs`)
    under `metric(logits [B, V], labels) -> [B]` (one value per pair, from the logits at each
    pair's last position; static: define it once to reuse compilations).

    method: 'eap' (one backward pass, gradients of the clean run), 'eap-ig-inputs' or
    'eap-ig-activations' (the module docstring), with `rule` and `steps`, or `rule='adaptive'`
    with `tolerance` (default 0.01) and `max_evaluations` (default `steps`) for 'eap-ig-inputs'.
    `chunk_size` bounds the path points vmapped at once (default: what `memory_budget` allows).
    `interventions` (`jaxdepth.core.sites`) act on every run, clean, corrupt and along the
    paths: the edges of the model as they intervene on it (a skipped layer, a steering vector).
    Returns an `EdgeScores`."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method == "eap":
        if (rule, steps) != ("left", DEFAULT_STEPS) or tolerance is not None or max_evaluations is not None:
            raise ValueError("rule, steps, tolerance and max_evaluations are EAP-IG's; method 'eap' takes none")
        rule, steps = "clean", 1  # the gradient of the clean run
    else:
        tolerance, max_evaluations = check_rule(rule, steps, tolerance, max_evaluations, 1)
    if rule == "adaptive" and method != "eap-ig-inputs":
        raise ValueError("the adaptive rule certifies the input path's completeness: use it with 'eap-ig-inputs'")
    graph = EdgeGraph.of(config)
    pairs.check(config, metric)
    check_interventions(interventions)
    B, T = pairs.clean.shape
    clean, corrupt = pair_runs(params, pairs, config, interventions)
    P, prefix = suffix_run(params, pairs, clean, config, interventions)
    delta = (clean.writers - corrupt.writers)[:, :, P:]
    f_clean, f_corrupt = (to_host(metric_values(metric, run.logits, pairs.labels)) for run in (clean, corrupt))
    chunk = chunk_size or path_chunk(config, B, T - P, memory_budget)
    mask = jnp.asarray(graph.edge_mask)
    bound, converged = np.full(B, np.nan), np.zeros(B, bool)
    if method == "eap":
        gradients = clean_gradients(params, pairs, prefix, config, metric, interventions)
        scores = to_host(edge_scores(delta, gradients, mask))
        evaluations = np.ones(B, np.int64)
    elif rule == "adaptive":
        scores, evaluations, bound, converged = _adaptive_scores(
            params,
            pairs,
            prefix,
            delta,
            f_clean,
            config=config,
            metric=metric,
            tolerance=tolerance,
            max_evaluations=max_evaluations,
            chunk=chunk,
            interventions=interventions,
            progress=progress,
        )
    else:
        alphas, weights = (jnp.asarray(x, jnp.float32) for x in rules.quadrature(rule, steps))
        chunk = min(chunk, steps)
        if method == "eap-ig-activations":
            scores = _activation_scores(
                params,
                pairs,
                prefix,
                delta,
                alphas,
                weights,
                config=config,
                metric=metric,
                chunk=chunk,
                interventions=interventions,
                progress=progress,
            )
            evaluations = np.full(B, steps * (2 * config.num_layers + 1), np.int64)
        else:
            grads = input_path_gradients(
                params, pairs, prefix, alphas, weights, config, metric, chunk, interventions=interventions
            )
            scores = to_host(edge_scores(delta, grads, mask))
            evaluations = np.full(B, steps, np.int64)
    return EdgeScores(
        scores=np.asarray(scores, np.float32),
        f_clean=np.asarray(f_clean, np.float32),
        f_corrupt=np.asarray(f_corrupt, np.float32),
        evaluations=evaluations,
        bound=bound,
        converged=converged,
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        method=method,
        rule=rule,
        steps=int(steps),
        tolerance=tolerance,
    )


def _adaptive_scores(
    params, pairs, prefix, delta, f_clean, *, config, metric, tolerance, max_evaluations, chunk, interventions, progress
):
    """EAP-IG 'inputs' under the adaptive rule, pair by pair: the rule places each pair's nodes
    on its input path (plain forward and backward passes), then the readers' gradients are
    integrated with the final rule's nodes and weights (one more gradient per node)."""
    graph = EdgeGraph.of(config)
    B = len(pairs)
    scores = np.zeros((B, graph.num_writers, graph.num_readers), np.float32)
    evaluations, bound, converged = np.zeros(B, np.int64), np.zeros(B), np.zeros(B, bool)
    for b in track(range(B), progress, "EAP-IG, adaptive (pairs)"):
        one = pairs.select([b])
        one_prefix = None if prefix is None else jax.tree.map(lambda x: x[:, b : b + 1], prefix)
        rule = _adaptive_nodes(
            params,
            one,
            float(f_clean[b]),
            config,
            metric,
            tolerance,
            max_evaluations,
            chunk,
            interventions=interventions,
        )
        alphas, weights = rule.node_weights()
        # padded to a multiple of the chunk (zero weights): a few compilations serve every pair
        n = _padded(len(alphas), chunk)
        alphas = np.concatenate([alphas, np.ones(n - len(alphas))]).astype(np.float32)
        weights = np.concatenate([weights, np.zeros(n - len(weights))]).astype(np.float32)
        grads = input_path_gradients(
            params,
            one,
            one_prefix,
            jnp.asarray(alphas),
            jnp.asarray(weights),
            config,
            metric,
            chunk,
            interventions=interventions,
        )
        scores[b] = to_host(edge_scores(delta[:, b : b + 1], grads, jnp.asarray(graph.edge_mask)))[0]
        evaluations[b] = rule.evaluations + len(rule.node_weights()[0])
        bound[b], converged[b] = rule.bound, rule.converged
    return scores, evaluations, bound, converged


def _activation_scores(
    params, pairs, prefix, delta, alphas, weights, *, config, metric, chunk, interventions, progress
):
    """EAP-IG 'activations': each node's path, `steps` gradients each; the node's writers take
    their scores from the gradients along their own node's path."""
    graph = EdgeGraph.of(config)
    writer_node = graph.writer_nodes
    scores = np.zeros((len(pairs), graph.num_writers, graph.num_readers), np.float32)
    for node in track(range(2 * config.num_layers + 1), progress, "EAP-IG, activations (nodes)"):
        rows = np.flatnonzero(writer_node == node)
        grads = node_path_gradients(
            params,
            pairs,
            prefix,
            delta,
            jnp.int32(node),
            alphas,
            weights,
            config=config,
            metric=metric,
            chunk=chunk,
            interventions=interventions,
        )
        mask = jnp.asarray(graph.edge_mask[rows])
        scores[:, rows] = to_host(edge_scores(delta[rows], grads, mask))
    return scores


def path_chunk(config: ModelConfig, batch: int, seq_len: int, memory_budget: Optional[int] = None) -> int:
    """Path points to vmap at once (1..32): what fits in `memory_budget` (default: a share of
    the free memory) when each point holds every reader's input, its stored copy and its
    gradient (`[L, B, T, 3H + 1, D]` each, float32) besides the layers' own activations."""
    budget = available_memory_budget() if memory_budget is None else memory_budget
    readers = config.num_layers * batch * seq_len * (3 * config.num_heads + 1) * config.hidden_size * 4 * 3
    per_point = readers + member_bytes(config, batch * seq_len, grad=True)
    return int(np.clip(budget // per_point, 1, 32))


def _adaptive_nodes(
    params, pair, f_clean, config, metric, tolerance, max_evaluations, chunk, *, interventions
) -> rules.LayerRule:
    """The adaptive rule on one pair's input path: its finished `LayerRule` (nodes and weights)."""

    def call(layer, alphas, grad, size):
        return _path_values(params, pair, jnp.asarray(alphas), config, metric, interventions)

    (rule,) = rules.run_rule(
        call,
        [0],
        f_clean,
        pair.clean.shape[1],
        config,
        tolerance=np.array([tolerance]),
        max_evaluations=max_evaluations,
        chunk_size=chunk,
    )
    return rule


def _padded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
