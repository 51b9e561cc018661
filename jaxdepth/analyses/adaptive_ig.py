"""Integrated gradients with an adaptive rule per layer that stops at a certified completeness
gap (METHODS §5, the accurate option).

Along the path of layer l, with x and b its target and baseline (as in
`jaxdepth.analyses.integrated_gradients`), let φ(α) = F(b + α(x - b)) and, per token,
g_t(α) = sum_c (x - b)[t, c] dF/dx(b + α(x - b))[t, c], so that IG_l[t] = ∫_0^1 g_t(α) dα and
sum_t g_t = φ'. On the embedded model φ' of early layers has sharp peaks of both signs (F rises,
falls and rises again along the path), and no fixed rule of a few hundred steps resolves them.

The certificate. φ needs only forward passes, and on any interval [β, β'] the exact integral of
sum_t g_t is φ(β') - φ(β). So the quadrature error of the token-summed integrand on interval i,
e_i = sum_t Q_i[g_t] - (φ(β_{i+1}) - φ(β_i)), is known exactly, not estimated. A layer stops
when B = sum_i |e_i| + |φ(1) - F(x)| <= tolerance * max(|F(x) - F(b)|, atol). B bounds the
completeness gap (which is sum_i e_i + φ(1) - F(x)); the gap itself is not used as the stopping
test because errors of opposite signs on different intervals cancel in it: a small gap can hide
an unresolved peak, a small B cannot. Like any completeness check, B does not see errors that
cancel across tokens.

The rule. Composite Simpson (nodes a, (a+b)/2, b on each interval; exact for cubics, like
2-point Gauss-Legendre) refined by bisection. A parent's three nodes are nodes of its halves,
so a split costs two gradient evaluations (the quarter points), where Gauss-Legendre, whose
nodes do not nest, would cost 2k and discard the parent's k. Every gradient evaluation also
returns φ at its node, so interval ends need no extra forward pass. On the embedded model,
bisected 3-point Gauss-Legendre needed up to 1.5x the evaluations for the same tolerance, and
Boole's rule on Simpson's nested nodes was no better than Simpson.

1. Each layer starts from 11 equal intervals. Optionally (`grid_points`), φ of every layer is
   first sampled on a uniform grid by forward passes only (one computation), and the initial
   partition equidistributes an even mix of α and the variation of φ along the grid, so that
   intervals cluster where F moves. On the embedded model that saved no gradient evaluation
   (φ there has several rises and falls, which bisection finds as fast) and cost a quarter of a
   gradient evaluation per grid point, so it is off by default. Partition ends lie on a 2^-12
   grid: every node after up to 11 bisections is a float32 number, and the device evaluates
   exactly the α the weights assume.
2. Rounds: every unfinished layer evaluates its new nodes; a layer that meets its target stops,
   converged; otherwise its intervals with the largest |e_i| are bisected until the others sum
   to at most half the target, and on to a multiple of 4 splits (8 nodes: what would otherwise
   be padding of a call of 8 nodes). A layer whose budget (`max_evaluations` gradient evaluations)
   cannot pay for the next split, or whose intervals are all at the float32 resolution of α,
   stops with converged False.

Batching. A round's gradient evaluations are calls of one layer each, every call a vmap of a
power of two nodes (`call_sizes`: as wide as memory allows, up to 32, down to 8), all of a
round's calls dispatched before the host reads any result, so the device runs them back to
back and waits for the host once per round. The layer is a traced scalar, so each call's suffix
starts at its own boundary layer+1 (the `fori_loop` bounds of `suffix_value_and_grad`) and costs
only the layers after it; mixing layers inside a vmap would need batched loop bounds (every
member running as long as the longest) or every member running the full depth with the path
point set by an intervention, about twice the FLOPs over all layers. A round's nodes of a layer
number a multiple of 8 (the split rounding of step 2), so calls need no padding after the
first round; the fixed rule's path sweep is the same vmapped gradient (`weighted_gradient`),
so both rules cost about the same per evaluation. A new tolerance, other node placements or
another prompt of the same padded length reuse the same few compiled computations (one per
call size, and the grid's, if any). A layer's calls hold only its own nodes, in an order fixed
by its own state: one layer's refinement leaves every other layer's numbers bit for bit
unchanged.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxdepth.analyses.integrated_gradients import (BASELINES, PAD_TO, TARGETS, IntegratedGradientsResult,
                                                    LayerPath, answer_aux, answer_probability, check_nonfinite_option,
                                                    ig_inputs, metric_head, nonfinite_report, raise_or_warn,
                                                    site_entry, study_path, suffix_value_and_grad,
                                                    warn_if_zero_baseline_diverges)
from jaxdepth.core.batch import PromptArrays, PromptBatch
from jaxdepth.core.compilation import jit
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.model import run_layers_from
from jaxdepth.core.sharding import to_host
from jaxdepth.core.sweep import auto_chunk_size, sweep

# Bump when the rule's internal choices (initial intervals, split rounding, ...) change: it is
# part of a saved result's cache identity, so results of an older rule are recomputed.
RULE_VERSION = 1
GRID_POINTS = 0  # no forward grid: a uniform initial partition (see the module docstring)
# 2 * 11 + 1 = 23 nodes: calls of 16 and 8 but one slot (a padding slot costs as much as a
# node).
INITIAL_INTERVALS = 11
# Gradient evaluations per layer at most. On whole GSM8K prompts of the embedded model the early
# layers' paths have sharp peaks: the hardest layer of row 0 needs 823 evaluations to certify 1%
# (1,471 for 0.2%), so a budget of 512 left layers uncertified.
MAX_EVALUATIONS = 2048
# Below this |F(x) - F(b)| a relative tolerance would ask for float32 noise.
ATOL = 1e-6
# Initial partition ends are multiples of 2^-12: their bisections stay float32 numbers (what the
# device evaluates) for 11 levels or more; an interval whose quarter points would be rounded is
# not split.
_PARTITION_GRID = 2.0 ** -12
# A layer's new nodes of a round run in calls of a power of two nodes, from _LARGEST_CALL (or
# what fits in memory) down to _SMALLEST_CALL: a few compiled computations, each as wide a vmap
# as the fixed rule's where the nodes fill it, and padding only below _SMALLEST_CALL.
_LARGEST_CALL = 32
_SMALLEST_CALL = 8
# A round splits a multiple of this many intervals (2 nodes each) where it can: the next largest
# errors fill what would be padding of a call of 8. A constant, not the call sizes in use, so
# that the nodes (and results) do not depend on the device's memory.
_SPLIT_MULTIPLE = 4


# ----------------------------------------------------------------------------- device


@partial(jit, static_argnames=("config", "site", "metric", "grad", "chunk_size"))
def site_path_points(params, valid, layer, path: LayerPath, alphas, config: ModelConfig, *, site: str, metric,
                     aux=None, positions=None, interventions=None, grad: bool = True,
                     chunk_size: Optional[int] = None):
    """φ and the per-token integrand at path points `alphas [n]` of layer `layer` of one prompt
    along `path` (`LayerPath`, batch 1), for the value at `site` and the metric `metric(logits,
    aux)` at `positions` (`jaxdepth.analyses.integrated_gradients.metric_head`).

    `layer` is traced: every layer reuses one compiled computation per number of nodes. Returns
    `(phi [n], integrand [n, T])` where phi = F(b + α(x - b)) and integrand[t] = sum over the
    site's channels of (x - b) dF/dx at t (zero at invalid positions; all zeros with
    `grad=False`, forward only).
    """
    dtype = params["embed"].dtype
    T = valid.shape[1]
    head = metric_head(params, config, metric, aux, positions)
    objective = lambda h: head(h)[0]
    channels = tuple(range(2, path.x.ndim))  # the site's axes after the position
    entry = site_entry(params, layer, None if path.h_in is None else path.h_in.astype(dtype), valid, config, site,
                       interventions)

    def member(alpha):
        z = path.at(alpha).astype(dtype)
        if not grad:
            h_last, _ = run_layers_from(params, entry(z), layer + 1, config, valid=valid, interventions=interventions)
            return objective(h_last), jnp.zeros(T, jnp.float32)
        h_next, pullback = jax.vjp(entry, z)
        value, g = suffix_value_and_grad(params, h_next, layer + 1, config, objective, valid=valid,
                                         interventions=interventions)
        g = pullback(g)[0]
        return value, jnp.sum((path.x - path.b) * g.astype(jnp.float32), axis=channels)[0] * valid[0]

    return sweep(member, alphas, chunk_size)


def path_points(params, prompt: PromptArrays, x, b, inputs, *, layer: int, alphas, config: ModelConfig,
                interventions=None, target: str = "layer", grad: bool = True, chunk_size: Optional[int] = None):
    """`site_path_points` of layer `layer` for a study target with the studies' F (`x`, `b`,
    `inputs` `[L, T, D]` as from `ig_inputs`)."""
    return site_path_points(params, prompt.valid, jnp.int32(layer), study_path(x, b, inputs, layer, target),
                            jnp.asarray(alphas, jnp.float32), config, site=TARGETS[target],
                            metric=answer_probability, aux=answer_aux(prompt), positions=prompt.answer_positions,
                            interventions=interventions, grad=grad, chunk_size=chunk_size)


# ----------------------------------------------------------------------------- the rule (host)


def simpson(a: float, b: float, fa, fm, fb):
    """Simpson's rule on [a, b] from the values at a, (a + b)/2 and b."""
    return (b - a) / 6.0 * (fa + 4.0 * fm + fb)


