"""Layer Jacobians: how close is each layer, and each stack of the last layers, to the identity?
(Sun et al., "The Curse of Depth in Large Language Models", arXiv 2502.05795: under pre-LN the
Jacobian of a deep block approaches the identity, so the block does little.)

For layer l and a measured position t of a prompt, J_l(t) = d h_{l+1}[t] / d h_l[t] (D x D) is
the token's own block of the layer's Jacobian: h_l[t] moves, every other position's input stays
the clean run's. The cross-token blocks d h_{l+1}[t] / d h_l[s], s < t (what the token reads
from earlier positions through attention), are left out; s > t contribute nothing (causal
attention). The token's own block of the map from h_l to the final residual h_L is then exactly
the product J_{l->L}(t) = J_{L-1}(t) ... J_l(t): a change of h_l[t] reaches only positions >= t,
and h_L[t] reads only positions <= t, so every path from h_l[t] to h_L[t] stays at t.
Where layers reuse an earlier layer's keys and values (Gemma 4's `shared_kv_layers`), a path
also runs from a layer that computes keys, through its key and value at t, to a later layer that
reuses them: J_l(t) holds those it reads fixed (the clean run's), and the suffix's is the product
of the Jacobians of the state (h[t], the shared keys' and values' row at t)
(`jaxdepth.core.loops.token_chain_step`), the row clean at boundary l; exact measures only (the
estimates are refused by name). The layers read the tokens' per-layer inputs (Gemma 4).

Each J_l(t) is the derivative of one token's step through layer l against the clean run's keys
and values of the positions before it (`jaxdepth.core.layer.piece_context`, as decoding and
erasure's pieces run a position), so a measurement costs one token's layer, not the prompt's.
For A = J - I, with D the residual width:
- **relative distance from the identity** ||A||_F / ||I||_F = sqrt(||A||_F^2 / D);
- **largest singular value** sigma_max(A) (= ||A||_2 / ||I||_2).
Both for A_l = J_l - I (`layer_*`) and for A = J_{l->L} - I (`suffix_*`), l = 0..L-1.

Where D <= `exact_width` the Jacobians are formed (forward-mode, D columns) and both measures
are exact. Otherwise no D x D matrix is formed:
- ||A||_F^2 is Hutchinson's estimate mean_p ||A w_p||^2 over `probes` Gaussian probes w_p (for
  the suffix maps, ||A^T w_p||^2, one reverse sweep giving every l at once). It is unbiased with
  relative standard deviation sqrt(2/P) ||A^T A||_F / ||A||_F^2 <= sqrt(2/P), about half that on
  the distance; each estimate is stored with its standard error over its probes.
- sigma_max(A) is Golub-Kahan-Lanczos bidiagonalization (`iterations` steps, each a jvp and a
  vjp, from a random start): a lower bound, at least as close as as many steps of the power
  method on A^T A, whose expected relative error on sigma_max^2 is at most
  0.871 ln(D) / (iterations - 1) whatever the spectrum (Kuczynski and Wozniakowski 1992), and
  which Lanczos improves on by far when the top singular value stands apart. The suffix maps'
  steps run every l at once, L chains of up to L layers a step: their cost grows as L^2 (the
  setting to lower first when it is slow).

Positions: `tokens` evenly spaced among 1..n-1 of each prompt of n tokens (the first token left
out: it attends only to itself and carries the attention sink's massive norm, so its maps are of
another kind; a one-token prompt measures position 0), or positions the caller gives.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import TYPE_CHECKING, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree
from jaxtyping import Array, Bool, Float, Int

from jaxdepth.analyses.suite import Analysis, DepthCurve, DepthReading, Settings, option
from jaxdepth.analyses.uncertainty import DEFAULT_RESAMPLES, DEFAULT_SEED, prompt_mean_band
from jaxdepth.core.batch import PromptBatch
from jaxdepth.core.compilation import jit
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.layer import Params
from jaxdepth.core.loops import map_layers, run_layers, scan_layers, shared_row_at, token_chain_step, token_step
from jaxdepth.core.model import embed, token_per_layer_inputs
from jaxdepth.core.saved_result import SavedResult
from jaxdepth.core.sharding import to_host

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "clean_layer_states",
    "measured_positions",
    "layer_jacobians",
    "Estimate",
    "JacobianResult",
    "jacobian_figure",
    "JacobianSettings",
    "ANALYSIS",
    "depth_reading",
]

DEFAULT_PROBES = 32
DEFAULT_ITERATIONS = 10
DEFAULT_TOKENS = 4
DEFAULT_EXACT_WIDTH = 64

# The per-position measures, each `[L]`: squared Frobenius norms with their standard errors
# (0 where exact), largest singular values.
MEASURES = ("layer_frob2", "layer_frob2_error", "layer_sigma", "suffix_frob2", "suffix_frob2_error", "suffix_sigma")


def _read_layer_state(record, _):
    return record.h, record.k, record.v


def clean_layer_states(params: Params, tokens: Int[Array, "B T"], valid: Bool[Array, "B T"], config: ModelConfig):
    """The clean run's `(inputs [L, B, T, D], keys, values [L, B, T, K, Dh])`: every layer's
    input h_l and its rotated keys and values, what a token's step through layer l reads.
    Pure: `jit` it with `config` static."""
    extra = token_per_layer_inputs(params, tokens, config)
    _, (inputs, keys, values) = run_layers(
        params, embed(params, tokens, config), config, valid=valid, tap=_read_layer_state, per_layer_inputs=extra
    )
    return inputs, keys, values


def _unit(v: Array) -> Array:
    # A zero vector stays zero (A = 0 where a layer is the identity): sigma is then exactly 0.
    n = jnp.linalg.norm(v, axis=-1, keepdims=True)
    return v / jnp.where(n > 0, n, 1.0)


def _largest_singular_value(A, At, start: Float[Array, "N D"], steps: int) -> Float[Array, " N"]:
    """sigma_max of each of N linear maps (`A`, `At`: the maps and their transposes on a stack of
    N vectors, row i by map i) by `steps` steps of Golub-Kahan-Lanczos bidiagonalization from
    `start`: the largest singular value of the k x k bidiagonal it builds, a lower bound that
    converges much faster than the power method at the same cost (one A and one A^T a step).
    Without reorthogonalization lost orthogonality can only repeat converged values, never
    exceed sigma_max. A zero map gives exactly 0."""
    safe = lambda x: jnp.where(x > 0, x, 1.0)  # noqa: E731  (a zero vector stays zero)

    def step(carry, _):
        v, u_previous, beta = carry
        u = A(v) - beta[:, None] * u_previous
        alpha = jnp.linalg.norm(u, axis=-1)
        u = u / safe(alpha)[:, None]
        w = At(u) - alpha[:, None] * v
        beta = jnp.linalg.norm(w, axis=-1)
        return (w / safe(beta)[:, None], u, beta), (alpha, beta)

    N = start.shape[0]
    zero = jnp.zeros(N, start.dtype)
    _, (alphas, betas) = jax.lax.scan(step, (_unit(start), jnp.zeros_like(start), zero), None, length=steps)
    # B: alphas on the diagonal, betas (all but the last) above it; [N, k, k]
    B = jax.vmap(lambda a, b: jnp.diag(a) + jnp.diag(b[:-1], 1))(alphas.T, betas.T)
    return jnp.linalg.norm(B, ord=2, axis=(1, 2))


def _hutchinson(sq: Float[Array, "... P"]) -> tuple[Array, Array]:
    """Mean and standard error over the probe axis of squared norms ||A w_p||^2."""
    P = sq.shape[-1]
    return sq.mean(-1), sq.std(-1, ddof=1) / np.sqrt(P) if P > 1 else jnp.zeros(sq.shape[:-1])


def _exact_measures(J: Float[Array, "L D D"], chain: Optional[Array] = None) -> dict[str, Array]:
    """Both measures of every layer and every suffix from the formed Jacobians; a suffix's from
    the product of `chain`'s (the Jacobians of a state of which h is the first D entries, the
    others starting clean at every boundary; J itself by default)."""
    L, D, _ = J.shape
    chain = J if chain is None else chain

    def down(product, Jl):  # product = J_{l+1 -> L}; J_{l -> L} = J_{l+1 -> L} J_l
        product = product @ Jl
        return product, product

    _, suffix = jax.lax.scan(down, jnp.eye(chain.shape[-1], dtype=J.dtype), chain, reverse=True)
    suffix = suffix[:, :D, :D]
    eye = jnp.eye(D, dtype=J.dtype)
    measures = {}
    for name, M in (("layer", J), ("suffix", suffix)):
        A = M - eye
        measures[f"{name}_frob2"] = jnp.sum(A * A, axis=(1, 2))
        measures[f"{name}_frob2_error"] = jnp.zeros(L, J.dtype)
        measures[f"{name}_sigma"] = jnp.linalg.norm(A, ord=2, axis=(1, 2))
    return measures


def _position_measures(params, prompt, position, key, config: ModelConfig, *, probes, iterations, exact):
    """Every measure `[L]` at one position of one prompt, whose clean run is `prompt = (inputs
    [L, T, D], keys, values [L, T, K, Dh], valid [T], per-layer inputs [T, L, P] or None)`."""
    inputs, keys, values, valid, per_layer = prompt
    xs = inputs[:, position]  # [L, D]: the position's input to every layer
    L, D = xs.shape
    options = dict(inputs=inputs, per_layer_inputs=per_layer)
    step = lambda l, x: token_step(params, l, x, keys, values, valid, position, config, **options)  # noqa: E731
    layers = jnp.arange(L)

    if config.shared_kv_layers:
        if not exact:
            raise ValueError(
                "estimated Jacobians (probes and Lanczos steps) of a model whose layers share keys and values are not "
                "implemented: a suffix's chain runs through the shared keys; measure exactly (Estimate(exact_width=D))"
            )

        def augmented(l):  # the Jacobian of (h_l[t], shared row at t) -> (h_{l+1}[t], shared row after layer l)
            flat, unravel = ravel_pytree((xs[l], shared_row_at(keys, values, l, position, config)))
            chain = lambda v: token_chain_step(params, l, unravel(v), keys, values, valid, position, config, **options)  # noqa: E731
            return jax.jacfwd(lambda v: ravel_pytree(chain(v))[0])(flat)

        A = map_layers(augmented, config)
        return _exact_measures(A[:, :D, :D], A)

    if exact:
        J = map_layers(lambda l: jax.jacfwd(partial(step, l))(xs[l]), config)
        return _exact_measures(J)

    def linear_map(l):
        """(A v, A^T u) of A = J_l - I, as functions of one vector."""
        _, jvp = jax.linearize(partial(step, l), xs[l])
        vjp = jax.linear_transpose(jvp, xs[l])
        return (lambda v: jvp(v) - v), (lambda u: vjp(u)[0] - u)

    def one_layer(l):
        A, At = linear_map(l)
        w = jax.random.normal(jax.random.fold_in(key, l), (probes, D), xs.dtype)
        frob2, error = _hutchinson(jnp.sum(jax.vmap(A)(w) ** 2, axis=-1))
        start = jax.random.normal(jax.random.fold_in(key, L + l), (1, D), xs.dtype)
        sigma = _largest_singular_value(jax.vmap(A), jax.vmap(At), start, iterations)[0]
        return frob2, error, sigma

    layer_frob2, layer_error, layer_sigma = map_layers(one_layer, config)

    def apply_transposed(u, l):  # u <- J_l^T u, for a stack of vectors
        _, vjp = jax.vjp(partial(step, l), xs[l])
        return jax.vmap(lambda r: vjp(r)[0])(u)

    # One reverse sweep: u_l = J_l^T ... J_{L-1}^T w = J_{l->L}^T w for every l, the same probes.
    w = jax.random.normal(jax.random.fold_in(key, 2 * L), (probes, D), xs.dtype)
    _, transposed = scan_layers(lambda u, l: (apply_transposed(u, l),) * 2, w, config, reverse=True)
    suffix_frob2, suffix_error = _hutchinson(jnp.sum((transposed - w) ** 2, axis=-1))

    # Every suffix's sigma_max at once: row l of the stack is suffix l's vector, moved by layer k
    # only when l <= k (its chain starts at layer l).
    def chain_forward(V):  # A_l v_l for every l
        def through(S, k):
            _, jvp = jax.linearize(partial(step, k), xs[k])
            return jnp.where((layers <= k)[:, None], jax.vmap(jvp)(S), S), None

        return scan_layers(through, V, config)[0] - V

    def chain_backward(Y):  # A_l^T y_l for every l
        def through(R, k):
            return jnp.where((layers <= k)[:, None], apply_transposed(R, k), R), None

        return scan_layers(through, Y, config, reverse=True)[0] - Y

    start = jax.random.normal(jax.random.fold_in(key, 2 * L + 1), (L, D), xs.dtype)
    suffix_sigma = _largest_singular_value(chain_forward, chain_backward, start, iterations)
    return dict(
        layer_frob2=layer_frob2,
        layer_frob2_error=layer_error,
        layer_sigma=layer_sigma,
        suffix_frob2=suffix_frob2,
        suffix_frob2_error=suffix_error,
        suffix_sigma=suffix_sigma,
    )


@partial(jit, static_argnames=("config", "probes", "iterations", "exact"))
def _group_measures(params, tokens, valid, positions, key, config: ModelConfig, *, probes: int, iterations: int, exact):
    """Every measure `[B, M, L]` at `positions [B, M]` of a group of prompts."""
    inputs, keys, values = clean_layer_states(params, tokens, valid, config)
    per_layer = token_per_layer_inputs(params, tokens, config)
    options = dict(probes=probes, iterations=iterations, exact=exact)
    # prompt b's states [L, T, ...]; the inner vmap shares them among its positions
    per_prompt = lambda prompt, where, key: jax.vmap(  # noqa: E731
        lambda t, key: _position_measures(params, prompt, t, key, config, **options)
    )(where, jax.random.split(key, where.shape[0]))
    moved = lambda a: jnp.moveaxis(a, 1, 0)  # noqa: E731  [L, B, ...] -> [B, L, ...]
    prompts = (moved(inputs), moved(keys), moved(values), valid, per_layer)
    return jax.vmap(per_prompt)(prompts, positions, jax.random.split(key, tokens.shape[0]))


def measured_positions(lengths, tokens: int = DEFAULT_TOKENS) -> np.ndarray:
    """`[N, tokens]` positions per prompt of `lengths`: up to `tokens` evenly spaced among
    1..n-1 (the first token left out; position 0 for a one-token prompt), -1 where a short
    prompt has fewer."""
    if tokens < 1:
        raise ValueError(f"measure at least one position per prompt, got tokens={tokens}")
    out = np.full((len(lengths), tokens), -1, np.int64)
    for i, n in enumerate(np.asarray(lengths)):
        chosen = np.unique(np.round(np.linspace(1, n - 1, tokens)).astype(np.int64)) if n > 1 else np.array([0])
        out[i, : len(chosen)] = chosen
    return out


@dataclasses.dataclass
class JacobianResult(SavedResult):
    """Per prompt and measured position `[N, M, L]`: `layer_frob2` ||J_l - I||_F^2,
    `suffix_frob2` ||J_{l->L} - I||_F^2 (with `*_frob2_error`, their standard errors; 0 where
    exact), `layer_sigma` and `suffix_sigma`, the largest singular values of J_l - I and
    J_{l->L} - I; `positions [N, M]` (-1: none measured), `width` D, `num_layers` L,
    `settings` (probes, iterations, exact)."""

    layer_frob2: np.ndarray
    layer_frob2_error: np.ndarray
    layer_sigma: np.ndarray
    suffix_frob2: np.ndarray
    suffix_frob2_error: np.ndarray
    suffix_sigma: np.ndarray
    positions: np.ndarray
    width: int
    num_layers: int
    settings: dict

    @property
    def measured(self) -> np.ndarray:
        """`[N, M]`: the positions measured (the others' values are NaN)."""
        return self.positions >= 0

    def distance(self, which: str = "layer") -> np.ndarray:
        """||A||_F / ||I||_F `[N, M, L]` of the layers ('layer') or the suffix maps ('suffix')."""
        return np.sqrt(np.maximum(getattr(self, f"{which}_frob2"), 0) / self.width)

    def per_prompt(self, name: str) -> np.ndarray:
        """Each prompt's mean over its measured positions `[N, L]` of `distance('layer')`,
        `distance('suffix')` ('layer_distance', 'suffix_distance') or a stored measure."""
        values = self.distance(name.split("_")[0]) if name.endswith("_distance") else getattr(self, name)
        return np.nanmean(np.where(self.measured[..., None], values, np.nan), axis=1)


def _refuse_rounded_products(params: Params) -> None:
    narrow = [
        name
        for name, w in params["layers"].items()
        if jnp.issubdtype(w.dtype, jnp.floating) and jnp.finfo(w.dtype).bits < jnp.finfo(params["embed"].dtype).bits
    ]
    if narrow:
        raise ValueError(
            f"layer Jacobians take forward-mode derivatives, which the rounded products of narrow weight matrices "
            f"({', '.join(narrow)}; --dtype bf16-matmuls) do not define: measure them on float32 or bfloat16 weights"
        )


@dataclasses.dataclass(frozen=True)
class Estimate:
    """How the Jacobians' measures are taken (module docstring): exactly where the width D <=
    `exact_width`, else from `probes` Gaussian probes (Hutchinson) and `iterations` Lanczos
    steps, drawn from `seed`."""

    probes: int = DEFAULT_PROBES
    iterations: int = DEFAULT_ITERATIONS
    exact_width: int = DEFAULT_EXACT_WIDTH
    seed: int = 0

    def __post_init__(self):
        if self.probes < 2 or self.iterations < 1:
            raise ValueError(
                f"the estimates need probes >= 2 and iterations >= 1, got {self.probes} and {self.iterations}"
            )


def layer_jacobians(
    params: Params,
    batch: PromptBatch,
    config: ModelConfig,
    *,
    tokens: int = DEFAULT_TOKENS,
    positions: Optional[np.ndarray] = None,
    estimate: Estimate = Estimate(),
    settings: Optional[dict] = None,
) -> JacobianResult:
    """Both measures of every layer's and every suffix's Jacobian (module docstring) at
    `positions [N, M]` of `batch`'s prompts (-1: none; default `measured_positions(lengths,
    tokens)`), `[N, M, L]` each: as `estimate` says (`Estimate`: exact where the width D <=
    `exact_width`, else from `probes` probes and `iterations` Lanczos steps, drawn from
    `seed`). One clean forward per group of prompts, then one token's steps through the layers
    per measured position."""
    _refuse_rounded_products(params)
    probes, iterations, seed = estimate.probes, estimate.iterations, estimate.seed
    lengths = np.asarray(batch.lengths)
    positions = measured_positions(lengths, tokens) if positions is None else np.asarray(positions, np.int64)
    N, L, D = len(lengths), config.num_layers, config.hidden_size
    if positions.ndim != 2 or positions.shape[0] != N:
        raise ValueError(f"positions must be [prompts={N}, M], got shape {positions.shape}")
    if np.any(positions >= lengths[:, None]) or np.any(positions < -1):
        raise ValueError("every measured position must be one of its prompt's tokens (or -1 for none)")
    exact = D <= estimate.exact_width
    out = {name: np.full((N, positions.shape[1], L), np.nan, np.float32) for name in MEASURES}
    key = jax.random.key(seed)
    for g, (index, group) in enumerate(batch.groups()):
        rows = np.concatenate([index, np.repeat(index[-1:], group.tokens.shape[0] - len(index))])
        where = np.maximum(positions[rows], 0)
        measures = _group_measures(
            params,
            group.tokens,
            group.valid,
            where,
            jax.random.fold_in(key, g),
            config,
            probes=probes,
            iterations=iterations,
            exact=exact,
        )
        for name in MEASURES:
            values = to_host(measures[name])[: len(index)]
            out[name][index] = np.where(positions[index, :, None] >= 0, values, np.nan)
    return JacobianResult(
        **out,
        positions=positions,
        width=D,
        num_layers=L,
        settings={**(settings or {}), "probes": probes, "iterations": iterations, "exact": exact, "seed": seed},
    )


# ----------------------------------------------------------------------------- figure


def jacobian_figure(result: JacobianResult, *, resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED) -> Figure:
    """Over relative depth (l + 0.5) / L: left, the relative distance from the identity of each
    layer's Jacobian and of the map from h_l to the final residual; right, the largest singular
    value of J - I of both; each the mean over prompts (of their positions' means) with a 95%
    bootstrap band over prompts."""
    from jaxdepth.analyses import drawing as d

    d.expect(result, JacobianResult, "jacobian_figure")
    L = result.num_layers
    x = (np.arange(L) + 0.5) / L
    fig = d.new_figure(11, 4.2)
    panels = fig.subplots(1, 2)
    kind = "exact" if result.settings.get("exact") else f"{result.settings.get('probes')} probes"
    for ax, measure, label in (
        (panels[0], "distance", "||J - I||_F / ||I||_F"),
        (panels[1], "sigma", "largest singular value of J - I"),
    ):
        for which, color, name in (("layer", "C0", "layer l alone"), ("suffix", "C3", "layers l..L-1 (to h_L)")):
            mean, band, _ = prompt_mean_band(result.per_prompt(f"{which}_{measure}"), resamples, seed)
            if mean is None:
                continue
            ax.plot(x, mean, color=color, marker="o", markersize=3, label=name)
            d.draw_band(ax, x, band, color, label=which == "layer")
        ax.set(xlabel="relative depth (l + 0.5) / L", ylabel=label, xlim=(0, 1), yscale="log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    panels[0].set_title(f"distance from the identity ({kind})")
    panels[1].set_title("largest stretch away from the identity")
    d.title_figure(fig, "Layer Jacobians", None, result.settings)
    return fig


# ----------------------------------------------------------------------------- in the suite


@dataclasses.dataclass(frozen=True, kw_only=True)
class JacobianSettings(Settings):
    """The layer Jacobians' settings in a study (`Settings` and its options)."""

    jacobian_tokens: int = option(DEFAULT_TOKENS, "layer Jacobians: positions measured per prompt (evenly spaced)")
    jacobian_probes: int = option(
        DEFAULT_PROBES, "layer Jacobians: Gaussian probes of the Frobenius estimates (relative error <= sqrt(2/P))"
    )
    jacobian_iterations: int = option(
        DEFAULT_ITERATIONS, "layer Jacobians: Lanczos steps for the largest singular values"
    )
    jacobian_exact_width: int = option(
        DEFAULT_EXACT_WIDTH, "layer Jacobians: form the Jacobians exactly where the model's width is at most this"
    )


def _summary(result: JacobianResult) -> list[str]:
    layer = np.nanmean(result.per_prompt("layer_distance"), axis=0)
    suffix = np.nanmean(result.per_prompt("suffix_distance"), axis=0)
    L = result.num_layers
    closest = int(np.argmin(layer))
    return [
        f"layer closest to the identity: {closest} of {L} (||J - I||_F / ||I||_F = {layer[closest]:.3f}; "
        f"first half {np.mean(layer[: L // 2]):.3f}, second half {np.mean(layer[L // 2 :]):.3f})",
        f"map to the final residual from layer {L // 2}: {suffix[L // 2]:.3f}, from layer {L - 1}: {suffix[-1]:.3f}",
    ]


def depth_reading(result: JacobianResult) -> DepthReading:
    """Each layer's Jacobian's distance from the identity, the mean over prompts, on the
    relative-depth axis."""
    L = result.num_layers
    distance = np.nanmean(result.per_prompt("layer_distance"), axis=0)
    curve = DepthCurve(
        "layer Jacobian's distance from I", "||J_l - I||_F / ||I||_F", (np.arange(L) + 0.5) / L, distance, log=True
    )
    return DepthReading(num_layers=L, curves={"layer_distance": curve})


ANALYSIS = Analysis(
    name="jacobians",
    default=False,  # in the suite, run when named: `--analyses jacobians`
    result_type=JacobianResult,
    settings=JacobianSettings,
    identity=lambda s: {
        "jacobian_tokens": s.jacobian_tokens,
        "jacobian_probes": s.jacobian_probes,
        "jacobian_iterations": s.jacobian_iterations,
        "jacobian_exact_width": s.jacobian_exact_width,
        "seed": s.seed,
    },
    run=lambda x: layer_jacobians(
        x.model.params,
        x.batch,
        x.model.config,
        tokens=x.settings.jacobian_tokens,
        estimate=Estimate(
            probes=x.settings.jacobian_probes,
            iterations=x.settings.jacobian_iterations,
            exact_width=x.settings.jacobian_exact_width,
            seed=x.settings.seed,
        ),
    ),
    figures=lambda r, tokenizer, n: {"": jacobian_figure(r)},
    summary=_summary,
    depth=depth_reading,
)
