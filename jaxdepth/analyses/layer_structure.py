"""What the model still does when its layers are dropped, swapped, reversed, repeated or run in
parallel: each structure of a family (`jaxdepth.core.structure`) scored on prompts with
reference answers, every structure of a sweep in one vmapped computation.

Scores of a structure, per prompt (teacher-forced: the prompt and its reference answer run
once, under the structure):
- `answer_logprob`: the mean log-probability of the answer tokens;
- `answer_token_accuracy`: the fraction of the answer tokens that are the top-1 prediction at
  their position (what a small model's scores move with, where whole answers are rarely right);
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
from jaxdepth.core.saved_result import SavedResult
from jaxdepth.core.sweep import auto_chunk_size, sweep
from jaxdepth.analyses.suite import Analysis, Settings, option

__all__ = [
    "Structure",
    "structure_family",
    "StructureScores",
    "structure_scores",
    "angular_distances",
    "gromov_choice",
    "StructureResult",
    "structure_analysis",
    "structure_figure",
    "StructureSettings",
    "ANALYSIS",
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
    """Teacher-forced scores `[structures, B]` (module docstring) of `structures`; also
    `answer_token_accuracy`, the fraction of each prompt's answer tokens that are top-1."""

    structures: tuple
    answer_logprob: np.ndarray
    answer_token_accuracy: np.ndarray
    answer_correct: np.ndarray

    def accuracy(self) -> np.ndarray:
        """Each structure's fraction of prompts answered correctly `[structures]`."""
        return self.answer_correct.mean(axis=1)


def _answer_scores(logits, tokens, valid, answer_start):
    """Per prompt: the mean log-probability of its answer tokens, the fraction of them that are
    the top-1 prediction, and whether all are."""
    T = tokens.shape[1]
    log_probs = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    targets = tokens[:, 1:]
    picked = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    position = jnp.arange(1, T)[None, :]
    answer = (position >= answer_start[:, None]) & valid[:, 1:]
    count = jnp.maximum(answer.sum(axis=1), 1)
    top = jnp.argmax(log_probs, axis=-1) == targets
    mean = lambda x: jnp.sum(jnp.where(answer, x, 0.0), axis=1) / count  # noqa: E731
    return mean(picked), mean(top.astype(jnp.float32)), jnp.all(top | ~answer, axis=1)


def structure_scores(
    params: Params,
    batch: PromptBatch,
    config: ModelConfig,
    structures,
    *,
    chunk_size: Optional[int] = None,
    memory_budget: Optional[int] = None,
) -> StructureScores:
    """The teacher-forced scores of each of `structures` (`Structure`s) on `batch` (prompts with
    their reference answers from `answer_start` on), `chunk_size` structures at a time in one
    vmapped computation (default: as many as `memory_budget` holds, `auto_chunk_size`; all at
    once can take many times longer, swapping memory)."""
    structures = tuple(structures)
    if not structures:
        raise ValueError("no structures to score")
    if (batch.answer_start >= batch.lengths).any():
        raise ValueError("every prompt needs an answer to score: answer_start is past a prompt's end")
    orders = stack_orders([s.order(config.num_layers) for s in structures])
    B, T = batch.tokens.shape
    chunk_size = chunk_size or auto_chunk_size(config, B * T, len(structures), memory_budget=memory_budget)
    tokens, valid = jnp.asarray(batch.tokens), jnp.asarray(batch.valid)
    starts = jnp.asarray(batch.answer_start)
    logprob, token_accuracy, correct = _scored(
        params, tokens, valid, starts, LayerOrder(*map(jnp.asarray, orders)), config, chunk_size
    )
    return StructureScores(
        structures, np.asarray(logprob), np.asarray(token_accuracy), np.asarray(correct).astype(np.float32)
    )


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
    fits = lambda row: np.where(np.isnan(row) | (row < 0), np.inf, row)  # noqa: E731  (NaN, or -1 as saved)
    return [Structure("drop", int(np.argmin(fits(row))), n + 1) for n, row in enumerate(distances)]


# ----------------------------------------------------------------------------- in the suite


@dataclasses.dataclass
class StructureResult(SavedResult):
    """The family's scores on a study's prompts: structure `kinds` (a list), `starts` and
    `sizes` `[S]` (the intact model first); per structure and prompt `[S, B]`,
    `answer_logprob`, `answer_token_accuracy` (the fraction of answer tokens that are the top-1
    prediction, teacher-forced) and `answer_correct` (all of them); `angular_distance`
    `[max_block, L]` (`angular_distances`, with -1 where a block does not fit: a saved result
    holds no NaN); `settings` as the caller passed them."""

    kinds: list
    starts: np.ndarray
    sizes: np.ndarray
    answer_logprob: np.ndarray
    answer_token_accuracy: np.ndarray
    answer_correct: np.ndarray
    angular_distance: np.ndarray
    num_layers: int
    settings: dict

    def structures(self) -> list[Structure]:
        """The family's structures, in the order of the score rows."""
        return [Structure(k, int(s), int(n)) for k, s, n in zip(self.kinds, self.starts, self.sizes)]

    def accuracy(self) -> np.ndarray:
        """Each structure's mean teacher-forced token accuracy over the prompts `[S]`."""
        return self.answer_token_accuracy.mean(axis=1)

    def drop_grid(self, scores: np.ndarray) -> np.ndarray:
        """`scores [S]` of the drops as a grid `[max_block, L]`: row k-1, column l is the drop of
        layers l..l+k-1 (NaN where that block does not fit)."""
        grid = np.full((self.angular_distance.shape[0], self.num_layers), np.nan)
        for s, value in zip(self.structures(), scores):
            if s.kind == "drop":
                grid[s.size - 1, s.start] = value
        return grid

    def largest_droppable(self, points: float = 1.0) -> Optional[Structure]:
        """The largest block of consecutive layers whose drop keeps the mean token accuracy
        within `points` percentage points of the intact model's (the best such block of that
        size), or None if not even one layer can go."""
        accuracy, found = self.accuracy(), None
        floor = accuracy[0] - points / 100
        for s, a in zip(self.structures(), accuracy):
            if s.kind == "drop" and a >= floor and (found is None or (s.size, a) > (found[0].size, found[1])):
                found = (s, a)
        return None if found is None else found[0]