def initial_partition(alphas: np.ndarray, phi: np.ndarray, n: int, mix: float = 0.5) -> np.ndarray:
    """Ends `0 = β_0 < ... < β_k = 1` (k <= n) of intervals that equidistribute
    `(1 - mix) * α + mix * V(α) / V(1)`, V the cumulative variation of φ sampled at `alphas`
    (uniform where φ does not move), rounded to multiples of 2^-12."""
    variation = np.concatenate([[0.0], np.cumsum(np.abs(np.diff(phi)))])
    share = variation / variation[-1] if variation[-1] > 0 else alphas
    monitor = (1 - mix) * alphas + mix * share
    ends = np.interp(np.linspace(0.0, 1.0, n + 1), monitor, alphas)
    ends = np.unique(np.round(ends / _PARTITION_GRID) * _PARTITION_GRID)
    ends[0], ends[-1] = 0.0, 1.0
    return ends


def splittable(a: float, b: float) -> bool:
    """Whether [a, b]'s halves have float32 midpoints (the nodes a bisection adds)."""
    m = (a + b) / 2
    return all(float(np.float32(q)) == q for q in ((a + m) / 2, (m + b) / 2))


def choose_splits(errors: np.ndarray, can_split: np.ndarray, residual: float, target: float,
                  max_splits: int, multiple: int = 1) -> list[int]:
    """Intervals to bisect: the largest |e_i| first among those `can_split`, until the others
    (with the `residual` no split can reduce) sum to at most half of `target`, then on to a
    multiple of `multiple` of them; at most `max_splits`."""
    remaining = float(np.abs(errors).sum()) + residual
    chosen = []
    for i in np.argsort(-np.abs(errors), kind="stable"):
        enough = remaining <= target / 2 and len(chosen) % multiple == 0
        if enough or len(chosen) >= max_splits:
            break
        if can_split[i]:
            chosen.append(int(i))
            remaining -= abs(float(errors[i]))
    return chosen


