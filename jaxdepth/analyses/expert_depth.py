"""How a mixture of experts uses its experts over depth: how sure each layer's router is, how
evenly its tokens spread over the experts, how much of its update its best expert makes, what
dropping one expert does to the later layers and to the output, and how far a skipped layer's
effect travels through the routing of the layers after it.

Per sparse layer l, over the prompts' valid tokens (N of them), with E experts of which the
router picks k per token (`jaxdepth.core.experts`); a dense layer among the sparse ones
(`ModelConfig.dense_layers`) has no router and no experts, and every measure of it is NaN
(its drops are not run; a skip of it is, and reroutes the sparse layers after it):

- router entropy: the mean over tokens of H(router_probs) in bits, and its ratio to log2 E (1:
  the router scores every expert alike; 0: it puts all its mass on one);
- load concentration: with p_e the share of the layer's k N assignments that go to expert e,
  the effective number of experts 1 / sum_e p_e^2 (E when the load is uniform, k when the same
  k experts take every token) and the largest share max_e p_e;
- the top expert's share of the update: per token ||w_1 y_1|| / sum_j ||w_j y_j||, the norm of
  its best expert's weighted output over the sum of the k chosen ones' (w_j the j-th chosen
  expert's weight, y_j its output, j = 1 the best), averaged over tokens (1/k where the k
  contribute alike, 1 where one does it all);
- dropping expert e of layer l (`jaxdepth.core.experts.drop_experts`: its weight zeroed at every
  position, the others' kept): the studies' layer skip over experts (METHODS §3, its 'current'
  variant, since the expert is dropped everywhere). `drop_later[l, e, j]` is the largest
  relative change ||Δ_j - Δ̄_j|| / ||Δ_j|| of layer j's contribution over the valid positions,
  exactly 0 for j < l (those layers see clean inputs; the diagonal j = l is the dropped
  expert's own share), and `drop_output[l, e]` the largest ||y_p - ȳ_p||_2 between the output
  probabilities without and with the drop; each the max over prompts, as `layer_skip`'s;
- routing travel: for each layer s skipped whole (`skip("delta", s, ...)`, as `layer_skip`
  skips it, in its 'current' mode by default: every position but 0, every position measured;
  or its 'future' mode: before sampled split positions, measured from them on), and each later
  layer l > s, the fraction of the measured tokens whose set of chosen experts at l differs from
  the clean run's; exactly 0 for l <= s (the router of layer s reads its input, which the skip
  does not change).

The drop sweep is one compiled program per prompt length: the layers one after another
(`lax.map`), each from its clean input (the layers before it are not rerun), its E drops a
stack of interventions vmapped in chunks (`jaxdepth.core.sweep.sweep`, the chunk from the
`jaxdepth.Execution`). The skip sweep is the same over skipped layers.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import TYPE_CHECKING, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from jaxdepth.analyses.layer_skip import MODES, SkipMasks, member_masks, sample_split_positions
from jaxdepth.analyses.stats import NORM_EPS, masked_max, norm, relative_norm
from jaxdepth.analyses.suite import Analysis, DepthCurve, DepthReading, Settings, option
from jaxdepth.core.batch import PromptArrays, PromptBatch
from jaxdepth.core.compilation import jit
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.execution import Execution, refuse_fields, refuse_loose_options
from jaxdepth.core.experts import drop_experts
from jaxdepth.core.layer import LayerRecord
from jaxdepth.core.loops import LayerRun, run_layers
from jaxdepth.core.model import embed, layer_inputs, unembed
from jaxdepth.core.progress import track
from jaxdepth.core.saved_result import SavedResult
from jaxdepth.core.sharding import to_host
from jaxdepth.core.sites import skip as skip_at
from jaxdepth.core.sweep import member_bytes, sweep

if TYPE_CHECKING:  # matplotlib is imported when a figure is drawn, not with the analysis
    from matplotlib.figure import Figure

__all__ = [
    "refuse_dense",
    "effective_experts",
    "router_statistics",
    "drop_expert_effects",
    "routing_changes",
    "ExpertSweeps",
    "ExpertDepthResult",
    "expert_depth",
    "expert_depth_figure",
    "depth_reading",
    "ExpertSettings",
    "SWEEPS",
    "ANALYSIS",
]

SWEEPS = ("drop", "skip")  # the sweeps beside the routing statistics: drop each expert, skip each layer


def refuse_dense(config: ModelConfig, what: str = "the experts analysis") -> None:
    """Refuse a model whose layers have a dense MLP (`ModelConfig.is_moe` false): a `ValueError`
    naming `what`, the model's type and what it needs."""
    if not config.is_moe:
        raise ValueError(
            f"{what} reads a mixture of experts, and this {config.model_type!r} model has a dense MLP in every "
            "layer (num_experts = 0): run it on a mixture of experts (Mixtral, Qwen3-MoE, OLMoE, GPT-OSS, DeepSeek-V3)"
        )


