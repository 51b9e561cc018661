"""Residual erasure (METHODS §4): replace one residual vector h_l[t] by a baseline mean and
measure how much the predictions of the answer tokens move.

The (boundary, position) erasures of a prompt run in one compiled computation
(`_erasure_sweep`), every boundary at once. Erasing position t cannot change any position
before t (causal attention), so only positions p >= t are measured: an erasure after the last
answer prediction is exactly 0, not float noise. The same fact saves work: the positions fall
into pieces, and an erasure runs only the pieces from its own on, up to the one holding the
last answer position. Each piece is one call of that computation, so that a progress bar
advances as each piece finishes.

Under `interventions` (`jaxdepth.core.sites`; default none), the user's interventions act on
the clean run and on every erasure, composed in one order: the user's first, then the erasure's
replacement, which so wins at its site (h_l[t] is the baseline whatever the user's
interventions at `resid_pre` of layer l did to it). Each erasure is then exactly a full forward
under the user's interventions and the replacement. A `metric` (a `jaxdepth.Metric`, read at
the positions it declares) is measured beside the built-in effect: `metric(erased run) -
metric(clean run)`, both under the user's interventions.

What is measured is one value, `Erasure` (the effect, the position pieces); how it runs
(chunks, memory, progress) is a `jaxdepth.Execution`.
"""

from __future__ import annotations

import dataclasses
import hashlib
from functools import partial
from typing import TYPE_CHECKING, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxdepth.core.progress import progress_bar
from jaxdepth.core.batch import PromptArrays, PromptBatch
from jaxdepth.core.execution import Execution, refuse_fields, refuse_loose_options
from jaxdepth.core.compilation import jit
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.loops import Pieces, final_residual, run_layers_in_pieces
from jaxdepth.core.model import layer_inputs, residual_stream, token_per_layer_inputs, unembed
from jaxdepth.core import sites
from jaxdepth.core.sites import check_layer_indices
from jaxdepth.core.saved_result import SavedResult
from jaxdepth.analyses.suite import Analysis, RunInputs, per_prompt_figures
from jaxdepth.analyses.metric_inputs import clean_readout, prompt_reads, refuse_prompt_padding
from jaxdepth.analyses.metrics import Metric, as_metric, readout
from jaxdepth.analyses.stats import masked_max, norm
from jaxdepth.core.sweep import auto_chunk_size, sweep
from jaxdepth.core.sharding import to_host

if TYPE_CHECKING:  # matplotlib is imported when a figure is drawn, not with the analysis
    from matplotlib.figure import Figure

    from jaxdepth.analyses.drawing import TokenPanel

__all__ = [
    "residual_erasure",
    "Erasure",
    "ErasureResult",
    "mean_residuals",
    "erasure_of_prompt",
    "probability_shift",
    "answer_probability_change",
    "EFFECTS",
    "erasure_figure",
    "erasure_panel",
    "ANALYSIS",
    "default_blocks",
    "piece_width",
    "clean_run",
    "pieces_to_run",
    "baseline_residuals",
]


@partial(jit, static_argnames="config")
def _residual_sums(params, tokens, valid, config: ModelConfig, interventions=None):
    hs = residual_stream(params, tokens, config, valid=valid, interventions=interventions).astype(jnp.float32)
    return jnp.sum(hs * valid[None, :, :, None], axis=(1, 2))


def mean_residuals(
    params, batch: PromptBatch, config: ModelConfig, *, batch_size: int = 8, interventions=None
) -> np.ndarray:
    """Baseline `[L+1, D]`: the mean residual at every boundary over all valid tokens of `batch`
    (a BOS token counts where the tokenizer added one).

    Under `interventions` (default none), the mean of the intervened runs' residuals, each after
    the interventions at its `resid_pre` (the values an erasure under the same interventions
    replaces). The batch runs at its full padded length, `batch_size` prompts at a time (the
    last part padded with empty rows, which add nothing: one compiled shape)."""
    total = np.zeros((config.num_layers + 1, config.hidden_size), np.float64)
    size = min(batch_size, len(batch))
    for i in range(0, len(batch), size):
        part = batch.select(slice(i, i + size))
        rows = ((0, size - len(part)), (0, 0))
        total += to_host(
            _residual_sums(params, np.pad(part.tokens, rows), np.pad(part.valid, rows), config, interventions)
        )
    return (total / batch.valid.sum()).astype(np.float32)


