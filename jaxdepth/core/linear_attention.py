"""Qwen3.5's gated DeltaNet mixer: linear attention with a recurrent state, as transformers computes it.

A linear-attention layer of Qwen3.5 (`Qwen3_5GatedDeltaNet`) replaces softmax attention by a
matrix-valued state per value head, `S [Dk, Dv]`, updated at every position by the gated delta
rule

    S <- exp(g_t) S                                   (decay: g_t <= 0)
    S <- S + k_t (beta_t (v_t - S^T k_t))^T           (delta rule: write the correction)
    o_t = S^T q_t

so a layer costs linear time in the sequence length and carries a fixed-size state into decoding.
Before the rule, the projected queries, keys and values pass a depthwise causal convolution (a
window of `conv_kernel` positions) and SiLU; after it, each value head's output is RMS-normed and
gated by SiLU of another projection, `z`.

Everything here is a pure function of arrays: jittable, vmappable (no Python branch on a traced
value) and differentiable in both modes. Shapes: B batch, T positions, D the model width, Hk key
heads of Dk dims, Hv value heads of Dv dims (Hv a multiple of Hk: each key head serves Hv // Hk
consecutive value heads), C = 2 Hk Dk + Hv Dv the convolved channels, K the kernel width.

Numerics follow transformers' torch code (`torch_recurrent_gated_delta_rule`,
`torch_chunk_gated_delta_rule`, `causal_conv1d_fn`, `Qwen3_5RMSNormGated`): the rule runs in
float32 whatever the activations' type; q and k are l2-normalised with epsilon 1e-6 inside the
square root; the gated norm casts back to the activations' type before its weight multiply.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jaxdepth.core.primitives import project

__all__ = [
    "LinearAttentionShape",
    "LinearState",
    "causal_conv",
    "l2_normalize",
    "gated_delta_rule",
    "gated_rms_norm",
    "gated_delta_net",
    "gated_delta_net_heads",
    "linear_output",
]


# transformers' `l2norm` (as the FLA kernels): x * rsqrt(sum(x^2) + eps), this eps
L2_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class LinearAttentionShape:
    """The sizes of a gated DeltaNet layer: `key_heads` (Hk) of `key_dim` (Dk), `value_heads`
    (Hv, a multiple of Hk) of `value_dim` (Dv), the convolution's `conv_kernel` (K) and the gated
    norm's `eps`."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int
    eps: float

    def __post_init__(self):
        if self.value_heads % self.key_heads:
            raise ValueError(f"value_heads ({self.value_heads}) must be a multiple of key_heads ({self.key_heads})")

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> "LinearAttentionShape":
        """From a transformers Qwen3.5 text config as a dict (`config.to_dict()`, config.json)."""
        return cls(
            key_heads=int(cfg["linear_num_key_heads"]),
            value_heads=int(cfg["linear_num_value_heads"]),
            key_dim=int(cfg["linear_key_head_dim"]),
            value_dim=int(cfg["linear_value_head_dim"]),
            conv_kernel=int(cfg["linear_conv_kernel_dim"]),
            eps=float(cfg["rms_norm_eps"]),
        )

    @property
    def conv_channels(self) -> int:
        """C = 2 Hk Dk + Hv Dv: the queries, keys and values that the convolution mixes."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


class LinearState(NamedTuple):
    """What a gated DeltaNet layer carries from one stretch of a sequence to the next (a pytree):
    `conv [B, C, K-1]`, the last K-1 inputs of the convolution (in the activations' type), and
    `recurrent [B, Hv, Dk, Dv]`, the delta rule's state (float32). transformers' cache
    (`LinearAttentionLayer`) keeps the same layouts, but K inputs of the convolution, the oldest
    of which no output reads: its conv state is `[..., 1:]` of the cache's."""

    conv: Float[Array, "B C Km1"]
    recurrent: Float[Array, "B Hv Dk Dv"]

    @classmethod
    def zeros(cls, batch: int, shape: LinearAttentionShape, dtype=jnp.float32) -> "LinearState":
        """The state before the first position: all zeros (what the sequence start means to both
        the convolution's left padding and the rule)."""
        return cls(
            conv=jnp.zeros((batch, shape.conv_channels, shape.conv_kernel - 1), dtype),
            recurrent=jnp.zeros((batch, shape.value_heads, shape.key_dim, shape.value_dim), jnp.float32),
        )


# ----------------------------------------------------------------------------- the convolution


def _wide(dtype):
    """The type the rule computes in: float32, or float64 for float64 inputs (a reference run
    under `jax_enable_x64`)."""
    return jnp.promote_types(dtype, jnp.float32)


def _ends(valid: Optional[Bool[Array, "B T"]]) -> Optional[Int[Array, " B"]]:
    """Each row's end: the position after its last valid one (0 where none is); None for None."""
    if valid is None:
        return None
    T = valid.shape[-1]
    return jnp.max(jnp.where(valid, jnp.arange(1, T + 1), 0), axis=-1)


def causal_conv(
    x: Float[Array, "B T C"],
    weight: Float[Array, "C K"],
    state: Optional[Float[Array, "B C Km1"]] = None,
    *,
    ends: Optional[Int[Array, " B"]] = None,
) -> tuple[Float[Array, "B T C"], Float[Array, "B C Km1"]]:
    """The depthwise causal convolution, then SiLU: `y[t, c] = silu(sum_j weight[c, j] x[t-K+1+j, c])`.

    `x [B, T, C]`, `weight [C, K]` (torch's conv1d weight `[C, 1, K]` squeezed; Qwen3.5's has no
    bias), `state [B, C, K-1]`: the K-1 inputs before position 0 (None: zeros, the sequence start,
    as `causal_conv1d_fn`'s left padding; a returned state continues an earlier stretch, as
    `causal_conv1d_update` and the cache's conv state). Returns `y [B, T, C]` in `x`'s type and
    the new state `[B, C, K-1]`, the last K-1 inputs (of the state and `x` together, so a stretch
    shorter than K-1 keeps part of the old state), which is what decoding carries; or, where
    `ends [B]` is given, the K-1 inputs before position `ends[b]` of each row (the state of a
    row that ends there).

    As transformers, the inputs are read in the weight's type and the result is cast back to
    `x`'s; the K products per output are summed in float32 (torch's conv accumulates so), K
    shifted multiplies rather than a convolution primitive: K is 4, and this is linear in T."""
    B, T, C = x.shape
    K = weight.shape[-1]
    if state is None:
        state = jnp.zeros((B, C, K - 1), x.dtype)
    history = jnp.concatenate([jnp.swapaxes(state, 1, 2).astype(x.dtype), x], axis=1)  # [B, T+K-1, C]
    read = history.astype(weight.dtype).astype(_wide(history.dtype))
    w = weight.astype(_wide(weight.dtype))
    acc = read[:, 0:T] * w[:, 0]
    for j in range(1, K):  # a static loop over the kernel's taps
        acc = acc + read[:, j : j + T] * w[:, j]
    y = jax.nn.silu(acc.astype(weight.dtype)).astype(x.dtype)
    if ends is None:
        kept = history[:, T:]  # the last K-1 of the K-1+T inputs
    else:  # history index j holds position j - (K-1): positions ends-K+1 .. ends-1
        kept = jax.vmap(lambda row, end: jax.lax.dynamic_slice_in_dim(row, end, K - 1, axis=0))(history, ends)
    return y, jnp.swapaxes(kept, 1, 2)


# ----------------------------------------------------------------------------- the delta rule


def l2_normalize(x: Float[Array, "... D"], eps: float = L2_EPS) -> Float[Array, "... D"]:
    """transformers' `l2norm`: `x * rsqrt(sum(x^2) + eps)` over the last axis (the epsilon inside
    the root, so a zero vector stays zero with a finite gradient)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _prepared(q, k, v, g, beta, state):
    """The rule's inputs as both forms read them: q, k repeated over their value heads, every
    input in float32 and head-major (`[B, Hv, T, ...]`), q and k l2-normalised, and the state
    (zeros where None)."""
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[-2:]
    # repeat_interleave: key head i serves value heads i*G .. i*G+G-1
    q, k = (jnp.repeat(a, Hv // Hk, axis=2) for a in (q, k))
    wide = _wide(q.dtype)
    q, k, v = (jnp.swapaxes(a, 1, 2).astype(wide) for a in (q, k, v))
    g, beta = (jnp.swapaxes(a, 1, 2).astype(wide) for a in (g, beta))
    q, k = l2_normalize(q), l2_normalize(k)
    if state is None:
        state = jnp.zeros((B, Hv, Dk, Dv), wide)
    return q, k, v, g, beta, state.astype(wide)


def _recurrent(q, k, v, g, beta, state):
    """The rule position by position (`torch_recurrent_gated_delta_rule`), head-major float32
    inputs; the state `[B, Hv, Dk, Dv]`. Elementwise products and sums as torch's, not matmuls,
    so each step is the same float32 arithmetic."""
    q = q / jnp.asarray(q.shape[-1] ** 0.5, q.dtype)  # this form divides (the chunked one multiplies)

    def step(S, inputs):
        q_t, k_t, v_t, g_t, b_t = inputs  # [B, Hv, Dk] [B, Hv, Dk] [B, Hv, Dv] [B, Hv] [B, Hv]
        S = S * jnp.exp(g_t)[..., None, None]
        remembered = jnp.sum(S * k_t[..., :, None], axis=-2)  # what S already predicts for k_t
        delta = (v_t - remembered) * b_t[..., None]
        S = S + k_t[..., :, None] * delta[..., None, :]
        return S, jnp.sum(S * q_t[..., :, None], axis=-2)

    time_major = tuple(jnp.moveaxis(a, 2, 0) for a in (q, k, v, g, beta))
    state, out = jax.lax.scan(step, state, time_major)
    return jnp.moveaxis(out, 0, 2), state  # [B, Hv, T, Dv]


def _unit_lower_inverse(system: Float[Array, "... C C"]) -> Float[Array, "... C C"]:
    """(I + A)^-1 for A the strictly lower triangle of `system` (its diagonal and upper triangle
    are not read): A is nilpotent (A^C = 0), so (I + A)^-1 = (I - A)(I + A^2)(I + A^4)... up to
    the power past C, 2 log2 C batched C x C products. On a CPU these run far faster than XLA's
    triangular solve (16 systems of 64 x 64: 180 ms solved), which is a loop over rows."""
    C = system.shape[-1]
    eye = jnp.eye(C, dtype=system.dtype)
    power = -jnp.tril(system, -1)
    inverse = eye + power
    for _ in range(max(0, (C - 1).bit_length() - 1)):  # powers 2, 4, .. below C
        power = power @ power
        inverse = inverse + inverse @ power
    return inverse


def _chunked(q, k, v, g, beta, state, chunk: int):
    """The rule chunk by chunk (`torch_chunk_gated_delta_rule`), head-major float32 inputs.

    Within a chunk of C positions, the C delta-rule updates condense into one unit lower-
    triangular solve (the UT transform of DeltaNet): with A = tril(diag(beta) K K^T * decay, -1),
    the values the chunk writes are (I + A)^-1 (beta V), less what the state entering the chunk
    already predicts. Then one scan over the chunks carries the state. Cost: C^2 (Dk + Dv) per
    position, linear in T; the sequence is padded to a multiple of C with g = beta = 0 and zero
    q, k, v, which leave the state and the real positions' outputs as they are."""
    B, H, T, Dk = k.shape
    Dv = v.shape[-1]
    q = q * jnp.asarray(Dk**-0.5, q.dtype)
    pad = -T % chunk
    q, k, v = (jnp.pad(a, ((0, 0), (0, 0), (0, pad), (0, 0))) for a in (q, k, v))
    g, beta = (jnp.pad(a, ((0, 0), (0, 0), (0, pad))) for a in (g, beta))
    N = (T + pad) // chunk
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, k_beta, v_beta = (a.reshape(B, H, N, chunk, a.shape[-1]) for a in (q, k, k_beta, v_beta))
    # the log decay from the chunk's start to each position in it
    cum = jnp.cumsum(g.reshape(B, H, N, chunk), axis=-1)
    # decay[i, j] = exp(cum_i - cum_j), between positions j <= i of a chunk; the upper triangle
    # (where the difference is positive and could overflow) is -inf before the exp
    upper = jnp.triu(jnp.ones((chunk, chunk), bool), 1)
    decay = jnp.exp(jnp.where(upper, -jnp.inf, cum[..., :, None] - cum[..., None, :]))
    ut_system = jnp.einsum("bhncd,bhnsd->bhncs", k_beta, k) * decay
    intra = jnp.einsum("bhncd,bhnsd->bhncs", q, k) * decay
    decayed_k_beta = k_beta * jnp.exp(cum)[..., None]
    # (I + A)^-1 for both right-hand sides (the diagonal is read as ones: the rule's identity)
    solved = _unit_lower_inverse(ut_system) @ jnp.concatenate([v_beta, decayed_k_beta], axis=-1)
    new_values, k_cumdecay = solved[..., :Dv], solved[..., Dv:]
    # the decays applied once, outside the scan, as transformers does
    q = q * jnp.exp(cum)[..., None]
    k = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])[..., None, None]  # [B, H, N, 1, 1]

    def step(S, inputs):
        new_values_i, k_cumdecay_i, q_i, k_i, intra_i, decay_i = inputs
        v_new = new_values_i - jnp.einsum("bhcd,bhde->bhce", k_cumdecay_i, S)
        out = jnp.einsum("bhcd,bhde->bhce", q_i, S) + jnp.einsum("bhcs,bhse->bhce", intra_i, v_new)
        S = S * decay_i + jnp.einsum("bhcd,bhce->bhde", k_i, v_new)
        return S, out

    chunk_major = tuple(jnp.moveaxis(a, 2, 0) for a in (new_values, k_cumdecay, q, k, intra, chunk_decay))
    state, out = jax.lax.scan(step, state, chunk_major)  # out [N, B, H, C, Dv]
    out = jnp.moveaxis(out, 0, 2).reshape(B, H, N * chunk, Dv)[:, :, :T]
    return out, state


