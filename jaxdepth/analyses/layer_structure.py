"""What the model still does when its layers are dropped, swapped, reversed, repeated or run in
parallel: each structure of a family (`jaxdepth.core.structure`) scored on prompts with
reference answers, every structure of a sweep in one vmapped computation.

Scores of a structure, per prompt (teacher-forced: the prompt and its reference answer run
once, under the structure):
- `answer_logprob`: the mean log-probability of the answer tokens;
- `answer_token_accuracy`: the fraction of the answer tokens that are the top-1 prediction at
  their position (what a small model's scores move with, where whole answers are rarely right);
- `answer_correct`: 1 where every answer token is the top-1 prediction at its position, else 0.

Generated (`generated_answers`): the model, under the structure, continues the prompt's question
greedily (`jaxdepth.core.decoding.generate` vmapped over a chunk of structures: their layer
orders are data, so one compiled program decodes every chunk of one shape); the continuation,
cut at its first blank line, is right when its final answer equals the reference answer's
(`jaxdepth.analyses.answers`: the boxed answer, the one after "final answer is" or "####",
else the last number, numbers compared as numbers).

The angular-distance rule of Gromov et al. (arXiv 2403.17887) is the baseline: for a block of
n layers it drops the block whose input h_l and output h_{l+n} are closest in angle at the
last token of the prompt, d(l, n) = arccos(cos(h_l, h_{l+n})) / pi averaged over the prompts;
`gromov_choice` names that block for each n, so that its cost can be set against the best
block the sweep finds.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxdepth.analyses.answers import cut_generation, same_answer
from jaxdepth.core.batch import PromptBatch
from jaxdepth.core.compilation import jit
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.decoding import Decoding, generate
from jaxdepth.core.execution import Execution, refuse_loose_options
from jaxdepth.core.layer import Params
from jaxdepth.core.loops import LayerRun, run_layers
from jaxdepth.core.model import embed, residual_stream, token_per_layer_inputs, unembed
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
from jaxdepth.core.progress import track
from jaxdepth.core.saved_result import SavedResult
from jaxdepth.core.sweep import member_bytes, sweep
from jaxdepth.analyses.suite import Analysis, Settings, option

__all__ = [
    "Structure",
    "structure_family",
    "StructureScores",
    "structure_scores",
    "generated_answers",
    "generations",
    "Generation",
    "angular_distances",
    "gromov_choice",
    "StructureResult",
    "structure_analysis",
    "structure_figure",
    "critical_layers_figure",
    "critical_under_generation",
    "TEACHER_FORCED_SLACK",
    "GENERATION_LOSS",
    "StructureSettings",
    "new_tokens_for",
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
    execution: Execution = Execution(),
    **loose,
) -> StructureScores:
    """The teacher-forced scores of each of `structures` (`Structure`s) on `batch` (prompts with
    their reference answers from `answer_start` on), `execution.chunk_size` structures at a
    time in one vmapped computation (default: as many as `execution`'s memory budget holds,
    `Execution.chunk`; all at once can take many times longer, swapping memory). The orders are
    data: one compiled program serves every chunk of one shape (`_shape_families`: at most
    two); `execution.progress` (`jaxdepth.core.progress`) counts the chunks."""
    refuse_loose_options("structure_scores", loose)
    structures = tuple(structures)
    if not structures:
        raise ValueError("no structures to score")
    if (batch.answer_start >= batch.lengths).any():
        raise ValueError("every prompt needs an answer to score: answer_start is past a prompt's end")
    orders = [s.order(config.num_layers) for s in structures]
    B, T = batch.tokens.shape
    chunk_size = execution.chunk(len(structures), member_bytes(config, B * T))
    # numpy arrays into the jitted sweep: converting each with jnp.asarray would compile a
    # program per shape (jax's "stage"), counted among the study's compilations
    tokens, valid, starts = np.asarray(batch.tokens), np.asarray(batch.valid), np.asarray(batch.answer_start)
    scores = np.zeros((3, len(structures), B), np.float32)
    chunks = _chunks(orders, chunk_size)
    desc = f"teacher-forced scores ({_programs(chunks)} programs to compile)"
    for members, stacked in track(chunks, execution.progress, desc):
        out = _scored(params, tokens, valid, starts, stacked, config, len(stacked.layers))
        scores[:, members] = np.stack([np.asarray(x, np.float32) for x in out])[:, : len(members)]
    return StructureScores(structures, *scores)


@partial(jit, static_argnames=("config", "chunk_size"))
def _scored(params, tokens, valid, starts, orders, config, chunk_size):
    h0, extra = embed(params, tokens, config), token_per_layer_inputs(params, tokens, config)

    def one(order):
        h, _ = run_layers(params, h0, config, valid=valid, run=LayerRun(order=order), per_layer_inputs=extra)
        return _answer_scores(unembed(params, h, config), tokens, valid, starts)

    return sweep(one, orders, chunk_size)


def _shape_families(orders: Sequence[LayerOrder]) -> list[list[int]]:
    """The orders' indices in at most two families, each stacked into one shape and so run by
    one compiled program whatever its orders: the orders of single-layer steps (the intact
    model, drops, swaps, reversed and repeated blocks; padded to the longest, a repeated block's
    L + k steps), and those with a parallel step (padded to the widest group). Apart, because
    every step of a stack runs as many layers as its widest group has: a parallel block of k
    among the others would make each of them run k layers a step."""
    single = [i for i, o in enumerate(orders) if np.shape(o.layers)[1] == 1]
    parallel = [i for i, o in enumerate(orders) if np.shape(o.layers)[1] > 1]
    return [family for family in (single, parallel) if family]


def _chunks(orders: Sequence[LayerOrder], chunk_size: int) -> list[tuple[list[int], LayerOrder]]:
    """`(members, stacked)` per chunk: up to `chunk_size` orders of one shape family
    (`_shape_families`) and their stack, padded to the family's one shape `[C, N, G]` (C the
    family's chunk, the last chunk filled up with its last order, whose rows are dropped): every
    chunk of a family is the same program."""
    chunks = []
    for family in _shape_families(orders):
        stacked = stack_orders([orders[i] for i in family])
        width = min(chunk_size, len(family))
        for first in range(0, len(family), width):
            members = family[first : first + width]
            rows = np.minimum(np.arange(first, first + width), len(family) - 1)
            chunks.append((members, LayerOrder(stacked.layers[rows], stacked.used[rows])))
    return chunks


def _programs(chunks) -> int:
    """How many compiled programs `chunks` need: one per distinct chunk shape."""
    return len({(tuple(stacked.layers.shape), tuple(stacked.used.shape)) for _, stacked in chunks})


@dataclasses.dataclass(frozen=True)
class Generation:
    """How generated answers are made and read (`generated_answers`): greedily, up to
    `max_new_tokens` per prompt, stopping at `eos_ids`; `decode` turns token ids into text (a
    tokenizer's `decode`; it also reads the reference answers), and each continuation is cut
    at its first blank line, or before the first of `stops`."""

    decode: Callable
    max_new_tokens: int
    eos_ids: tuple = ()
    stops: Optional[Sequence[str]] = None

    def __post_init__(self):
        if not callable(self.decode):
            raise TypeError(f"decode must turn token ids into text (a tokenizer's decode), got {self.decode!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        object.__setattr__(self, "eos_ids", tuple(int(e) for e in self.eos_ids))


def generated_answers(
    params: Params,
    batch: PromptBatch,
    config: ModelConfig,
    structures,
    generation: Generation,
    *,
    execution: Execution = Execution(),
    **loose,
) -> tuple[np.ndarray, list[list[str]]]:
    """Whether each of `structures` answers each prompt of `batch` right by generation (module
    docstring): `correct [structures, B]` (bool) and the continuations read, `texts[s][b]`.
    The model continues each prompt's question (its tokens before `answer_start`) as
    `generation` (`Generation`) says: greedily, for up to `generation.max_new_tokens`, stopping
    at its `eos_ids`, the continuation cut at its first blank line (or before the first of its
    `stops`); its `decode` turns token ids into text and reads the reference answer from the
    prompt's answer tokens. The structures decode `execution.chunk_size` at a time (default: as
    many as `execution`'s memory budget holds with their key/value caches, `Execution.chunk`),
    `generate` vmapped over a chunk's orders: the orders are data, so one compiled program
    serves every chunk of one family (`_generation_chunks`: the drops, the swaps, the middle
    blocks; three programs at most); `execution.progress` (`jaxdepth.core.progress`) counts the
    chunks."""
    refuse_loose_options("generated_answers", loose)
    decode, max_new_tokens, stops = generation.decode, generation.max_new_tokens, generation.stops
    structures = tuple(structures)
    if not structures:
        raise ValueError("no structures to generate under")
    if (batch.answer_start >= batch.lengths).any():
        raise ValueError("every prompt needs a reference answer: answer_start is past a prompt's end")
    B, T = batch.tokens.shape
    questions = np.arange(T)[None, :] < batch.answer_start[:, None]
    references = [
        decode([int(t) for t in row[a:n]]) for row, a, n in zip(batch.tokens, batch.answer_start, batch.lengths)
    ]
    orders = [s.order(config.num_layers) for s in structures]
    # layers run per member, padding included: a swap's schedule has 2L - 1 steps
    steps = max([int(np.prod(np.shape(o.layers))) for o in orders] + [2 * config.num_layers - 1])
    cache = steps * B * (T + max_new_tokens) * 2 * config.num_kv_heads * config.head_dim * 4
    # under vmap each member reads (gathers) its own copy of the layers of its step
    width = max(np.shape(o.layers)[1] for o in orders)
    layer_bytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(params["layers"])) // config.num_layers
    weights = width * layer_bytes
    chunk_size = execution.chunk(len(structures), B * _prompt_bytes(config, T) + cache + weights)
    eos = set(generation.eos_ids)
    correct, texts = np.zeros((len(structures), B), bool), [None] * len(structures)
    chunks = _generation_chunks(structures, orders, config.num_layers, chunk_size)
    desc = f"generating under each structure ({_programs(chunks)} programs to compile)"
    for members, stacked in track(chunks, execution.progress, desc):
        # vmapped over `used` and, unless one schedule of layers `[J, 1]` serves every member,
        # over `layers` too
        shared = stacked.layers.ndim == 2
        out = generations(
            params,
            np.asarray(batch.tokens),
            questions,
            stacked,
            config,
            max_new_tokens,
            Decoding(eos_ids=tuple(eos)),
            axes=(None, None, LayerOrder(None if shared else 0, 0)),
        )
        for s, rows, counts in zip(members, np.asarray(out.tokens), np.asarray(out.lengths)):
            read = [
                cut_generation(decode([int(t) for t in row[:n] if int(t) not in eos]), stops)
                for row, n in zip(rows, counts)
            ]
            correct[s] = [same_answer(text, reference) for text, reference in zip(read, references)]
            texts[s] = read
    return correct, texts


def _prompt_bytes(config: ModelConfig, T: int) -> int:
    """What one structure of a generation chunk holds per prompt of T tokens: its residual and,
    while a layer runs, that layer's activations (`member_bytes`, less the output distribution:
    only each prompt's last position is read). Its key/value caches and the layers it reads
    come on top (`generated_answers`)."""
    return member_bytes(config, T) - 3 * T * config.vocab_size * 4


@partial(jit, static_argnames=("config", "max_new_tokens", "axes"))
def generations(
    params,
    tokens,
    valid,
    order: Optional[LayerOrder],
    config: ModelConfig,
    max_new_tokens: int,
    decoding: Decoding,
    axes=None,
):
    """`jaxdepth.core.decoding.generate` of the prompts `tokens [B, T]` (`valid` marking their
    real tokens) under the layer `order` (None: the identity), picking tokens as `decoding`
    says, as one compiled call: one program per `config`, `max_new_tokens`, `axes` and choice
    of `decoding`'s static fields (its key is data). Where `axes` is given, the `in_axes` of
    `(tokens, valid, order)` (e.g. `(None, None, LayerOrder(0, 0))`: a stack of orders on
    shared prompts; `(0, 0, 0)`: a prompt `[1, T]` of its own for each order), `generate` is
    vmapped over those members and each member's `Generated` is stacked on a leading axis."""

    def one(tokens, valid, order):
        return generate(
            params, tokens, config, max_new_tokens=max_new_tokens, valid=valid, order=order, decoding=decoding
        )

    return one(tokens, valid, order) if axes is None else jax.vmap(one, in_axes=axes)(tokens, valid, order)


def _schedule_of(kind: str, num_layers: int) -> Optional[np.ndarray]:
    """The layers every structure of `kind` runs a subsequence of, in order (None: the kind's
    structures run their own orders): the identity for the intact model and the drops; for the
    swaps 0, 1, 0, 2, 1, 3, 2, ..., L-1, L-2 (layer m + 1 then m, for each m), in which swap s
    finds 0..s-1, s+1, s, s+2..L-1 in turn.

    A stack whose layers are one schedule shared by every member reads each step's weights once
    for all of them, in one matmul over all their rows; a step a member does not run leaves its
    residual as it is (the `used` mask), so each member computes what its own order computes.
    Stacked orders of their own (the vmapped stack) read a copy of the step's layer per member:
    with a few new tokens a step, that copy is decoding's cost. The swaps' schedule runs two
    steps a layer, twice the arithmetic of a swap alone: still cheaper than a copy per member."""
    if kind in ("intact", "drop"):
        return np.arange(num_layers)
    if kind == "swap":
        return np.array([0] + [m for n in range(num_layers - 1) for m in (n + 1, n)])
    return None


def _on_schedule(order: LayerOrder, schedule: np.ndarray) -> np.ndarray:
    """`used [J]`: the steps of `schedule` at which `order` (single-layer steps) runs its layers,
    each matched at the first step from there that runs it."""
    layers = np.asarray(order.layers)[np.asarray(order.used)]
    used, at = np.zeros(len(schedule), bool), 0
    for layer in layers:
        found = np.nonzero(schedule[at:] == layer)[0]
        if not found.size:
            raise ValueError(f"the order {layers.tolist()} is not a subsequence of the schedule {schedule.tolist()}")
        at += int(found[0])
        used[at], at = True, at + 1
    return used


def _generation_chunks(structures, orders, num_layers: int, chunk_size: int) -> list[tuple[list[int], LayerOrder]]:
    """`(members, stacked)` per generation chunk, up to `chunk_size` structures of one family,
    the last chunk filled up with its last member: the intact model and the drops on the
    identity's schedule, the swaps on theirs (`_schedule_of`: `layers [J, 1]` shared by the
    chunk, `used [C, J, 1]`), and the middle blocks' structures (reversed, repeated, parallel:
    few, one per size) stacked as their own orders `[C, N, G]`. One compiled program each."""
    family_of = {"intact": "drop", "drop": "drop", "swap": "swap"}  # the others: "block"
    families: dict = {}
    for i, s in enumerate(structures):
        families.setdefault(family_of.get(s.kind, "block"), []).append(i)
    chunks = []
    for kind, family in families.items():
        schedule = _schedule_of(kind, num_layers)
        if schedule is None:  # few structures: one stack, padded to the longest and the widest
            stacked = stack_orders([orders[i] for i in family])
        else:
            used = np.stack([_on_schedule(orders[i], schedule) for i in family])[..., None]
            stacked = LayerOrder(schedule[:, None].astype(np.int32), used)
        width = min(chunk_size, len(family))
        for first in range(0, len(family), width):
            rows = np.minimum(np.arange(first, first + width), len(family) - 1)
            layers = stacked.layers if schedule is not None else stacked.layers[rows]
            chunks.append((family[first : first + width], LayerOrder(layers, stacked.used[rows])))
    return chunks


def angular_distances(params: Params, batch: PromptBatch, config: ModelConfig, max_block: int) -> np.ndarray:
    """`[max_block, L]`: row n-1, column l is the mean over prompts of arccos(cos(h_l, h_{l+n}))
    / pi at the prompt's last token before its answer (NaN where l + n > L)."""
    hs = np.asarray(_residuals(params, np.asarray(batch.tokens), config, np.asarray(batch.valid)))
    last = np.asarray(batch.answer_start) - 1  # in numpy: no small programs compiled to index
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
    holds no NaN); `generated_correct [S, B]` (1 where the structure's generated answer is
    right, `generated_answers`; `[S, 0]` where nothing was generated) and `generated_texts`
    (the continuations read, `[S][B]`); `settings` as the caller passed them."""

    kinds: list
    starts: np.ndarray
    sizes: np.ndarray
    answer_logprob: np.ndarray
    answer_token_accuracy: np.ndarray
    answer_correct: np.ndarray
    angular_distance: np.ndarray
    num_layers: int
    settings: dict
    generated_correct: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0, 0), np.float32))
    generated_texts: list = dataclasses.field(default_factory=list)

    @property
    def generated(self) -> bool:
        """Whether answers were generated (`generated_correct` has a column per prompt)."""
        return self.generated_correct.shape[-1] > 0

    def generated_accuracy(self) -> np.ndarray:
        """Each structure's fraction of prompts answered right by generation `[S]` (NaN where
        nothing was generated)."""
        if not self.generated:
            return np.full(len(self.kinds), np.nan)
        return self.generated_correct.mean(axis=1)

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
    generation: Optional[Generation] = None,
    execution: Execution = Execution(),
    **loose,
) -> "StructureResult":
    """`StructureResult` of `structure_family(L, max_block)` on `batch` (`structure_scores`),
    with generated answers (`generated_answers`) where `generation` (`Generation`: a
    tokenizer's `decode`, `max_new_tokens`, ...) is given; both as `execution` says
    (`execution.chunk_size` structures at a time, default as memory allows; its `progress`
    counting the chunks of each)."""
    refuse_loose_options("structure_analysis", loose)
    family = structure_family(config.num_layers, max_block)
    scores = structure_scores(params, batch, config, family, execution=execution)
    correct, texts = np.zeros((len(family), 0), bool), []
    if generation is not None:
        correct, texts = generated_answers(params, batch, config, family, generation, execution=execution)
    max_new_tokens = 0 if generation is None else generation.max_new_tokens
    return StructureResult(
        kinds=[s.kind for s in family],
        starts=np.array([s.start for s in family]),
        sizes=np.array([s.size for s in family]),
        answer_logprob=scores.answer_logprob,
        answer_token_accuracy=scores.answer_token_accuracy,
        answer_correct=scores.answer_correct,
        angular_distance=np.nan_to_num(angular_distances(params, batch, config, max_block), nan=-1.0),
        num_layers=config.num_layers,
        settings={"max_block": max_block, "max_new_tokens": max_new_tokens},
        generated_correct=correct.astype(np.float32),
        generated_texts=texts,
    )


def structure_figure(result: StructureResult, *, title: Optional[str] = None):
    """The drop heatmaps (block start x size) of the answer log-probability, the token accuracy
    and (where answers were generated) the generated-answer accuracy, each with the
    angular-distance rule's choice per size marked x; then the swaps' scores against the first
    swapped layer, and the middle block's reversal, repetition and parallel run against the
    block's size (a panel each, so that each x axis has one meaning), the intact model dashed."""
    from jaxdepth.analyses import drawing as d

    d.expect(result, StructureResult, "structure_figure")
    heatmaps = [
        (result.answer_logprob.mean(axis=1), "answer log-probability"),
        (result.accuracy(), "token accuracy"),
    ]
    if result.generated:
        heatmaps.append((result.generated_accuracy(), "generated-answer accuracy"))
    blocks = [kind for kind in ("reverse", "repeat", "parallel") if kind in result.kinds]
    panels = len(heatmaps) + 1 + bool(blocks)
    fig = d.new_figure(4.4 * panels, 4.2)
    axes = fig.subplots(1, panels)
    rule = gromov_choice(result.angular_distance)
    for ax, (scores, label) in zip(axes, heatmaps):
        image = ax.imshow(result.drop_grid(scores), aspect="auto", origin="lower", cmap="viridis")
        ax.scatter([s.start for s in rule], [s.size - 1 for s in rule], marker="x", color="r", label="angular rule")
        ax.set_xlabel("first dropped layer")
        ax.set_ylabel("layers dropped")
        ax.set_yticks(range(result.angular_distance.shape[0]), range(1, result.angular_distance.shape[0] + 1))
        ax.set_title(f"drops: {label} (intact {scores[0]:.2f})")
        fig.colorbar(image, ax=ax, pad=0.01)
    axes[1].legend(loc="upper right", fontsize="small")
    swap_ax = axes[len(heatmaps)]
    _draw_structure_scores(swap_ax, result, ["swap"], lambda s: s.start)
    swap_ax.set(xlabel="first swapped layer (swapped with the next)", title="adjacent layers swapped")
    if blocks:
        block_ax = axes[-1]
        _draw_structure_scores(block_ax, result, blocks, lambda s: s.size)
        block_ax.set(xlabel="size of the middle block", title="the middle block, rearranged")
        sizes = sorted({int(n) for k, n in zip(result.kinds, result.sizes) if k in blocks})
        block_ax.set_xticks(sizes)  # the block sizes themselves: one size would get fractional ticks
        block_ax.set_xlim(sizes[0] - 0.5, sizes[-1] + 0.5)
    d.title_figure(fig, "What the model still does without its layers in order", title, result.settings)
    return fig


# A layer is critical under generation only when dropping it keeps the teacher-forced token
# accuracy within this many points of the intact model's but costs the generated answers at
# least `GENERATION_LOSS` points: the two readings of "can the model lose this layer" disagree.
TEACHER_FORCED_SLACK = 1.0
GENERATION_LOSS = 10.0


def critical_under_generation(result: StructureResult) -> list[Structure]:
    """The drops the teacher-forced reading calls harmless and the generated one does not
    (`TEACHER_FORCED_SLACK`, `GENERATION_LOSS`); empty where nothing was generated."""
    if not result.generated:
        return []
    accuracy, generated = 100 * result.accuracy(), 100 * result.generated_accuracy()
    return [
        s
        for s, a, g in zip(result.structures(), accuracy, generated)
        if s.kind == "drop" and a >= accuracy[0] - TEACHER_FORCED_SLACK and g <= generated[0] - GENERATION_LOSS
    ]


def critical_layers_figure(result: StructureResult, *, title: Optional[str] = None):
    """Each block of layers dropped (a panel per block size, against its first layer), read two
    ways side by side: by generation (the share of prompts whose generated answer is right) and
    teacher-forced (the token accuracy of the reference answer, and the share of answers whose
    every token is the top-1 prediction), each beside the intact model's (dashed), the gap
    between the generated and the teacher-forced answers shaded, and on a second axis the change
    of the answer's log-probability. Drops harmless teacher-forced but not generated
    (`critical_under_generation`) are marked. In a residual stream a layer's update zeroed and
    the layer skipped are one intervention: these drops are both."""
    from jaxdepth.analyses import drawing as d

    d.expect(result, StructureResult, "critical_layers_figure")
    if not result.generated:
        raise ValueError("the critical layers compare generated answers with teacher-forced ones: none were generated")
    sizes = sorted({int(n) for k, n in zip(result.kinds, result.sizes) if k == "drop"})
    fig = d.new_figure(6.5 * len(sizes), 4.4)
    axes = np.atleast_1d(fig.subplots(1, len(sizes), squeeze=False)[0])
    scores = {
        "generated answers right": (result.generated_accuracy(), "C3", "-"),
        "teacher-forced token accuracy": (result.accuracy(), "C0", "-"),
        "teacher-forced answers right": (result.answer_correct.mean(axis=1), "C0", "--"),
    }
    logprob = result.answer_logprob.mean(axis=1)
    critical = {(s.start, s.size) for s in critical_under_generation(result)}
    structures = result.structures()
    for ax, size in zip(axes, sizes):
        rows = [i for i, s in enumerate(structures) if s.kind == "drop" and s.size == size]
        x = np.array([structures[i].start for i in rows])
        for label, (values, color, style) in scores.items():
            ax.plot(x, values[rows], color=color, linestyle=style, marker=".", label=label)
            ax.axhline(values[0], color=color, linestyle=":", linewidth=1)
        generated, forced = scores["generated answers right"][0][rows], scores["teacher-forced answers right"][0][rows]
        ax.fill_between(x, generated, forced, color="C3", alpha=0.12, linewidth=0, label="gap between the readings")
        marked = [i for i, r in enumerate(rows) if (structures[r].start, size) in critical]
        if marked:
            ax.scatter(x[marked], generated[marked], s=60, facecolors="none", edgecolors="k", zorder=3,
                       label="harmless teacher-forced, not generated")  # fmt: skip
        twin = ax.twinx()
        twin.plot(x, logprob[rows] - logprob[0], color="C7", linewidth=1, alpha=0.7)
        twin.set_ylabel("change of the answer log-probability (nats)", color="C7")
        ax.set(
            xlabel=f"first layer of the {size} dropped" if size > 1 else "layer dropped",
            ylabel="share",
            ylim=(-0.05, 1.05),
            title=f"{size} layer{'s' if size > 1 else ''} dropped",
        )
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small", loc="lower left")
    d.title_figure(fig, "Which layers can the model lose: generated against teacher-forced", title, result.settings)
    return fig


def _draw_structure_scores(ax, result: StructureResult, kinds: Sequence[str], x_of):
    """Each of `kinds`' structures' token accuracy (dots, solid) and, where answers were
    generated, generated-answer accuracy (crosses, dotted) at x = `x_of(structure)`, with the
    intact model's as dashed lines."""
    accuracy, generated = result.accuracy(), result.generated_accuracy()
    structures = result.structures()
    for kind in kinds:
        picked = [(x_of(s), a, g) for s, a, g in zip(structures, accuracy, generated) if s.kind == kind]
        x, y, z = zip(*picked)
        color = f"C{('swap', 'reverse', 'repeat', 'parallel').index(kind)}"
        ax.plot(x, y, marker=".", color=color, label=f"{kind}: token accuracy")
        if result.generated:
            ax.plot(x, z, marker="x", linestyle=":", color=color, label=f"{kind}: generated answers")
    ax.axhline(accuracy[0], color="k", linestyle="--", label="intact: token accuracy")
    if result.generated:
        ax.axhline(generated[0], color="grey", linestyle="--", label="intact: generated answers")
    ax.set_ylabel("accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def _summary(result: StructureResult) -> list[str]:
    """The largest block droppable within a point of token accuracy (or that none is) and the
    angular-distance rule's block of that size (of one layer where none is droppable), with
    both token accuracies; the intact model's generated accuracy where answers were generated."""
    best = result.largest_droppable()
    accuracy = {str(s): 100 * a for s, a in zip(result.structures(), result.accuracy())}
    size = 1 if best is None else best.size
    by_rule = next(s for s in gromov_choice(result.angular_distance) if s.size == size)
    if best is None:
        lines = [
            "no layer droppable within 1 point of token accuracy",
            f"angular rule at 1 layer: {by_rule} ({accuracy[str(by_rule)]:.0f}% against {accuracy['intact']:.0f}% "
            "intact)",
        ]
    else:
        lines = [
            f"droppable within 1 point: {best.size} layers ({best})",
            f"angular rule at that size: {by_rule} ({accuracy[str(by_rule)]:.0f}% against {accuracy[str(best)]:.0f}%)",
        ]
    if result.generated:
        lines.append(f"generated answers right: {100 * result.generated_accuracy()[0]:.0f}% intact")
        critical = critical_under_generation(result)
        lines.append(
            f"harmless teacher-forced, not generated: {', '.join(map(str, critical))}"
            if critical
            else "no drop harmless teacher-forced costs the generated answers 10 points"
        )
    return lines


@dataclasses.dataclass(frozen=True, kw_only=True)
class StructureSettings(Settings):
    """The structure sweep's settings in a study (`Settings` and its option)."""

    structure_max_block: int = option(
        4, "layer structure: the largest block of consecutive layers dropped (and reversed, repeated, parallel)"
    )
    structure_new_tokens: int = option(
        -1,
        "layer structure: generate up to this many tokens per prompt and score the answers (-1: the longest "
        "reference answer's length plus 8, where the model has a tokenizer; 0: teacher-forced scores only)",
    )

    def __post_init__(self):
        super().__post_init__()
        if self.structure_max_block < 1:
            raise ValueError(f"--structure-max-block must be at least 1, got {self.structure_max_block}")
        if self.structure_new_tokens < -1:
            raise ValueError(
                f"--structure-new-tokens must be -1 (auto), 0 (none) or more, got {self.structure_new_tokens}"
            )


def new_tokens_for(batch: PromptBatch, setting: int) -> int:
    """The generation budget of `--structure-new-tokens`: `setting`, or where it is -1 the
    longest reference answer in `batch` (in tokens) plus 8, room for the answer and a few
    tokens of slack."""
    return int((batch.lengths - batch.answer_start).max()) + 8 if setting == -1 else setting


def _run(x) -> StructureResult:
    L = x.model.config.num_layers
    setting = x.settings.structure_new_tokens
    # auto generates where answers can be read as text
    new_tokens = 0 if setting == -1 and x.model.tokenizer is None else new_tokens_for(x.batch, setting)
    generation = None
    if new_tokens > 0:
        if x.model.tokenizer is None:
            raise ValueError("generated answers are read as text: the model needs a tokenizer")
        generation = Generation(x.model.tokenizer.decode, new_tokens, _eos_ids(x.model.tokenizer))
    return structure_analysis(
        x.model.params,
        x.batch,
        x.model.config,
        max_block=min(x.settings.structure_max_block, L - 1),
        generation=generation,
        execution=Execution(progress=x.progress, memory_budget=x.settings.memory_budget),
    )


def _eos_ids(tokenizer) -> tuple:
    eos = getattr(tokenizer, "eos_token_id", None)
    return () if eos is None else (int(eos),)


ANALYSIS = Analysis(
    name="layer_structure",
    default=False,  # in the suite, run when named: `--analyses layer_structure`
    result_type=StructureResult,
    settings=StructureSettings,
    identity=lambda s: {"structure_max_block": s.structure_max_block, "structure_new_tokens": s.structure_new_tokens},
    run=_run,
    figures=lambda r, tokenizer, n: (
        {"": structure_figure(r)} | ({"critical_layers": critical_layers_figure(r)} if r.generated else {})
    ),
    summary=_summary,
    detail=True,
)