# Erasure positions fall into up to this many pieces of at least MIN_PIECE positions. An erasure
# in piece k runs only pieces k.. (erasing position t changes no position before t), so the work
# falls to about (pieces + 1) / (2 * pieces) of running every position (0.5625 at 8). The pieces
# are rows of one compiled computation (`_erasure_sweep`), not separate shapes: a prompt length
# compiles once, however many pieces.
PREFIX_BLOCKS = 8
MIN_BLOCK = 8


def default_blocks(T: int) -> int:
    """How many position pieces `erasure_of_prompt` uses for a prompt of T (padded) positions."""
    return max(1, min(PREFIX_BLOCKS, T // MIN_BLOCK))


def piece_width(T: int, blocks: Optional[int] = None) -> int:
    """The width of `blocks` (default `default_blocks(T)`) equal position pieces covering T
    positions (the last piece may reach past T: the prompt is padded to whole pieces)."""
    blocks = max(default_blocks(T) if blocks is None else blocks, 1)
    return -(-T // blocks)


def probability_shift(probs, clean, reach, answer):
    """METHODS §4, the default effect: the largest ||P'_p - P_p||_2 over the answer-predicting
    positions p the erasure can reach (`probs`, `clean`: `[1, A, V]`; `reach [A]`)."""
    return masked_max(norm(probs - clean), reach[None])[0]


def answer_probability_change(probs, clean, reach, answer):
    """The change of the integrated-gradients objective F (the summed teacher-forced probability
    of the answer tokens): `sum_p P'_p(target_p) - P_p(target_p)` over the real answer-predicting
    positions p the erasure can reach. `answer = (targets [A], real [A])`."""
    targets, real = answer
    rows = jnp.arange(targets.shape[0])
    change = probs[0, rows, targets] - clean[0, rows, targets]
    return jnp.sum(jnp.where(real & reach, change, 0.0))


EFFECTS = {"probability_shift": probability_shift, "answer_probability_change": answer_probability_change}


@dataclasses.dataclass(frozen=True)
class Erasure:
    """What a residual erasure measures, and the pieces its positions fall into (how it runs
    is a `jaxdepth.Execution`).

    effect: the name of what is measured (`EFFECTS`): METHODS' 'probability_shift' (default)
        or 'answer_probability_change', the exact change of the integrated-gradients
        objective (what `jaxdepth.analyses.attribution.attribution_patching` estimates).
    blocks: the position pieces of `erasure_of_prompt` (default `default_blocks(T)`; 1 turns
        the saving off); the result does not depend on it."""

    effect: str = "probability_shift"
    blocks: Optional[int] = None

    def __post_init__(self):
        if self.effect not in EFFECTS:
            raise ValueError(f"effect must be one of {', '.join(EFFECTS)}, got {self.effect!r}")
        if self.blocks is not None and (isinstance(self.blocks, bool) or int(self.blocks) < 1):
            raise ValueError(f"blocks must be a whole number >= 1 or None, got {self.blocks!r}")


def _refuse_loose(function: str, options: dict) -> None:
    """A `TypeError` for the keywords an erasure once took on its own: the fields of `Erasure`
    (shown as the `Erasure` that says the same), and those of `Execution`
    (`refuse_loose_options`)."""
    refuse_fields(function, options, Erasure, "erasure=Erasure", "what is measured")
    refuse_loose_options(function, options)


@partial(jit, static_argnames="config")
def clean_run(params, prompt: PromptArrays, config: ModelConfig, *, interventions=None):
    """What every erasure of `prompt` (`PromptArrays` with its answer positions) starts from, all
    of the run under `interventions` (default none): `(inputs, keys, values, clean)`, every
    boundary's residual as its layer receives it `[L+1, 1, T, D]` (the clean residual stream
    h_0..h_L; under interventions, before each layer's own, `layer_inputs`), every layer's keys
    and values (read off the run: the prefix of a suffix run), and the clean answer
    distributions `[1, A, V]`."""
    hs, final, (keys, values) = layer_inputs(
        params, prompt.tokens, config, valid=prompt.valid, interventions=interventions, tap=lambda r, _: (r.k, r.v)
    )
    clean = jax.nn.softmax(unembed(params, final[:, prompt.answer_positions], config), axis=-1)
    return hs, keys, values, clean


def _answer_of(prompt: PromptArrays):
    """What an effect may read of `prompt`'s answer: `(targets [A], real [A])`, every answer
    position real where `prompt.answer_real` is None."""
    positions = prompt.answer_positions
    real = jnp.ones(positions.shape, bool) if prompt.answer_real is None else jnp.asarray(prompt.answer_real, bool)
    return prompt.answer_targets, real


def _erased_final_residual(
    params,
    clean_state,
    valid,
    boundary,
    position,
    value,
    *,
    first_piece,
    last_piece,
    width: int,
    config: ModelConfig,
    interventions=(),
    per_layer_inputs=None,
):
    """The final residual `[1, T, D]` of the run in which h_boundary[position] is `value`, under
    `interventions` (checked; applied first, the replacement after them), computed for the
    positions of pieces `first_piece..last_piece` only (`width` positions each; positions
    before the first piece keep h_boundary, those after the last piece are stale).

    Each layer runs its pieces in order against a key/value buffer that starts as the clean
    run's (`clean_state = clean_run(...)`), each piece writing its own keys into it: erasing
    position t changes nothing before t, so the prefix before `first_piece` is the clean one. A
    linear-attention layer starts its pieces from its state there, which the clean inputs of
    the positions before give it (as they gave the buffer its keys), and carries it on.
    `boundary`, `first_piece` and `last_piece` may be traced, not batched (they are loop
    bounds); `position` and `value` may be batched. Forward only.

    Gemma 4: the layers read the tokens' per-layer inputs (`per_layer_inputs`, of the clean
    embeddings, `jaxdepth.core.model.token_per_layer_inputs`: erasing h_0[t] replaces the
    residual, not the layers' inputs), and the keys and values shared among layers start as the
    clean run's at the boundary (the layers before it ran on clean inputs), each later layer
    that computes its own writing them, as in the full forward."""
    hs, keys, values, _ = clean_state
    T = hs.shape[2]
    erase_rows = lambda rows: sites.replace("resid_pre", boundary, rows == position, value)
    h = run_layers_in_pieces(
        params,
        hs[boundary],
        boundary,
        (keys, values),
        valid,
        config,
        pieces=Pieces(first_piece, last_piece, width),
        interventions_of=lambda rows: (*interventions, erase_rows(rows)),
        clean_inputs=hs,
        per_layer_inputs=per_layer_inputs,
    )
    return final_residual(h, config, (*interventions, erase_rows(jnp.arange(T))))


@partial(jit, static_argnames=("config", "width", "chunk_size", "effect", "metric"))
def _erasure_sweep(
    params,
    clean_state,
    prompt: PromptArrays,
    baseline,
    config: ModelConfig,
    *,
    width: int,
    chunk_size: Optional[int] = None,
    effect=probability_shift,
    interventions=None,
    metric: Optional[Metric] = None,
    pieces=None,
):
    """`[L+1, T]` effects of erasing h_l[t] for every boundary l and position t of `prompt`
    (`PromptArrays`, T a multiple of `width`), from `clean_state = clean_run(params, prompt,
    config, interventions=...)`, as one compiled computation. `effect(probs, clean, reach,
    answer)` turns the erased and clean answer distributions into the effect (see
    `probability_shift`); `answer = (targets [A], real [A])` is what it may read (`_answer_of`).
    With `metric` (a `Metric`), returns `(effects, metric_changes)` (see `erasure_of_prompt`).

    The positions fall into pieces of `width`. The erasures of piece k (every boundary, its
    positions as one chunked sweep) run pieces k.. only, from their boundary on
    (`_erased_final_residual`), and up to the last piece a measurement reads: the one holding
    the last answer position, or the last position the metric reads. Positions after it are
    not run at all: their effects are exactly 0.

    `pieces = (first, stop)` runs pieces first..stop-1 only, leaving the other columns 0. The
    bounds are traced: every range is the same compiled computation, so a caller can run the
    pieces as separate calls (`erasure_of_prompt` does) and hear as each one finishes.
    """
    hs, _, _, clean = clean_state
    valid, answer_positions, answer = prompt.valid, prompt.answer_positions, _answer_of(prompt)
    L, T = config.num_layers, hs.shape[2]
    if T % width:
        raise ValueError(f"the prompt's length {T} must be a multiple of the piece width {width}")
    ivs = check_layer_indices(interventions, L)
    last = jnp.max(answer_positions)
    if metric is not None:  # the clean run's readout, at the positions the metric reads
        reads = prompt_reads(metric, prompt)
        last = jnp.maximum(last, jnp.max(reads.positions))
        clean_r = clean_readout(params, final_residual(hs[-1], config, ivs), prompt, config, metric)
        clean_metric = metric(clean_r)[0]
    last_piece = last // width
    per_layer = token_per_layer_inputs(params, prompt.tokens, config)

    def piece_effects(k, out):
        def boundary_effects(boundary):
            def member(position):
                h = _erased_final_residual(
                    params,
                    clean_state,
                    valid,
                    boundary,
                    position,
                    baseline[boundary],
                    first_piece=k,
                    last_piece=last_piece,
                    width=width,
                    config=config,
                    interventions=ivs,
                    per_layer_inputs=per_layer,
                )
                # Causality: an erasure at t changes no position before t, and at the last boundary
                # (after every layer) it changes position t alone. Masking the rest gives exact zeros.
                reach = jnp.where(boundary == L, answer_positions == position, answer_positions >= position)
                # The LM head on the answer rows only; with a metric too, which reads its own rows,
                # the effect is still taken from these rows' own product, so it is the same to the bit.
                probs = jax.nn.softmax(unembed(params, h[:, answer_positions], config), axis=-1)
                value = effect(probs, clean, reach, answer)
                if metric is None:
                    return value
                erased = _erased_readout(params, h, config, reads, clean_r, position, boundary)
                return value, metric(erased)[0] - clean_metric

            return sweep(member, k * width + jnp.arange(width), chunk_size)

        part = jax.lax.map(boundary_effects, jnp.arange(L + 1))
        return jax.tree.map(lambda o, p: jax.lax.dynamic_update_slice_in_dim(o, p, k * width, axis=1), out, part)

    first, stop = (0, last_piece + 1) if pieces is None else (pieces[0], jnp.minimum(pieces[1], last_piece + 1))
    zeros = jnp.zeros((L + 1, T), jnp.float32)
    return jax.lax.fori_loop(first, stop, piece_effects, zeros if metric is None else (zeros, zeros))


def _erased_readout(params, h, config: ModelConfig, reads, clean_r, position, boundary):
    """The metric's `Readout` of the erasure of h_boundary[position], whose final residual is
    `h [1, T, D]`: the logits at the read positions, the clean run's (`clean_r`) wherever
    causality leaves them unchanged (before `position`; at the last boundary, everywhere but
    `position`), so that a metric reading only those changes by exactly 0, not float noise."""
    r = readout(params, h, config, reads, clean=clean_r.clean)
    at = reads.positions
    changed = jnp.where(boundary == config.num_layers, at == position, at >= position)
    return dataclasses.replace(r, logits=jnp.where(changed[..., None], r.logits, clean_r.logits))


@partial(jit, static_argnames=("config", "metric"))
def _clean_state_readout(params, h_last, prompt: PromptArrays, config: ModelConfig, metric, interventions=None):
    """The clean run's `Readout` for `metric` from its last boundary's input (`clean_run`'s
    `hs[-1]`), after the interventions at the final residual: what the padding check reads."""
    ivs = check_layer_indices(interventions, config.num_layers)
    return clean_readout(params, final_residual(h_last, config, ivs), prompt, config, metric)


def _last_read(prompt: PromptArrays, metric: Optional[Metric]) -> int:
    """The last position an erasure of `prompt` measures (host): its last answer position, or
    the last one `metric` reads where that is later (its last token, or its last position)."""
    last = int(np.max(to_host(prompt.answer_positions)))
    if metric is None or metric.reads == "answer":
        return last
    if metric.reads == "last":
        return max(last, int(np.sum(to_host(prompt.valid))) - 1)
    return prompt.tokens.shape[1] - 1


def pieces_to_run(prompt: PromptArrays, blocks: Optional[int] = None, metric: Optional[Metric] = None) -> int:
    """How many position pieces the erasures of `prompt` run (`erasure_of_prompt`, `blocks` as
    there): those up to the one holding the last answer position or, with a `metric`, the last
    position it reads (its last token for reads='last', every piece for reads='all')."""
    T = prompt.tokens.shape[1]
    return _last_read(prompt, metric) // piece_width(T, blocks) + 1


def _place(out, part, columns: slice):
    """Copy the `columns` of a piece's effects (with a metric, of both arrays) into `out`."""
    for whole, piece in zip(jax.tree.leaves(out), jax.tree.leaves(part)):
        whole[:, columns] = to_host(piece)[:, columns]


def erasure_of_prompt(
    params,
    prompt: PromptArrays,
    baseline,
    config: ModelConfig,
    erasure: Erasure = Erasure(),
    *,
    metric: Optional[Metric] = None,
    interventions=None,
    execution: Execution = Execution(),
):
    """`[L+1, T]` effects of erasing h_l[t] for one prompt (`PromptArrays`: `tokens`, `valid`
    `[1, T]`; `answer_positions [A]`, the positions predicting answer tokens, repeats allowed,
    the real ones marked by `answer_real [A]`, default all), measured by `erasure.effect` (see
    `EFFECTS`), `execution.chunk_size` erasures vmapped at once (None: all), `execution.progress`
    a bar over the position pieces.

    `interventions` (`jaxdepth.core.sites`; default none) act on the clean run and on every
    erasure: the user's first, then the replacement of h_l[t], which so wins at its site. They
    must act on each position alone (as every built-in kind does), and their position-indexed
    data must broadcast to a piece's rows and to the prompt's (`[L, 1]` masks, not `[L, T]`).
    With `metric` (a `jaxdepth.Metric`, read at the positions it declares, the clean run's
    logits there as `Readout.clean` where it says `clean=True`; define it once: it is a static
    argument), returns `(effects, metric_changes [L+1, T])`, `metric(erased) - metric(clean)`,
    both under `interventions`; a metric that reads the prompt's padding (reads='all', with the
    positions added to whole pieces) or its answer span's padding is refused before any erasure
    runs (`jaxdepth.analyses.metric_inputs.refuse_prompt_padding`).

    Erasing position t changes no position before t, so the positions are split into
    `erasure.blocks` pieces (default `default_blocks(T)`; 1 turns the saving off) and an erasure
    runs only the positions from its piece on. The prompt is padded to whole pieces (invalid
    positions the result leaves out); every piece runs in the same compiled computation. Each
    piece is a call of its own, all of them queued at once, so the device runs them back to
    back, `pieces_to_run` of them. Returns numpy arrays.
    """
    metric = None if metric is None else as_metric(metric, "erasure")
    with progress_bar(
        execution.progress,
        total=pieces_to_run(prompt, erasure.blocks, metric),
        desc="residual erasure (position pieces)",
    ) as bar:
        return _erasure_of_prompt(
            params,
            prompt,
            baseline,
            config,
            erasure,
            metric=metric,
            interventions=interventions,
            execution=execution,
            on_piece=bar.update,
        )


def _erasure_of_prompt(
    params, prompt, baseline, config, erasure, *, metric, interventions, execution, on_piece, label=0
):
    """`erasure_of_prompt`, `on_piece()` called as each piece finishes (in order), the prompt
    named `label` in a refusal of its metric."""
    T = prompt.tokens.shape[1]
    width, count = piece_width(T, erasure.blocks), pieces_to_run(prompt, erasure.blocks, metric)
    pad = -T % width
    if pad:  # whole pieces: positions that no valid key or answer reads
        prompt = dataclasses.replace(
            prompt, tokens=jnp.pad(prompt.tokens, ((0, 0), (0, pad))), valid=jnp.pad(prompt.valid, ((0, 0), (0, pad)))
        )
    state = clean_run(params, prompt, config, interventions=interventions)
    if metric is not None:
        refuse_prompt_padding(
            metric,
            prompt,
            lambda: _clean_state_readout(params, state[0][-1], prompt, config, metric, interventions),  # where padded
            analysis="erasure",
            label=label,
        )
    run = partial(
        _erasure_sweep,
        params,
        state,
        prompt,
        baseline,
        config,
        width=width,
        chunk_size=execution.chunk_size,
        effect=EFFECTS[erasure.effect],
        interventions=interventions,
        metric=metric,
    )
    # All queued before any is waited for: the device runs them one after the other, in order,
    # and waiting for piece k while k+1 runs leaves it no idle gap.
    parts = [run(pieces=(k, k + 1)) for k in range(count)]
    zeros = lambda: np.zeros((config.num_layers + 1, T + pad), np.float32)
    out = zeros() if metric is None else (zeros(), zeros())
    for k, part in enumerate(parts):
        _place(out, part, slice(k * width, (k + 1) * width))
        on_piece()
    return jax.tree.map(lambda x: x[:, :T], out)


@dataclasses.dataclass
class ErasureResult(SavedResult):
    """`effects [P, L+1, T]` per prompt: `effects[p, l, t]` is the effect of erasing h_l[t]
    (boundary l = 0..L, h_0 the embeddings and h_L the final residual; position t), 0 beyond
    each prompt's length, with the prompts' tokens, lengths and answer starts so plots can
    label positions. `settings` holds 'effect' when it is not 'probability_shift'.

    `metric_change [P, L+1, T]`, where a metric was given: `metric(erased run) -
    metric(clean run)` per erasure (0 beyond each prompt's length); None otherwise, and in
    results saved before it existed."""

    effects: np.ndarray
    tokens: np.ndarray
    lengths: np.ndarray
    answer_start: np.ndarray
    settings: dict
    metric_change: Optional[np.ndarray] = None


def residual_erasure(
    params,
    batch: PromptBatch,
    config: ModelConfig,
    baseline: np.ndarray,
    erasure: Erasure = Erasure(),
    *,
    metric: Optional[Metric] = None,
    interventions=None,
    execution: Execution = Execution(),
    **loose,
) -> ErasureResult:
    """Residual erasure for every prompt of `batch` against a `[L+1, D]` baseline, measuring
    what `erasure` (`Erasure`) names: METHODS' 'probability_shift' (default) or
    'answer_probability_change', the exact change of the integrated-gradients objective (what
    `jaxdepth.analyses.attribution.attribution_patching` estimates); `erasure.blocks`, the
    position pieces of `erasure_of_prompt`, leaves the result as it is.

    `interventions` (`jaxdepth.core.sites`; default none) act on the clean run and on every
    erasure, the user's first, then the replacement of h_l[t] (which so wins at its site):
    each erasure is a full forward under both (`mean_residuals(..., interventions=...)` gives
    the matching baseline). Each prompt runs at its own padded length (`PromptBatch.prompt`),
    and an erasure computes only the positions from its piece's first one on, so intervention
    data indexed by position must broadcast to every length (`[L, 1]` keep-masks, head
    ablations, a vector added at every position); data that does not is refused at trace time.

    `metric` (default none): a `jaxdepth.Metric`, one value per prompt, read at the positions
    it declares (reads='last': the prompt's last real token; 'answer': its answer span, the
    answer tokens as `Readout.targets`; 'all': every position at its padded length,
    `Readout.real` false at the padding), the clean run's logits there as `Readout.clean` where
    it says `clean=True`; define it once (a static argument: a new one compiles anew).
    `metric_change` then holds `metric(erased) - metric(clean)` for every erasure, beside
    `effects`. A metric that reads padding (of a reads='all' prompt, or of an answer span) is
    refused, a `ValueError` naming the prompt and its length, before any erasure runs
    (`jaxdepth.analyses.metric_inputs`); a plain function of the logits, the form this took
    before, is refused with the form to write instead.

    `execution` (`jaxdepth.Execution`) says how it runs: `chunk_size` and `memory_budget`
    (bytes; default a share of the free memory) bound how many erasures are vmapped at once
    (memory, not what is computed); `progress` shows a bar over the position pieces of every
    prompt (`pieces_to_run`), one step as each piece finishes. The keywords these once were on
    their own (`effect=`, `chunk_size=`, `progress=`, ...) are refused, with the value that
    says the same."""
    _refuse_loose("residual_erasure", loose)
    if not isinstance(erasure, Erasure):
        raise TypeError(
            f"residual_erasure() takes what is measured as an Erasure, e.g. Erasure(blocks=2); got {erasure!r}"
        )
    metric = None if metric is None else as_metric(metric, "erasure")
    L, T = config.num_layers, batch.tokens.shape[1]
    if baseline.shape != (L + 1, config.hidden_size):
        raise ValueError(f"baseline must be [L+1, D] = {(L + 1, config.hidden_size)}, got {baseline.shape}")
    effects = np.zeros((len(batch), L + 1, T), np.float32)
    changes = None if metric is None else np.zeros((len(batch), L + 1, T), np.float32)
    prompts = [batch.prompt(i) for i in range(len(batch))]
    # A step per piece, not per prompt: one prompt's erasures can take minutes.
    total = sum(pieces_to_run(prompt, erasure.blocks, metric) for prompt in prompts)
    with progress_bar(execution.progress, total=total, desc="residual erasure (position pieces)") as bar:
        for i, prompt in enumerate(prompts):
            bar.set_postfix(prompt=f"{i + 1}/{len(prompts)}")
            Ti = prompt.tokens.shape[1]
            chunk = execution.chunk_size or auto_chunk_size(config, Ti, Ti, memory_budget=execution.memory_budget)
            out = _erasure_of_prompt(
                params,
                prompt,
                baseline,
                config,
                erasure,
                metric=metric,
                interventions=interventions,
                execution=execution.replace(chunk_size=chunk),
                on_piece=bar.update,
                label=i,
            )
            if metric is not None:
                out, change = out
                n = int(batch.lengths[i])  # erasures of padding positions are no erasures of the prompt
                changes[i, :, :n] = change[:, :n]
            effects[i, :, :Ti] = out
    settings = {} if erasure.effect == "probability_shift" else {"effect": erasure.effect}
    # (the default effect stays unrecorded: results saved before read the same)
    return ErasureResult(
        effects=effects,
        tokens=batch.tokens,
        lengths=batch.lengths,
        answer_start=batch.answer_start,
        settings=settings,
        metric_change=changes,
    )


# ----------------------------------------------------------------------------- figures


def erasure_panel(result: ErasureResult, prompt: int = 0, *, tokenizer=None) -> "TokenPanel":
    """The erasure heatmap of one prompt as a `TokenPanel` (see `erasure_figure`)."""
    from jaxdepth.analyses import drawing as d

    d.expect(result, ErasureResult, "erasure_panel")
    p = d.prompt_index(result, prompt)
    n = int(result.lengths[p])
    return d.TokenPanel(
        result.effects[p, :, :n],
        d.token_labels(result.tokens[p, :n], tokenizer),
        row_label="erased boundary l (0 = embeddings)",
        answer_start=int(result.answer_start[p]),
        cmap="magma",
        symmetric=False,
        colorbar_label=r"max over answer of $\|y - \bar{y}\|_2$",
        caption="residual erasure",
    )


def erasure_figure(result: ErasureResult, prompt: int = 0, *, tokenizer=None, title: Optional[str] = None) -> Figure:
    """Residual erasure of one prompt: the effect on the answer predictions of erasing h_l[t],
    boundary l = 0..L (y) by token t (x). `tokenizer` (its `decode`, else `convert_ids_to_tokens`)
    labels the tokens; None labels positions."""
    from jaxdepth.analyses import drawing as d

    fig = d.token_heatmap(dataclasses.replace(erasure_panel(result, prompt, tokenizer=tokenizer), caption=""))
    d.title_figure(fig, f"Residual erasure, prompt {d.prompt_index(result, prompt)}", title, result.settings)
    return fig


# ----------------------------------------------------------------------------- in the suite


# The last study baseline: (params, config, prompts' digest, baseline). Erasure, attribution
# patching and gradient x activation of one run all take the same baseline, on every dataset of
# the run when it has baseline prompts: computed once, not once per analysis and dataset. The
# params are held (compared by identity), so the entry cannot be mistaken for another model's.
_last_baseline: list = []


def baseline_residuals(inputs: RunInputs) -> np.ndarray:
    """The erasure baseline of a study run: `mean_residuals` of its baseline prompts (its own
    prompts when it has none), computed once for the analyses of a run that share it (the array
    is read-only)."""
    batch = inputs.baseline_batch if inputs.baseline_batch is not None else inputs.batch
    params, config = inputs.model.params, inputs.model.config
    tokens, valid = np.asarray(batch.tokens), np.asarray(batch.valid)
    digest = hashlib.sha256(repr(tokens.shape).encode() + tokens.tobytes() + valid.tobytes()).hexdigest()
    for held_params, held_config, held_digest, baseline in _last_baseline:
        if held_params is params and held_config == config and held_digest == digest:
            return baseline
    baseline = mean_residuals(params, batch, config)
    baseline.setflags(write=False)
    _last_baseline[:] = [(params, config, digest, baseline)]
    return baseline


ANALYSIS = Analysis(
    name="erasure",
    result_type=ErasureResult,
    identity=lambda s: {"detail_prompts": s.detail_prompts},
    run=lambda x: residual_erasure(
        x.model.params,
        x.batch,
        x.model.config,
        baseline_residuals(x),
        execution=Execution(progress=x.progress, memory_budget=x.settings.memory_budget),
    ),
    figures=per_prompt_figures(erasure_figure),
    summary=lambda r: [f"erasure max effect {float(r.effects.max()):.3g}"],
    panel=erasure_panel,
    detail=True,
    uses_baseline=True,
)