def gated_delta_rule(
    q: Float[Array, "B T Hk Dk"],
    k: Float[Array, "B T Hk Dk"],
    v: Float[Array, "B T Hv Dv"],
    g: Float[Array, "B T Hv"],
    beta: Float[Array, "B T Hv"],
    state: Optional[Float[Array, "B Hv Dk Dv"]] = None,
    *,
    chunk: Optional[int] = None,
) -> tuple[Float[Array, "B T Hv Dv"], Float[Array, "B Hv Dk Dv"]]:
    """The gated delta rule over T positions: `(out [B, T, Hv, Dv], final_state [B, Hv, Dk, Dv])`.

    q, k `[B, T, Hk, Dk]` (raw: l2-normalised here, epsilon 1e-6, and q scaled by Dk^-1/2, as
    transformers does with `use_qk_l2norm_in_kernel`), v `[B, T, Hv, Dv]`, g (the log decay,
    <= 0) and beta (the write strength, in (0, 1)) `[B, T, Hv]`; each key head serves Hv // Hk
    consecutive value heads. `state`: the state before position 0 (None: zeros), a previous
    call's `final_state` to continue a sequence. Everything runs in float32; `out` has q's type,
    the state is float32.

    `chunk=None`: a scan over positions (transformers' recurrent form, what decoding one token at
    a time runs); `chunk=C`: the chunked form (transformers' prefill form, C = 64 there), a C x C
    triangular inverse per chunk (2 log2 C products) and a scan over chunks: fewer, larger products. Both are linear in
    T and equal to float32 rounding."""
    out_dtype = q.dtype
    q, k, v, g, beta, state = _prepared(q, k, v, g, beta, state)
    if chunk is None:
        out, state = _recurrent(q, k, v, g, beta, state)
    else:
        out, state = _chunked(q, k, v, g, beta, state, int(chunk))
    return jnp.swapaxes(out, 1, 2).astype(out_dtype), state


