"""Quadrature rules of integrated gradients: the fixed rules (left, the published one; midpoint;
Gauss-Legendre) and an adaptive rule per layer that stops at a certified completeness gap
(METHODS §5, the accurate option). Host side: the device evaluates the nodes
(`jaxdepth.analyses.ig.path`).

Along the path of layer l, with x and b its value at the site and its baseline, let
φ(α) = F(b + α(x - b)) and, per token, g_t(α) = sum_c (x - b)[t, c] dF/dx(b + α(x - b))[t, c],
so that IG_l[t] = ∫_0^1 g_t(α) dα and sum_t g_t = φ'. On the embedded model φ' of early layers has sharp
peaks of both signs (F rises, falls and rises again along the path), and no fixed rule of a few
hundred steps resolves them.

The certificate. φ needs only forward passes, and on any interval [β, β'] the exact integral of
sum_t g_t is φ(β') - φ(β). So the quadrature error of the token-summed integrand on interval i,
e_i = sum_t Q_i[g_t] - (φ(β_{i+1}) - φ(β_i)), is known exactly, not estimated. A layer stops
when B = sum_i |e_i| + |φ(1) - F(x)| <= tolerance * max(|F(x) - F(b)|, FLOOR_SHARE |F(x)|, atol)
(the floor: where F barely moves along the path, a tolerance relative to that move would ask
for float32 noise; such layers are reported as `floored`). B bounds the
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
   be padding of a call of 8 nodes). A layer whose budget (`max_evaluations` gradient evaluations;
   by default the fixed rule's steps, so the adaptive rule never costs more) cannot pay for the
   next split, or whose intervals are all at the float32 resolution of α, stops with converged
   False; so does a layer at its first non-finite value (bound NaN).

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
from typing import Any, ClassVar, Mapping, Optional, Sequence, Union

import numpy as np

from jaxdepth.core.config import ModelConfig
from jaxdepth.core.sharding import to_host
from jaxdepth.core.sweep import auto_chunk_size

__all__ = [
    "FixedRule",
    "AdaptiveRule",
    "Rule",
    "as_rule",
    "rule_of",
    "rule_from_settings",
    "quadrature",
    "LayerRule",
    "run_rule",
    "summarise",
    "largest_call",
    "default_budget",
    "RULES",
    "FIXED_RULES",
    "DEFAULT_STEPS",
    "DEFAULT_TOLERANCE",
    "MAX_EVALUATIONS",
    "RULE_VERSION",
    "simpson",
    "initial_partition",
    "splittable",
    "choose_splits",
    "call_sizes",
    "power_of_two_floor",
]

# Bump when the rule's internal choices (initial intervals, split rounding, ...) change: it is
# part of a saved result's cache identity, so results of an older rule are recomputed.
RULE_VERSION = 2  # 2: the floor FLOOR_SHARE |F(x)|; a non-finite value stops a layer
GRID_POINTS = 0  # no forward grid: a uniform initial partition (see the module docstring)
# 2 * 11 + 1 = 23 nodes: calls of 16 and 8 but one slot (a padding slot costs as much as a
# node).
INITIAL_INTERVALS = 11
# The fixed rules' steps by default, the published count.
DEFAULT_STEPS = 256
# Gradient evaluations per layer at most, by default: the fixed rule's, so the adaptive rule never
# costs more than the rule it replaces. On whole GSM8K prompts of the embedded model the early
# layers' paths have sharp peaks: the hardest layer of row 0 needs 823 evaluations to certify 1%
# (1,471 for 0.2%); such layers stop uncertified (`converged` False) unless given more.
MAX_EVALUATIONS = DEFAULT_STEPS
DEFAULT_TOLERANCE = 0.01  # relative to max(|F(x) - F(b)|, FLOOR_SHARE |F(x)|, ATOL)
# The floor of the tolerance's scale, as a share of |F(x)|: a layer whose path moves F by less
# than a tenth of F is certified to tolerance x 10% of F, not to a share of a change that may be
# float32 noise (on random weights, |F(x) - F(b)| ~ 4e-7 made 1% unreachable).
FLOOR_SHARE = 0.1
# Below this scale a relative tolerance would ask for float32 noise whatever F is.
ATOL = 1e-6
# Initial partition ends are multiples of 2^-12: their bisections stay float32 numbers (what the
# device evaluates) for 11 levels or more; an interval whose quarter points would be rounded is
# not split.
_PARTITION_GRID = 2.0**-12
# A layer's new nodes of a round run in calls of a power of two nodes, from _LARGEST_CALL (or
# what fits in memory) down to _SMALLEST_CALL: a few compiled computations, each as wide a vmap
# as the fixed rule's where the nodes fill it, and padding only below _SMALLEST_CALL.
_LARGEST_CALL = 32
_SMALLEST_CALL = 8
# A round splits a multiple of this many intervals (2 nodes each) where it can: the next largest
# errors fill what would be padding of a call of 8. A constant, not the call sizes in use, so
# that the nodes (and results) do not depend on the device's memory.
_SPLIT_MULTIPLE = 4


def default_budget(steps: int) -> int:
    """The adaptive rule's default gradient evaluations per layer: the fixed rule's `steps`, so it
    never costs more (at least 3, one Simpson interval)."""
    return max(int(steps), 3)


FIXED_RULES = ("left", "midpoint", "gauss", "right")
RULES = FIXED_RULES + ("adaptive",)  # the rules' names: the command line's and the settings' "rule"


def quadrature(rule: str, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Nodes α_k in [0, 1] and weights w_k (summing to 1) of a fixed quadrature rule.

    'left': α_k = k/n (the default, as the published code); 'midpoint': (k + 1/2)/n;
    'gauss': Gauss-Legendre on [0, 1]; 'right': (k + 1)/n (one step is the gradient at the
    input itself: gradient x (input - baseline), what edge attribution patching takes).
    """
    if steps < 1:
        raise ValueError("steps must be >= 1")
    k = np.arange(steps, dtype=np.float64)
    if rule == "left":
        return k / steps, np.full(steps, 1.0 / steps)
    if rule == "right":
        return (k + 1) / steps, np.full(steps, 1.0 / steps)
    if rule == "midpoint":
        return (k + 0.5) / steps, np.full(steps, 1.0 / steps)
    if rule == "gauss":
        nodes, weights = np.polynomial.legendre.leggauss(steps)
        return (nodes + 1) / 2, weights / 2
    raise ValueError(f"rule must be one of {FIXED_RULES}, got {rule!r}")


