"""What an ablated edge carries: the value each writer's output is replaced by when an edge is
patched (`jaxdepth.analyses.edges.patching`) and that the scores measure the clean run against
(`jaxdepth.analyses.edges.scores`).

- `CORRUPT` (the default): the writer's output in the pair's corrupt run;
- `ZERO`: zero;
- `mean_ablation(...)`: the writer's output averaged over every real token of a prompt set the
  user gives (`[W, D]`), or with `per_position=True` over the prompts at each position
  (`[W, T, D]`; every position the pairs use must be reached by some prompt).

Under any ablation, F(ablated) is F with every edge ablated (the empty circuit): for `CORRUPT`
the corrupt run's F, otherwise one patched run. The edges out of a node of the 'activations'
variant then sum to F(clean) - F(that node's output ablated). EAP-IG over the inputs
interpolates between two prompts' embeddings and takes `CORRUPT` only, as the EAP-IG package
does.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxdepth.analyses.edges.graph import EdgeGraph
from jaxdepth.analyses.edges.pairs import SAME_PROMPTS, PromptPairs
from jaxdepth.analyses.edges.readers import EdgeRun, check_interventions, edge_run
from jaxdepth.core.compilation import jit
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.execution import Execution
from jaxdepth.core.model import check_tokens, embed
from jaxdepth.core.progress import track

__all__ = ["Ablation", "CORRUPT", "ZERO", "ABLATIONS", "Patching", "mean_ablation", "as_ablation"]

ABLATIONS = ("corrupt", "zero", "mean", "mean-per-position")
PROMPTS_AT_ONCE = 8  # prompts run together when a mean is taken


@dataclasses.dataclass(frozen=True, eq=False)
class Ablation:
    """`kind` (one of `ABLATIONS`) and, for the means, the writers' mean outputs `values`
    (`[W, D]` for 'mean', `[W, T, D]` for 'mean-per-position'). Build the means with
    `mean_ablation`; `CORRUPT` and `ZERO` are the others."""

    kind: str
    values: Optional[np.ndarray] = None

    def __post_init__(self):
        if self.kind not in ABLATIONS:
            raise ValueError(f"ablation must be one of {ABLATIONS}, got {self.kind!r}")
        dims = {"mean": 2, "mean-per-position": 3}.get(self.kind)
        if (dims is None) != (self.values is None) or (dims and np.ndim(self.values) != dims):
            raise ValueError(
                f"a {self.kind!r} ablation takes "
                + (f"its means [W, {'T, ' * (dims == 3)}D]" if dims else "no values")
                + " (build means with mean_ablation)"
            )

    def writers(self, graph: EdgeGraph, pairs: PromptPairs, corrupt: Optional[EdgeRun], hidden: int) -> jax.Array:
        """`[W, B, T, D]` (or broadcastable to it): each writer's ablated output for `pairs`."""
        W, T = graph.num_writers, pairs.clean.shape[1]
        if self.kind == "corrupt":
            if np.array_equal(np.asarray(pairs.clean), np.asarray(pairs.corrupt)):
                raise ValueError(f"the corrupt ablation patches in the corrupt prompts, and {SAME_PROMPTS}")
            return corrupt.writers
        if self.kind == "zero":
            return jnp.zeros((W, 1, 1, hidden), jnp.float32)
        values = np.asarray(self.values)
        if values.shape[0] != W or values.shape[-1] != hidden:
            raise ValueError(f"the ablation's means are [{values.shape[0]}, ..., {values.shape[-1]}]: another model's")
        if self.kind == "mean":
            return jnp.asarray(values[:, None, None])
        if values.shape[1] < T:
            raise ValueError(
                f"the mean per position covers positions 0..{values.shape[1] - 1} (no prompt of its set reaches "
                f"further), and the pairs have {T}: take the means over prompts at least as long as the pairs"
            )
        return jnp.asarray(values[:, None, :T])


CORRUPT = Ablation("corrupt")
ZERO = Ablation("zero")