# ----------------------------------------------------------------------------- the mixer


def gated_rms_norm(x: Float[Array, "... Dv"], gate: Float[Array, "... Dv"], weight: Float[Array, " Dv"], eps: float):
    """`Qwen3_5RMSNormGated`: RMSNorm of each value head's output `x` in float32, cast back to
    `x`'s type, times `weight` (type promotion as torch's), times `silu(gate)` taken in float32,
    and the product cast to `x`'s type. (The gate follows the norm: norm, then gate.)"""
    x32 = x.astype(_wide(x.dtype))
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    y = weight * x32.astype(x.dtype)
    return (y * jax.nn.silu(gate.astype(_wide(gate.dtype)))).astype(x.dtype)


def gated_delta_net(
    p: Mapping[str, Array],
    x: Float[Array, "B T D"],
    shape: LinearAttentionShape,
    *,
    valid: Optional[Bool[Array, "B T"]] = None,
    state: Optional[LinearState] = None,
    chunk: Optional[int] = 64,
    heads_only: bool = False,
) -> tuple[Float[Array, "B T D"], LinearState]:
    """The whole gated DeltaNet mixer (`Qwen3_5GatedDeltaNet.forward`) on its normed input
    `x [B, T, D]`: `(out [B, T, D], new_state)`.

    `p` holds the layer's weights, matrices `[in, out]` (torch's Linear weights transposed):
    `linear_qkv [D, C]`, `linear_z [D, Hv*Dv]`, `linear_b [D, Hv]`, `linear_a [D, Hv]`,
    `linear_conv [C, K]`, `linear_dt_bias [Hv]`, `linear_A_log [Hv]`, `linear_norm [Dv]`,
    `linear_out [Hv*Dv, D]`. `valid [B, T]`: False at padding, whose inputs are zeroed first (as
    `apply_mask_to_padding_states`; a real position only reads earlier ones, so right padding
    leaves a prompt's outputs as they are alone). The returned state is each row's after its
    last valid position, as if the row had ended there: the rule neither decays nor writes at a
    position `valid` leaves out (g = beta = 0), and the convolution's state is the K-1 inputs
    before the position after the row's last valid one. So a right-padded prompt's state is
    the one it has alone (what decoding continues from), and a mask of the positions before P
    gives the state at P (what a run from position P continues from). `state`: a
    `LinearState` to continue from (None: the sequence start). `chunk`:
    the rule's chunk (None: the recurrent form; a single position always runs the recurrent
    form, as transformers' decoding step does, rather than padding it to a chunk).
    `heads_only`: return each value head's gated, normed output `[B, T, Hv, Dv]` in place of
    `out` (what the output projection reads: `linear_output` of it is `out`).

    The steps, as transformers: projections qkv, z, b, a; the causal convolution and SiLU on
    qkv, split into q, k, v; beta = sigmoid(b); g = -exp(A_log) softplus(a + dt_bias) in float32
    (in a narrower type exp(A_log) may overflow); the rule; the gated RMSNorm per value head;
    the output projection."""
    B, T, _ = x.shape
    Hk, Hv, Dk, Dv = shape.key_heads, shape.value_heads, shape.key_dim, shape.value_dim
    if valid is not None:
        x = jnp.where(valid[..., None], x, jnp.zeros((), x.dtype))
    mixed = project(x, p["linear_qkv"])
    z = project(x, p["linear_z"]).reshape(B, T, Hv, Dv)
    b = project(x, p["linear_b"])
    a = project(x, p["linear_a"])
    mixed, conv_state = causal_conv(mixed, p["linear_conv"], None if state is None else state.conv, ends=_ends(valid))
    q = mixed[..., : Hk * Dk].reshape(B, T, Hk, Dk)
    k = mixed[..., Hk * Dk : 2 * Hk * Dk].reshape(B, T, Hk, Dk)
    v = mixed[..., 2 * Hk * Dk :].reshape(B, T, Hv, Dv)
    heads, recurrent = _gated_heads(p, (q, k, v, z, a, b), shape, valid, state, chunk)
    state = LinearState(conv=conv_state, recurrent=recurrent)
    return (heads if heads_only else linear_output(p, heads)), state