# ----------------------------------------------------------------------------- rules as values


def _integer(value, name: str) -> int:
    """`value` as a Python int (a numpy integer too); a float, a bool or anything else is refused."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class FixedRule:
    """A fixed quadrature rule: `steps` nodes of `kind` ('left', the published rule: α_k = k/n;
    'midpoint'; 'gauss', Gauss-Legendre; 'right', whose one step is gradient x (input -
    baseline)), the same for every layer. `FixedRule()` is the published rule, 256 left steps."""

    kind: str = "left"
    steps: int = DEFAULT_STEPS

    def __post_init__(self):
        if self.kind not in FIXED_RULES:
            hint = (
                ": the adaptive rule is AdaptiveRule(tolerance=..., max_evaluations=...)"
                if self.kind == "adaptive"
                else ""
            )
            raise ValueError(f"a fixed rule's kind must be one of {FIXED_RULES}, got {self.kind!r}{hint}")
        object.__setattr__(self, "steps", _integer(self.steps, "steps"))  # a numpy int hashes and saves as an int
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")

    @property
    def name(self) -> str:
        """The rule's name among `RULES`: its kind."""
        return self.kind

    @property
    def evaluations(self) -> int:
        """Gradient evaluations per layer: its steps."""
        return self.steps

    def nodes(self) -> tuple[np.ndarray, np.ndarray]:
        """`(alphas, weights)` (`quadrature`)."""
        return quadrature(self.kind, self.steps)

    def settings(self) -> dict:
        """The entries it contributes to a result's settings (`rule_from_settings` reads them back)."""
        return {"steps": self.steps, "rule": self.kind}

    def identity(self) -> dict:
        """What a cached result must match (`jaxdepth.lab.study`): its settings."""
        return self.settings()

    @property
    def description(self) -> str:
        """In words: "left rule, 256 steps"."""
        return f"{self.kind} rule, {self.steps} steps"

    def __str__(self) -> str:
        return self.description