def effective_experts(shares) -> np.ndarray:
    """The effective number of experts `1 / sum_e p_e^2` of load shares `shares [..., E]` (each
    row summing to 1): E for a uniform load, k for k experts taking equal shares, 1 for one."""
    shares = np.asarray(shares, np.float64)
    return 1.0 / np.sum(shares * shares, axis=-1)


# ----------------------------------------------------------------------------- the routing


def _chosen_set(choice: Int[Array, "B T k"], num_experts: int) -> Bool[Array, "B T E"]:
    """Each token's chosen experts as a set (a mask over the E experts): the order of the k, by
    score, is not part of which experts run."""
    return jnp.any(choice[..., None] == jnp.arange(num_experts), axis=-2)


def _routing_tap(valid: Bool[Array, "B T"], config: ModelConfig):
    def tap(r: LayerRecord, _):
        p = r.router_probs.astype(jnp.float32)
        # 0 log 0 = 0: a score that underflowed to 0 adds nothing (and no NaN)
        entropy = -jnp.sum(jnp.where(p > 0, p * jnp.log2(jnp.where(p > 0, p, 1.0)), 0.0), axis=-1)
        weights = jnp.take_along_axis(r.expert_weights, r.expert_choice, axis=-1).astype(jnp.float32)
        parts = norm(r.expert_out.astype(jnp.float32) * weights[..., None])  # [B, T, k]: ||w_j y_j||
        top = parts[..., 0] / jnp.maximum(jnp.sum(parts, axis=-1), NORM_EPS)
        chosen = _chosen_set(r.expert_choice, config.num_experts) & valid[..., None]
        return entropy, top, jnp.sum(chosen, axis=1, dtype=jnp.int32)

    return tap


@partial(jit, static_argnames="config")
def router_statistics(params, tokens: Int[Array, "B T"], valid: Bool[Array, "B T"], config: ModelConfig):
    """One forward of a batch: `(entropy [L, B, T], top_share [L, B, T], counts [L, B, E])`,
    each token's router entropy in bits and its best expert's share of the update (module
    docstring), and each prompt's assignments to each expert over its valid tokens. Padded
    positions hold numbers of no prompt in the first two: leave them out."""
    return run_layers(params, embed(params, tokens, config), config, valid=valid, tap=_routing_tap(valid, config))[1]


# ----------------------------------------------------------------------------- the sweeps


def _probabilities(params, h, config: ModelConfig):
    return jax.nn.softmax(unembed(params, h, config).astype(jnp.float32), axis=-1)


def _change_tap(measured: Bool[Array, "1 T"]):
    def tap(r: LayerRecord, clean_delta):
        return masked_max(relative_norm(clean_delta - r.delta, clean_delta), measured)  # [1]

    return tap


@partial(jit, static_argnames=("config", "chunk_size"))
def drop_expert_effects(params, prompt: PromptArrays, layers, config: ModelConfig, *, chunk_size: Optional[int] = None):
    """Drop each expert of each of `layers [G]` in turn, at every position of one prompt
    (`PromptArrays`: `tokens`, `valid` `[1, T]`): `(later [G, E, L], output [G, E])`, the
    largest relative change of every layer's contribution and the largest shift of the output
    probabilities over the valid positions (module docstring), `later[g, e, j]` exactly 0 for
    j < layers[g]. The layers run one after another, each from its clean input; its E drops are
    one stack of interventions, `chunk_size` of them vmapped at once (None: all)."""
    L, E = config.num_layers, config.num_experts
    tokens, valid = prompt.tokens, prompt.valid
    starts, clean_final, clean_deltas = layer_inputs(params, tokens, config, valid=valid, tap=lambda r, _: r.delta)
    clean = _probabilities(params, clean_final, config)

    def of_layer(layer):
        def member(mask):
            h, later = run_layers(
                params,
                starts[layer],
                config,
                valid=valid,
                interventions=drop_experts(layer, mask),
                tap=_change_tap(valid),
                tap_inputs=clean_deltas,
                run=LayerRun(start=layer),
            )
            later = jnp.where(jnp.arange(L) >= layer, later[:, 0], 0.0)  # exact zeros by causality
            return later, masked_max(norm(_probabilities(params, h, config) - clean), valid)[0]

        return sweep(member, jnp.eye(E, dtype=jnp.float32), chunk_size)

    return jax.lax.map(of_layer, layers)