def structure_analysis(
    params: Params,
    batch: PromptBatch,
    config: ModelConfig,
    *,
    max_block: int,
    chunk_size: Optional[int] = None,
    memory_budget: Optional[int] = None,
) -> "StructureResult":
    """`StructureResult` of `structure_family(L, max_block)` on `batch` (`structure_scores`)."""
    family = structure_family(config.num_layers, max_block)
    scores = structure_scores(params, batch, config, family, chunk_size=chunk_size, memory_budget=memory_budget)
    return StructureResult(
        kinds=[s.kind for s in family],
        starts=np.array([s.start for s in family]),
        sizes=np.array([s.size for s in family]),
        answer_logprob=scores.answer_logprob,
        answer_token_accuracy=scores.answer_token_accuracy,
        answer_correct=scores.answer_correct,
        angular_distance=np.nan_to_num(angular_distances(params, batch, config, max_block), nan=-1.0),
        num_layers=config.num_layers,
        settings={"max_block": max_block},
    )


def structure_figure(result: StructureResult, *, title: Optional[str] = None):
    """The drop heatmaps (block start x size) of the answer log-probability and the token
    accuracy, each with the angular-distance rule's choice per size marked x, and the other
    structures' token accuracy against the intact model's."""
    from jaxdepth.analyses import drawing as d

    d.expect(result, StructureResult, "structure_figure")
    fig = d.new_figure(13, 4.2)
    logprob_ax, accuracy_ax, rows_ax = fig.subplots(1, 3)
    rule = gromov_choice(result.angular_distance)
    for ax, scores, label in (
        (logprob_ax, result.answer_logprob.mean(axis=1), "answer log-probability"),
        (accuracy_ax, result.accuracy(), "token accuracy"),
    ):
        image = ax.imshow(result.drop_grid(scores), aspect="auto", origin="lower", cmap="viridis")
        ax.scatter([s.start for s in rule], [s.size - 1 for s in rule], marker="x", color="r", label="angular rule")
        ax.set_xlabel("first dropped layer")
        ax.set_ylabel("layers dropped")
        ax.set_yticks(range(result.angular_distance.shape[0]), range(1, result.angular_distance.shape[0] + 1))
        ax.set_title(f"drops: {label} (intact {scores[0]:.2f})")
        fig.colorbar(image, ax=ax, pad=0.01)
    accuracy_ax.legend(loc="upper right", fontsize="small")
    accuracy = result.accuracy()
    for i, kind in enumerate(("swap", "reverse", "repeat", "parallel")):
        picked = [
            (s.start if kind == "swap" else s.size, a) for s, a in zip(result.structures(), accuracy) if s.kind == kind
        ]
        if picked:
            x, y = zip(*picked)
            rows_ax.plot(
                x, y, marker=".", color=f"C{i}", label=kind + (" (first layer)" if kind == "swap" else " (block size)")
            )
    rows_ax.axhline(accuracy[0], color="k", linestyle="--", label="intact")
    rows_ax.set_xlabel("first swapped layer, or middle block size")
    rows_ax.set_ylabel("token accuracy")
    rows_ax.grid(alpha=0.3)
    rows_ax.legend(fontsize="small")
    d.title_figure(fig, "What the model still does without its layers in order", title, result.settings)
    return fig


def _summary(result: StructureResult) -> list[str]:
    best = result.largest_droppable()
    rule = gromov_choice(result.angular_distance)
    if best is None:
        return ["no layer droppable within 1 point of token accuracy"]
    by_rule = next(s for s in rule if s.size == best.size)
    accuracy = {str(s): 100 * a for s, a in zip(result.structures(), result.accuracy())}
    return [
        f"droppable within 1 point: {best.size} layers ({best})",
        f"angular rule at that size: {by_rule} ({accuracy[str(by_rule)]:.0f}% against {accuracy[str(best)]:.0f}%)",
    ]


@dataclasses.dataclass(frozen=True, kw_only=True)
class StructureSettings(Settings):
    """The structure sweep's settings in a study (`Settings` and its option)."""

    structure_max_block: int = option(
        4, "layer structure: the largest block of consecutive layers dropped (and reversed, repeated, parallel)"
    )

    def __post_init__(self):
        super().__post_init__()
        if self.structure_max_block < 1:
            raise ValueError(f"--structure-max-block must be at least 1, got {self.structure_max_block}")


def _run(x) -> StructureResult:
    L = x.model.config.num_layers
    return structure_analysis(
        x.model.params,
        x.batch,
        x.model.config,
        max_block=min(x.settings.structure_max_block, L - 1),
        memory_budget=x.settings.memory_budget,
    )


ANALYSIS = Analysis(
    name="layer_structure",
    result_type=StructureResult,
    settings=StructureSettings,
    identity=lambda s: {"structure_max_block": s.structure_max_block},
    run=_run,
    figures=lambda r, tokenizer, n: {"": structure_figure(r)},
    summary=_summary,
    detail=True,
)
