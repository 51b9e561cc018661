"""A quadrature rule applied to paths, blind to what is differentiated along them.

`Paths` are straight paths from a baseline (α = 0) to an input (α = 1), one per key (an
attributed layer of integrated gradients at a site, a prompt pair of EAP-IG), with the two
device functions that evaluate them:

- `weighted(key, alphas [n], weights [n], chunk)`: sum_k w_k G(α_k) for any pytree G (the
  gradient at a site, the gradients at every edge reader), `chunk` nodes vmapped at a time
  (`jaxdepth.core.sweep.weighted_sum`);
- `points(key, alphas [n], grad, chunk)`: `(phi [n], integrand [n, T])`, F along the path and the
  per-position integrand that sums to φ' (forward only with `grad=False`): what the adaptive
  rule evaluates and certifies (`jaxdepth.analyses.ig.rules`).

The integrator owns the rest: a fixed rule's nodes and weights (`integrate_fixed`), the adaptive
rule's rounds (`adapt`) and the weighted pass with its final nodes (`integrate_final`). A new
attribution along straight paths supplies the two functions and reuses the rules as they are.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import numpy as np

from jaxdepth.analyses.ig import rules

__all__ = [
    "Paths",
    "integrate_fixed",
    "adapt",
    "integrate_final",
    "FINAL_CHUNK",
]

# The adaptive rule's final weighted pass runs this many nodes at a time at most, its nodes padded
# to a multiple of the chunk (zero weights): the node counts of different keys share compilations.
FINAL_CHUNK = 8


@dataclasses.dataclass(frozen=True)
class Paths:
    """Paths to integrate and how to evaluate them (the module docstring): `weighted` and
    `points` (None where only fixed rules apply), `chunk` the nodes a weighted sweep vmaps at
    once (what fits in memory), `call_size` the adaptive rule's nodes per call at most
    (`rules.run_rule`'s `largest`)."""

    weighted: Callable[..., Any]
    points: Optional[Callable[..., tuple]] = None
    chunk: int = FINAL_CHUNK
    call_size: int = FINAL_CHUNK

    def __post_init__(self):
        if self.chunk < 1 or self.call_size < 1:
            raise ValueError(f"chunk and call_size must be >= 1, got {self.chunk} and {self.call_size}")


def integrate_fixed(paths: Paths, key, rule: rules.FixedRule) -> Any:
    """The path of `key` integrated with a fixed rule: `weighted` at its nodes and weights."""
    alphas, weights = rule.nodes()
    chunk = min(paths.chunk, rule.steps)  # one compilation for any chunk bound above the steps
    return paths.weighted(key, np.asarray(alphas, np.float32), np.asarray(weights, np.float32), chunk)


def adapt(paths: Paths, keys: Sequence, f_input: float, rule: rules.AdaptiveRule, *, on_done=None):
    """The adaptive rule on the paths of `keys` (one prompt, F(x) = `f_input`): each key's
    finished `rules.LayerRule` (its nodes, its per-position integral, its certificate)."""
    if paths.points is None:
        raise ValueError("the adaptive rule evaluates points along the paths: these paths have no `points`")
    return rules.run_rule(paths.points, keys, f_input, rule, largest=paths.call_size, on_done=on_done)


def integrate_final(paths: Paths, key, finished: rules.LayerRule) -> Any:
    """`weighted` with the finished adaptive rule's nodes and weights (its composite Simpson rule
    as one rule): one more gradient per node, for what the rule's rounds do not keep (the
    gradient per channel, the readers' gradients)."""
    alphas, weights = finished.node_weights()
    chunk = min(paths.chunk, FINAL_CHUNK)
    pad = -len(alphas) % chunk
    alphas = np.pad(alphas, (0, pad), constant_values=1.0)  # at α = 1, weight 0: no effect on the sum
    weights = np.pad(weights, (0, pad))
    return paths.weighted(key, alphas.astype(np.float32), weights.astype(np.float32), chunk)