@partial(jit, static_argnames=("config", "chunk_size"))
def routing_changes(
    params, prompt: PromptArrays, layers, masks: SkipMasks, config: ModelConfig, *, chunk_size: Optional[int] = None
):
    """Skip each of `layers [G]` whole under K position masks (`SkipMasks`: `skip [K, T]`, 1
    where member k skips, `measure [K, T]`, where it is measured), on one prompt: `(changed
    [G, K, L], measured [K])`, the count of measured valid tokens whose set of chosen experts at
    each layer differs from the clean run's, exactly 0 at the layers up to the skipped one, and
    the count of measured valid tokens of each member. Each skipped layer runs from its clean
    input; its K members are vmapped `chunk_size` at a time (None: all)."""
    L, E = config.num_layers, config.num_experts
    tokens, valid = prompt.tokens, prompt.valid
    starts, _, clean_sets = layer_inputs(
        params, tokens, config, valid=valid, tap=lambda r, _: _chosen_set(r.expert_choice, E)
    )

    def of_layer(layer):
        def member(m):
            keep, measure = m
            seen = measure[None] & valid

            def tap(r: LayerRecord, clean):
                differs = jnp.any(_chosen_set(r.expert_choice, E) != clean, axis=-1)
                return jnp.sum(differs & seen, dtype=jnp.int32)

            _, changed = run_layers(
                params,
                starts[layer],
                config,
                valid=valid,
                interventions=skip_at("delta", layer, keep),
                tap=tap,
                tap_inputs=clean_sets,
                run=LayerRun(start=layer),
            )
            return jnp.where(jnp.arange(L) > layer, changed, 0)  # the routing up to layer s reads clean inputs

        return sweep(member, (masks.skip, masks.measure), chunk_size)

    return jax.lax.map(of_layer, layers), jnp.sum(masks.measure & valid, axis=-1, dtype=jnp.int32)


# ----------------------------------------------------------------------------- the analysis


@dataclasses.dataclass(frozen=True)
class ExpertSweeps:
    """What the sweeps beside the routing statistics run (how they run is a `jaxdepth.Execution`).

    drop: drop each expert of each layer (the drop effects). skip: skip each layer whole and
        count the tokens whose experts change later (the routing travel).
    mode: the skip's positions, as `layer_skip.Skip`'s: 'current' (default: every position but
        0, every position measured, as the drops act everywhere; no prompt is too short) or
        'future' (skipped before `splits_per_prompt` split positions per prompt drawn with
        `seed`, measured from each on, METHODS §3).
    prompts: the sweeps run on the first this many prompts (None: all); the routing statistics
        always read every prompt."""

    drop: bool = True
    skip: bool = True
    mode: str = "current"
    seed: int = 123
    splits_per_prompt: int = 4
    prompts: Optional[int] = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.splits_per_prompt < 1:
            raise ValueError(f"splits_per_prompt must be >= 1, got {self.splits_per_prompt}")
        if self.prompts is not None and self.prompts < 1:
            raise ValueError(f"prompts must be >= 1 or None (all), got {self.prompts}")


