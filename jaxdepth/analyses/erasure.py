"""Residual erasure (METHODS §4): replace one residual vector h_l[t] by a baseline mean and
measure how much the predictions of the answer tokens move.

The (boundary, position) erasures of a prompt run as one compiled sweep per block of positions
(`erasure_of_block`), every boundary and position of the block at once. Erasing position t
cannot change any position before t (causal attention), so only positions p >= t are
measured: an erasure after the last answer prediction is exactly 0, not float noise. The same
fact saves work: an erasure runs only the positions from its block's first one on.

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
from functools import partial
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxdepth.core.batch import PromptArrays, PromptBatch
from jaxdepth.core.compilation import jit
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.interventions import replace_residual
from jaxdepth.core.model import final_residual, layer_inputs, residual_stream, run_layers_from, unembed
from jaxdepth.core.sites import as_interventions
from jaxdepth.core.saved_result import SavedResult
from jaxdepth.analyses.stats import masked_max, metric_value, norm
from jaxdepth.core.sweep import auto_chunk_size, sweep
from jaxdepth.core.sharding import to_host


@partial(jit, static_argnames="config")
def _residual_sums(params, tokens, valid, config: ModelConfig, interventions=None):
    hs = residual_stream(params, tokens, config, valid=valid, interventions=interventions).astype(jnp.float32)
    return jnp.sum(hs * valid[None, :, :, None], axis=(1, 2))


def mean_residuals(params, batch: PromptBatch, config: ModelConfig, *, batch_size: int = 8,
                   interventions=None) -> np.ndarray:
    """Baseline `[L+1, D]`: the mean residual at every boundary over all valid tokens of `batch`
    (a BOS token counts where the tokenizer added one).

    Under `interventions` (default none), the mean of the intervened runs' residuals, each after
    the interventions at its `resid_pre` (the values an erasure under the same interventions
    replaces). The batch runs at its full padded length, `batch_size` prompts at a time."""
    total = np.zeros((config.num_layers + 1, config.hidden_size), np.float64)
    for i in range(0, len(batch), batch_size):
        part = batch.select(slice(i, i + batch_size))
        total += to_host(_residual_sums(params, jnp.asarray(part.tokens), jnp.asarray(part.valid), config,
                                        interventions))
    return (total / batch.valid.sum()).astype(np.float32)


# Erasure positions are split into up to this many blocks of at least MIN_BLOCK positions; each
# block runs only the positions from its first one on (see `erasure_of_prompt`). Work falls to
# (blocks + 1) / (2 * blocks) of running every position (0.625 at 4 blocks, 0.5625 at 8); each
# block is one more shape to compile, which only short prompts notice.
PREFIX_BLOCKS = 8
MIN_BLOCK = 8


def default_blocks(T: int) -> int:
    """How many position blocks `erasure_of_prompt` uses for a prompt of T (padded) positions."""
    return max(1, min(PREFIX_BLOCKS, T // MIN_BLOCK))


def position_blocks(T: int, blocks: Optional[int] = None) -> list[tuple[int, int]]:
    """`blocks` (default `default_blocks(T)`) contiguous `(first, stop)` ranges of near-equal
    size covering positions 0..T-1."""
    blocks = max(default_blocks(T) if blocks is None else blocks, 1)
    edges = sorted({round(k * T / blocks) for k in range(blocks + 1)})
    return list(zip(edges[:-1], edges[1:]))


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
    hs, final, (keys, values) = layer_inputs(params, prompt.tokens, config, valid=prompt.valid,
                                             interventions=interventions, tap=lambda r, _: (r.k, r.v))
    clean = jax.nn.softmax(unembed(params, final[:, prompt.answer_positions], config), axis=-1)
    return hs, keys, values, clean


def answer_of(prompt: PromptArrays):
    """What an effect may read of `prompt`'s answer: `(targets [A], real [A])`, every answer
    position real where `prompt.answer_real` is None."""
    positions = prompt.answer_positions
    real = jnp.ones(positions.shape, bool) if prompt.answer_real is None else jnp.asarray(prompt.answer_real, bool)
    return prompt.answer_targets, real


def erased_logits(logits, clean_logits, position, boundary, num_layers: int):
    """A whole prompt's logits `[1, T, V]` under the erasure of h_boundary[position], from the
    suffix run's logits `[1, S, V]` (positions T-S..T-1): the clean logits wherever causality
    leaves them unchanged (before `position`; at the last boundary, everywhere but `position`),
    so that a metric reading only those changes by exactly 0, not float noise."""
    T, S = clean_logits.shape[1], logits.shape[1]
    pos = jnp.arange(T)
    changed = jnp.where(boundary == num_layers, pos == position, pos >= position)
    suffix = jnp.concatenate([clean_logits[:, :T - S], logits], axis=1)
    return jnp.where(changed[None, :, None], suffix, clean_logits)


@partial(jit, static_argnames=("config", "first", "stop", "chunk_size", "effect", "metric"))
def erasure_of_block(params, clean_state, prompt: PromptArrays, baseline, config: ModelConfig, first: int,
                     stop: int, *, chunk_size: Optional[int] = None, effect=probability_shift, interventions=None,
                     metric: Optional[Callable] = None):
    """`[L+1, stop - first]` effects of erasing h_l[t] for every boundary l and every position
    `first <= t < stop` of `prompt` (`PromptArrays`), from `clean_state = clean_run(params,
    prompt, config, interventions=...)`. `effect(probs, clean, reach, answer)` turns the erased
    and clean answer distributions into the effect (see `probability_shift`); `answer =
    (targets [A], real [A])` is what it may read (`answer_of`).

    `interventions` (the clean state's) act on every erasure, the user's first, then the
    replacement of h_l[t]. With `metric` (a static, jit-traceable scalar function of one
    prompt's logits `[1, T, V]`), returns `(effects, metric_changes)`, the second
    `[L+1, stop - first]`: `metric(erased) - metric(clean)` on the whole prompt's logits (the
    positions an erasure cannot reach keep their clean logits, `erased_logits`).

    Each erasure runs positions `first..T-1` only, reading the clean keys and values of the
    positions before `first` (they cannot change), and starts at its boundary l (the layers
    before l are not rerun). Boundaries run one after another (`lax.map`), the positions of a
    boundary as one chunked sweep.
    """
    hs, keys, values, clean = clean_state
    valid, answer_positions, answer = prompt.valid, prompt.answer_positions, answer_of(prompt)
    L, T = config.num_layers, hs.shape[2]
    ivs = as_interventions(interventions)
    prefix = None if first == 0 else (keys[:, :, :first], values[:, :, :first])
    rows = jnp.arange(first, T)  # the positions the suffix run computes
    read = jnp.maximum(answer_positions - first, 0)  # answer positions, as suffix rows
    if metric is not None:  # the whole clean output: the erased runs compute positions first..T-1 only
        clean_logits = unembed(params, final_residual(hs[-1], config, ivs), config)
        clean_metric = metric_value(metric, clean_logits)

    def boundary_effects(boundary):
        def member(position):
            iv = replace_residual(boundary, rows == position, baseline[boundary])
            h, _ = run_layers_from(params, hs[boundary][:, first:], boundary, config, valid=valid,
                                   interventions=(*ivs, iv), prefix=prefix)
            # Causality: an erasure at t changes no position before t, and at the last boundary
            # (after every layer) it changes position t alone. Masking the rest gives exact zeros.
            reach = jnp.where(boundary == L, answer_positions == position, answer_positions >= position)
            # The LM head on the answer rows only; with a metric too, which reads every row, the
            # effect is still taken from these rows' own product, so it is the same to the bit.
            value = effect(jax.nn.softmax(unembed(params, h[:, read], config), axis=-1), clean, reach, answer)
            if metric is None:
                return value
            erased = erased_logits(unembed(params, h, config), clean_logits, position, boundary, L)
            return value, metric_value(metric, erased) - clean_metric
        return sweep(member, jnp.arange(first, stop), chunk_size)

    return jax.lax.map(boundary_effects, jnp.arange(L + 1))


def erasure_of_prompt(params, prompt: PromptArrays, baseline, config: ModelConfig, *,
                      chunk_size: Optional[int] = None, blocks: Optional[int] = None,
                      on_block: Optional[Callable[[], None]] = None, effect=probability_shift,
                      interventions=None, metric: Optional[Callable] = None):
    """`[L+1, T]` effects of erasing h_l[t] for one prompt (`PromptArrays`: `tokens`, `valid`
    `[1, T]`; `answer_positions [A]`, the positions predicting answer tokens, repeats allowed,
    the real ones marked by `answer_real [A]`, default all), measured by `effect` (see
    `erasure_of_block`).

    `interventions` (`jaxdepth.core.sites`; default none) act on the clean run and on every
    erasure: the user's first, then the replacement of h_l[t], which so wins at its site. They
    must act on each position alone (as every built-in kind does), and their position-indexed
    data must broadcast to the suffix runs' lengths (`[L, 1]` masks, not `[L, T]`). With
    `metric` (a jit-traceable function of the prompt's logits `[1, T, V]` returning a scalar;
    define it once: it is a static argument), returns `(effects, metric_changes [L+1, T])`,
    `metric(erased) - metric(clean)`, both under `interventions`.

    Erasing position t changes no position before t, so the positions are split into `blocks`
    ranges (default `default_blocks(T)`; 1 turns the saving off), each one compiled
    computation (`erasure_of_block`) that runs only the positions from the range's first one
    on. `on_block()` is called after each range (progress).
    """
    T = prompt.tokens.shape[1]
    state = clean_run(params, prompt, config, interventions=interventions)
    parts = []
    for first, stop in position_blocks(T, blocks):
        parts.append(erasure_of_block(params, state, prompt, baseline, config, first, stop, chunk_size=chunk_size,
                                      effect=effect, interventions=interventions, metric=metric))
        if on_block is not None:
            jax.block_until_ready(parts[-1])
            on_block()
    if metric is None:
        return jnp.concatenate(parts, axis=1)
    return tuple(jnp.concatenate(part, axis=1) for part in zip(*parts))


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


def residual_erasure(params, batch: PromptBatch, config: ModelConfig, baseline: np.ndarray, *,
                     chunk_size: Optional[int] = None, memory_budget: Optional[int] = None,
                     blocks: Optional[int] = None, effect: str = "probability_shift", progress: bool = True,
                     settings=None, interventions=None, metric: Optional[Callable] = None) -> ErasureResult:
    """Residual erasure for every prompt of `batch` against a `[L+1, D]` baseline (`blocks`: the
    position blocks of `erasure_of_prompt`; the result does not depend on it). `effect` names
    what is measured (`EFFECTS`): METHODS' 'probability_shift' (default) or
    'answer_probability_change', the exact change of the integrated-gradients objective (what
    `jaxdepth.analyses.attribution.attribution_patching` estimates).

    `interventions` (`jaxdepth.core.sites`; default none) act on the clean run and on every
    erasure, the user's first, then the replacement of h_l[t] (which so wins at its site):
    each erasure is a full forward under both (`mean_residuals(..., interventions=...)` gives
    the matching baseline). Each prompt runs at its own padded length (`PromptBatch.prompt`),
    and an erasure computes only the positions from its block's first one on, so intervention
    data indexed by position must broadcast to every length (`[L, 1]` keep-masks, head
    ablations, a vector added at every position); data that does not is refused at trace time.

    `metric` (default none): a jit-traceable function of one prompt's float32 logits
    `[1, T, V]` returning a scalar (anything else is refused at trace time), defined once (it is
    a static argument: a new function compiles anew). `metric_change` then holds
    `metric(erased) - metric(clean)` for every erasure, beside `effects`. T is the prompt's
    padded length (its length bucket, `PromptBatch.buckets`): positions from its length on are
    padding, and a metric should read only positions every prompt has.

    `chunk_size` and `memory_budget` (bytes; default a share of the free memory) bound how many
    erasures are vmapped at once: memory, not what is computed. `progress` shows a progress
    bar; `settings` (a dict) is stored in the result."""
    if effect not in EFFECTS:
        raise ValueError(f"effect must be one of {', '.join(EFFECTS)}, got {effect!r}")
    L, T = config.num_layers, batch.tokens.shape[1]
    if baseline.shape != (L + 1, config.hidden_size):
        raise ValueError(f"baseline must be [L+1, D] = {(L + 1, config.hidden_size)}, got {baseline.shape}")
    effects = np.zeros((len(batch), L + 1, T), np.float32)
    changes = None if metric is None else np.zeros((len(batch), L + 1, T), np.float32)
    total = sum(len(position_blocks(batch.single(i).tokens.shape[1], blocks)) for i in range(len(batch)))
    with tqdm(total=total, desc="residual erasure (position blocks)", disable=not progress) as bar:
        for i in range(len(batch)):
            prompt = batch.prompt(i)
            Ti = prompt.tokens.shape[1]
            chunk = chunk_size or auto_chunk_size(config, Ti, Ti, memory_budget=memory_budget)
            out = erasure_of_prompt(params, prompt, jnp.asarray(baseline), config, chunk_size=chunk, blocks=blocks,
                                    on_block=bar.update, effect=EFFECTS[effect], interventions=interventions,
                                    metric=metric)
            if metric is not None:
                out, change = out
                n = int(batch.lengths[i])  # erasures of padding positions are no erasures of the prompt
                changes[i, :, :n] = to_host(change)[:, :n]
            effects[i, :, :Ti] = to_host(out)
    settings = dict(settings or {})
    if effect != "probability_shift":  # the default stays unrecorded: results saved before read the same
        settings["effect"] = effect
    return ErasureResult(effects=effects, tokens=batch.tokens, lengths=batch.lengths,
                         answer_start=batch.answer_start, settings=settings, metric_change=changes)
