"""Residual erasure (METHODS §4): replace one residual vector h_l[t] by a baseline mean and
measure how much the predictions of the answer tokens move.

The (boundary, position) erasures of a prompt run in one compiled computation
(`erasure_sweep`), every boundary at once. Erasing position t cannot change any position
before t (causal attention), so only positions p >= t are measured: an erasure after the last
answer prediction is exactly 0, not float noise. The same fact saves work: the positions fall
into pieces, and an erasure runs only the pieces from its own on, up to the one holding the
last answer position. Each piece is one call of that computation, so that a progress bar
advances as each piece finishes.

Under `interventions` (`jaxdepth.core.sites`; default none), the user's interventions act on
the clean run and on every erasure, composed in one order: the user's first, then the erasure's
replacement, which so wins at its site (h_l[t] is the baseline whatever the user's
interventions at `resid_pre` of layer l did to it). Each erasure is then exactly a full forward
under the user's interventions and the replacement. A `metric` (a scalar function of one
prompt's logits `[1, T, V]`) is measured beside the built-in effect: `metric(erased logits) -
metric(clean logits)`, both under the user's interventions.
"""

from __future__ import annotations

import dataclasses
import hashlib
from functools import partial
from typing import TYPE_CHECKING, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxdepth.core.progress import ProgressLike, progress_bar
from jaxdepth.core.batch import PromptArrays, PromptBatch
from jaxdepth.core.compilation import jit
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.loops import final_residual, run_layers_in_pieces
from jaxdepth.core.model import layer_inputs, residual_stream, unembed
from jaxdepth.core import sites
from jaxdepth.core.sites import check_layer_indices
from jaxdepth.core.saved_result import SavedResult
from jaxdepth.analyses.suite import Analysis, RunInputs, per_prompt_figures
from jaxdepth.analyses.metric_inputs import ONE_PROMPT_HINT, refuse_padding_reads
from jaxdepth.analyses.stats import masked_max, metric_value, norm
from jaxdepth.core.sweep import auto_chunk_size, sweep
from jaxdepth.core.sharding import to_host

if TYPE_CHECKING:  # matplotlib is imported when a figure is drawn, not with the analysis
    from matplotlib.figure import Figure

    from jaxdepth.analyses.drawing import TokenPanel

__all__ = [
    "residual_erasure",
    "ErasureResult",
    "mean_residuals",
    "erasure_of_prompt",
    "probability_shift",
    "answer_probability_change",
    "EFFECTS",
    "erasure_figure",
    "erasure_panel",
    "ANALYSIS",
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
# are rows of one compiled computation (`erasure_sweep`), not separate shapes: a prompt length
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


def _erased_logits(logits, clean_logits, position, boundary, num_layers: int):
    """A whole prompt's logits `[1, T, V]` under the erasure of h_boundary[position], from the
    suffix run's logits `[1, S, V]` (positions T-S..T-1): the clean logits wherever causality
    leaves them unchanged (before `position`; at the last boundary, everywhere but `position`),
    so that a metric reading only those changes by exactly 0, not float noise."""
    T, S = clean_logits.shape[1], logits.shape[1]
    pos = jnp.arange(T)
    changed = jnp.where(boundary == num_layers, pos == position, pos >= position)
    suffix = jnp.concatenate([clean_logits[:, : T - S], logits], axis=1)
    return jnp.where(changed[None, :, None], suffix, clean_logits)


def erased_final_residual(
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
):
    """The final residual `[1, T, D]` of the run in which h_boundary[position] is `value`, under
    `interventions` (checked; applied first, the replacement after them), computed for the
    positions of pieces `first_piece..last_piece` only (`width` positions each; positions
    before the first piece keep h_boundary, those after the last piece are stale).

    Each layer runs its pieces in order against a key/value buffer that starts as the clean
    run's (`clean_state = clean_run(...)`), each piece writing its own keys into it: erasing
    position t changes nothing before t, so the prefix before `first_piece` is the clean one.
    `boundary`, `first_piece` and `last_piece` may be traced, not batched (they are loop
    bounds); `position` and `value` may be batched. Forward only."""
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
        first_piece=first_piece,
        last_piece=last_piece,
        width=width,
        interventions_of=lambda rows: (*interventions, erase_rows(rows)),
    )
    return final_residual(h, config, (*interventions, erase_rows(jnp.arange(T))))