@dataclasses.dataclass(frozen=True)
class AdaptiveRule:
    """The adaptive rule (the module docstring): per layer, composite Simpson refined where the
    exact per-interval error is largest until the certified bound on the completeness gap is at
    most `tolerance` times max(|F(x) - F(b)|, `floor_share` |F(x)|, `atol`), or the layer has
    spent `max_evaluations` gradient evaluations (then it is reported as not converged).

    `tolerance`: one value, or one per attributed layer (a tuple; any sequence is taken as one).
    `grid_points` (0: none, else >= 2): a forward grid for the initial partition;
    `initial_intervals`: the intervals each layer starts from. It takes one prompt at a time."""

    tolerance: Union[float, tuple[float, ...]] = DEFAULT_TOLERANCE
    max_evaluations: int = MAX_EVALUATIONS
    atol: float = ATOL
    floor_share: float = FLOOR_SHARE
    grid_points: int = GRID_POINTS
    initial_intervals: int = INITIAL_INTERVALS

    def __post_init__(self):
        tolerance = np.asarray(self.tolerance, np.float64)
        if tolerance.ndim > 1 or tolerance.size == 0:
            raise ValueError(f"tolerance must be one value or one per layer, got {self.tolerance!r}")
        if not np.all(tolerance > 0):  # NaN too
            shown = tolerance.item() if tolerance.ndim == 0 else tolerance.tolist()
            raise ValueError(f"tolerance must be > 0, got {shown}")
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731  (its own normalisation)
        set_("tolerance", float(tolerance) if tolerance.ndim == 0 else tuple(tolerance.tolist()))
        set_("max_evaluations", _integer(self.max_evaluations, "max_evaluations"))
        if self.max_evaluations < 3:
            raise ValueError(f"max_evaluations must be >= 3 (one Simpson interval), got {self.max_evaluations}")
        set_("atol", float(self.atol))
        set_("floor_share", float(self.floor_share))
        if not (self.atol >= 0 and self.floor_share >= 0):
            raise ValueError(f"atol and floor_share must be >= 0, got {self.atol} and {self.floor_share}")
        set_("grid_points", _integer(self.grid_points, "grid_points"))
        if self.grid_points < 0 or self.grid_points == 1:
            raise ValueError(f"grid_points must be 0 (no grid) or >= 2, got {self.grid_points}")
        set_("initial_intervals", _integer(self.initial_intervals, "initial_intervals"))
        if self.initial_intervals < 1:
            raise ValueError(f"initial_intervals must be >= 1, got {self.initial_intervals}")

    name: ClassVar[str] = "adaptive"  # among `RULES`

    @property
    def evaluations(self) -> int:
        """Gradient evaluations per layer at most: its budget."""
        return self.max_evaluations

    def tolerances(self, layers: int) -> np.ndarray:
        """The tolerance of each of `layers` attributed layers `[layers]`."""
        if isinstance(self.tolerance, tuple) and len(self.tolerance) != layers:
            raise ValueError(
                f"tolerance has {len(self.tolerance)} values, one per layer, for {layers} attributed layers"
            )
        return np.broadcast_to(np.asarray(self.tolerance, np.float64), (layers,))

    @property
    def uniform_tolerance(self) -> Optional[float]:
        """The tolerance of every layer, or None where layers have tolerances of their own."""
        values = set(np.atleast_1d(self.tolerance).tolist())
        return values.pop() if len(values) == 1 else None

    def settings(self) -> dict:
        """The entries it contributes to a result's settings (`rule_from_settings` reads them back);
        a tolerance equal on every layer is one number."""
        uniform = self.uniform_tolerance
        return {
            "rule": self.name,
            "tolerance": list(self.tolerance) if uniform is None else uniform,
            "max_evaluations": self.max_evaluations,
            "atol": self.atol,
            "grid_points": self.grid_points,
            "initial_intervals": self.initial_intervals,
            "floor_share": self.floor_share,
        }

    def identity(self) -> dict:
        """What a cached result must match (`jaxdepth.lab.study`): the tolerance, the budget and
        `RULE_VERSION` (results of an older rule are recomputed); the other knobs only where
        they are not the defaults, so that results saved before they could be set stay valid."""
        settings, defaults = self.settings(), AdaptiveRule().settings()
        knobs = {k: v for k, v in settings.items() if k not in _ADAPTIVE_IDENTITY and v != defaults[k]}
        return {**{k: settings[k] for k in _ADAPTIVE_IDENTITY}, "rule_version": RULE_VERSION, **knobs}

    @property
    def description(self) -> str:
        """In words: "adaptive rule to 1%" (or "to per-layer tolerances")."""
        uniform = self.uniform_tolerance
        return f"adaptive rule to {'per-layer tolerances' if uniform is None else f'{100 * uniform:g}%'}"

    def __str__(self) -> str:
        return self.description


