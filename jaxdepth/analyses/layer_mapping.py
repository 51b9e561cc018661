"""Linear maps between the residual streams of two models (first study, Analysis 5).

For a smaller model (boundaries m = 0..L_s, `residual_stream` rows: 0 = embeddings, k = output
of layer k-1) and a larger one sharing its tokenizer (boundaries l = 0..L_l), fit for every pair
(m, l) an affine map `f(h) = h W + c` from h_m (width D_s) to h_l (width D_l) by ridge least
squares on the tokens of some prompts, and measure on held-out tokens the relative error

    E[m, l] = sqrt( sum_t ||h_l[t] - f(h_m[t])||^2 / sum_t ||h_l[t]||^2 ),

summed over every held-out token (token-weighted: long prompts count more; the denominator is
the uncentered norm of the target, so E = 1 is the error of predicting zero, and the error of
predicting the training mean is reported beside it as `baseline`). If the larger model spreads
the smaller one's computation over more layers, row m is best predicted near l = m * L_l / L_s.

The fit, in closed form
-----------------------
The bias is removed by centering with the training means: `W = (X^T X + lam I)^-1 X^T Y`, `c =
mean(y) - mean(x) W`, X and Y the centered training residuals. The ridge is relative to the
feature scale: `lam_m = ridge * trace(X_m^T X_m) / D_s`, the mean eigenvalue of the Gram times
`ridge`, so one setting means the same for every boundary, model, token count and residual
magnitude (residual norms grow by orders of magnitude with depth). It bounds the condition number
of the system at D_s / ridge + 1, which float32 Cholesky factorises safely; the default 1e-3
halves (or shrinks more) only directions whose variance is below 0.1% of the mean eigenvalue.

Sufficient statistics
---------------------
Nothing holds all tokens of all layers. Training tokens are folded into `MappingStatistics`
(count, means, the centered Gram `X_m^T X_m` of every small boundary and the centered
cross-products `X_m^T Y_l` of every pair, `[L_s+1, D_s, L_l+1, D_l]`), batch by batch, with the
pairwise update of Chan, Golub and LeVeque (exact, and stable in float32 where subtracting
`n * mean mean^T` from raw sums is not: residuals have means far larger than their spread in
some channels). The held-out pass never forms W either: for each small boundary m it solves the
Cholesky factor once against the held-out tokens and multiplies by the stacked cross-products of
every large boundary at once, accumulating the squared errors (`ErrorSums`).

Memory and sharding: the cross-products take (L_s+1) D_s (L_l+1) D_l float32 (1.3 GB for
SmolLM2-135M onto itself, 45 GB for Qwen2.5-1.5B onto Qwen2.5-14B). Every function here is pure
and jittable and takes arrays that may be sharded: place `MappingStatistics.xy` with its last
(D_l) axis split over the mesh and the updates, the solves and the error sums run where the data
lives (the error sums reduce over D_l, one all-reduce of `[L_s+1, L_l+1]` scalars). The update
walks the small boundaries in a `fori_loop` writing into the carried buffer in place, so a step
needs one `[D_s, L_l+1, D_l]` slice of scratch, not a second copy of the statistics. Products
run at `Precision.HIGHEST`: on accelerators the default float32 matmul rounds its inputs to
bf16 or tf32, too coarse for a Gram matrix that is then inverted.

Over prompts: `compute_mapping` runs both models on each prompt (one jitted call each, prompts
padded to `PAD_TO`), folds the training prompts into the statistics, fits, and measures the
held-out ones; `jaxdepth map` (`jaxdepth.lab.mapping_study`) caches, saves and draws the result.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float

from jaxdepth.core.execution import Execution, refuse_loose_options
from jaxdepth.core.progress import track
from jaxdepth.core.batch import LengthBuckets, PromptBatch
from jaxdepth.core.compilation import jit
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.model import residual_stream
from jaxdepth.core.saved_result import SavedResult
from jaxdepth.core.sharding import to_host

__all__ = [
    "compute_mapping",
    "LayerMappingResult",
    "MappingSettings",
    "MappingStatistics",
    "empty_statistics",
    "accumulate_statistics",
    "place_statistics",
    "MappingFit",
    "fit_maps",
    "linear_maps",
    "ErrorSums",
    "empty_errors",
    "accumulate_errors",
    "relative_errors",
    "mapping_result",
    "best_match",
    "equal_relative_depth",
    "PAD_TO",
]

HIGHEST = jax.lax.Precision.HIGHEST
DEFAULT_RIDGE = 1e-3


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MappingStatistics:
    """Sufficient statistics of the training tokens: `count` (a float scalar), the means
    `x_mean [Ms, Ds]` (small boundaries) and `y_mean [Ml, Dl]` (large), the centered Gram
    `xx [Ms, Ds, Ds]` and the centered cross-products `xy [Ms, Ds, Ml, Dl]`; Ms = L_s + 1,
    Ml = L_l + 1. All float32."""

    count: Float[Array, ""]
    x_mean: Float[Array, "Ms Ds"]
    y_mean: Float[Array, "Ml Dl"]
    xx: Float[Array, "Ms Ds Ds"]
    xy: Float[Array, "Ms Ds Ml Dl"]


def empty_statistics(
    small_boundaries: int, small_width: int, large_boundaries: int, large_width: int
) -> MappingStatistics:
    """Statistics of no tokens, to accumulate into."""
    Ms, Ds, Ml, Dl = small_boundaries, small_width, large_boundaries, large_width
    z = lambda *shape: jnp.zeros(shape, jnp.float32)  # noqa: E731
    return MappingStatistics(z(), z(Ms, Ds), z(Ml, Dl), z(Ms, Ds, Ds), z(Ms, Ds, Ml, Dl))


def _batch_mean(x: Float[Array, "M N D"], mask: Bool[Array, " N"], count) -> Float[Array, "M D"]:
    return jnp.sum(jnp.where(mask[None, :, None], x, 0.0), axis=1) / jnp.maximum(count, 1.0)


def accumulate_statistics(
    stats: MappingStatistics, xs: Float[Array, "Ms N Ds"], ys: Float[Array, "Ml N Dl"], mask: Bool[Array, " N"]
) -> MappingStatistics:
    """`stats` with the tokens where `mask` is true added: `xs` are the small model's residuals
    at every boundary, `ys` the large model's, for the same N tokens (any dtype; float32 here).

    The batch is centered on its own mean and merged with the pairwise rule: the merged
    cross-product is `xy_a + xy_b + (n_a n_b / n) dx dy^T` (dx, dy the differences of the
    means), which is one product of the batch's centered rows with one extra row
    `sqrt(n_a n_b / n) dx` appended. Masked tokens (padding, excluded positions) are zeroed
    before any product, so whatever values they hold never count."""
    xs, ys = xs.astype(jnp.float32), ys.astype(jnp.float32)
    mask = mask.astype(bool)
    n_b = jnp.sum(mask, dtype=jnp.float32)
    n = stats.count + n_b
    x_b, y_b = _batch_mean(xs, mask, n_b), _batch_mean(ys, mask, n_b)
    dx, dy = x_b - stats.x_mean, y_b - stats.y_mean
    scale = jnp.sqrt(stats.count * n_b / jnp.maximum(n, 1.0))
    rows = lambda h, mean, d: jnp.concatenate(  # noqa: E731  centered rows, then the merge row
        [jnp.where(mask[None, :, None], h - mean[:, None], 0.0), scale * d[:, None]], axis=1
    )
    x_rows, y_rows = rows(xs, x_b, dx), rows(ys, y_b, dy)  # [Ms, N+1, Ds], [Ml, N+1, Dl]
    xx = stats.xx + jnp.einsum("mnd,mne->mde", x_rows, x_rows, precision=HIGHEST)

    def add_row(m, xy):  # one small boundary at a time, in place: no second [Ms, Ds, Ml, Dl] buffer
        update = jnp.einsum("nd,lne->dle", x_rows[m], y_rows, precision=HIGHEST)
        return jax.lax.dynamic_update_index_in_dim(xy, xy[m] + update, m, axis=0)

    xy = jax.lax.fori_loop(0, xs.shape[0], add_row, stats.xy)
    weight = n_b / jnp.maximum(n, 1.0)
    return MappingStatistics(n, stats.x_mean + weight * dx, stats.y_mean + weight * dy, xx, xy)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MappingFit:
    """The ridge fit of every pair, kept factored: the training means, the lower Cholesky
    factor `cholesky [Ms, Ds, Ds]` of each regularised Gram `xx_m + lam_m I`, the cross-products
    `xy` (the same array as the statistics'), and the ridge `lam [Ms]` each boundary got.
    `linear_maps` turns it into explicit weights."""

    x_mean: Float[Array, "Ms Ds"]
    y_mean: Float[Array, "Ml Dl"]
    cholesky: Float[Array, "Ms Ds Ds"]
    xy: Float[Array, "Ms Ds Ml Dl"]
    lam: Float[Array, " Ms"]


def fit_maps(stats: MappingStatistics, ridge: float = DEFAULT_RIDGE) -> MappingFit:
    """Factor every small boundary's regularised Gram once (vmapped over m); the maps to every
    large boundary share it. `ridge` is relative: `lam_m = ridge * trace(xx_m) / D_s`. A Gram
    that is singular at `ridge` = 0 (fewer tokens than D_s) gives NaN: raise the ridge."""
    Ds = stats.xx.shape[-1]
    lam = ridge * jnp.trace(stats.xx, axis1=-2, axis2=-1) / Ds
    gram = stats.xx + lam[:, None, None] * jnp.eye(Ds, dtype=stats.xx.dtype)
    return MappingFit(stats.x_mean, stats.y_mean, jnp.linalg.cholesky(gram), stats.xy, lam)


def linear_maps(fit: MappingFit) -> tuple[Float[Array, "Ms Ds Ml Dl"], Float[Array, "Ms Ml Dl"]]:
    """Explicit `(weight, bias)` of every pair: `f_{m,l}(h) = h @ weight[m, :, l] + bias[m, l]`.
    As large as the statistics: the error functions do without it."""
    Ms, Ds, Ml, Dl = fit.xy.shape
    weight = jax.vmap(lambda c, xy: jax.scipy.linalg.cho_solve((c, True), xy.reshape(Ds, Ml * Dl)))(
        fit.cholesky, fit.xy
    ).reshape(Ms, Ds, Ml, Dl)
    bias = fit.y_mean[None] - jnp.einsum("md,mdle->mle", fit.x_mean, weight, precision=HIGHEST)
    return weight, bias


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ErrorSums:
    """Held-out sums, additive over batches: `error [Ms, Ml]` = sum_t ||h_l - f(h_m)||^2,
    `target [Ml]` = sum_t ||h_l||^2, `baseline [Ml]` = sum_t ||h_l - mean_train(h_l)||^2 (the
    error of the best constant map), and the token `count`."""

    error: Float[Array, "Ms Ml"]
    target: Float[Array, " Ml"]
    baseline: Float[Array, " Ml"]
    count: Float[Array, ""]


def empty_errors(small_boundaries: int, large_boundaries: int) -> ErrorSums:
    """Error sums of no tokens, to accumulate into."""
    z = lambda *shape: jnp.zeros(shape, jnp.float32)  # noqa: E731
    return ErrorSums(z(small_boundaries, large_boundaries), z(large_boundaries), z(large_boundaries), z())


def accumulate_errors(
    sums: ErrorSums, fit: MappingFit, xs: Float[Array, "Ms N Ds"], ys: Float[Array, "Ml N Dl"], mask: Bool[Array, " N"]
) -> ErrorSums:
    """`sums` plus the squared errors of every pair's map on the tokens where `mask` is true.

    Per small boundary m (`lax.map`, so one `[N, Ml, Dl]` prediction exists at a time): the
    centered inputs are solved against m's Cholesky factor once and multiplied by the
    cross-products of every large boundary, which predicts every h_l at once."""
    xs, ys = xs.astype(jnp.float32), ys.astype(jnp.float32)
    keep = mask.astype(bool)[:, None]
    ys_centered = jnp.where(keep[None], ys - fit.y_mean[:, None], 0.0)  # [Ml, N, Dl]

    def one_boundary(args):
        x, x_mean, chol, xy = args
        z = jax.scipy.linalg.cho_solve((chol, True), jnp.where(keep, x - x_mean, 0.0).T)  # [Ds, N]
        predicted = jnp.einsum("dn,dle->lne", z, xy, precision=HIGHEST)  # centered prediction
        return jnp.sum(jnp.square(ys_centered - predicted), axis=(1, 2))

    error = jax.lax.map(one_boundary, (xs, fit.x_mean, fit.cholesky, fit.xy))
    target = jnp.sum(jnp.where(keep[None], jnp.square(ys), 0.0), axis=(1, 2))
    return ErrorSums(
        sums.error + error,
        sums.target + target,
        sums.baseline + jnp.sum(jnp.square(ys_centered), axis=(1, 2)),
        sums.count + jnp.sum(keep, dtype=jnp.float32),
    )


def relative_errors(sums: ErrorSums) -> tuple[np.ndarray, np.ndarray]:
    """`(errors [Ms, Ml], baseline [Ml])`: sqrt(sum of squared errors / sum of squared target
    norms) of every pair's map and of the constant training-mean prediction."""
    error, target, baseline = (np.asarray(a, np.float64) for a in (sums.error, sums.target, sums.baseline))
    if np.any(target <= 0):
        raise ValueError("no held-out token (or an all-zero target): the relative error is undefined")
    return np.sqrt(error / target[None]), np.sqrt(baseline / target)


def best_match(errors: np.ndarray) -> np.ndarray:
    """`[Ms]`: for each small boundary m, the large boundary l of least error (the shallowest
    one on an exact tie, e.g. two large boundaries holding the same residual)."""
    return np.argmin(np.asarray(errors), axis=1).astype(np.int64)


def equal_relative_depth(small_layers: int, large_layers: int) -> np.ndarray:
    """`[L_s + 1]`: the large boundary at the same relative depth as each small one,
    m * L_l / L_s (fractional): the diagonal a 'stretched' larger model would follow."""
    return np.arange(small_layers + 1) * (large_layers / small_layers)


@dataclasses.dataclass
class LayerMappingResult(SavedResult):
    """Held-out relative errors of the linear maps from every boundary of `small_model` to every
    boundary of `large_model`.

    errors [L_s+1, L_l+1]: E[m, l] (module docstring); best_match [L_s+1]: argmin over l per m;
    baseline_errors [L_l+1]: the relative error of predicting each h_l by its training mean
    (a map is only informative where it beats it). Token and prompt counts of both splits;
    `settings` holds the ridge, the split, the excluded positions and the cache identity."""

    errors: np.ndarray
    best_match: np.ndarray
    baseline_errors: np.ndarray
    small_model: str
    large_model: str
    dataset: str
    train_tokens: int
    heldout_tokens: int
    train_prompts: int
    heldout_prompts: int
    settings: dict

    @property
    def small_layers(self) -> int:
        """L_s, the smaller model's number of layers (its boundaries are 0..L_s)."""
        return self.errors.shape[0] - 1

    @property
    def large_layers(self) -> int:
        """L_l, the larger model's number of layers (its boundaries are 0..L_l)."""
        return self.errors.shape[1] - 1

    def diagonal_offset(self) -> np.ndarray:
        """`[L_s+1]`: best match minus the equal-relative-depth boundary, in large-model layers
        (positive: the large model reaches what small boundary m holds later than m's relative
        depth)."""
        return self.best_match - equal_relative_depth(self.small_layers, self.large_layers)


def mapping_result(
    sums: ErrorSums,
    *,
    small_model: str,
    large_model: str,
    dataset: str,
    train_tokens: int,
    train_prompts: int,
    heldout_prompts: int,
    settings: Optional[dict] = None,
) -> LayerMappingResult:
    """The result from accumulated held-out error sums (host arrays)."""
    errors, baseline = relative_errors(sums)
    return LayerMappingResult(
        errors=errors.astype(np.float32),
        best_match=best_match(errors),
        baseline_errors=baseline.astype(np.float32),
        small_model=small_model,
        large_model=large_model,
        dataset=dataset,
        train_tokens=int(train_tokens),
        heldout_tokens=int(np.asarray(sums.count)),
        train_prompts=int(train_prompts),
        heldout_prompts=int(heldout_prompts),
        settings=dict(settings or {}),
    )


# Prompts run one at a time, padded to a multiple of 64: a whole dataset compiles a handful of
# shapes, and padding (masked out of every statistic) costs at most 63 positions per prompt.
PAD_TO = LengthBuckets(64, geometric=False)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MappingSettings:
    """Everything that changes a mapping result besides the models and the prompts.

    train_prompts: prompts 0..train_prompts-1 fit the maps, the later ones are held out (a
        split by prompt, so no held-out token shares a context with a training token).
    ridge: relative ridge, `lam = ridge * trace(Gram) / D_s` (`fit_maps`).
    first_position: positions before it are left out of fitting and evaluation. Default 1:
        position 0 (the BOS, or the first token where the tokenizer adds none, as Qwen2.5's)
        is an attention sink whose residual norm is far larger than every other position's,
        and it would dominate both the least squares and the norm-weighted error.
    """

    train_prompts: int = 80
    ridge: float = DEFAULT_RIDGE
    first_position: int = 1

    def __post_init__(self):
        if self.first_position < 0 or self.ridge < 0:
            raise ValueError(f"first_position and ridge must be >= 0, got {self.first_position} and {self.ridge}")


# ----------------------------------------------------------------------------- over prompts


def _flat_residuals(params, tokens, valid, config: ModelConfig):
    """Every boundary's residual as `[L+1, B*T, D]` (tokens flattened, B = 1 here)."""
    hs = residual_stream(params, tokens, config, valid=valid)
    return hs.reshape(hs.shape[0], -1, hs.shape[-1])


def _token_mask(valid, first_position: int):
    return (valid & (jnp.arange(valid.shape[1]) >= first_position)[None]).reshape(-1)


@partial(jit, static_argnames=("small_config", "large_config", "first_position"), donate_argnames="stats")
def _train_step(stats, small_params, large_params, tokens, valid, small_config, large_config, first_position):
    """Both models' residual streams of one prompt, folded into the statistics (one compiled call)."""
    xs = _flat_residuals(small_params, tokens, valid, small_config)
    ys = _flat_residuals(large_params, tokens, valid, large_config)
    return accumulate_statistics(stats, xs, ys, _token_mask(valid, first_position))


@partial(jit, static_argnames=("small_config", "large_config", "first_position"), donate_argnames="sums")
def _heldout_step(sums, fit, small_params, large_params, tokens, valid, *, small_config, large_config, first_position):
    """Both models' residual streams of one held-out prompt, their map errors added to the sums."""
    xs = _flat_residuals(small_params, tokens, valid, small_config)
    ys = _flat_residuals(large_params, tokens, valid, large_config)
    return accumulate_errors(sums, fit, xs, ys, _token_mask(valid, first_position))


_fit = jit(fit_maps, static_argnames="ridge")


def place_statistics(stats: MappingStatistics, mesh) -> MappingStatistics:
    """With a mesh, split the large width D_l of the cross-products (and of the large means) over
    all its devices; the small Gram and means, a small fraction, stay replicated."""
    if mesh is None:
        return stats
    from jax.sharding import NamedSharding, PartitionSpec as P

    axes = tuple(mesh.axis_names)

    if stats.xy.shape[-1] % mesh.size:
        # Replicating the cross-products would put all of them on every device: for 1.5B -> 14B
        # that is 45 GB each, so refuse rather than fail later for memory.
        raise ValueError(
            f"the larger model's width {stats.xy.shape[-1]} does not divide over the mesh's "
            f"{mesh.size} devices; choose a mesh whose size divides it"
        )

    def sharding(x, split: bool):
        return NamedSharding(mesh, P(*([None] * (x.ndim - 1)), axes)) if split else NamedSharding(mesh, P())

    return jax.device_put(
        stats,
        MappingStatistics(
            sharding(stats.count, False),
            sharding(stats.x_mean, False),
            sharding(stats.y_mean, True),
            sharding(stats.xx, False),
            sharding(stats.xy, True),
        ),
    )


def compute_mapping(
    small,
    large,
    train: PromptBatch,
    held_out: PromptBatch,
    settings: MappingSettings = MappingSettings(),
    *,
    mesh=None,
    execution: Execution = Execution(progress=True),
    names: tuple[str, str, str] = ("small", "large", "prompts"),
    **loose,
) -> LayerMappingResult:
    """Fit on `train`, measure on `held_out` (batches with the same token ids for both models),
    one jitted call per prompt; `small` and `large` are loaded models (`jaxdepth.Model`: params
    and config); `names` = (small model, large model, dataset) for the result: its errors are
    `[L_small + 1, L_large + 1]`. With a `mesh`, the cross-products are split over its devices
    (`place_statistics`). `execution` (a `jaxdepth.core.execution.Execution`) gives the
    progress bars (default shown); a loose `progress=` is refused with the `Execution` that
    says the same."""
    refuse_loose_options("compute_mapping", loose)
    progress = execution.progress
    cs, cl = small.config, large.config
    stats = place_statistics(
        empty_statistics(cs.num_layers + 1, cs.hidden_size, cl.num_layers + 1, cl.hidden_size), mesh
    )
    step = dict(small_config=cs, large_config=cl, first_position=settings.first_position)
    for i in track(range(len(train)), progress, "layer mapping: fit"):
        one = train.single(i, PAD_TO)
        stats = _train_step(stats, small.params, large.params, jnp.asarray(one.tokens), jnp.asarray(one.valid), **step)
    train_tokens = int(to_host(stats.count))
    if train_tokens == 0:
        raise ValueError(
            f"no training token: {len(train)} prompt(s), none with a position >= {settings.first_position}"
        )
    fit = _fit(stats, ridge=settings.ridge)
    del stats  # its cross-products live on in the fit (the same array)
    sums = empty_errors(cs.num_layers + 1, cl.num_layers + 1)
    for i in track(range(len(held_out)), progress, "layer mapping: held out"):
        one = held_out.single(i, PAD_TO)
        sums = _heldout_step(
            sums, fit, small.params, large.params, jnp.asarray(one.tokens), jnp.asarray(one.valid), **step
        )
    sums = jax.tree.map(to_host, sums)
    result = mapping_result(
        sums,
        small_model=names[0],
        large_model=names[1],
        dataset=names[2],
        train_tokens=train_tokens,
        train_prompts=len(train),
        heldout_prompts=len(held_out),
        settings=dataclasses.asdict(settings),
    )
    if not np.all(np.isfinite(result.errors)):
        raise ValueError(
            f"the layer mapping gave NaN or infinite errors (ridge {settings.ridge:g}): with fewer "
            f"training tokens ({train_tokens}) than residual width ({cs.hidden_size}) or a very small "
            "ridge the Gram matrix is singular; use more training prompts or a larger ridge"
        )
    return result