def linear_output(p: Mapping[str, Array], heads: Float[Array, "B T Hv Dv"], *, per_head: bool = False):
    """The output projection of the value heads' gated, normed outputs `heads`: the mixer's
    output `[B, T, D]`, or (`per_head`) each head's through its rows of it, `[B, T, Hv, D]`."""
    B, T, Hv, Dv = heads.shape
    if per_head:
        return project(heads, p["linear_out"].reshape(Hv, Dv, -1), "bthe,hed->bthd")
    return project(heads.reshape(B, T, Hv * Dv), p["linear_out"])


def _gated_heads(p: Mapping[str, Array], inputs, shape: LinearAttentionShape, valid, state, chunk):
    """From the convolved `q`, `k` (`[B, T, N, Dk]`, N the key heads, or the value heads where
    each value head has its own), `v`, the gate `z` (`[B, T, Hv, Dv]`) and the gates' projections
    `a`, `b` (`[B, T, Hv]`): beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias) in float32
    (in a narrower type exp(A_log) may overflow), the rule, and each value head's gated RMSNorm:
    `(heads [B, T, Hv, Dv], recurrent state)`."""
    q, k, v, z, a, b = inputs
    T = q.shape[1]
    beta = jax.nn.sigmoid(b)
    a32 = a.astype(_wide(a.dtype)) + p["linear_dt_bias"].astype(_wide(a.dtype))
    g = -jnp.exp(p["linear_A_log"].astype(a32.dtype)) * jax.nn.softplus(a32)
    if valid is not None:  # left out: the state passes unchanged (decay exp(0) = 1, no write)
        g = jnp.where(valid[..., None], g, jnp.zeros((), g.dtype))
        beta = jnp.where(valid[..., None], beta, jnp.zeros((), beta.dtype))
    heads, recurrent = gated_delta_rule(
        q, k, v, g, beta, None if state is None else state.recurrent, chunk=chunk if T > 1 else None
    )
    return gated_rms_norm(heads, z, p["linear_norm"], shape.eps), recurrent