_ADAPTIVE_IDENTITY = ("rule", "tolerance", "max_evaluations")  # always in its identity, in this order

Rule = Union[FixedRule, AdaptiveRule]


def as_rule(rule: Union[Rule, str]) -> Rule:
    """`rule` itself, or the rule a name stands for with its defaults: 'left', 'midpoint',
    'gauss', 'right' -> `FixedRule(name)` (256 steps); 'adaptive' -> `AdaptiveRule()` (to 1%,
    at most 256 evaluations per layer)."""
    if isinstance(rule, (FixedRule, AdaptiveRule)):
        return rule
    if isinstance(rule, str):
        if rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
        return AdaptiveRule() if rule == "adaptive" else FixedRule(rule)
    if isinstance(rule, (int, np.integer)):  # steps, or a budget? say which
        raise TypeError(f"a number is not a rule: FixedRule(steps={rule}) or AdaptiveRule(max_evaluations={rule})?")
    raise TypeError(f"rule must be a FixedRule, an AdaptiveRule or one of {RULES}, got {rule!r}")


def rule_of(
    name: str, steps: int = DEFAULT_STEPS, tolerance: Any = None, max_evaluations: Optional[int] = None
) -> Rule:
    """The rule of loose options, as the command line gives them: `name` (one of `RULES`) with
    `steps`; the adaptive rule's `tolerance` (default `DEFAULT_TOLERANCE`) and `max_evaluations`
    (default `default_budget(steps)`: never more than the fixed rule). A fixed rule refuses a
    tolerance or a budget."""
    if name not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {name!r}")
    if name == "adaptive":
        return AdaptiveRule(
            tolerance=DEFAULT_TOLERANCE if tolerance is None else tolerance,
            max_evaluations=default_budget(steps) if max_evaluations is None else max_evaluations,
        )
    if tolerance is not None:
        raise ValueError(f"tolerance is the adaptive rule's; the {name!r} rule takes steps")
    if max_evaluations is not None:
        raise ValueError(f"max_evaluations is the adaptive rule's; the {name!r} rule takes steps")
    return FixedRule(name, steps)


def rule_from_settings(settings: Mapping) -> Rule:
    """The rule a result's settings name (`FixedRule.settings`, `AdaptiveRule.settings`); an entry
    missing takes the default (a fixed rule's name: 'left')."""
    if settings.get("rule") == "adaptive":
        fields = [f.name for f in dataclasses.fields(AdaptiveRule)]
        return AdaptiveRule(**{k: settings[k] for k in fields if k in settings})
    return FixedRule(settings.get("rule", "left"), settings.get("steps", DEFAULT_STEPS))


# ----------------------------------------------------------------------------- the adaptive rule


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


def choose_splits(
    errors: np.ndarray, can_split: np.ndarray, residual: float, target: float, max_splits: int, multiple: int = 1
) -> list[int]:
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

    def __init__(
        self,
        ends: np.ndarray,
        f_input: float,
        tolerance: float,
        atol: float,
        max_evaluations: int,
        floor_share: float = FLOOR_SHARE,
    ):
        self.intervals = list(zip(ends[:-1].tolist(), ends[1:].tolist()))
        self.phi: dict[float, float] = {}
        self.integrand: dict[float, np.ndarray] = {}
        self.f_input, self.tolerance, self.atol, self.floor_share = f_input, tolerance, atol, floor_share
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
    def scale(self) -> float:
        """What the tolerance is relative to: |F(x) - F(b)|, or the floor where that is smaller."""
        return max(abs(self.f_input - self.f_baseline), self.floor_share * abs(self.f_input), self.atol)

    @property
    def floored(self) -> bool:
        """Whether the floor, not |F(x) - F(b)|, set the target."""
        return abs(self.f_input - self.f_baseline) < self.scale

    @property
    def target(self) -> float:
        """The bound at which the layer stops, in units of F."""
        return self.tolerance * self.scale

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
        split = set(
            choose_splits(
                errors,
                can_split,
                residual,
                self.target,
                (self.max_evaluations - self.evaluations) // 2,
                _SPLIT_MULTIPLE,
            )
        )
        if not split:
            self.done = True
            return
        intervals = []
        for i, (a, b) in enumerate(self.intervals):
            m = (a + b) / 2
            intervals += [(a, m), (m, b)] if i in split else [(a, b)]
        self.intervals = intervals


