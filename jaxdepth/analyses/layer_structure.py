"""What the model still does when its layers are dropped, swapped, reversed, repeated or run in
parallel: each structure of a family (`jaxdepth.core.structure`) scored on prompts with
reference answers, every structure of a sweep in one vmapped computation.

Scores of a structure, per prompt (teacher-forced: the prompt and its reference answer run
once, under the structure):
- `answer_logprob`: the mean log-probability of the answer tokens;
- `answer_correct`: 1 where every answer token is the top-1 prediction at its position, else 0.

The angular-distance rule of Gromov et al. (arXiv 2403.17887) is the baseline: for a block of
n layers it drops the block whose input h_l and output h_{l+n} are closest in angle at the
last token of the prompt, d(l, n) = arccos(cos(h_l, h_{l+n})) / pi averaged over the prompts;
`gromov_choice` names that block for each n, so that its cost can be set against the best
block the sweep finds.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxdepth.core.batch import PromptBatch
from jaxdepth.core.compilation import jit
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.layer import Params
from jaxdepth.core.loops import run_layers
from jaxdepth.core.model import embed, residual_stream, unembed
from jaxdepth.core.structure import (
    LayerOrder,
    drop_block,
    identity_order,
    parallel_block,
    repeat_block,
    reverse_block,
    stack_orders,
    swap_pair,
)
from jaxdepth.core.sweep import sweep

__all__ = [
    "Structure",
    "structure_family",
    "StructureScores",
    "structure_scores",
    "angular_distances",
    "gromov_choice",
]


@dataclasses.dataclass(frozen=True)
class Structure:
    """One member of a family: its `kind` ('intact', 'drop', 'swap', 'reverse', 'repeat',
    'parallel'), the first layer of its block and the block's size (2 for a swap; the intact
    model, every layer once in order, has none: 0, 0)."""

    kind: str
    start: int
    size: int

    def order(self, num_layers: int) -> LayerOrder:
        """The layer order this structure runs (`jaxdepth.core.structure`)."""
        make = {
            "intact": lambda L, start, size: identity_order(L),
            "drop": drop_block,
            "swap": lambda L, start, size: swap_pair(L, start),
            "reverse": reverse_block,
            "repeat": repeat_block,
            "parallel": parallel_block,
        }
        if self.kind not in make:
            raise ValueError(f"unknown structure kind {self.kind!r}; kinds: {', '.join(make)}")
        return make[self.kind](num_layers, self.start, self.size)

    def __str__(self) -> str:
        return self.kind if self.kind == "intact" else f"{self.kind} {self.start}..{self.start + self.size - 1}"


def structure_family(num_layers: int, max_block: int) -> list[Structure]:
    """The intact model, then the family of the studies: drop k consecutive layers at every
    start for k = 1..`max_block`; swap each adjacent pair; reverse, repeat (twice) and
    parallelise the middle block of each size k = 2..`max_block`."""
    if not 1 <= max_block < num_layers:
        raise ValueError(f"max_block must be in 1..{num_layers - 1}, got {max_block}")
    family = [Structure("intact", 0, 0)]
    family += [Structure("drop", s, k) for k in range(1, max_block + 1) for s in range(num_layers - k + 1)]
    family += [Structure("swap", s, 2) for s in range(num_layers - 1)]
    for kind in ("reverse", "repeat", "parallel"):
        family += [Structure(kind, (num_layers - k) // 2, k) for k in range(2, max_block + 1)]
    return family


@dataclasses.dataclass(frozen=True)
class StructureScores:
    """Teacher-forced scores `[structures, B]` (module docstring) of `structures`."""

    structures: tuple
    answer_logprob: np.ndarray
    answer_correct: np.ndarray

    def accuracy(self) -> np.ndarray:
        """Each structure's fraction of prompts answered correctly `[structures]`."""
        return self.answer_correct.mean(axis=1)


def _answer_scores(logits, tokens, valid, answer_start):
    """Per prompt: the mean log-probability of its answer tokens and whether each is top-1."""
    T = tokens.shape[1]
    log_probs = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    targets = tokens[:, 1:]
    picked = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    position = jnp.arange(1, T)[None, :]
    answer = (position >= answer_start[:, None]) & valid[:, 1:]
    count = jnp.maximum(answer.sum(axis=1), 1)
    top = jnp.argmax(log_probs, axis=-1) == targets
    return jnp.sum(jnp.where(answer, picked, 0.0), axis=1) / count, jnp.all(top | ~answer, axis=1)


def structure_scores(
    params: Params,
    batch: PromptBatch,
    config: ModelConfig,
    structures,
    *,
    chunk_size: Optional[int] = None,
) -> StructureScores:
    """The teacher-forced scores of each of `structures` (`Structure`s) on `batch` (prompts with
    their reference answers from `answer_start` on), `chunk_size` structures at a time in one
    vmapped computation (default: all at once)."""
    structures = tuple(structures)
    if not structures:
        raise ValueError("no structures to score")
    if (batch.answer_start >= batch.lengths).any():
        raise ValueError("every prompt needs an answer to score: answer_start is past a prompt's end")
    orders = stack_orders([s.order(config.num_layers) for s in structures])
    tokens, valid = jnp.asarray(batch.tokens), jnp.asarray(batch.valid)
    starts = jnp.asarray(batch.answer_start)
    logprob, correct = _scored(params, tokens, valid, starts, LayerOrder(*map(jnp.asarray, orders)), config, chunk_size)
    return StructureScores(structures, np.asarray(logprob), np.asarray(correct).astype(np.float32))


@partial(jit, static_argnames=("config", "chunk_size"))
def _scored(params, tokens, valid, starts, orders, config, chunk_size):
    h0 = embed(params, tokens, config)

    def one(order):
        h, _ = run_layers(params, h0, config, valid=valid, order=order)
        return _answer_scores(unembed(params, h, config), tokens, valid, starts)

    return sweep(one, orders, chunk_size)


def angular_distances(params: Params, batch: PromptBatch, config: ModelConfig, max_block: int) -> np.ndarray:
    """`[max_block, L]`: row n-1, column l is the mean over prompts of arccos(cos(h_l, h_{l+n}))
    / pi at the prompt's last token before its answer (NaN where l + n > L)."""
    hs = _residuals(params, jnp.asarray(batch.tokens), config, jnp.asarray(batch.valid))
    last = jnp.asarray(batch.answer_start) - 1
    h = np.asarray(hs[:, np.arange(len(batch)), last], np.float64)  # [L+1, B, D]
    unit = h / np.linalg.norm(h, axis=-1, keepdims=True)
    L = config.num_layers
    out = np.full((max_block, L), np.nan)
    for n in range(1, max_block + 1):
        cosines = np.clip(np.sum(unit[: L + 1 - n] * unit[n:], axis=-1), -1.0, 1.0)  # [L+1-n, B]
        out[n - 1, : L + 1 - n] = np.mean(np.arccos(cosines) / np.pi, axis=1)
    return out


@partial(jit, static_argnames="config")
def _residuals(params, tokens, config, valid):
    return residual_stream(params, tokens, config, valid=valid)


def gromov_choice(distances: np.ndarray) -> list[Structure]:
    """For each block size n (row n-1 of `angular_distances`), the block Gromov et al. drop:
    the start with the smallest angular distance."""
    return [Structure("drop", int(np.nanargmin(row)), n + 1) for n, row in enumerate(distances)]