@dataclasses.dataclass
class ExpertDepthResult(SavedResult):
    """How a mixture of experts of `num_layers` L layers, `num_experts` E experts and
    `experts_per_token` k routes N prompts (module docstring: the definitions).

    Per prompt (over its valid tokens, `lengths [N]`): `entropy_per_prompt [N, L]` (the mean
    router entropy in bits), `top_share_per_prompt [N, L]` (the mean share of the best expert)
    and `expert_counts [N, L, E]` (each expert's assignments). Of the first M prompts the sweeps
    ran on (None where a sweep did not run): `drop_later_per_prompt [M, L, E, L]` and
    `drop_output_per_prompt [M, L, E]` (each prompt's largest effects of dropping expert e of
    layer l), `routing_changed [M, L, L]` (per skipped layer s and later layer l, the tokens
    whose chosen experts changed, summed over the prompt's split members) and
    `routing_measured [M]` (the tokens measured, likewise summed); `split_positions [M, splits]`
    the future mode's t_s (-1 where a prompt has fewer; None in the current mode);
    `dense_layers` the layers without experts, NaN in every per-layer measure. The
    properties pool them: token means and shares over every prompt, maxima over prompts.
    `settings`: the sweeps' (`ExpertSweeps`) and what the caller passed."""

    entropy_per_prompt: np.ndarray
    top_share_per_prompt: np.ndarray
    expert_counts: np.ndarray
    lengths: np.ndarray
    num_layers: int
    num_experts: int
    experts_per_token: int
    settings: dict
    drop_later_per_prompt: Optional[np.ndarray] = None
    drop_output_per_prompt: Optional[np.ndarray] = None
    routing_changed: Optional[np.ndarray] = None
    routing_measured: Optional[np.ndarray] = None
    split_positions: Optional[np.ndarray] = None
    dense_layers: list = dataclasses.field(default_factory=list)

    def _token_mean(self, per_prompt: np.ndarray) -> np.ndarray:
        n = np.asarray(self.lengths, np.float64)
        return (np.asarray(per_prompt, np.float64) * n[:, None]).sum(axis=0) / n.sum()

    @property
    def entropy(self) -> np.ndarray:
        """`[L]`: the router entropy in bits, the mean over every valid token of every prompt."""
        return self._token_mean(self.entropy_per_prompt)

    @property
    def entropy_ratio(self) -> np.ndarray:
        """`[L]`: `entropy` over log2 E, in [0, 1] (1: a uniform router)."""
        return self.entropy / math.log2(self.num_experts)

    @property
    def shares(self) -> np.ndarray:
        """`[L, E]`: p_e, each expert's share of the layer's k N assignments over every prompt."""
        counts = np.asarray(self.expert_counts, np.float64).sum(axis=0)
        total = counts.sum(axis=-1, keepdims=True)  # 0 in a dense layer: NaN there
        return np.divide(counts, total, out=np.full_like(counts, np.nan), where=total > 0)

    @property
    def effective_experts(self) -> np.ndarray:
        """`[L]`: 1 / sum_e p_e^2, between k and E (`effective_experts`)."""
        return effective_experts(self.shares)

    @property
    def largest_share(self) -> np.ndarray:
        """`[L]`: max_e p_e, the share of the busiest expert."""
        return self.shares.max(axis=-1)

    @property
    def top_share(self) -> np.ndarray:
        """`[L]`: the best expert's share of the update, the mean over every valid token."""
        return self._token_mean(self.top_share_per_prompt)

    @property
    def drop_later(self) -> Optional[np.ndarray]:
        """`[L, E, L]`: the largest relative change of layer j's contribution when expert e of
        layer l is dropped, over the prompts (None without the drop sweep)."""
        return None if self.drop_later_per_prompt is None else self.drop_later_per_prompt.max(axis=0)

    @property
    def drop_output(self) -> Optional[np.ndarray]:
        """`[L, E]`: the largest output shift when expert e of layer l is dropped, over the
        prompts (None without the drop sweep)."""
        return None if self.drop_output_per_prompt is None else self.drop_output_per_prompt.max(axis=0)

    def drop_after(self) -> Optional[np.ndarray]:
        """`[L, E]`: per dropped expert, its largest effect on a layer after its own, max over
        j > l of `drop_later` (NaN for the last layer, which has none; None without the drop
        sweep). What the figure draws: the diagonal j = l is the dropped share itself."""
        later = self.drop_later
        if later is None:
            return None
        L = self.num_layers
        after = np.arange(L)[None, :] > np.arange(L)[:, None]  # [l, j]
        masked = np.where(after[:, None, :], later, -np.inf).max(axis=-1)
        return np.where(np.isfinite(masked), masked, np.nan)

    @property
    def routing_travel(self) -> Optional[np.ndarray]:
        """`[L, L]`: per skipped layer s (row) and layer l (column), the fraction of the measured
        tokens of every swept prompt whose chosen experts at l differ from the clean run's; 0 for
        l <= s (None without the skip sweep)."""
        if self.routing_changed is None:
            return None
        measured = float(np.sum(self.routing_measured))
        travel = np.asarray(self.routing_changed, np.float64).sum(axis=0) / max(measured, 1.0)
        travel[:, self.dense_layers] = np.nan  # no routing there to change
        return travel