# ----------------------------------------------------------------------------- batching the nodes


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
            part = nodes[start : start + size]
            start += len(part)
            alphas = np.asarray(part + [part[-1]] * (size - len(part)), np.float32)
            pending.append((layer, len(part), call(layer, alphas, True, size)))
    out: dict[int, tuple[list, list]] = {}
    for layer, count, (phi, integrand) in pending:
        ps, gs = out.setdefault(layer, ([], []))
        ps.extend(to_host(phi)[:count])
        gs.extend(to_host(integrand)[:count])
    return {layer: (np.asarray(ps), np.asarray(gs)) for layer, (ps, gs) in out.items()}


def largest_call(
    config: ModelConfig, seq_len: int, memory_budget: Optional[int] = None, *, stored: Union[bool, int] = False
) -> int:
    """The largest number of nodes of one call: a power of two, at most `_LARGEST_CALL`, whose
    vmapped gradients fit in memory (`auto_chunk_size`; `stored` as `member_bytes` takes it)."""
    return power_of_two_floor(
        auto_chunk_size(config, seq_len, _LARGEST_CALL, grad=True, stored=stored, memory_budget=memory_budget)
    )


def power_of_two_floor(n: int) -> int:
    """The largest power of two <= n (1 for n < 1)."""
    return 1 << (max(int(n), 1).bit_length() - 1)


def run_rule(
    call,
    keys: Sequence,
    f_input: float,
    rule: AdaptiveRule,
    *,
    largest: int = _LARGEST_CALL,
    tolerance: Optional[np.ndarray] = None,
    on_done=None,
) -> list[LayerRule]:
    """`rule` on the paths of `keys` (one prompt; the attributed layers, or any keys `call`
    knows), host side: rounds of `call(key, alphas [n], grad, chunk) -> (phi [n], integrand
    [n, T])` (`jaxdepth.analyses.ig.path.path_points`, `chunk` nodes vmapped at a time) until
    every path is done. `largest`: the nodes of one call at most (`largest_call`: what fits in
    memory, at most 32; rounded down to a power of two); `tolerance`: one per key (default the
    rule's, `AdaptiveRule.tolerances`). Returns each key's finished `LayerRule`; `on_done()` is
    called as each one finishes."""
    keys = list(keys)
    tolerance = rule.tolerances(len(keys)) if tolerance is None else np.broadcast_to(tolerance, (len(keys),))
    largest = power_of_two_floor(largest)
    n = min(rule.initial_intervals, (rule.max_evaluations - 1) // 2)
    if rule.grid_points >= 2:  # forward passes only: a call of gradients fits, so does one of forwards
        grid = np.linspace(0.0, 1.0, rule.grid_points)
        calls = [call(key, grid.astype(np.float32), False, largest)[0] for key in keys]
        phi_grid = np.stack([to_host(phi) for phi in calls]).astype(np.float64)
    else:  # no grid: a uniform initial partition
        grid, phi_grid = np.array([0.0, 1.0]), np.zeros((len(keys), 2))
    states = [
        LayerRule(
            initial_partition(grid, phi_grid[i], n),
            f_input,
            float(tolerance[i]),
            rule.atol,
            rule.max_evaluations,
            rule.floor_share,
        )
        for i in range(len(keys))
    ]
    while not all(r.done for r in states):
        requests = {i: r.missing() for i, r in enumerate(states) if not r.done}
        for i, (phi, integrand) in _evaluate(lambda i, *a: call(keys[i], *a), requests, largest).items():
            states[i].record(requests[i], phi, integrand)
        for r in states:
            if not r.done:
                r.step()
                if r.done and on_done is not None:
                    on_done()
    return states


def summarise(rules: Sequence[LayerRule]) -> dict:
    """The finished rules of a prompt's layers as arrays: `attributions [n, T]`, `f_input []`,
    `f_baseline [n]`, `evaluations [n]`, `converged [n]`, `bound [n]` (the certificate
    sum_i |e_i| + |φ(1) - F(x)|), `floored [n]` (the floor set the layer's target)."""
    return dict(
        attributions=np.stack([r.attributions() for r in rules]),
        f_input=rules[0].f_input,
        f_baseline=np.array([r.f_baseline for r in rules]),
        evaluations=np.array([r.evaluations for r in rules]),
        converged=np.array([r.converged for r in rules]),
        bound=np.array([r.bound for r in rules]),
        floored=np.array([r.floored for r in rules]),
    )