class LayerRule:
    """The adaptive rule's state for one layer of one prompt: its intervals, the values φ and
    integrands at its nodes (each node evaluated once), and whether it is done."""

    def __init__(self, ends: np.ndarray, f_input: float, tolerance: float, atol: float, max_evaluations: int):
        self.intervals = list(zip(ends[:-1].tolist(), ends[1:].tolist()))
        self.phi: dict[float, float] = {}
        self.integrand: dict[float, np.ndarray] = {}
        self.f_input, self.tolerance, self.atol = f_input, tolerance, atol
        self.max_evaluations = max_evaluations
        self.done = self.converged = False
        self.finite = True  # False from the first non-finite φ or integrand on: the layer stops
        self.bound = np.inf
        self._cache: dict[tuple[float, float], tuple[np.ndarray, float]] = {}

    def missing(self) -> list[float]:
        """Nodes of the current intervals not evaluated yet, in increasing order."""
        nodes = {a for iv in self.intervals for a in (iv[0], (iv[0] + iv[1]) / 2, iv[1])}
        return sorted(a for a in nodes if a not in self.phi)

    def record(self, alphas: Sequence[float], phi: np.ndarray, integrand: np.ndarray) -> None:
        """Store φ and the per-token integrand `[T]` evaluated at `alphas`."""
        for a, p, g in zip(alphas, phi, integrand):
            self.phi[a], self.integrand[a] = float(p), g.astype(np.float64)
        self.finite = self.finite and bool(np.all(np.isfinite(phi)) and np.all(np.isfinite(integrand)))

    @property
    def evaluations(self) -> int:
        """Gradient evaluations so far (one per node)."""
        return len(self.phi)

    @property
    def f_baseline(self) -> float:
        """F(b) = φ(0)."""
        return self.phi[0.0]

    @property
    def target(self) -> float:
        """The bound at which the layer stops, in units of F."""
        return self.tolerance * max(abs(self.f_input - self.f_baseline), self.atol)

    def _interval(self, a: float, b: float) -> tuple[np.ndarray, float]:
        """(Simpson's IG on [a, b] per token, its exact error e of the token sum)."""
        if (a, b) not in self._cache:
            g = self.integrand
            ig = simpson(a, b, g[a], g[(a + b) / 2], g[b])
            self._cache[(a, b)] = ig, float(ig.sum()) - (self.phi[b] - self.phi[a])
        return self._cache[(a, b)]

    def node_weights(self) -> tuple[np.ndarray, np.ndarray]:
        """`(alphas, weights)`: the composite Simpson rule of the current intervals as one
        quadrature rule (the weights of a node shared by two intervals summed)."""
        weights: dict[float, float] = {}
        for a, b in self.intervals:
            for node, w in ((a, 1.0), ((a + b) / 2, 4.0), (b, 1.0)):
                weights[node] = weights.get(node, 0.0) + (b - a) / 6.0 * w
        nodes = sorted(weights)
        return np.array(nodes), np.array([weights[a] for a in nodes])

    def attributions(self) -> np.ndarray:
        """IG per token `[T]`: the sum of the intervals' Simpson rules."""
        return np.sum([self._interval(a, b)[0] for a, b in self.intervals], axis=0)

    def step(self) -> None:
        """With every node evaluated: stop (converged, or out of budget or resolution), or
        bisect the intervals that carry the error. A non-finite value stops the layer at once
        (not converged, bound NaN): no refinement makes it finite, and the budget would go on it."""
        if not self.finite:
            self.done, self.bound = True, float("nan")
            return
        errors = np.array([self._interval(a, b)[1] for a, b in self.intervals])
        residual = abs(self.phi[1.0] - self.f_input)
        self.bound = float(np.abs(errors).sum()) + residual
        if self.bound <= self.target:
            self.done = self.converged = True
            return
        can_split = np.array([splittable(a, b) for a, b in self.intervals])
        split = set(choose_splits(errors, can_split, residual, self.target,
                                  (self.max_evaluations - self.evaluations) // 2, _SPLIT_MULTIPLE))
        if not split:
            self.done = True
            return
        intervals = []
        for i, (a, b) in enumerate(self.intervals):
            m = (a + b) / 2
            intervals += [(a, m), (m, b)] if i in split else [(a, b)]
        self.intervals = intervals


# ----------------------------------------------------------------------------- one prompt


def call_sizes(n: int, largest: int, smallest: int = _SMALLEST_CALL) -> list[int]:
    """How a layer's `n` new nodes are split into calls: powers of two from `largest` down to
    `smallest`, the largest that fits first; what is left below `smallest` goes in one more
    call of that size, padded. A round's nodes come in multiples of 8 (`_SPLIT_MULTIPLE`
    splits), so only the first round pads."""
    smallest = min(smallest, largest)
    sizes, size = [], largest
    while n > 0:
        while size > smallest and size > n:
            size //= 2
        sizes.append(size)
        n -= size
    return sizes


def _evaluate(call, requests: dict[int, list[float]], largest: int) -> dict[int, tuple]:
    """Run every requested node: each layer's nodes in calls of `call_sizes`, all dispatched
    before any result is read (the device runs them back to back). Returns `{layer: (phi [n],
    integrand [n, T])}` in the order requested."""
    pending = []
    for layer, nodes in sorted(requests.items()):
        start = 0
        for size in call_sizes(len(nodes), largest):
            part = nodes[start:start + size]
            start += len(part)
            alphas = np.asarray(part + [part[-1]] * (size - len(part)), np.float32)
            pending.append((layer, len(part), call(layer, alphas, True, size)))
    out: dict[int, tuple[list, list]] = {}
    for layer, count, (phi, integrand) in pending:
        ps, gs = out.setdefault(layer, ([], []))
        ps.extend(to_host(phi)[:count])
        gs.extend(to_host(integrand)[:count])
    return {layer: (np.asarray(ps), np.asarray(gs)) for layer, (ps, gs) in out.items()}


def largest_call(config: ModelConfig, seq_len: int, memory_budget: Optional[int] = None) -> int:
    """The largest number of nodes of one call: a power of two, at most `_LARGEST_CALL`, whose
    vmapped gradients fit in memory (`auto_chunk_size`)."""
    return _power_of_two_floor(auto_chunk_size(config, seq_len, _LARGEST_CALL, grad=True,
                                               memory_budget=memory_budget))


def _power_of_two_floor(n: int) -> int:
    """The largest power of two <= n (1 for n < 1)."""
    return 1 << (max(int(n), 1).bit_length() - 1)


def run_rule(call, layers: Sequence[int], f_input: float, seq_len: int, config: ModelConfig, *,
             tolerance: np.ndarray, max_evaluations: int = MAX_EVALUATIONS, atol: float = ATOL,
             grid_points: int = GRID_POINTS, initial_intervals: int = INITIAL_INTERVALS,
             chunk_size: Optional[int] = None, memory_budget: Optional[int] = None,
             on_layer=None) -> list[LayerRule]:
    """The adaptive rule on `layers` (one prompt of `seq_len` positions; `tolerance`, one per
    layer of `layers`), host side: rounds of `call(layer, alphas [n], grad, chunk) -> (phi [n],
    integrand [n, T])` (`site_path_points`, `chunk` nodes vmapped at a time) until every layer
    is done. `chunk_size` caps the nodes of one call (default: what fits in memory, at most
    32). Returns each layer's finished `LayerRule`; `on_layer()` is called as each layer
    finishes."""
    if max_evaluations < 3:
        raise ValueError("max_evaluations must be >= 3 (one Simpson interval)")
    layers = [int(layer) for layer in layers]
    n = min(initial_intervals, (max_evaluations - 1) // 2)
    if grid_points >= 2:
        grid = np.linspace(0.0, 1.0, grid_points)
        forward_chunk = auto_chunk_size(config, seq_len, grid_points, memory_budget=memory_budget)
        calls = [call(layer, grid.astype(np.float32), False, forward_chunk)[0] for layer in layers]
        phi_grid = np.stack([to_host(phi) for phi in calls]).astype(np.float64)
    else:  # no grid: a uniform initial partition
        grid, phi_grid = np.array([0.0, 1.0]), np.zeros((len(layers), 2))
    rules = {layer: LayerRule(initial_partition(grid, phi_grid[i], n), f_input, float(tolerance[i]), atol,
                              max_evaluations) for i, layer in enumerate(layers)}
    largest = (largest_call(config, seq_len, memory_budget) if chunk_size is None
               else _power_of_two_floor(chunk_size))
    while not all(r.done for r in rules.values()):
        requests = {layer: r.missing() for layer, r in rules.items() if not r.done}
        for layer, (phi, integrand) in _evaluate(call, requests, largest).items():
            rules[layer].record(requests[layer], phi, integrand)
        for r in rules.values():
            if not r.done:
                r.step()
                if r.done and on_layer is not None:
                    on_layer()
    return [rules[layer] for layer in layers]


def adaptive_ig_of_prompt(params, prompt: PromptArrays, config: ModelConfig, *, tolerance: np.ndarray,
                          max_evaluations: int = MAX_EVALUATIONS, baseline: str = "channel_mean",
                          target: str = "layer", atol: float = ATOL, grid_points: int = GRID_POINTS,
                          initial_intervals: int = INITIAL_INTERVALS, chunk_size: Optional[int] = None,
                          memory_budget: Optional[int] = None, interventions=None, on_layer=None) -> dict:
    """Adaptive IG of every layer for one prompt (arguments as `ig_of_prompt`; `tolerance [L]`
    per layer). Returns numpy arrays: `attributions [L, T]`, `f_input []`, `f_baseline [L]`,
    `evaluations [L]`, `converged [L]`, `bound [L]` (the certificate sum_i |e_i| + |φ(1) - F(x)|).
    `on_layer()` is called as each layer finishes."""
    L, T = config.num_layers, prompt.tokens.shape[1]
    x, b, inputs, f_input = ig_inputs(params, prompt, config, baseline=baseline, interventions=interventions,
                                      target=target)

    def call(layer, alphas, grad, chunk):
        return path_points(params, prompt, x, b, inputs, layer=layer, alphas=alphas, config=config,
                           interventions=interventions, target=target, grad=grad, chunk_size=chunk)

    rules = run_rule(call, range(L), float(to_host(f_input)), T, config, tolerance=tolerance,
                     max_evaluations=max_evaluations, atol=atol, grid_points=grid_points,
                     initial_intervals=initial_intervals, chunk_size=chunk_size, memory_budget=memory_budget,
                     on_layer=on_layer)
    return summarise(rules)


def summarise(rules: Sequence[LayerRule]) -> dict:
    """The finished rules of a prompt's layers as arrays (keys as `adaptive_ig_of_prompt`)."""
    return dict(attributions=np.stack([r.attributions() for r in rules]), f_input=rules[0].f_input,
                f_baseline=np.array([r.f_baseline for r in rules]),
                evaluations=np.array([r.evaluations for r in rules]),
                converged=np.array([r.converged for r in rules]), bound=np.array([r.bound for r in rules]))


# ----------------------------------------------------------------------------- the entry point


@dataclasses.dataclass
class AdaptiveIGResult(IntegratedGradientsResult):
    """`IntegratedGradientsResult` (attributions, completeness `gap [P, L]`, F(x), F(b), tokens)
    from the adaptive rule, with per layer the gradient `evaluations [P, L]` it used, whether it
    `converged [P, L]` to its tolerance, and the certified `bound [P, L]` >= |gap| (in units of
    F). A layer not converged ran out of `settings['max_evaluations']`: its attributions are
    the best the budget gave, its gap says how far off they are."""

    evaluations: np.ndarray
    converged: np.ndarray
    bound: np.ndarray

    @property
    def rule(self) -> str:
        """Which quadrature produced the attributions, in words: "adaptive rule to 1%" (which
        layers got there: `converged`)."""
        tolerance = self.settings.get("tolerance")
        target = f"{100 * tolerance:g}%" if isinstance(tolerance, (int, float)) else "per-layer tolerances"
        return f"adaptive rule to {target}"

    @property
    def relative_gap(self) -> np.ndarray:
        """`gap / (F(x) - F(b))` `[P, L]` (NaN where F(x) = F(b))."""
        with np.errstate(divide="ignore", invalid="ignore"):
            return self.gap / (self.f_input[:, None] - self.f_baseline)


def adaptive_integrated_gradients(params, batch: PromptBatch, config: ModelConfig, *,
                                  tolerance: Union[float, Sequence[float]] = 0.01,
                                  max_evaluations: int = MAX_EVALUATIONS, baseline: str = "channel_mean",
                                  target: str = "layer", atol: float = ATOL, grid_points: int = GRID_POINTS,
                                  initial_intervals: int = INITIAL_INTERVALS, chunk_size: Optional[int] = None,
                                  memory_budget: Optional[int] = None, progress: bool = True, settings=None,
                                  interventions=None, nonfinite: str = "raise") -> AdaptiveIGResult:
    """Integrated gradients per layer and token for every prompt of `batch` (targets, baselines
    and `interventions` as `integrated_gradients`), each layer refined until its certified
    completeness bound is at most `tolerance * max(|F(x) - F(b)|, atol)` (`tolerance`: one
    value, or one per layer) or it has used `max_evaluations` gradient evaluations (then
    `converged` is False for it). A layer stops at its first non-finite evaluation; `nonfinite`
    as `integrated_gradients`. See the module docstring for the rule and its certificate."""
    if baseline not in BASELINES:
        raise ValueError(f"baseline must be one of {BASELINES}, got {baseline!r}")
    if target not in TARGETS:
        raise ValueError(f"target must be one of {', '.join(TARGETS)}, got {target!r}")
    check_nonfinite_option(nonfinite)
    warn_if_zero_baseline_diverges(baseline, TARGETS[target])
    L, P, T = config.num_layers, len(batch), batch.tokens.shape[1]
    tolerances = np.broadcast_to(np.asarray(tolerance, np.float64), (L,))
    if np.any(tolerances <= 0):
        raise ValueError("tolerance must be > 0")
    attributions = np.zeros((P, L, T), np.float32)
    f_input, f_baseline = np.zeros(P, np.float32), np.zeros((P, L), np.float32)
    evaluations, converged = np.zeros((P, L), np.int64), np.zeros((P, L), bool)
    bound = np.zeros((P, L), np.float32)
    with tqdm(total=P * L, desc="adaptive integrated gradients (layers)", disable=not progress) as bar:
        for i in range(P):
            prompt = batch.prompt(i, PAD_TO)
            Ti = prompt.tokens.shape[1]
            r = adaptive_ig_of_prompt(params, prompt, config, tolerance=tolerances,
                                      max_evaluations=max_evaluations, baseline=baseline, target=target, atol=atol,
                                      grid_points=grid_points, initial_intervals=initial_intervals,
                                      chunk_size=chunk_size, memory_budget=memory_budget,
                                      interventions=interventions, on_layer=bar.update)
            attributions[i, :, :Ti], f_input[i], f_baseline[i] = r["attributions"], r["f_input"], r["f_baseline"]
            evaluations[i], converged[i], bound[i] = r["evaluations"], r["converged"], r["bound"]
            raise_or_warn(nonfinite_report(range(L), attributions[i][:, None], f_input[i:i + 1], f_baseline[i][:, None],
                                           baseline=baseline, site=TARGETS[target], prompts=[i]), nonfinite)
    gap = attributions.astype(np.float64).sum(axis=-1) - (f_input[:, None].astype(np.float64) - f_baseline)
    tol_setting = float(tolerances[0]) if np.all(tolerances == tolerances[0]) else tolerances.tolist()
    return AdaptiveIGResult(
        attributions=attributions, gap=gap.astype(np.float32), f_input=f_input, f_baseline=f_baseline,
        tokens=batch.tokens, lengths=batch.lengths, answer_start=batch.answer_start,
        evaluations=evaluations, converged=converged, bound=bound,
        settings={**(settings or {}), "rule": "adaptive", "tolerance": tol_setting,
                  "max_evaluations": max_evaluations, "baseline": baseline, "atol": atol,
                  "grid_points": grid_points, "initial_intervals": initial_intervals,
                  **({} if target == "layer" else {"target": target})})