def _refuse_loose(options: dict) -> None:
    refuse_fields("expert_depth", options, ExpertSweeps, "sweeps=ExpertSweeps", "what the sweeps run")
    refuse_loose_options("expert_depth", options)


def _future_masks(length: int, T: int, splits: list, count: int) -> SkipMasks:
    """The future mode's `SkipMasks` of one prompt, padded to `count` members that measure
    nothing (counted tokens are summed: a repeated member would count twice)."""
    skip, measure = member_masks(length, T, splits, "future")
    skip += [skip[0]] * (count - len(skip))
    measure += [np.zeros(T, bool)] * (count - len(measure))
    return SkipMasks(np.stack(skip).astype(np.float32), np.stack(measure))


def _routing_statistics(params, batch: PromptBatch, config: ModelConfig):
    """`(entropy [N, L], top_share [N, L], counts [N, L, E])`: the routing statistics of every
    prompt, one forward per group of prompts of similar length."""
    N, L, E = len(batch), config.num_layers, config.num_experts
    entropy, top, counts = np.zeros((N, L)), np.zeros((N, L)), np.zeros((N, L, E), np.int64)
    for index, group in batch.groups():
        valid = np.asarray(group.valid)
        e, t, c = (to_host(x) for x in router_statistics(params, group.tokens, group.valid, config))
        n = valid.sum(axis=1)
        mean = lambda x: (np.einsum("lbt,bt->bl", x.astype(np.float64), valid) / n[:, None])[: len(index)]  # noqa: E731
        entropy[index], top[index] = mean(e), mean(t)
        counts[index] = c.transpose(1, 0, 2)[: len(index)]
    return entropy, top, counts


