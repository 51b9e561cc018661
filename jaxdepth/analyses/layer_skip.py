"""Effects of skipping a layer (or one of its sublayers) on later layers and on the output
(METHODS §3).

For a skipped layer s and a split position t_s, layer s passes its input through unchanged at
positions 1 <= p < t_s (position 0 is never skipped). We measure, at future positions
p >= t_s, how much every layer j's contribution changes, `||Δ_j - Δ̄_j|| / ||Δ_j||`, and how
much the output distribution moves, `||y_p - ȳ_p||_2`. All (s, t_s) pairs of a prompt are one
vmapped computation.

The split positions are sampled (METHODS §3, the default) or, with `splits="answer_start"`,
each prompt's answer start alone: skip while the question is read, measure from the first
answer token on (how the first study relates its depth score to MQuAKE's number of hops).

Under `interventions` (`jaxdepth.core.sites`; default none), the user's interventions act on the
clean run and on every skipped run, composed in one order: the user's first, then the skip
(a keep-mask at `delta`, `attn_out` or `mlp_out`, which so wins at its site: the skipped
(sub)layer adds nothing at the skipped positions, whatever the user's interventions made of
it). Every effect is then that of full forwards under the user's interventions, with and
without the skip. A `metric` (a `jaxdepth.Metric`, read at the positions it declares) is
measured beside the built-in effects: `metric(skipped run) - metric(clean run)`.

What is skipped and measured is one value, `Skip` (the sublayer, the mode, the split
positions); how it runs (chunks, memory, progress) is a `jaxdepth.Execution`.
"""

from __future__ import annotations

import dataclasses
import random
from functools import partial
from typing import TYPE_CHECKING, Mapping, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxdepth.core.progress import track
from jaxdepth.core.batch import PromptArrays, PromptBatch
from jaxdepth.core.execution import Execution, refuse_fields, refuse_loose_options
from jaxdepth.core.compilation import jit
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.layer import LayerRecord, shared_kv_at
from jaxdepth.core.loops import LayerRun, run_layers
from jaxdepth.core.model import layer_inputs, token_per_layer_inputs, unembed
from jaxdepth.analyses.metrics import Metric, as_metric, readout
from jaxdepth.core.sites import as_interventions, skip as skip_at
from jaxdepth.core.saved_result import SavedResult
from jaxdepth.analyses.metric_inputs import clean_readout, prompt_reads, refuse_prompt_padding
from jaxdepth.analyses.stats import masked_max, norm, relative_norm
from jaxdepth.core.sweep import auto_chunk_size, sweep
from jaxdepth.core.sharding import to_host
from jaxdepth.analyses.effective_depth import depth_effects, depth_score
from jaxdepth.analyses.suite import Analysis, DepthCurve, DepthReading, Settings, option

if TYPE_CHECKING:  # matplotlib is imported when a figure is drawn, not with the analysis
    from matplotlib.figure import Figure

__all__ = [
    "layer_skip",
    "Skip",
    "LayerSkipResult",
    "layer_skip_sublayers",
    "LayerSkipBySublayer",
    "sample_split_positions",
    "layer_skip_figure",
    "LayerSkipSettings",
    "SUBLAYERS",
    "MODES",
    "SPLITS",
    "ANALYSIS",
    "SkipMasks",
    "skipped_runs",
    "depth_reading",
    "output_shifts",
    "metric_changes",
    "measured_rows",
    "skipped_layer_groups",
    "skip_effects_of_prompt",
    "largest_change",
    "member_masks",
]

# what each sublayer's skip removes: the layer's whole contribution, or one sublayer's output
SUBLAYERS = {"layer": "delta", "attn": "attn_out", "mlp": "mlp_out"}
MODES = ("future", "current")
SPLITS = ("sampled", "answer_start")


@dataclasses.dataclass(frozen=True)
class Skip:
    """What a layer skip skips and where it measures (how it runs is a `jaxdepth.Execution`).

    sublayer: 'layer' (the whole layer, attention and MLP), 'attn' or 'mlp' (`SUBLAYERS`).
    mode: 'future' (default) skips before each split position and measures from it on;
        'current' skips every position but 0 and measures every position (no split position,
        so `splits` stays 'sampled').
    splits: the future mode's split positions: 'sampled' (default, `splits_per_prompt` per
        prompt drawn with `seed`, METHODS §3) or 'answer_start' (each prompt's answer start
        alone, `PromptBatch.answer_start`)."""

    sublayer: str = "layer"
    mode: str = "future"
    splits: str = "sampled"
    seed: int = 123
    splits_per_prompt: int = 4

    def __post_init__(self):
        if self.sublayer not in SUBLAYERS or self.mode not in MODES or self.splits not in SPLITS:
            raise ValueError(
                f"sublayer must be one of {tuple(SUBLAYERS)}, mode one of {MODES} and splits one of {SPLITS}"
            )
        if self.mode == "current" and self.splits != "sampled":
            raise ValueError(
                f"splits={self.splits!r} needs mode='future': the 'current' mode skips every position but 0 "
                "and has no split position"
            )

    def of_a_run(self) -> "Skip":
        """This skip without its split sampling: what one prompt's skipped runs depend on (a
        static key of `skipped_runs` that a new seed does not change)."""
        return Skip(self.sublayer, self.mode)