def gated_delta_net_heads(
    p: Mapping[str, Array],
    inputs: tuple[Float[Array, "B T Hv D"], Float[Array, "B T Hv D"], Float[Array, "B T Hv D"]],
    shape: LinearAttentionShape,
    *,
    valid: Optional[Bool[Array, "B T"]] = None,
    state: Optional[LinearState] = None,
    chunk: Optional[int] = 64,
    heads_only: bool = False,
) -> tuple[Float[Array, "B T Hv D"], LinearState]:
    """`gated_delta_net` split per value head: `(results [B, T, Hv, D], new_state)`, each value
    head's output through its rows of the output projection, which sum over the heads to the
    mixer's output (to float rounding).

    `inputs = (xq, xk, xv)`, the normed inputs `[B, T, Hv, D]` each value head reads its three
    parts from (a layer split per head, `jaxdepth.core.sites`): from `xq` its key head's query
    channels and its output gate z; from `xk` its key head's key channels and its two gates'
    projections b (beta, the write strength) and a (the decay); from `xv` its value channels.
    Every part of the mixer is per value head but the key heads' queries and keys, which the G
    = Hv / Hk value heads of a group project with their key head's weights (never copied), and
    the convolution, which mixes each channel's K positions: head j's query at position t reads
    `xq[:, t-K+1..t, j]`. With every head's inputs the layer's one normed input, the channels of
    a key head are the same for its G value heads and the results sum to `gated_delta_net`'s
    output. `state`, `valid` and `chunk` as `gated_delta_net`'s; the returned state's
    convolution inputs are, for a key head's channels, those of the first value head of its
    group (the state the unsplit layer carries where the heads' inputs agree). `heads_only`:
    return each value head's gated, normed output `[B, T, Hv, Dv]` in place of its result
    (`linear_output(p, heads, per_head=True)` of it is the results)."""
    xq, xk, xv = inputs
    B, T, Hv, D = xq.shape
    Hk, Dk, Dv = shape.key_heads, shape.key_dim, shape.value_dim
    G = Hv // Hk
    if valid is not None:
        xq, xk, xv = (jnp.where(valid[..., None, None], x, jnp.zeros((), x.dtype)) for x in (xq, xk, xv))
    w = p["linear_qkv"]

    def by_key_head(x, part):  # each value head's key head's channels, with that key head's weights
        weight = w[:, part * Hk * Dk : (part + 1) * Hk * Dk].reshape(D, Hk, Dk)
        return project(x.reshape(B, T, Hk, G, D), weight, "btkgd,dke->btkge").reshape(B, T, Hv * Dk)

    per_value_head = lambda x, weight: project(x, weight.reshape(D, Hv, -1), "bthd,dhe->bthe")  # noqa: E731
    v = per_value_head(xv, w[:, 2 * Hk * Dk :]).reshape(B, T, Hv * Dv)
    z = per_value_head(xq, p["linear_z"])
    b, a = (project(xk, p[name], "bthd,dh->bth") for name in ("linear_b", "linear_a"))
    # The convolution per value head's channels: a key head's taps serve its G value heads.
    conv = p["linear_conv"]
    K = conv.shape[-1]
    key_taps = lambda part: jnp.repeat(conv[part * Hk * Dk : (part + 1) * Hk * Dk].reshape(Hk, Dk, K), G, axis=0)  # noqa: E731
    taps = jnp.concatenate([key_taps(0).reshape(-1, K), key_taps(1).reshape(-1, K), conv[2 * Hk * Dk :]])
    before = None
    if state is not None:  # the clean state's inputs of a key head's channels, for each of its value heads
        old = state.conv
        key_state = (
            lambda part: jnp.repeat(  # noqa: E731
                old[:, part * Hk * Dk : (part + 1) * Hk * Dk].reshape(B, Hk, Dk, K - 1), G, axis=1
            ).reshape(B, Hv * Dk, K - 1)
        )
        before = jnp.concatenate([key_state(0), key_state(1), old[:, 2 * Hk * Dk :]], axis=1)
    mixed = jnp.concatenate([by_key_head(xq, 0), by_key_head(xk, 1), v], axis=-1)
    mixed, conv_state = causal_conv(mixed, taps, before, ends=_ends(valid))
    q = mixed[..., : Hv * Dk].reshape(B, T, Hv, Dk)
    k = mixed[..., Hv * Dk : 2 * Hv * Dk].reshape(B, T, Hv, Dk)
    v = mixed[..., 2 * Hv * Dk :].reshape(B, T, Hv, Dv)
    heads, recurrent = _gated_heads(p, (q, k, v, z, a, b), shape, valid, state, chunk)
    # the first value head of each group's channels of each key head, as the unsplit layer's state
    first = lambda part: conv_state[:, part * Hv * Dk : (part + 1) * Hv * Dk].reshape(B, Hk, G, Dk, K - 1)[:, :, 0]  # noqa: E731
    kept = jnp.concatenate([first(0).reshape(B, Hk * Dk, K - 1), first(1).reshape(B, Hk * Dk, K - 1)], axis=1)
    state = LinearState(conv=jnp.concatenate([kept, conv_state[:, 2 * Hv * Dk :]], axis=1), recurrent=recurrent)
    return (heads if heads_only else linear_output(p, heads, per_head=True)), state