def expert_depth(
    params,
    batch: PromptBatch,
    config: ModelConfig,
    sweeps: ExpertSweeps = ExpertSweeps(),
    *,
    execution: Execution = Execution(),
    settings: Optional[dict] = None,
    **loose,
) -> ExpertDepthResult:
    """How the mixture of experts of `config` routes the prompts of `batch` over its depth
    (module docstring): the routing statistics of every prompt, and the sweeps `sweeps` says
    (`ExpertSweeps`: dropping each expert of each layer, skipping each layer) on its first
    `sweeps.prompts` prompts, each prompt at its own padded length. A dense model is refused
    (`refuse_dense`).

    `execution` (`jaxdepth.Execution`) says how the sweeps run: `chunk_size` drops (or skip
    members) vmapped at once (default: what `memory_budget` holds, read once for the whole
    run so that every prompt of a length shares one program), `progress` a bar over the
    prompts. `settings` (a dict) is stored in the result."""
    _refuse_loose(loose)
    if not isinstance(sweeps, ExpertSweeps):
        raise TypeError(f"expert_depth() takes what the sweeps run as an ExpertSweeps, got {sweeps!r}")
    refuse_dense(config)
    L, E = config.num_layers, config.num_experts
    entropy, top, counts = _routing_statistics(params, batch, config)
    M = len(batch) if sweeps.prompts is None else min(sweeps.prompts, len(batch))
    lengths = np.asarray(batch.lengths)
    future = sweeps.mode == "future"
    K = sweeps.splits_per_prompt if future else 1
    dense, sparse = list(config.dense_layers), np.asarray(config.expert_layers, np.int32)
    entropy[:, dense] = top[:, dense] = np.nan
    counts[:, dense] = 0  # a dense layer's record holds zeros, which read as expert 0
    drop_later = np.full((M, L, E, L), np.nan, np.float32) if sweeps.drop else None
    drop_output = np.full((M, L, E), np.nan, np.float32) if sweeps.drop else None
    changed = np.zeros((M, L, L), np.int64) if sweeps.skip else None
    measured = np.zeros(M, np.int64) if sweeps.skip else None
    splits = sample_split_positions(lengths[:M], seed=sweeps.seed, per_prompt=K) if sweeps.skip and future else None
    used = np.full((M, K), -1, np.int64) if splits is not None else None
    if sweeps.drop or sweeps.skip:
        execution = execution.replace(memory_budget=execution.budget())  # one budget, so one chunk size per length
        layers, dropped = jax.device_put(np.arange(L, dtype=np.int32)), jax.device_put(sparse)
        for i in track(range(M), execution.progress, "experts: drops and skips"):
            one = batch.single(i)
            T = one.tokens.shape[1]
            prompt = PromptArrays(*jax.device_put((one.tokens, one.valid)))
            per_member = member_bytes(config, T)
            if sweeps.drop:
                chunk = execution.chunk(E, per_member)
                later, output = drop_expert_effects(params, prompt, dropped, config, chunk_size=chunk)
                drop_later[i, sparse], drop_output[i, sparse] = to_host(later), to_host(output)
            if sweeps.skip and not (future and not splits[i]):  # a prompt too short for a split: nothing
                if future:
                    masks = _future_masks(int(lengths[i]), T, splits[i], K)
                    used[i, : len(splits[i])] = splits[i]
                else:
                    skip, measure = member_masks(int(lengths[i]), T, [], "current")
                    masks = SkipMasks(np.stack(skip).astype(np.float32), np.stack(measure))
                chunk = execution.chunk(K, per_member)
                count, seen = routing_changes(params, prompt, layers, jax.device_put(masks), config, chunk_size=chunk)
                changed[i], measured[i] = to_host(count).sum(axis=1), to_host(seen).sum()
        if sweeps.skip and future and M and (used < 0).all():
            raise ValueError(
                "every swept prompt is too short for a split position (needs more than 12 tokens): "
                "use ExpertSweeps(mode='current')"
            )
    return ExpertDepthResult(
        entropy_per_prompt=entropy,
        top_share_per_prompt=top,
        expert_counts=counts,
        lengths=lengths.astype(np.int64),
        num_layers=L,
        num_experts=E,
        experts_per_token=config.experts_per_token,
        settings={
            **(settings or {}),
            "sweeps": [name for name in SWEEPS if getattr(sweeps, name)],
            "mode": sweeps.mode,
            "seed": sweeps.seed,
            "splits_per_prompt": K,
            "sweep_prompts": M,
        },
        drop_later_per_prompt=drop_later,
        drop_output_per_prompt=drop_output,
        routing_changed=changed,
        routing_measured=measured,
        split_positions=used,
        dense_layers=dense,
    )


# ----------------------------------------------------------------------------- figure, summary

# Colour-scale percentile of the heat map: one dominant expert is 1/E of a layer's column.
HEAT_PERCENTILE = 95.0


def _heat_panel(fig, ax, result: ExpertDepthResult, heat: str):
    """The fourth panel: the drop effects [layer x expert] or the routing travel [s x l], both
    over relative depth; cells with nothing to measure grey."""
    import matplotlib
    import matplotlib.ticker

    from jaxdepth.analyses import drawing as d

    L, E = result.num_layers, result.num_experts
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="0.85")
    if heat == "drop":
        values = result.drop_after().T  # [E, L]: experts up, layers across
        extent, ylabel = (0.0, 1.0, -0.5, E - 0.5), "dropped expert e"
        label = r"max$_{j>l}$ $\|\Delta_j - \bar{\Delta}_j\| / \|\Delta_j\|$"
        title, origin = "dropping one expert: later layers", "lower"
        xlabel = "relative depth of its layer"
    else:
        travel = result.routing_travel
        values = np.where(np.arange(L)[None, :] > np.arange(L)[:, None], travel, np.nan)  # [s, l]
        extent, ylabel = (0.0, 1.0, 1.0, 0.0), "skipped layer s / L"
        label, title, origin = "share of the tokens routed anew", "a skipped layer: later routing", "upper"
        xlabel = "layer l / L"
    vmax, clipped = d.robust_limit(values, HEAT_PERCENTILE)
    finite = values[np.isfinite(values)]
    top = float(finite.max()) if finite.size else 0.0
    image = ax.imshow(
        np.ma.masked_invalid(values),
        origin=origin,
        extent=extent,
        aspect="auto",
        interpolation="nearest",
        cmap=cmap,
        vmin=0.0,
        vmax=vmax,
    )
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title, xlim=(0, 1))
    if heat == "drop":
        ax.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    bar = fig.colorbar(
        image,
        ax=ax,
        pad=0.01,
        extend="max" if clipped else "neither",
        label=d.clipped_label(label, vmax, top, clipped, HEAT_PERCENTILE),
    )
    d.wrap_at_the_edge(bar.ax.yaxis.label)