def as_ablation(ablation) -> Ablation:
    """`ablation` as an `Ablation`: None is `CORRUPT`; 'corrupt' and 'zero' stand for theirs (the
    means need their prompts: `mean_ablation`)."""
    if ablation is None:
        return CORRUPT
    if isinstance(ablation, Ablation):
        return ablation
    if ablation in ("corrupt", "zero"):
        return Ablation(ablation)
    if ablation in ABLATIONS:
        raise ValueError(f"a {ablation!r} ablation needs its prompts: build it with edges.mean_ablation(...)")
    raise ValueError(f"ablation must be an Ablation, 'corrupt' or 'zero', got {ablation!r}")


@dataclasses.dataclass(frozen=True, eq=False)
class Patching:
    """The runs an edge function compares: `ablation`, what an ablated (patched) edge carries
    (an `Ablation`, or 'corrupt' or 'zero'; None: `CORRUPT`, the pair's corrupt run; held as an
    `Ablation`, `as_ablation`), and `interventions` (`jaxdepth.core.sites`), which act on every
    run, clean, corrupt, patched and along the paths (refused at a site no edge carries,
    `readers.check_interventions`). What is measured, not how it runs (that is the
    `jaxdepth.Execution`)."""

    ablation: Any = None
    interventions: Any = None

    def __post_init__(self):
        object.__setattr__(self, "ablation", as_ablation(self.ablation))


@partial(jit, static_argnames="config")
def _writer_sums(params, tokens, valid, config: ModelConfig, interventions=None):
    """Each writer's outputs summed over the rows `[W, T, D]`, real positions only."""
    last = jnp.maximum(valid.sum(axis=1) - 1, 0)
    run = edge_run(params, embed(params, tokens, config), valid, last, config, interventions=interventions)
    # `where`, not a product: a row with no real position (the last chunk's filling) may hold NaN
    return jnp.where(valid[None, :, :, None], run.writers.astype(jnp.float32), 0.0).sum(axis=1)


def mean_ablation(
    params,
    prompts: Sequence[Sequence[int]],
    config: ModelConfig,
    *,
    per_position: bool = False,
    interventions=None,
    execution: Execution = Execution(),
) -> Ablation:
    """Mean ablation: each writer's output (`jaxdepth.analyses.edges.graph`'s writers: the
    input, every head, every MLP) averaged over every real token of `prompts` (token lists of
    any lengths; `[W, D]`), or with `per_position` over the prompts that reach each position
    (`[W, T, D]`, T the longest prompt), under `interventions` as the edge functions run them.
    `execution`: `chunk_size` prompts run at a time (default `PROMPTS_AT_ONCE`; another only
    reorders the sums) and `progress`."""
    prompts = [list(map(int, p)) for p in prompts]
    if not prompts or not all(prompts):
        raise ValueError("mean_ablation needs prompts, none of them empty")
    check_interventions(interventions, EdgeGraph.of(config))
    T = max(map(len, prompts))
    padded = np.array([p + [0] * (T - len(p)) for p in prompts], np.int32)
    check_tokens(padded, config)
    valid = np.arange(T)[None] < np.array([len(p) for p in prompts])[:, None]
    sums = 0.0
    # not `in_chunks`: the filling rows here have no real position (a repeated prompt would count twice)
    at_once = execution.chunk_size or PROMPTS_AT_ONCE
    for start in track(range(0, len(prompts), at_once), execution.progress, "mean ablation (prompts)"):
        rows = slice(start, start + at_once)
        tokens, real = padded[rows], valid[rows]
        if len(tokens) < at_once:  # one compiled shape: the last rows padded with no real position
            fill = at_once - len(tokens)
            tokens = np.concatenate([tokens, np.zeros((fill, T), np.int32)])
            real = np.concatenate([real, np.zeros((fill, T), bool)])
        sums = sums + np.asarray(_writer_sums(params, jnp.asarray(tokens), jnp.asarray(real), config, interventions))
    counts = valid.sum(axis=0)  # [T]: prompts at each position
    if per_position:  # every position has a prompt: T is the longest
        return Ablation("mean-per-position", (sums / counts[None, :, None]).astype(np.float32))
    return Ablation("mean", (sums.sum(axis=1) / counts.sum()).astype(np.float32))