def _refuse_loose(function: str, options: dict) -> None:
    """A `TypeError` for the keywords a layer skip once took on its own: the fields of `Skip`
    (shown as the `Skip` that says the same), and those of `Execution` (`refuse_loose_options`)."""
    refuse_fields(function, options, Skip, "skip=Skip", "what is skipped")
    refuse_loose_options(function, options)


def sample_split_positions(
    lengths: Sequence[int], *, seed: int = 123, per_prompt: int = 4, start: int = 8, stride: int = 8, margin: int = 4
) -> list[list[int]]:
    """Per prompt, candidates `range(8, T-4, 8)` shuffled by one seeded generator for the whole
    run (as the reference seeds Python's `random` once), the first `per_prompt` kept."""
    rng = random.Random(seed)
    chosen = []
    for length in lengths:
        candidates = list(range(start, int(length) - margin, stride))
        rng.shuffle(candidates)
        chosen.append(sorted(candidates[:per_prompt]))
    return chosen


def _split_positions_of(batch: PromptBatch, splits: str, *, seed: int = 123, per_prompt: int = 4) -> list[list[int]]:
    """The split positions t_s of every prompt: `sample_split_positions` ('sampled'), or the
    prompt's answer start ('answer_start'; none where the answer is empty, nothing to measure)."""
    if splits == "sampled":
        return sample_split_positions(batch.lengths, seed=seed, per_prompt=per_prompt)
    if splits == "answer_start":
        return [[int(a)] if int(a) < int(n) else [] for a, n in zip(batch.answer_start, batch.lengths)]
    raise ValueError(f"splits must be one of {SPLITS}, got {splits!r}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SkipMasks:
    """The position masks of K layer-skip members as one value (a pytree): `skip [K, T]` float,
    1 where member k skips its layer, and `measure [K, T]` bool, where member k is measured
    (`member_masks` gives them per member)."""

    skip: jax.Array
    measure: jax.Array


def _tap_relative_change(measure):
    def tap(r: LayerRecord, clean_delta):
        change = relative_norm(clean_delta - r.delta, clean_delta)  # [1, T]
        return masked_max(change, measure)

    return tap


@partial(jit, static_argnames=("config", "skip", "chunk_size"))
def skipped_runs(
    params,
    prompt: PromptArrays,
    layers,
    masks: SkipMasks,
    config: ModelConfig,
    *,
    skip: Skip = Skip(),
    chunk_size: Optional[int] = None,
    interventions=None,
):
    """Skip `skip.sublayer` of each layer s of `layers [G]` under K position masks, on one
    prompt (`PromptArrays`: its `tokens`, `valid` `[1, T]`): every layer-skip forward, without
    the LM head, `chunk_size` members vmapped at once (None: all). `skip.mode` as below; its
    split sampling plays no part (the masks say where).

    Member (s, k) skips layer s where `masks.skip[k]` is 1 and measures where
    `masks.measure[k]` (and `valid`) hold. Returns `(later [G, K, L], final [G, K, T, D],
    clean_final [T, D])`: the effects on later layers' contributions, each member's last
    residual h_L, and the clean h_L (what `output_shifts` compares them with). `later[s, k, j]`
    is exactly 0 where causality makes it so: j < s in both modes (those layers see clean
    inputs), and j = s too in the 'future' mode, where layer s is skipped only before the
    measured positions. In the 'current' mode the diagonal is measured: the skipped layer's own
    contribution is what changed (1 for a whole-layer skip). Skipped layers run one after
    another (`lax.map`), each starting from the clean h_s: the layers before s are not rerun.

    `interventions` (anything `jaxdepth.core.sites.as_interventions` takes) act on the clean run
    and on every member, the user's first, then the skip. The clean run is then the intervened
    one (Δ_j its layers' h_{j+1} - h_j, the clean h_L after the interventions at the final
    residual), and a member starts from layer s's input before layer s's own interventions
    (`jaxdepth.core.model.layer_inputs`), so they act once, as in a full forward.

    Gemma 4: every member's layers read the tokens' per-layer inputs
    (`jaxdepth.core.model.token_per_layer_inputs`), and start from the keys and values shared
    at boundary s in the clean run (`jaxdepth.core.layer.shared_kv_at`). A skip replaces what
    layer s writes to the residual, not what it computes: a skipped layer that computes keys
    for later layers still computes them (from its clean input), and the later layers that
    reuse them read them, as in the full forward under the skip.
    """
    L, tokens, valid = config.num_layers, prompt.tokens, prompt.valid
    sublayer, mode = skip.sublayer, skip.mode
    ivs = as_interventions(interventions)
    # Without interventions, each layer's input is h_l of the residual stream and Δ_j = h_{j+1} - h_j.
    shares = bool(config.shared_kv_layers)
    starts, clean_final, (clean_deltas, clean_kv) = layer_inputs(
        params,
        tokens,
        config,
        valid=valid,
        interventions=ivs,
        tap=lambda r, _: (r.delta, (r.k, r.v) if shares else None),
    )
    per_layer = token_per_layer_inputs(params, tokens, config)

    def runs_of_layer(layer):
        def member(m):
            keep, measure = m
            h, later = run_layers(
                params,
                starts[layer],
                config,
                valid=valid,
                interventions=(*ivs, skip_at(SUBLAYERS[sublayer], layer, keep)),
                tap=_tap_relative_change(measure[None] & valid),
                tap_inputs=clean_deltas,
                run=LayerRun(start=layer, shared_kv=shared_kv_at(clean_kv, layer, config)),
                per_layer_inputs=per_layer,
            )
            first_changed = layer if mode == "current" else layer + 1
            later = jnp.where(jnp.arange(L) >= first_changed, later[:, 0], 0.0)  # exact zeros by construction
            return later, h[0]

        return sweep(member, (masks.skip, masks.measure), chunk_size)

    later, final = jax.lax.map(runs_of_layer, layers)
    return later, final, clean_final[0]


@partial(jit, static_argnames="config")
def output_shifts(params, final, clean_final, rows, members, config: ModelConfig):
    """`[G, K]` output effects `max_p ||y_p - ȳ_p||_2` of the runs `final [G, K, T, D]` (from
    `skipped_runs`) against `clean_final [T, D]`, over the measured positions only.

    `rows [R]` lists every measured (member k, position p) as the flat index `k * T + p` into a
    run's `[K, T]` rows, and `members [R]` its k (K marks padding rows, which count nowhere):
    the LM head, the vocabulary-sized softmax and the norm run on those R rows, not on all
    K x T. Layers run one after another (`lax.map`), bounding the `[R, V]` distributions.
    """
    G, K, T, D = final.shape
    clean = jax.nn.softmax(unembed(params, clean_final[rows % T], config), axis=-1)

    def of_layer(runs):
        probs = jax.nn.softmax(unembed(params, runs.reshape(K * T, D)[rows], config), axis=-1)
        shift = jax.ops.segment_max(norm(probs - clean), members, num_segments=K + 1)[:K]
        return jnp.maximum(shift, 0.0)  # a member measuring nothing: 0 (segment_max gives -inf)

    return jax.lax.map(of_layer, final)


@partial(jit, static_argnames=("config", "metric"))
def metric_changes(params, final, clean_final, prompt: PromptArrays, config: ModelConfig, metric: Metric):
    """`[G, K]` changes `metric(skipped run) - metric(clean run)` of the runs `final
    [G, K, T, D]` (from `skipped_runs`) against `clean_final [T, D]`, of one prompt
    (`PromptArrays`; for a metric of reads='answer', with its answer span). The final norm and
    LM head run at the metric's positions only (`jaxdepth.analyses.metric_inputs.prompt_reads`),
    of one run at a time (`lax.map`), the clean run's logits there given as `Readout.clean`
    where the metric reads them. The metric is static (define it once)."""
    G, K, T, D = final.shape
    clean = clean_readout(params, clean_final[None], prompt, config, metric)
    reads, clean_value = prompt_reads(metric, prompt), metric(clean)[0]
    change = lambda h: metric(readout(params, h[None], config, reads, clean=clean.clean))[0] - clean_value
    return jax.lax.map(change, final.reshape(G * K, T, D)).reshape(G, K)


# `output_shifts` compiles once per padded row count: rows are padded to a multiple of this.
ROWS_MULTIPLE = 64


def measured_rows(measure_masks: np.ndarray, valid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The `(rows, members)` arguments of `output_shifts` for `measure_masks [K, T]` and
    `valid [T]`, padded to a multiple of `ROWS_MULTIPLE` rows."""
    K, T = measure_masks.shape
    members, positions = np.nonzero(measure_masks & valid[None])
    pad = -len(members) % ROWS_MULTIPLE
    rows = np.concatenate([members * T + positions, np.zeros(pad, np.int64)]).astype(np.int32)
    return rows, np.concatenate([members, np.full(pad, K)]).astype(np.int32)


def skipped_layer_groups(
    config: ModelConfig, T: int, n_members: int, execution: Execution = Execution(), *, bytes_per: int = 4
) -> int:
    """Skipped layers per `skipped_runs` call: all L unless their last residuals `[G, K, T, D]`
    would take more than a quarter of `execution`'s memory budget (`Execution.budget`)."""
    budget = execution.budget()
    per_layer = n_members * T * config.hidden_size * bytes_per
    return int(np.clip(budget // 4 // per_layer, 1, config.num_layers))


def skip_effects_of_prompt(
    params,
    prompt: PromptArrays,
    masks: SkipMasks,
    config: ModelConfig,
    skip: Skip = Skip(),
    *,
    metric: Optional[Metric] = None,
    interventions=None,
    execution: Execution = Execution(),
):
    """Effects of skipping `skip.sublayer` of every layer s under K position masks, on one
    prompt (`PromptArrays`: its `tokens`, `valid` `[1, T]`, and for a metric of reads='answer'
    its answer span; `masks`: `SkipMasks` of host arrays, `skip [K, T]` float, `measure [K, T]`
    bool), in `skip.mode`. Returns numpy `(later [L, K, L], output [L, K])` (see
    `skipped_runs`).

    The forwards run in calls of as many skipped layers as `execution`'s memory budget holds
    (`skipped_layer_groups`: all of them where memory allows), `execution.chunk_size` members
    vmapped at once (None: all); the LM head then runs on the measured positions only
    (`output_shifts`), about half of them in the 'future' mode. The output effect of skipping
    the last layer is exactly 0 where it is skipped at no measured position: it feeds nothing
    but the output at its own positions.

    `interventions` (`jaxdepth.core.sites`; default none) act on the clean run and on every
    skipped run: the user's first, then the skip (see `skipped_runs`). With `metric` (a
    `jaxdepth.Metric`, see `metric_changes`), returns `(later, output, metric_change [L, K])`:
    each member's `metric(skipped run) - metric(clean run)` at the positions the metric reads,
    positions before the split included (where the skip acts directly), both under
    `interventions`. A metric that reads the prompt's padding (reads='all') or its answer
    span's padding is refused before it is measured
    (`jaxdepth.analyses.metric_inputs.refuse_prompt_padding`, on the clean run's readout).
    """
    metric = None if metric is None else as_metric(metric, "layer skip")
    return _skip_effects(
        params, prompt, masks, config, skip, metric=metric, interventions=interventions, execution=execution
    )


# the clean run's readout, called on its own (for the padding check)
_clean_readout = partial(jit, static_argnames=("config", "metric"))(clean_readout)


def _skip_effects(params, prompt, masks, config, skip, *, metric, interventions, execution, label=0):
    """`skip_effects_of_prompt`, the prompt named `label` in a refusal of its metric."""
    L, K, T = config.num_layers, len(masks.skip), np.shape(prompt.tokens)[1]
    measure_masks, valid_host = np.asarray(masks.measure, bool), np.asarray(prompt.valid, bool)[0]
    # jax.device_put, not jnp.asarray: the latter compiles a program per shape to stage numpy data
    rows, members = jax.device_put(measured_rows(measure_masks, valid_host))
    device_masks = jax.device_put(SkipMasks(np.asarray(masks.skip), measure_masks))
    group = skipped_layer_groups(config, T, K, execution)
    later, output, changes = [], [], []
    for first in range(0, L, group):
        layers = np.minimum(np.arange(first, first + group), L - 1)  # the last call repeats layer L-1
        part_later, final, clean_final = skipped_runs(
            params,
            prompt,
            layers,
            device_masks,
            config,
            skip=skip.of_a_run(),
            chunk_size=execution.chunk_size,
            interventions=interventions,
        )
        keep = min(group, L - first)
        later.append(part_later[:keep])
        output.append(output_shifts(params, final, clean_final, rows, members, config)[:keep])
        if metric is not None and first == 0:  # the clean run's readout, before the metric reads any skipped run
            refuse_prompt_padding(
                metric,
                prompt,
                lambda: _clean_readout(params, clean_final[None], prompt, config, metric),  # only where padded
                analysis="layer skip",
                label=label,
            )
        if metric is not None:
            changes.append(metric_changes(params, final, clean_final, prompt, config, metric)[:keep])
    joined = lambda parts: np.concatenate([to_host(x) for x in parts])  # on the host: no eager programs
    later, output = joined(later), joined(output)
    last_unmeasured = ~np.any((np.asarray(masks.skip) > 0) & measure_masks & valid_host[None], axis=1)
    output[L - 1] = np.where(last_unmeasured, 0.0, output[L - 1])
    # No such zero for the metric: it reads the positions where the last layer is skipped too.
    return (later, output) if metric is None else (later, output, joined(changes))


@dataclasses.dataclass
class LayerSkipResult(SavedResult):
    """`later [L, L]`: effect of skipping layer s (row) on layer j's contribution (column);
    `output [L]`: effect on the output probabilities. Max over positions, split positions and
    prompts; per-prompt maxima and the split positions used are kept.

    `later[s, j]` is the largest relative change `||Δ_j - Δ̄_j|| / ||Δ_j||` of layer j's
    contribution Δ_j = h_{j+1} - h_j (Δ̄_j: with layer s skipped) over the measured positions:
    0 for j < s, and for j = s in the 'future' mode. `output[s]` is the largest
    `||y_p - ȳ_p||_2` between the output probability vectors without and with the skip.
    `later_per_prompt [N, L, L]` and `output_per_prompt [N, L]` are each prompt's maxima (zeros
    for a prompt too short for any split position); `split_positions [N, splits]` the t_s used
    (-1 where a prompt has fewer, and everywhere in the 'current' mode). `settings` holds
    'sublayer', 'mode', 'splits', 'seed', 'splits_per_prompt' and whatever the caller passed.

    Where a metric was given: `metric_change_per_prompt [N, L, splits]`, the change
    `metric(skipped) - metric(clean)` of every prompt, skipped layer and split position (in the
    order of `split_positions`, NaN where a prompt has fewer split positions; one column in the
    'current' mode), and `metric_change [L]`, per skipped layer the change of largest magnitude
    over prompts and split positions, with its sign (`largest_change`). None otherwise, and in
    results saved before they existed."""

    later: np.ndarray
    output: np.ndarray
    later_per_prompt: np.ndarray
    output_per_prompt: np.ndarray
    split_positions: np.ndarray
    settings: dict
    metric_change: Optional[np.ndarray] = None
    metric_change_per_prompt: Optional[np.ndarray] = None


def largest_change(changes: np.ndarray) -> np.ndarray:
    """`[L]` from `changes [N, L, splits]`: per layer, the entry of largest magnitude over prompts
    and splits, with its sign (a change can go either way: the largest |change| says how far
    skipping the layer can move the metric, as `output` is a maximum). NaN entries (splits a
    prompt does not have) are ignored; a layer with none at all gets NaN."""
    flat = np.moveaxis(changes, 1, 0).reshape(changes.shape[1], -1)  # [L, N * splits]
    magnitude = np.where(np.isnan(flat), -1.0, np.abs(flat))
    return np.take_along_axis(flat, np.argmax(magnitude, axis=1)[:, None], axis=1)[:, 0]


def member_masks(length: int, T: int, splits: Sequence[int], mode: str):
    """`(skip, measure)`: one `[T]` mask each per member of a prompt of `length` tokens padded
    to T: per split position t in the 'future' mode, one member in the 'current' mode."""
    pos = np.arange(T)
    if mode == "current":
        return [(pos >= 1) & (pos < length)], [pos < length]
    return [(pos >= 1) & (pos < t) for t in splits], [(pos >= t) & (pos < length) for t in splits]


def layer_skip(
    params,
    batch: PromptBatch,
    config: ModelConfig,
    skip: Skip = Skip(),
    *,
    metric: Optional[Metric] = None,
    interventions=None,
    execution: Execution = Execution(),
    settings=None,
    **loose,
) -> LayerSkipResult:
    """Layer-skip effects over a batch of prompts: one compiled sweep per prompt, shared by
    prompts of the same padded length. Returns a `LayerSkipResult` (its effects defined there).

    `skip` (`Skip`) says what is skipped and measured: the sublayer ('layer', the whole layer,
    attention and MLP; 'attn' or 'mlp'), the mode and the split positions.
    mode 'future' (default): skip before split positions, measure after them; the split
    positions are `skip.splits`: 'sampled' (default, `skip.splits_per_prompt` per prompt drawn
    with `skip.seed`) or 'answer_start' (one per prompt, its `batch.answer_start`;
    `split_positions` is then `[N, 1]`).
    mode 'current': skip every position but 0, measure every position; it has no split
    position.

    `execution` (`jaxdepth.Execution`) says how it runs: `chunk_size` and `memory_budget`
    (bytes; default a share of the free memory) bound how many skipped runs are vmapped at once
    (memory, not what is computed); `progress` shows a bar over the prompts. `settings` (a
    dict) is stored in the result. The keywords these once were on their own (`sublayer=`,
    `chunk_size=`, `progress=`, ...) are refused, with the value that says the same.

    `interventions` (`jaxdepth.core.sites`; default none) act on the clean run and on every
    skipped run, the user's first, then the skip (which so wins at its site): every effect is
    that of full forwards under the user's interventions, with and without the skip. Each prompt
    runs at its own padded length (`PromptBatch.single`), so intervention data indexed by
    position must broadcast to every length (`[L, 1]` keep-masks, head ablations, a vector added
    at every position); data that does not is refused at trace time.

    `metric` (default none): a `jaxdepth.Metric`, one value per prompt, read at the positions
    it declares (reads='last': each prompt's last real token; 'answer': its answer span, the
    answer tokens as `Readout.targets`; 'all': every position of the prompt at its padded
    length, `Readout.real` false at the padding), the clean run's logits there as
    `Readout.clean` where it says `clean=True`; define it once (it is a static argument: a new
    one compiles anew). The result's `metric_change_per_prompt` and `metric_change` then hold
    `metric(skipped) - metric(clean)` (see `LayerSkipResult`), positions before the split
    included. A metric that reads padding (of a reads='all' prompt, or of an answer span) is
    refused, a `ValueError` naming the prompt and its length, before it is measured
    (`jaxdepth.analyses.metric_inputs`). A plain function of the logits, the form this took
    before, is refused with the form to write instead (`jaxdepth.analyses.metrics.as_metric`).
    """
    _refuse_loose("layer_skip", loose)
    if not isinstance(skip, Skip):
        raise TypeError(f"layer_skip() takes what is skipped as a Skip, e.g. Skip(sublayer='attn'); got {skip!r}")
    metric = None if metric is None else as_metric(metric, "layer skip")
    L = config.num_layers
    lengths, mode = batch.lengths, skip.mode
    splits_per_prompt = 1 if skip.splits == "answer_start" else skip.splits_per_prompt
    positions = _split_positions_of(batch, skip.splits, seed=skip.seed, per_prompt=splits_per_prompt)
    n_splits = 1 if mode == "current" else splits_per_prompt
    later_pp = np.zeros((len(batch), L, L), np.float32)
    output_pp = np.zeros((len(batch), L), np.float32)
    metric_pp = None if metric is None else np.full((len(batch), L, n_splits), np.nan, np.float32)
    used = np.full((len(batch), splits_per_prompt), -1, np.int64)
    for i in track(range(len(batch)), execution.progress, f"layer skip ({skip.sublayer}, {mode})"):
        if mode == "future" and not positions[i]:
            continue  # prompt too short for any split position: it contributes nothing
        one = batch.single(i)
        Ti = one.tokens.shape[1]
        masks = _masks_of(int(lengths[i]), Ti, positions[i], mode, n_splits)
        chunk = execution.chunk_size or auto_chunk_size(config, Ti, n_splits, memory_budget=execution.memory_budget)
        later, output, *change = _skip_effects(
            params,
            _prompt_of(batch, i, one, metric),
            masks,
            config,
            skip,
            metric=metric,
            interventions=interventions,
            execution=execution.replace(chunk_size=chunk),
            label=i,
        )
        later_pp[i] = to_host(later).max(axis=1)
        output_pp[i] = to_host(output).max(axis=1)
        if metric is not None:
            real = 1 if mode == "current" else len(positions[i])  # the padding members repeat split 0
            metric_pp[i, :, :real] = to_host(change[0])[:, :real]
        if mode == "future":
            used[i, : len(positions[i])] = positions[i]
    if mode == "future" and (used < 0).all():
        raise ValueError(
            "no prompt has an answer token to measure"
            if skip.splits == "answer_start"
            else "every prompt is too short for a split position (needs more than 12 tokens)"
        )
    return LayerSkipResult(
        later=later_pp.max(axis=0),
        output=output_pp.max(axis=0),
        later_per_prompt=later_pp,
        output_per_prompt=output_pp,
        split_positions=used,
        settings={
            **(settings or {}),
            "sublayer": skip.sublayer,
            "mode": mode,
            "splits": skip.splits,
            "seed": skip.seed,
            "splits_per_prompt": splits_per_prompt,
        },
        metric_change=None if metric is None else largest_change(metric_pp),
        metric_change_per_prompt=metric_pp,
    )


def _masks_of(length: int, T: int, splits: Sequence[int], mode: str, n_splits: int) -> SkipMasks:
    """The `SkipMasks` of one prompt (`member_masks`), padded to `n_splits` members by
    repeating the first, so every prompt shares one compiled sweep (a repeated split changes no
    maximum)."""
    skip, measure = member_masks(length, T, splits, mode)
    skip += [skip[0]] * (n_splits - len(skip))
    measure += [measure[0]] * (n_splits - len(measure))
    return SkipMasks(np.stack(skip).astype(np.float32), np.stack(measure))


def _prompt_of(batch: PromptBatch, i: int, one: PromptBatch, metric: Optional[Metric]) -> PromptArrays:
    """Prompt i (`one`, `batch.single(i)`) as `PromptArrays`, with its answer span where the
    metric reads it (`PromptBatch.prompt`)."""
    if metric is not None and metric.reads == "answer":
        return batch.prompt(i)
    return PromptArrays(*jax.device_put((one.tokens, one.valid)))


@dataclasses.dataclass
class LayerSkipBySublayer(SavedResult):
    """Layer skip of several sublayers in one result: every array of `LayerSkipResult` with a
    leading sublayer axis, in the order of `sublayers` ('layer', 'attn', 'mlp'). The split
    positions are drawn once per run (same seed), so they are shared by every sublayer."""

    sublayers: list
    later: np.ndarray  # [S, L, L]
    output: np.ndarray  # [S, L]
    later_per_prompt: np.ndarray  # [S, N, L, L]
    output_per_prompt: np.ndarray  # [S, N, L]
    split_positions: np.ndarray  # [N, splits]
    settings: dict
    metric_change: Optional[np.ndarray] = None  # [S, L], where a metric was given
    metric_change_per_prompt: Optional[np.ndarray] = None  # [S, N, L, splits]

    def part(self, sublayer: str) -> LayerSkipResult:
        """The `LayerSkipResult` of one sublayer."""
        if sublayer not in self.sublayers:
            raise KeyError(f"no layer-skip result for sublayer {sublayer!r}; this one has {self.sublayers}")
        i = list(self.sublayers).index(sublayer)
        row = lambda x: None if x is None else x[i]
        return LayerSkipResult(
            later=self.later[i],
            output=self.output[i],
            later_per_prompt=self.later_per_prompt[i],
            output_per_prompt=self.output_per_prompt[i],
            split_positions=self.split_positions,
            settings={**self.settings, "sublayer": sublayer},
            metric_change=row(self.metric_change),
            metric_change_per_prompt=row(self.metric_change_per_prompt),
        )

    def parts(self) -> dict[str, LayerSkipResult]:
        """`{sublayer: LayerSkipResult}` in order (what `plots.layer_skip_figure` draws as rows)."""
        return {s: self.part(s) for s in self.sublayers}


def layer_skip_sublayers(
    params,
    batch: PromptBatch,
    config: ModelConfig,
    skip: Skip = Skip(),
    *,
    sublayers: Sequence[str] = tuple(SUBLAYERS),
    metric: Optional[Metric] = None,
    interventions=None,
    execution: Execution = Execution(),
    **loose,
) -> LayerSkipBySublayer:
    """`layer_skip` of each of `sublayers`, stacked on a leading sublayer axis: `skip` (its
    `sublayer` replaced by each), `metric`, `interventions` and `execution` as in `layer_skip`:
    the user's interventions first, then each skip."""
    _refuse_loose("layer_skip_sublayers", loose)
    sublayers = list(sublayers)
    if not sublayers or len(set(sublayers)) != len(sublayers) or not set(sublayers) <= set(SUBLAYERS):
        raise ValueError(f"sublayers must be distinct names among {tuple(SUBLAYERS)}, got {sublayers}")
    parts = [
        layer_skip(
            params,
            batch,
            config,
            dataclasses.replace(skip, sublayer=s),
            interventions=interventions,
            metric=metric,
            execution=execution,
        )
        for s in sublayers
    ]
    stack = lambda name: np.stack([getattr(p, name) for p in parts])
    common = {k: v for k, v in parts[0].settings.items() if k != "sublayer"}
    return LayerSkipBySublayer(
        sublayers=sublayers,
        later=stack("later"),
        output=stack("output"),
        later_per_prompt=stack("later_per_prompt"),
        output_per_prompt=stack("output_per_prompt"),
        split_positions=parts[0].split_positions,
        settings={**common, "sublayers": sublayers},
        metric_change=None if metric is None else stack("metric_change"),
        metric_change_per_prompt=None if metric is None else stack("metric_change_per_prompt"),
    )


# ----------------------------------------------------------------------------- figures

# Colour-scale percentile: one skipped-layer row of a layer-skip matrix is 2/L of its upper
# triangle, under 10% from L = 20 on.
LAYER_SKIP_PERCENTILE = 90.0


def layer_skip_figure(
    results: Union[LayerSkipResult, Mapping[str, LayerSkipResult]], *, title: Optional[str] = None
) -> Figure:
    """Effect of skipping layer s on every later layer's contribution (heatmap, s on the y axis,
    measured layer j on the x axis) and on the output (bars sharing the s axis), one row per
    sublayer when given a dict `name -> LayerSkipResult`. Cells zero by construction (j <= s in
    the 'future' mode, j < s in the 'current' mode, whose diagonal is measured) are drawn grey;
    all heatmaps share one colour scale so sublayers compare directly."""
    from jaxdepth.analyses import drawing as d

    if isinstance(results, LayerSkipResult):
        results = {results.settings.get("sublayer", "layer"): results}
    if not isinstance(results, Mapping):
        raise d.ResultTypeError(
            f"layer_skip_figure needs a LayerSkipResult or a dict of them, got {type(results).__name__}"
        )
    rows = dict(results)
    if not rows:
        raise ValueError("layer_skip_figure needs at least one LayerSkipResult")
    for name, result in rows.items():
        d.expect(result, LayerSkipResult, f"layer_skip_figure ({name!r})")
    import matplotlib
    import matplotlib.ticker

    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="0.85")  # grey: zero by construction
    # One scale for every sublayer, read from the cells that are not zero by construction: a
    # single extreme cell (skipping layer 0 often changes everything) would otherwise leave the
    # rest of the matrix one colour.
    # Grey: zero by causality (j <= s in the 'future' mode, j < s in the 'current' one).
    first = lambda r: 0 if r.settings.get("mode") == "current" else 1
    shown = {
        name: np.where(np.triu(np.ones_like(r.later, bool), k=first(r)), r.later, np.nan) for name, r in rows.items()
    }
    measured = np.concatenate([m[np.isfinite(m)] for m in shown.values()])
    vmax, clipped = d.robust_limit(measured, LAYER_SKIP_PERCENTILE)
    top = float(measured.max()) if measured.size else 0.0
    out_max = max(float(np.nanmax(r.output)) for r in rows.values()) or 1.0
    L = max(len(r.output) for r in rows.values())
    size = min(max(3.0, 0.12 * L + 2.0), 6.0)
    label = d.clipped_label(
        r"$\|\Delta_j - \bar{\Delta}_j\| \,/\, \|\Delta_j\|$ (max)", vmax, top, clipped, LAYER_SKIP_PERCENTILE
    )
    fig = d.new_figure(size * 1.75 + 1.5, size * len(rows) + 0.6)
    axes = fig.subplots(len(rows), 2, squeeze=False, width_ratios=[3, 1])
    for (name, result), (heat_ax, out_ax) in zip(rows.items(), axes):
        n = len(result.output)
        image = heat_ax.imshow(
            shown[name], origin="upper", interpolation="nearest", aspect="auto", cmap=cmap, vmin=0.0, vmax=vmax
        )
        try:
            score = f"depth score {depth_score(result.later):.2f}"
        except ValueError:
            score = "depth score undefined"
        mode = result.settings.get("mode")
        heat_ax.set(
            xlabel="measured layer j",
            ylabel="skipped layer s",
            title=f"{name}{f' ({mode})' if mode else ''}: later layers, {score}",
        )
        for axis in (heat_ax.xaxis, heat_ax.yaxis):  # layers: no ticks between them on a few-layer model
            axis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        # Horizontal bars share the skipped-layer axis, so row s of the heatmap and bar s align.
        out_ax.sharey(heat_ax)
        out_ax.barh(np.arange(n), result.output, color="C3", height=0.8)
        out_ax.set(xlabel=r"$\|y - \bar{y}\|_2$ (max)", title="output", xlim=(0, out_max * 1.05))
        out_ax.grid(axis="x", alpha=0.3)
        # Each heat map its own colour bar, beside it and exactly as tall (one shared scale, so
        # the bars are alike): a single bar under the heat maps left a blank band above it.
        bar = fig.colorbar(image, ax=heat_ax, pad=0.01, extend="max" if clipped else "neither", label=label)
        d.wrap_at_the_edge(bar.ax.yaxis.label)  # a short model's bar is shorter than its label
    d.title_figure(fig, "Effect of skipping a layer", title, next(iter(rows.values())).settings)
    return fig


# ----------------------------------------------------------------------------- in the suite


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerSkipSettings(Settings):
    """Layer skip's settings in a study (`Settings` and its options)."""

    skip_sublayers: tuple = option(
        tuple(SUBLAYERS), "what the layer-skip analysis skips: any of layer,attn,mlp (default: all three)"
    )
    skip_mode: str = option(
        "future",
        "layer skip: 'future' skips before split positions (--skip-split) and measures after them "
        "(the first study's main analysis); 'current' skips every position but 0 and measures every position",
        choices=MODES,
    )
    skip_split: str = option(
        "sampled",
        "future layer skip: split at 4 sampled positions per prompt (default, METHODS §3) or at the start of "
        "the answer (the first study's depth-against-difficulty runs)",
        choices=SPLITS,
    )

    def __post_init__(self):
        super().__post_init__()
        sublayers = tuple(self.skip_sublayers)
        if not sublayers or len(set(sublayers)) != len(sublayers) or not set(sublayers) <= set(SUBLAYERS):
            raise ValueError(f"--skip-sublayers takes layer, attn, mlp; got {','.join(sublayers)!r}")
        if self.skip_mode == "current" and self.skip_split != "sampled":
            raise ValueError(
                "--skip-split applies to --skip-mode future; the current mode skips and measures every position"
            )


def _skip_identity(s: LayerSkipSettings) -> dict:
    return {
        "seed": s.seed,
        "skip_sublayers": list(s.skip_sublayers),
        "skip_mode": s.skip_mode,
        # only when not the default: earlier results stay valid
        **({} if s.skip_split == "sampled" else {"skip_split": s.skip_split}),
    }


_SKIPPED = {"layer": "the layer", "attn": "its attention", "mlp": "its MLP"}


def depth_reading(result: LayerSkipBySublayer) -> DepthReading:
    """Per skipped sublayer, two curves over the skipped layer s at (s + 0.5) / L: its mean
    effect on the layers after it, e_s (what the depth score weighs,
    `jaxdepth.analyses.effective_depth.depth_effects`), and its effect on the output
    probabilities, `output[s]`. The last layer is left out where its value is fixed by
    construction: of e_s always (no layer after it), of the output in the 'future' mode (the
    positions it skips are read by no later layer)."""
    curves = {}
    future = result.settings.get("mode", "future") == "future"
    for sublayer, part in result.parts().items():
        L = len(part.output)
        x = (np.arange(L) + 0.5) / L
        output = np.asarray(part.output, np.float64)
        skipped = _SKIPPED.get(sublayer, sublayer)
        curves[f"skip_{sublayer}_later"] = DepthCurve(
            f"skipping {skipped}: effect on later layers", "e_s", x[:-1], depth_effects(part.later)[:-1]
        )
        curves[f"skip_{sublayer}_output"] = DepthCurve(
            f"skipping {skipped}: effect on the output",
            "||y - y'||_2",
            x[:-1] if future else x,
            output[:-1] if future else output,
        )
    return DepthReading(num_layers=len(result.output[0]), curves=curves)


ANALYSIS = Analysis(
    name="layer_skip",
    result_type=LayerSkipBySublayer,
    settings=LayerSkipSettings,
    identity=_skip_identity,
    run=lambda x: layer_skip_sublayers(
        x.model.params,
        x.batch,
        x.model.config,
        Skip(mode=x.settings.skip_mode, splits=x.settings.skip_split, seed=x.settings.seed),
        sublayers=x.settings.skip_sublayers,
        execution=Execution(progress=x.progress, memory_budget=x.settings.memory_budget),
    ),
    figures=lambda r, tokenizer, n: {"": layer_skip_figure(r.parts())},
    summary=lambda r: [f"depth score ({s} skipped) {depth_score(part.later):.2f}" for s, part in r.parts().items()],
    depth=depth_reading,
)