def expert_depth_figure(result: ExpertDepthResult, *, heat: str = "drop", title: Optional[str] = None) -> Figure:
    """Four panels over relative depth (layer l at (l + 0.5) / L): the router's entropy over
    log2 E, the effective number of experts over E (and the busiest expert's share), the best
    expert's share of the update (each pooled over every token, faint: each prompt's), and a heat
    map: `heat='drop'` (default) the largest effect on a later layer of dropping each expert of
    each layer, `'routing'` the share of tokens whose experts change at layer l when layer s is
    skipped (where the result has that sweep; the other one otherwise, or a note)."""
    from jaxdepth.analyses import drawing as d

    d.expect(result, ExpertDepthResult, "expert_depth_figure")
    if heat not in ("drop", "routing"):
        raise ValueError(f"heat must be 'drop' or 'routing', got {heat!r}")
    available = [
        h
        for h, there in (("drop", result.drop_later_per_prompt), ("routing", result.routing_changed))
        if there is not None
    ]
    L, E, k = result.num_layers, result.num_experts, result.experts_per_token
    x = (np.arange(L) + 0.5) / L
    fig = d.new_figure(17, 4.3)
    entropy_ax, load_ax, top_ax, heat_ax = fig.subplots(1, 4, width_ratios=[1, 1, 1, 1.25])
    d.draw_per_prompt(entropy_ax, x, result.entropy_per_prompt / math.log2(E), "C0")
    entropy_ax.plot(x, result.entropy_ratio, color="C0", linewidth=2, marker=".", label="every token")
    entropy_ax.axhline(1.0, color="0.5", linestyle=":", label="uniform router")
    entropy_ax.set(ylabel=r"H(router) / log$_2$ E", title="router entropy")
    load_ax.plot(x, result.effective_experts / E, color="C1", linewidth=2, marker=".", label="effective experts / E")
    load_ax.plot(x, result.largest_share, color="C1", linestyle="--", label="busiest expert's share")
    load_ax.axhline(k / E, color="0.5", linestyle=":", label=f"k / E: the same {k} for every token")
    load_ax.set(ylabel="share", title=f"load over the {E} experts")
    d.draw_per_prompt(top_ax, x, result.top_share_per_prompt, "C2")
    top_ax.plot(x, result.top_share, color="C2", linewidth=2, marker=".", label="every token")
    top_ax.axhline(1.0 / k, color="0.5", linestyle=":", label=f"1/k: {k} alike")
    top_ax.set(ylabel=r"$\|w_1 y_1\| \,/\, \Sigma_j \|w_j y_j\|$", title="the best expert's share")
    for ax in (entropy_ax, load_ax, top_ax):
        ax.set(xlabel="relative depth (l + 0.5) / L", xlim=(0, 1), ylim=(0, 1.05))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    if available:
        _heat_panel(fig, heat_ax, result, heat if heat in available else available[0])
    else:
        heat_ax.text(0.5, 0.5, "no sweep was run", ha="center", va="center", transform=heat_ax.transAxes)
        heat_ax.set(xticks=[], yticks=[], title="sweeps")
    d.title_figure(
        fig, f"How the mixture of experts is used over depth (L = {L}, E = {E}, k = {k})", title, result.settings
    )
    return fig