@partial(jit, static_argnames=("config", "width", "chunk_size", "effect", "metric"))
def erasure_sweep(
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
    metric: Optional[Callable] = None,
    pieces=None,
):
    """`[L+1, T]` effects of erasing h_l[t] for every boundary l and position t of `prompt`
    (`PromptArrays`, T a multiple of `width`), from `clean_state = clean_run(params, prompt,
    config, interventions=...)`, as one compiled computation. `effect(probs, clean, reach,
    answer)` turns the erased and clean answer distributions into the effect (see
    `probability_shift`); `answer = (targets [A], real [A])` is what it may read (`_answer_of`).
    With `metric`, returns `(effects, metric_changes)` (see `erasure_of_prompt`).

    The positions fall into pieces of `width`. The erasures of piece k (every boundary, its
    positions as one chunked sweep) run pieces k.. only, from their boundary on
    (`erased_final_residual`), and up to the last piece a measurement reads: the one holding
    the last answer position (every position with a metric). Positions after the last answer
    position are not run at all: their effects are exactly 0.

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
    last = T - 1 if metric is not None else jnp.max(answer_positions)
    last_piece = last // width
    if metric is not None:  # the whole clean output: a metric reads every position
        clean_logits = unembed(params, final_residual(hs[-1], config, ivs), config)
        clean_metric = metric_value(metric, clean_logits)

    def piece_effects(k, out):
        def boundary_effects(boundary):
            def member(position):
                h = erased_final_residual(
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
                )
                # Causality: an erasure at t changes no position before t, and at the last boundary
                # (after every layer) it changes position t alone. Masking the rest gives exact zeros.
                reach = jnp.where(boundary == L, answer_positions == position, answer_positions >= position)
                # The LM head on the answer rows only; with a metric too, which reads every row, the
                # effect is still taken from these rows' own product, so it is the same to the bit.
                probs = jax.nn.softmax(unembed(params, h[:, answer_positions], config), axis=-1)
                value = effect(probs, clean, reach, answer)
                if metric is None:
                    return value
                erased = _erased_logits(unembed(params, h, config), clean_logits, position, boundary, L)
                return value, metric_value(metric, erased) - clean_metric

            return sweep(member, k * width + jnp.arange(width), chunk_size)

        part = jax.lax.map(boundary_effects, jnp.arange(L + 1))
        return jax.tree.map(lambda o, p: jax.lax.dynamic_update_slice_in_dim(o, p, k * width, axis=1), out, part)

    first, stop = (0, last_piece + 1) if pieces is None else (pieces[0], jnp.minimum(pieces[1], last_piece + 1))
    zeros = jnp.zeros((L + 1, T), jnp.float32)
    return jax.lax.fori_loop(first, stop, piece_effects, zeros if metric is None else (zeros, zeros))


@partial(jit, static_argnames="config")
def _clean_logits(params, h_last, config: ModelConfig, interventions=None):
    """The clean run's logits `[1, T, V]` from its last boundary's input (`clean_run`'s `hs[-1]`),
    after the interventions at the final residual: what a metric reads of the clean run."""
    ivs = check_layer_indices(interventions, config.num_layers)
    return unembed(params, final_residual(h_last, config, ivs), config)


def pieces_to_run(prompt: PromptArrays, blocks: Optional[int] = None, metric: Optional[Callable] = None) -> int:
    """How many position pieces the erasures of `prompt` run (`erasure_of_prompt`, `blocks` as
    there): those up to the one holding the last answer position, every piece with a metric."""
    T = prompt.tokens.shape[1]
    width = piece_width(T, blocks)
    last = T - 1 if metric is not None else int(np.max(to_host(prompt.answer_positions)))
    return last // width + 1


def _place(out, part, columns: slice):
    """Copy the `columns` of a piece's effects (with a metric, of both arrays) into `out`."""
    for whole, piece in zip(jax.tree.leaves(out), jax.tree.leaves(part)):
        whole[:, columns] = to_host(piece)[:, columns]


def erasure_of_prompt(
    params,
    prompt: PromptArrays,
    baseline,
    config: ModelConfig,
    *,
    chunk_size: Optional[int] = None,
    blocks: Optional[int] = None,
    effect=probability_shift,
    interventions=None,
    metric: Optional[Callable] = None,
    on_piece: Optional[Callable[[], object]] = None,
    label=0,
):
    """`[L+1, T]` effects of erasing h_l[t] for one prompt (`PromptArrays`: `tokens`, `valid`
    `[1, T]`; `answer_positions [A]`, the positions predicting answer tokens, repeats allowed,
    the real ones marked by `answer_real [A]`, default all), measured by `effect` (see
    `erasure_sweep`).

    `interventions` (`jaxdepth.core.sites`; default none) act on the clean run and on every
    erasure: the user's first, then the replacement of h_l[t], which so wins at its site. They
    must act on each position alone (as every built-in kind does), and their position-indexed
    data must broadcast to a piece's rows and to the prompt's (`[L, 1]` masks, not `[L, T]`).
    With `metric` (a jit-traceable function of the prompt's logits `[1, T, V]` returning a
    scalar; define it once: it is a static argument), returns `(effects, metric_changes
    [L+1, T])`, `metric(erased) - metric(clean)`, both under `interventions`; a metric that
    reads the prompt's padding (or the positions added to whole pieces) is refused before any
    erasure runs (`jaxdepth.analyses.metric_inputs.refuse_padding_reads`; `label` names the
    prompt there).

    Erasing position t changes no position before t, so the positions are split into `blocks`
    pieces (default `default_blocks(T)`; 1 turns the saving off) and an erasure runs only the
    positions from its piece on. The prompt is padded to whole pieces (invalid positions the
    result leaves out); every piece runs in the same compiled computation (`erasure_sweep`).
    Each piece is a call of its own, all of them queued at once, so the device runs them back to
    back; `on_piece()` (e.g. a progress bar's step) is called as each one finishes, in order,
    `pieces_to_run` times. Returns numpy arrays.
    """
    T = prompt.tokens.shape[1]
    width, count = piece_width(T, blocks), pieces_to_run(prompt, blocks, metric)
    pad = -T % width
    if pad:  # whole pieces: positions that no valid key or answer reads
        prompt = dataclasses.replace(
            prompt, tokens=jnp.pad(prompt.tokens, ((0, 0), (0, pad))), valid=jnp.pad(prompt.valid, ((0, 0), (0, pad)))
        )
    state = clean_run(params, prompt, config, interventions=interventions)
    if metric is not None:
        refuse_padding_reads(
            metric,
            lambda: _clean_logits(params, state[0][-1], config, interventions),  # only where padded
            prompt.valid,
            analysis="erasure",
            prompts=[label],
            hint=ONE_PROMPT_HINT,
        )
    run = partial(
        erasure_sweep,
        params,
        state,
        prompt,
        baseline,
        config,
        width=width,
        chunk_size=chunk_size,
        effect=effect,
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
        if on_piece is not None:
            on_piece()
    return jax.tree.map(lambda x: x[:, :T], out)


@dataclasses.dataclass
class ErasureResult(SavedResult):
    """`effects [P, L+1, T]` per prompt: `effects[p, l, t]` is the effect of erasing h_l[t]
    (boundary l = 0..L, h_0 the embeddings and h_L the final residual; position t), 0 beyond
    each prompt's length, with the prompts' tokens, lengths and answer starts so plots can
    label positions. `settings` holds 'effect' when it is not 'probability_shift', and whatever
    the caller passed.

    `metric_change [P, L+1, T]`, where a metric was given: `metric(erased logits) -
    metric(clean logits)` per erasure (0 beyond each prompt's length); None otherwise, and in
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
    *,
    chunk_size: Optional[int] = None,
    memory_budget: Optional[int] = None,
    blocks: Optional[int] = None,
    effect: str = "probability_shift",
    progress: ProgressLike = True,
    settings=None,
    interventions=None,
    metric: Optional[Callable] = None,
) -> ErasureResult:
    """Residual erasure for every prompt of `batch` against a `[L+1, D]` baseline (`blocks`: the
    position pieces of `erasure_of_prompt`; the result does not depend on it). `effect` names
    what is measured (`EFFECTS`): METHODS' 'probability_shift' (default) or
    'answer_probability_change', the exact change of the integrated-gradients objective (what
    `jaxdepth.analyses.attribution.attribution_patching` estimates).

    `interventions` (`jaxdepth.core.sites`; default none) act on the clean run and on every
    erasure, the user's first, then the replacement of h_l[t] (which so wins at its site):
    each erasure is a full forward under both (`mean_residuals(..., interventions=...)` gives
    the matching baseline). Each prompt runs at its own padded length (`PromptBatch.prompt`),
    and an erasure computes only the positions from its piece's first one on, so intervention
    data indexed by position must broadcast to every length (`[L, 1]` keep-masks, head
    ablations, a vector added at every position); data that does not is refused at trace time.

    `metric` (default none): a jit-traceable function of one prompt's float32 logits
    `[1, T, V]` returning a scalar (anything else is refused at trace time), defined once (it is
    a static argument: a new function compiles anew). `metric_change` then holds
    `metric(erased) - metric(clean)` for every erasure, beside `effects`. T is the prompt's
    padded length (its length bucket, `PromptBatch.buckets`): positions from its length on are
    padding, and a metric that reads them (`logits[0, -1]` of a padded prompt) is refused, a
    `ValueError` naming the prompt and its length, before any erasure runs
    (`jaxdepth.analyses.metric_inputs`): read only positions every prompt has.

    `chunk_size` and `memory_budget` (bytes; default a share of the free memory) bound how many
    erasures are vmapped at once: memory, not what is computed. `progress` shows a progress
    bar over the position pieces of every prompt (`pieces_to_run`), one step as each piece
    finishes; `settings` (a dict) is stored in the result."""
    if effect not in EFFECTS:
        raise ValueError(f"effect must be one of {', '.join(EFFECTS)}, got {effect!r}")
    L, T = config.num_layers, batch.tokens.shape[1]
    if baseline.shape != (L + 1, config.hidden_size):
        raise ValueError(f"baseline must be [L+1, D] = {(L + 1, config.hidden_size)}, got {baseline.shape}")
    effects = np.zeros((len(batch), L + 1, T), np.float32)
    changes = None if metric is None else np.zeros((len(batch), L + 1, T), np.float32)
    prompts = [batch.prompt(i) for i in range(len(batch))]
    # A step per piece, not per prompt: one prompt's erasures can take minutes.
    total = sum(pieces_to_run(prompt, blocks, metric) for prompt in prompts)
    with progress_bar(progress, total=total, desc="residual erasure (position pieces)") as bar:
        for i, prompt in enumerate(prompts):
            bar.set_postfix(prompt=f"{i + 1}/{len(prompts)}")
            Ti = prompt.tokens.shape[1]
            chunk = chunk_size or auto_chunk_size(config, Ti, Ti, memory_budget=memory_budget)
            out = erasure_of_prompt(
                params,
                prompt,
                baseline,
                config,
                chunk_size=chunk,
                blocks=blocks,
                effect=EFFECTS[effect],
                interventions=interventions,
                metric=metric,
                on_piece=bar.update,
                label=i,
            )
            if metric is not None:
                out, change = out
                n = int(batch.lengths[i])  # erasures of padding positions are no erasures of the prompt
                changes[i, :, :n] = change[:, :n]
            effects[i, :, :Ti] = out
    settings = dict(settings or {})
    if effect != "probability_shift":  # the default stays unrecorded: results saved before read the same
        settings["effect"] = effect
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
        memory_budget=x.settings.memory_budget,
        progress=x.progress,
    ),
    figures=per_prompt_figures(erasure_figure),
    summary=lambda r: [f"erasure max effect {float(r.effects.max()):.3g}"],
    panel=erasure_panel,
    detail=True,
    uses_baseline=True,
)