def _summary(result: ExpertDepthResult) -> list[str]:
    """The mean entropy ratio, effective experts and top share over the layers, and the largest
    effects of the sweeps that ran."""
    E, k = result.num_experts, result.experts_per_token
    lines = [
        f"router entropy {np.nanmean(result.entropy_ratio):.2f} of log2 E",
        f"effective experts {np.nanmean(result.effective_experts):.1f} of {E} (k = {k})",
        f"best expert {np.nanmean(result.top_share):.0%} of the update",
    ]
    if result.drop_output is not None:
        l, e = np.unravel_index(np.nanargmax(result.drop_output), result.drop_output.shape)
        shift = np.nanmax(result.drop_output)
        lines.append(f"dropping one expert shifts the output by up to {shift:.3g} (layer {l}, expert {e})")
    travel = result.routing_travel
    if travel is not None:
        s, l = np.unravel_index(np.nanargmax(travel), travel.shape)
        most = np.nanmax(travel)
        lines.append(f"a skipped layer reroutes up to {most:.0%} of a later layer's tokens (layer {s} -> {l})")
    return lines


def depth_reading(result: ExpertDepthResult) -> DepthReading:
    """The router's entropy ratio, the effective experts over E and the best expert's share,
    per layer on the relative-depth axis."""
    L = result.num_layers
    x = (np.arange(L) + 0.5) / L
    return DepthReading(
        num_layers=L,
        curves={
            "router_entropy": DepthCurve("router entropy", "H / log2 E", x, result.entropy_ratio),
            "effective_experts": DepthCurve(
                "effective experts", "share of E", x, result.effective_experts / result.num_experts
            ),
            "top_expert_share": DepthCurve("the best expert's share of the update", "share", x, result.top_share),
        },
    )


# ----------------------------------------------------------------------------- in the suite


def _parse_sweeps(text: str) -> tuple:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    return () if names == ("none",) else names


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExpertSettings(Settings):
    """The experts analysis's settings in a study (`Settings` and its options)."""

    experts_sweeps: tuple = option(
        SWEEPS,
        "experts: the sweeps beside the routing statistics, any of drop,skip (drop each expert of each layer; "
        "skip each layer and count the tokens routed anew after it), or none",
        parse=_parse_sweeps,
    )
    experts_skip_mode: str = option(
        "current",
        "experts: the skipped layer's positions, as --skip-mode's: 'current' (every position but 0) or 'future' "
        "(before sampled split positions, measured from them on)",
        choices=MODES,
    )
    experts_sweep_prompts: int = option(
        -1, "experts: the sweeps run on the first this many prompts (-1: all; the routing statistics read all)"
    )

    def __post_init__(self):
        super().__post_init__()
        if len(set(self.experts_sweeps)) != len(self.experts_sweeps) or not set(self.experts_sweeps) <= set(SWEEPS):
            raise ValueError(f"--experts-sweeps takes drop, skip or none; got {','.join(self.experts_sweeps)!r}")
        if self.experts_sweep_prompts < 1 and self.experts_sweep_prompts != -1:
            raise ValueError(f"--experts-sweep-prompts must be -1 (all) or >= 1, got {self.experts_sweep_prompts}")

    def sweeps(self) -> ExpertSweeps:
        """These settings as the `ExpertSweeps` of `expert_depth`."""
        return ExpertSweeps(
            drop="drop" in self.experts_sweeps,
            skip="skip" in self.experts_sweeps,
            mode=self.experts_skip_mode,
            seed=self.seed,
            prompts=None if self.experts_sweep_prompts == -1 else self.experts_sweep_prompts,
        )


def _identity(s: ExpertSettings) -> dict:
    future = "skip" in s.experts_sweeps and s.experts_skip_mode == "future"
    return {
        "experts_sweeps": list(s.experts_sweeps),
        "experts_skip_mode": s.experts_skip_mode,
        "experts_sweep_prompts": s.experts_sweep_prompts,
        **({"seed": s.seed} if future else {}),  # the seed draws the future mode's split positions alone
    }


def _run(x) -> ExpertDepthResult:
    config = x.model.config
    source = getattr(x.model, "source", None)
    refuse_dense(config, f"the experts analysis (--analyses experts){f' of {source}' if source else ''}")
    return expert_depth(
        x.model.params,
        x.batch,
        config,
        x.settings.sweeps(),
        execution=Execution(progress=x.progress, memory_budget=x.settings.memory_budget),
    )


ANALYSIS = Analysis(
    name="experts",
    default=False,  # in the suite, run when named: `--analyses experts`
    result_type=ExpertDepthResult,
    settings=ExpertSettings,
    identity=_identity,
    run=_run,
    figures=lambda r, tokenizer, n: {"": expert_depth_figure(r)},
    summary=_summary,
    depth=depth_reading,
)
