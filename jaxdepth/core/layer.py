"""One decoder layer: the building blocks, the layer body `layer_step` and what it shows a tap.

`layer_step` is the one layer body: every loop over the layers (`jaxdepth.core.loops`) runs it,
with every intervention at its site (`jaxdepth.core.sites`). Shapes follow the axis glossary of
`jaxdepth.core.model`; `p` is one layer's slice of the layer-stacked params.

Numerics follow Hugging Face transformers: RMSNorm in float32 then cast back before the weight
multiply, rotate-half rotary embedding with float32 angles, attention softmax in float32 with a
finite mask value.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from typing import Any, Callable, Mapping, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from jaxdepth.core import experts
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.linear_attention import (
    LinearAttentionShape,
    LinearState,
    gated_delta_net,
    gated_delta_net_heads,
    linear_output,
)
from jaxdepth.core.parameters import kind_slots
from jaxdepth.core.primitives import ACTIVATIONS, gated_units, project
from jaxdepth.core.sites import (
    SITE_TABLE,
    AnyIntervention,
    acting_sites,
    apply_at,
    refuse_absent_sites,
    splits_layer,
)

__all__ = [
    "norm",
    "layer_norm_of",
    "pre_norm",
    "rotary_frequencies",
    "rotary_tables",
    "longrope_rows",
    "apply_rotary",
    "key_values",
    "input_key_values",
    "KeyValueBuffer",
    "attention_heads",
    "attend",
    "gated_heads",
    "attention_output",
    "attention",
    "mlp_hidden",
    "mlp_output",
    "mlp",
    "mixture",
    "attention_mask",
    "head_projections",
    "LayerRecord",
    "layer_step",
    "LayerContext",
    "context_of_layer",
    "layer_context",
    "piece_context",
    "step_context",
    "check_layer_rows",
    "layer_row",
    "layer_params",
    "every_layer_rows",
    "layer_weights",
    "LayerWeights",
    "one_kind",
    "linear_shape",
    "refuse_linear_prefix",
    "MixerPrefix",
    "check_mixer_prefix",
    "in_layers",
    "value_norm",
    "refuse_typed_attention",
    "refuse_shared_key_values",
    "empty_shared_kv",
    "shared_kv_at",
    "piece_shared_kv",
    "written_shared_kv",
    "layer_key_values",
    "attention_config",
    "per_layer_output",
]


Params = dict[str, Any]


# ----------------------------------------------------------------------------- building blocks


def norm(x: Float[Array, "*b D"], weight, config: ModelConfig, bias=None, eps=None) -> Float[Array, "*b D"]:
    """The family's norm (`ModelConfig.norm`): RMSNorm or LayerNorm (mean removed, then `bias`
    added), normalised in float32, scaled by `norm_offset + weight` after casting back to the
    activations' dtype, or before where `norm_scale_in_float32` (Gemma, OLMo 2). `eps`: another
    epsilon than the config's `rms_norm_eps` (DeepSeek's latent norms)."""
    x32 = x.astype(jnp.float32)
    if config.norm == "layer":
        x32 = x32 - jnp.mean(x32, axis=-1, keepdims=True)
    eps = config.rms_norm_eps if eps is None else eps
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if config.norm_scale_in_float32:
        y = (x32 * (config.norm_offset + weight.astype(jnp.float32))).astype(x.dtype)
    else:
        scale = weight + config.norm_offset if config.norm_offset else weight
        y = scale * x32.astype(x.dtype)
    return y if bias is None else y + bias


def layer_norm_of(p: Params, name: str, x, config: ModelConfig):
    """Norm `name` of one layer (`p`) on `x`, with its bias where the family has one."""
    return norm(x, p[name], config, p.get(f"{name}_bias"))


def pre_norm(p: Params, name: str, x, config: ModelConfig):
    """What a sublayer reads of the residual `x`: its norm `name`, or `x` itself in a family
    without norms before the sublayers (OLMo 2)."""
    return layer_norm_of(p, name, x, config) if config.pre_norms else x


def rotary_frequencies(config: ModelConfig, local: bool = False, long: bool = False) -> np.ndarray:
    """The rotary inverse frequencies [rotated/2], float32, as HF computes them, bit for bit
    (`local`: a sliding layer's, which differ where `local_rope_theta` is set; `long`: under
    'longrope', a prompt's beyond the original context).

    Computed on the host with numpy, never by the compiler. The angle at position t is
    t * inv_freq, so a 1e-5 relative error in one frequency moves a tiny model's late logits by
    3e-4, and XLA may evaluate the same float32 formula differently on different CPUs (traced,
    the llama3 blend came out 2 ulps from HF's on one). Here each step is the float32 IEEE
    operation torch performs, in HF's order, so the bits are the same on every machine; the
    power is correctly rounded (torch's own is within an ulp of that, depending on the CPU).
    Rope type 'llama3' divides the low frequencies by `rope_factor` and blends the middle band
    smoothly (Llama 3.1 / 3.2); 'linear' divides them all by it; 'longrope' divides each by its
    short (or `long`) factor.
    """
    f32 = np.float32
    Dh = config.rotated_dims
    own_base = local and config.local_rope_theta
    theta = config.local_rope_theta if own_base else config.rope_theta
    if config.rope_type == "proportional":
        return _proportional_frequencies(config, float(theta), config.head_dim if own_base else 0)
    exponents = np.arange(0, Dh, 2).astype(f32) / f32(Dh)
    # torch casts the Python base to float32 and raises it to the float32 exponents
    power = (np.float64(f32(theta)) ** exponents.astype(np.float64)).astype(f32)
    if config.rope_type == "longrope" and not own_base:
        factors = config.rope_long_factor if long else config.rope_short_factor
        return f32(1) / (np.asarray(factors, f32) * power)
    if config.rope_type == "yarn" and not own_base:
        return _yarn_frequencies(config, power)
    inv_freq = f32(1) / power
    if config.rope_type == "default" or own_base:
        return inv_freq
    if config.rope_type == "linear":
        return inv_freq / f32(config.rope_factor)
    factor, low, high = config.rope_factor, config.rope_low_freq_factor, config.rope_high_freq_factor
    context = config.rope_original_max_position

    def scalar_over(scalar: float, x: np.ndarray) -> np.ndarray:
        # torch evaluates `python_scalar / tensor` as `tensor.reciprocal() * scalar`
        return (f32(1) / x) * f32(scalar)

    # Python scalars meet float32 tensors: torch casts each scalar to float32 first
    wavelength = scalar_over(2 * np.pi, inv_freq)
    low_edge, high_edge = f32(context / low), f32(context / high)
    scaled = np.where(wavelength > low_edge, inv_freq / f32(factor), inv_freq)
    smooth = (scalar_over(context, wavelength) - f32(low)) / f32(high - low)
    blended = (f32(1) - smooth) * scaled / f32(factor) + smooth * scaled
    middle = ~(wavelength < high_edge) & ~(wavelength > low_edge)
    return np.where(middle, blended, scaled).astype(f32)


def _proportional_frequencies(config: ModelConfig, theta: float, local_width: int) -> np.ndarray:
    """Gemma 4's rotary frequencies as transformers computes them: a full-attention layer's
    ('proportional') over half its head's width, base^(-2i / Dh) for the first `rotary_dim` / 2,
    then zeros, all divided by `rope_factor`; a sliding layer's (`local_width`, its heads' width)
    the plain ones over its whole heads."""
    f32 = np.float32
    width = local_width or config.full_head_dim
    rotated = local_width or config.rotated_dims
    exponents = np.arange(0, rotated, 2).astype(f32) / f32(width)
    inv_freq = f32(1) / (np.float64(f32(theta)) ** exponents.astype(np.float64)).astype(f32)
    if local_width:
        return inv_freq
    inv_freq = np.concatenate([inv_freq, np.zeros(width // 2 - len(inv_freq), f32)])
    return (inv_freq / f32(config.rope_factor)).astype(f32)


def _yarn_frequencies(config: ModelConfig, power: np.ndarray) -> np.ndarray:
    """YaRN's frequencies as transformers computes them: the correction range in float64
    (Python's math), then float32 tensor steps in its order (each Python scalar cast to float32)."""
    f32 = np.float32
    dim, context = config.rotated_dims, config.rope_original_max_position

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(context / (rotations * 2 * math.pi))) / (2 * math.log(config.rope_theta))

    low, high = correction_dim(config.rope_beta_fast), correction_dim(config.rope_beta_slow)
    if config.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (transformers' guard against a zero-width ramp)
    ramp = np.clip((np.arange(dim // 2, dtype=f32) - f32(low)) / f32(high - low), f32(0), f32(1))
    extrapolated = f32(1) - ramp  # the share of each frequency left as it is
    interpolated = f32(1) / (f32(config.rope_factor) * power)
    return (interpolated * (f32(1) - extrapolated) + (f32(1) / power) * extrapolated).astype(f32)


def rotary_tables(
    seq_len: int, config: ModelConfig, local: bool = False, long: Optional[Bool[Array, " B"]] = None
) -> tuple[Float[Array, "*B T R"], Float[Array, "*B T R"]]:
    """cos and sin of the rotate-half rotary embedding over the R rotated dims of a head at
    positions 0..seq_len-1, computed in float32 as HF does (`local`: a sliding layer's,
    `rotary_frequencies`). `[T, R]` each, or, under 'longrope' scaling, `[B, T, R]`: each
    prompt's own, by the long factors where `long[b]` (`longrope_rows`), scaled by the
    attention factor."""

    def tables(inv_freq):
        angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]
        angles = jnp.concatenate([angles, angles], axis=-1)
        return jnp.cos(angles), jnp.sin(angles)

    if config.rope_type == "yarn" and not (local and config.local_rope_theta):
        scale = np.float32(config.rope_attention_factor)
        return tuple(t * scale for t in tables(rotary_frequencies(config, local)))
    if config.rope_type != "longrope" or (local and config.local_rope_theta):
        return tables(rotary_frequencies(config, local))
    if long is None:
        raise ValueError("longrope rotary tables need each prompt's choice of factors (`long`, `longrope_rows`)")
    scale = np.float32(config.rope_attention_factor)
    short, extended = (tables(rotary_frequencies(config, local, f)) for f in (False, True))
    return tuple(jnp.where(long[:, None, None], e, s) * scale for s, e in zip(short, extended))


def longrope_rows(valid: Bool[Array, "B T"], config: ModelConfig) -> Optional[Bool[Array, " B"]]:
    """Per prompt, whether 'longrope' scaling takes its long factors: where the prompt reaches
    past the original context (its last valid position + 1 > `rope_original_max_position`), as
    transformers decides for that prompt alone (for a padded batch it decides by the padded
    length, the whole batch at once). None under any other rope type."""
    if config.rope_type != "longrope":
        return None
    ends = jnp.max(jnp.where(valid, jnp.arange(1, valid.shape[1] + 1), 0), axis=1)
    return ends > config.rope_original_max_position


def apply_rotary(x: Float[Array, "B T N Dh"], cos, sin, *, last: bool = False) -> Float[Array, "B T N Dh"]:
    """Rotate the first R dims of each head (R = the tables' width; the rest pass through), or
    the last R where `last` (DeepSeek's latent attention, `ModelConfig.rotary_last`), or nothing
    where the family has no rotary embedding (`cos` None)."""
    if cos is None:
        return x
    R = cos.shape[-1]
    if R < x.shape[-1] and last:
        return jnp.concatenate([x[..., :-R], apply_rotary(x[..., -R:], cos, sin)], axis=-1)
    if R < x.shape[-1]:
        return jnp.concatenate([apply_rotary(x[..., :R], cos, sin), x[..., R:]], axis=-1)
    half = R // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    # tables [S, R], or [B, S, R] where each prompt's rows sit at positions of their own
    cos, sin = cos[..., None, :].astype(x.dtype), sin[..., None, :].astype(x.dtype)
    return x * cos + rotated * sin


def _qk_norm(p: Params, name: str, x: Float[Array, "B T N Dh"], config: ModelConfig):
    """Qwen3's and Gemma 3's norm over each head, or OLMo 2's over the whole projection."""
    if not config.qk_norm:
        return x
    if config.qk_norm_scope == "head":
        return norm(x, p[name], config)
    flat = norm(x.reshape(x.shape[:2] + (-1,)), p[name], config)
    return flat.reshape(x.shape)


# The epsilon of DeepSeek's latent norms: transformers builds them with its RMSNorm's default.
LATENT_NORM_EPS = 1e-6


def _query_latent(p: Params, x, config: ModelConfig):
    """DeepSeek's normed query latent of `x` (`q_a`, then `q_a_norm`), which `q_b` expands."""
    return norm(project(x, p["q_a"]), p["q_a_norm"], config, eps=LATENT_NORM_EPS)


def _projected(p: Params, x, name: str, heads: int, config: ModelConfig):
    B, T, _ = x.shape
    if name == "q" and config.q_lora_rank:  # through the queries' normed latent
        y = project(_query_latent(p, x, config), p["q_b"])
    else:
        y = project(x, p[name])
    if config.qkv_bias:
        y = y + p[f"{name}_bias"]
    return y.reshape(B, T, heads, -1)


def _rotated(x, cos, sin, config: ModelConfig):
    return apply_rotary(x, cos, sin, last=config.rotary_last)


def _latent_key_values(p: Params, x: Float[Array, "*b D"], config: ModelConfig, per_head: bool = False):
    """Latent attention's keys and values `[*b, H, Dh]`, `[*b, H, Dv]` before the rotation, from
    the normed latent of `x` (`kv_a`, then `kv_a_norm` and each head's part of `kv_b`) and the
    rotary key beside it (shared by the heads). `per_head`: `x` is `[*b, H, D]`, an input per
    head (a split layer), each head expanding its own latent."""
    a = project(x, p["kv_a"])
    rank, R, H = config.kv_lora_rank, config.rotated_dims, config.num_heads
    latent = norm(a[..., :rank], p["kv_a_norm"], config, eps=LATENT_NORM_EPS)
    kv_b = p["kv_b"].reshape(rank, H, -1)
    kv = project(latent, kv_b, "...hr,rhe->...he" if per_head else "...r,rhe->...he")
    nope = config.head_dim - R
    k_rot = a[..., rank:] if per_head else jnp.broadcast_to(a[..., None, rank:], kv.shape[:-1] + (R,))
    return jnp.concatenate([kv[..., :nope], k_rot.astype(kv.dtype)], axis=-1), kv[..., nope:]


def value_norm(v: Float[Array, "*b Dh"], config: ModelConfig) -> Float[Array, "*b Dh"]:
    """Gemma 4's norm of each value head (and of its router's input): an RMSNorm without a
    weight, in float32, cast back."""
    v32 = v.astype(jnp.float32)
    return (v32 * jax.lax.rsqrt(jnp.mean(v32 * v32, axis=-1, keepdims=True) + config.rms_norm_eps)).astype(v.dtype)


def key_values(p: Params, x: Float[Array, "B T D"], cos, sin, config: ModelConfig):
    """Rotated keys and values `[B, T, K, Dh]` of one layer on its normed input `x` (the values
    its keys' projection where `keys_as_values`, normed where `value_norm`). Refused where the
    layers' attention comes in two shapes or shares keys and values (`refuse_typed_attention`):
    there the layer's type says which weights and keys it reads (`layer_step`)."""
    refuse_typed_attention(config, "keys and values of one layer")
    if config.kv_lora_rank:
        k, v = _latent_key_values(p, x, config)
        return _rotated(k, cos, sin, config), v
    K = config.num_kv_heads
    raw = _projected(p, x, "k", K, config)
    k = _qk_norm(p, "k_norm", raw, config)
    v = raw if config.keys_as_values else _projected(p, x, "v", K, config)
    return _rotated(k, cos, sin, config), value_norm(v, config) if config.value_norm else v


def input_key_values(p: Params, h: Float[Array, "B T D"], cos, sin, config: ModelConfig):
    """`key_values` of one layer on its input `h` (before the attention norm)."""
    return key_values(p, pre_norm(p, "attn_norm", h, config), cos, sin, config)


class KeyValueBuffer(NamedTuple):
    """One layer's decoding buffer, head-major so that attention reads it where it lies: keys
    and values `[B, K, S, Dh]`, and the position `[B]` at which each row's new token's key and
    value are written before it attends (a `prefix` of `attention_heads` and `layer_step`, with
    the context of `step_context(..., buffered=True)`). The layer's record then holds the
    updated buffers as its `k` and `v`: decoding carries them to the next token with no copy
    (a `(keys, values)` prefix is concatenated with the new key at every step)."""

    keys: Array
    values: Array
    position: Array


def attention_heads(
    p: Params,
    x: Float[Array, "B S D"],
    cos,
    sin,
    mask: Bool[Array, "B S T"],
    config: ModelConfig,
    prefix: Optional[tuple[Array, Array]] = None,
):
    """Causal grouped-query self-attention of one layer (`p` holds that layer's weights), up to
    the heads' outputs: `(q [B,S,H,Dh], k [B,T,K,Dh], v [B,T,K,Dh], probs [B,H,S,T],
    heads [B,S,H,Dh])`, keys and values including the prefix.

    `prefix = (keys, values)`, each `[B, P, K, Dh]`, are the keys and values of P positions
    before those of `x`: the queries of `x` attend to them as well as to `x` (T = P + S keys).
    A `KeyValueBuffer` prefix (one new token per row, S = 1) takes the token's key and value
    at its position instead; the keys and values returned are then the buffers `[B, K, T, Dh]`.
    """
    refuse_typed_attention(config, "attention_heads")
    q = _qk_norm(p, "q_norm", _projected(p, x, "q", config.num_heads, config), config)
    q = _rotated(q, cos, sin, config)
    k, v = key_values(p, x, cos, sin, config)
    if isinstance(prefix, KeyValueBuffer):
        if x.shape[1] != 1:
            raise ValueError(f"a KeyValueBuffer takes one new token per row, got {x.shape[1]}")
        rows = jnp.arange(x.shape[0])
        write = lambda buffer, new: buffer.at[rows, :, prefix.position].set(new[:, 0].astype(buffer.dtype))  # noqa: E731
        k, v = write(prefix.keys, k), write(prefix.values, v)
        probs, heads = attend(q, k, v, mask, config, head_major=True, sinks=p.get("sinks"))
        return q, k, v, probs, gated_heads(p, x, heads, config)
    if prefix is not None:
        k, v = jnp.concatenate([prefix[0], k], axis=1), jnp.concatenate([prefix[1], v], axis=1)
    probs, heads = attend(q, k, v, mask, config, sinks=p.get("sinks"))
    return q, k, v, probs, gated_heads(p, x, heads, config)


def gated_heads(p: Params, x, heads: Float[Array, "B S H Dh"], config: ModelConfig) -> Float[Array, "B S H Dh"]:
    """The heads' outputs, each times the sigmoid of its gate projected from the attention's
    normed input `x` (`[B, S, D]`, or `[B, S, H, D]` in a layer split per head: each head's own
    query input) where the family gates them (Qwen3.5, `ModelConfig.attention_gate`)."""
    if not config.attention_gate:
        return heads
    B, S, H, Dh = heads.shape
    if x.ndim == 4:  # each head's gate from its own query input
        gate = project(x, p["attn_gate"].reshape(-1, H, Dh), "bshd,dhe->bshe")
    else:
        gate = project(x, p["attn_gate"]).reshape(B, S, H, Dh)
    return heads * jax.nn.sigmoid(gate)


def attend(
    q: Float[Array, "B S H Dh"],
    k: Float[Array, "B T N Dh"],
    v: Float[Array, "B T N Dh"],
    mask: Bool[Array, "B S T"],
    config: ModelConfig,
    *,
    head_major: bool = False,
    sinks: Optional[Float[Array, " H"]] = None,
):
    """Softmax attention of the (rotated) queries over keys and values of N heads, where N divides
    H: query head h reads key/value head h // (H // N). N = K is grouped-query attention; N = H
    gives every query head keys and values of its own (the per-head readers of
    `jaxdepth.analyses.edges`). Scores are scaled by `config.attn_scale` (default Dh**-0.5) and
    soft-capped where the family caps them; in a family with attention sinks (GPT-OSS), each
    head's `sinks` logit joins the softmax and is dropped after it (the probabilities then sum
    to less than 1). Returns `(probs [B, H, S, T], heads [B, S, H, Dh])`.
    `head_major`: k and v are `[B, N, T, Dh]` (a `KeyValueBuffer`'s layout)."""
    B, S, H, Dh = q.shape
    N = k.shape[1 if head_major else 2]
    keys = "bksd" if head_major else "bskd"
    # Group query heads by the kv head they read: head h = kv * G + g.
    grouped = q.reshape(B, S, N, H // N, Dh)
    scores = jnp.einsum(f"btkgd,{keys}->bkgts", grouped, k, preferred_element_type=jnp.float32)
    scores = scores * (config.attn_scale or Dh**-0.5)
    if config.attn_softcap:
        scores = jnp.tanh(scores / config.attn_softcap) * config.attn_softcap
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    if config.attention_sinks != (sinks is not None):
        raise ValueError(f"{config.model_type!r} attention takes {'its' if config.attention_sinks else 'no'} sinks")
    if sinks is None:
        weights = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    else:  # the sink of head h = kv * G + g, a column of its own, dropped after the softmax
        sink = sinks.astype(jnp.float32).reshape(N, H // N)[None, :, :, None, None]
        joined = jnp.concatenate([scores, jnp.broadcast_to(sink, scores.shape[:-1] + (1,))], axis=-1)
        weights = jax.nn.softmax(joined, axis=-1)[..., :-1].astype(q.dtype)
    heads = jnp.einsum(f"bkgts,{keys}->btkgd", weights, v).reshape(B, S, H, v.shape[-1])
    return weights.reshape(B, H, S, -1), heads


def attention_output(p: Params, heads: Float[Array, "B S H Dh"], config: ModelConfig) -> Float[Array, "B S D"]:
    """What the residual receives from the heads: the output projection (and its bias), then the
    post-attention norm where the family has one."""
    return _attention_written(p, project(heads.reshape(heads.shape[:2] + (-1,)), p["o"]), config)


def _attention_written(p: Params, projected: Float[Array, "B S D"], config: ModelConfig) -> Float[Array, "B S D"]:
    """The heads' projected sum as the residual receives it: plus the output bias, then the
    post-attention norm, where the family has them."""
    a = projected + p["o_bias"] if config.o_bias else projected
    return _after_sublayer(p, "attn_post_norm", a, config)


def _after_sublayer(p: Params, name: str, y, config: ModelConfig):
    return layer_norm_of(p, name, y, config) if config.post_norms else y


def attention(
    p: Params,
    x: Float[Array, "B S D"],
    cos,
    sin,
    mask: Bool[Array, "B S T"],
    config: ModelConfig,
    prefix: Optional[tuple[Array, Array]] = None,
) -> Float[Array, "B S D"]:
    """The attention output a of one layer, as the residual receives it; `prefix` as in
    `attention_heads`."""
    return attention_output(p, attention_heads(p, x, cos, sin, mask, config, prefix)[-1], config)


def mlp_hidden(p: Params, x: Float[Array, "B T D"], config: ModelConfig) -> Float[Array, "B T F"]:
    """The MLP's hidden units on its normed input: `act(x W_gate) * (x W_up)` (gated) or
    `act(x W_up)` (plain), with biases where the family has them."""
    act = ACTIVATIONS[config.activation]

    def linear(name):
        y = project(x, p[name])
        return y + p[f"{name}_bias"] if config.mlp_bias else y

    if config.mlp == "plain":
        return act(linear("up"))
    return gated_units(linear("gate"), linear("up"), config)


def mlp_output(p: Params, hidden: Float[Array, "B T F"], config: ModelConfig) -> Float[Array, "B T D"]:
    """What the residual receives from the MLP's hidden units: the down projection (and its
    bias), then the post-MLP norm where the family has one."""
    m = project(hidden, p["down"])
    return _after_sublayer(p, "mlp_post_norm", m + p["down_bias"] if config.mlp_bias else m, config)


def mlp(p: Params, x: Float[Array, "B T D"], config: ModelConfig) -> Float[Array, "B T D"]:
    """The MLP's output from its normed input: `mlp_output` of `mlp_hidden`, or the mixture of
    experts' (`mixture`) where the family has one. Among layers of two kinds the layer's index
    says which runs: refused (`layer_step` takes it)."""
    if config.mixed_mlps or config.wide_mlp_layers:
        raise ValueError("this model's layers have MLPs of two kinds, which the layer's index picks: run layer_step")
    if config.expert_norms:
        raise ValueError("Gemma 4's router and experts read the MLP's input before its norm: run layer_step")
    if config.is_moe:
        return mixture(p, x, config, lambda site, value: value)[0]
    return mlp_output(p, mlp_hidden(p, x, config), config)


def mixture(
    p: Params,
    x: Float[Array, "B T D"],
    config: ModelConfig,
    at,
    *,
    edited_weights: bool = False,
    edited_hidden: bool = False,
    residual: Optional[Array] = None,
):
    """A mixture of experts on its normed input `x` (`jaxdepth.core.experts`): `(m, parts)`, m
    what the residual receives (after the post-MLP norm where the family has one), `parts` the
    router's logits, scores, selection and weights, the chosen experts (`expert_choice`
    `[B, T, k]`, best first) and their outputs. `at(site, value)` applies the interventions at
    each site; `edited_weights`: one acts at `expert_weights`, so the experts that run are
    those it leaves a weight; `edited_hidden`: one acts at `expert_hidden`, the experts' hidden
    units (`jaxdepth.core.experts.expert_outputs`). Where `config.expert_norms` (Gemma 4) the
    router and the experts read norms of their own of `residual`, the MLP's input before its
    norm, and `x` is the shared MLP's input alone."""
    router_in, experts_in = x, x
    if config.expert_norms:
        if residual is None:
            raise ValueError("Gemma 4's router and experts read the MLP's input before its norm: give residual=")
        scale = p["router_scale"] * config.hidden_size**-0.5
        router_in = value_norm(residual, config) * scale.astype(residual.dtype)
        experts_in = layer_norm_of(p, "expert_norm", residual, config)
    logits = at("router_logits", experts.router_logits(p, router_in, config))
    scores = at("router_probs", experts.router_scores(logits, config))
    selection = at("router_selection", experts.selection_of(p, scores, config))
    chosen = experts.choose_experts(selection, config)
    weights = experts.chosen_weights(scores, chosen, config)
    if config.expert_norms:  # each chosen expert's own scale, after the renormalisation
        weights = weights * p["router_expert_scale"][chosen]
    weights = at("expert_weights", experts.dense_weights(weights, chosen, config))
    too_many = None
    if edited_weights:
        chosen, too_many = experts.experts_of_weights(weights, config)
    outputs, hidden = experts.expert_outputs(p, experts_in, chosen, config, at, edited_hidden)
    outputs = at("expert_out", outputs)
    m = experts.combine_experts(outputs, jnp.take_along_axis(weights, chosen, axis=-1), too_many)
    shared = None
    if config.shared_expert_size:
        shared = experts.shared_experts(p, x, config)
        if config.expert_norms:  # each part its own post-norm before they are summed
            m = layer_norm_of(p, "expert_post_norm", m, config)
            shared = layer_norm_of(p, "shared_post_norm", shared, config)
        shared = at("shared_out", shared)
        m = m + shared
    parts = dict(
        shared_out=shared,
        router_logits=logits,
        router_probs=scores,
        router_selection=selection,
        expert_weights=weights,
        expert_choice=chosen,
        expert_hidden=hidden,
        expert_out=outputs,
    )
    return _after_sublayer(p, "mlp_post_norm", m, config), parts


def attention_mask(valid: Bool[Array, "B T"], offset: int = 0, window: int = 0) -> Bool[Array, "B S T"]:
    """Causal mask restricted to valid keys: the query at position t sees keys s <= t with
    valid[s] (and t - s < `window`, where a window is given). The queries are positions
    `offset..T-1` (all of them by default)."""
    T = valid.shape[1]
    keys, queries = jnp.arange(T)[None, :], jnp.arange(offset, T)[:, None]
    seen = keys <= queries
    if window:
        seen = seen & (queries - keys < window)
    return seen[None] & valid[:, None, :]


def head_projections(p: Params, xq, xk, xv, cos, sin, config: ModelConfig):
    """Rotated queries, keys and values `[B, T, H, Dh]` of every query head from normed inputs
    of its own `[B, T, H, D]` (a split layer, `jaxdepth.core.sites`): the key and value inputs
    of the G heads of a group are projected with that group's weights, never copied per head."""
    B, T, H, _ = xq.shape
    K, Dh = config.num_kv_heads, config.head_dim

    def per_group(x, name, heads):
        w = p[name].reshape(-1, heads, Dh)
        grouped = x.reshape(B, T, heads, H // heads, -1)
        y = project(grouped, w, "btkgd,dke->btkge")
        if config.qkv_bias:
            y = y + p[f"{name}_bias"].reshape(heads, 1, Dh)
        return y.reshape(B, T, H, Dh)

    def normed_whole(x, name, heads):
        # OLMo 2 normalises a head's query (key) with the rest of the projection of the same
        # input: each query head's input is its own here, so it is projected whole, per head.
        y = project(x, p[name])
        if config.qkv_bias:
            y = y + p[f"{name}_bias"]
        y = norm(y, p[f"{name}_norm"], config).reshape(B, T, H, heads, Dh)
        own = (jnp.arange(H) // (H // heads))[None, None, :, None, None]
        return jnp.take_along_axis(y, own, axis=3)[:, :, :, 0]

    if config.kv_lora_rank:  # each head's key and value from a latent of its own input
        if config.q_lora_rank:
            q = project(_query_latent(p, xq, config), p["q_b"].reshape(-1, H, Dh), "bthr,rhe->bthe")
        else:
            q = per_group(xq, "q", H)
        k = _latent_key_values(p, xk, config, per_head=True)[0]
        v = _latent_key_values(p, xv, config, per_head=True)[1]
        return _rotated(q, cos, sin, config), _rotated(k, cos, sin, config), v
    refuse_typed_attention(config, "a layer split per head")
    v = per_group(xv, "k" if config.keys_as_values else "v", K)
    v = value_norm(v, config) if config.value_norm else v
    if config.qk_norm and config.qk_norm_scope == "projection":
        q, k = normed_whole(xq, "q", H), normed_whole(xk, "k", K)
    else:
        q, k = per_group(xq, "q", H), per_group(xk, "k", K)
        q, k = _qk_norm(p, "q_norm", q, config), _qk_norm(p, "k_norm", k, config)
    return _rotated(q, cos, sin, config), _rotated(k, cos, sin, config), v


# ----------------------------------------------------------------------------- the layer body


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerRecord:
    """What a tap sees of layer `index`, every site after its interventions (`jaxdepth.core.sites`):
    its input `h` (= h_l, site `resid_pre`), the queries `q` `[B,S,H,Dh]`, keys and values `k`,
    `v` `[B,T,K,Dh]` (rotated; with a prefix, T = P + S; per query head, `[B,T,H,Dh]`, in a
    split layer), attention probabilities `attn_probs` `[B,H,S,T]`, the heads' outputs
    `head_out` `[B,S,H,Dh]`, the sublayer outputs `attn` (= a_l) and `mlp` (= m_l), the MLP's
    input `mlp_in` and `mlp_hidden` `[B,S,F]`, its output `out` (= h_{l+1}), the sites of a
    split layer (`q_in`, `k_in`, `v_in`, `head_result`; None in a layer that is not split), a
    mixture of experts' router and experts (`router_logits`, `router_probs`,
    `router_selection`, `expert_weights` `[B,T,E]`, the chosen `expert_choice` `[B,T,k]`, their
    hidden units `expert_hidden` `[B,T,k,F]` and outputs `expert_out` `[B,T,k,D]`, the shared
    experts' `shared_out`; None in a dense MLP, whose `mlp_hidden` is None in a mixture; zeros
    on the other kind's layers among layers of two kinds), the per-layer inputs'
    contribution `per_layer` `[B,T,D]` (Gemma 4, site `per_layer_out`; None elsewhere), a
    linear-attention layer's
    `linear_state` after its last position (a `LinearState`: what a later run from there
    continues from; None in a model without linear attention, zeros on its attention layers,
    whose `q`, `k`, `v` and `attn_probs` are zeros on the linear-attention ones, where `head_out`
    holds the value heads' gated, normed outputs, `ModelConfig.head_out_shape` wide), and
    the carried `states` of stateful interventions after the layer, and `shared_kv`, the keys and
    values a layer type's later layers may share after this layer (Gemma 4's
    `shared_kv_layers`: per layer type 'sliding' / 'full', `(keys, values)` `[B,T,K,Dh]` in that
    type's own shapes; None in a model that shares none). Where layers' heads differ in width or
    key/value heads (`ModelConfig.global_layers`), `q`, `k`, `v` and `head_out` are as wide as
    the widest (`widest_head_dim`, `most_kv_heads`) and zero beyond a layer's own; `mlp_hidden`
    likewise (`widest_mlp`). Only what a tap reads is kept: XLA drops the rest."""

    index: Int[Array, ""]
    h: Float[Array, "B T D"]
    attn: Float[Array, "B T D"]
    mlp: Float[Array, "B T D"]
    out: Float[Array, "B T D"]
    q: Optional[Array] = None
    k: Optional[Array] = None
    v: Optional[Array] = None
    attn_probs: Optional[Array] = None
    head_out: Optional[Array] = None
    mlp_in: Optional[Array] = None
    mlp_hidden: Optional[Array] = None
    q_in: Optional[Array] = None
    k_in: Optional[Array] = None
    v_in: Optional[Array] = None
    head_result: Optional[Array] = None
    router_logits: Optional[Array] = None
    router_probs: Optional[Array] = None
    router_selection: Optional[Array] = None
    expert_weights: Optional[Array] = None
    expert_choice: Optional[Array] = None
    expert_hidden: Optional[Array] = None
    expert_out: Optional[Array] = None
    shared_out: Optional[Array] = None
    linear_state: Optional[LinearState] = None
    per_layer: Optional[Array] = None
    states: tuple = ()
    shared_kv: Any = None

    @property
    def delta(self) -> Float[Array, "B T D"]:
        """The layer's contribution to the residual, h_{l+1} - h_l."""
        return self.out - self.h


# The site names of `jaxdepth.core.sites`, for taps written with them (`record.resid_pre` is
# `record.h`): one property per site whose record field has another name, from the site table.
for _site in SITE_TABLE:
    if _site.name != _site.record:
        setattr(LayerRecord, _site.name, property(operator.attrgetter(_site.record), doc=f"`{_site.record}`"))
del _site

Tap = Callable[[LayerRecord, Any], Any]


def layer_step(
    p: Params,
    h: Float[Array, "B S D"],
    index,
    context,
    config: ModelConfig,
    interventions: tuple[AnyIntervention, ...] = (),
    prefix=None,
    states: tuple = (),
    *,
    shared_kv=None,
) -> LayerRecord:
    """One decoder layer (`p` holds its weights) with every intervention at its site:
    `a = Attn(norm(h))`, `m = MLP(norm(h + a))` (or `MLP(norm(h))` in a parallel block),
    `out = h + a + m`, where a and m are what the residual receives (after the post-sublayer
    norms of the families that have them). The one layer body of every loop over the layers
    (`jaxdepth.core.loops`).

    `context` is a `LayerContext` (`layer_context`, `piece_context`); `index` the (traced)
    layer index; `prefix` the keys and values of earlier positions `[B, P, K, Dh]` each, as in
    `attention_heads` (a `MixerPrefix` in a model with linear-attention layers); `states` what
    stateful interventions carry into the layer (`jaxdepth.core.sites.initial_states`; () when
    none is stateful). The layer is split per head when an intervention acts at a split site
    (`jaxdepth.core.sites.SPLIT_SITES`).

    Gemma 4 (`ModelConfig`): a layer of `shared_kv_layers` attends to the keys and values in
    `shared_kv` (`empty_shared_kv`, then each layer's record's `shared_kv`: a loop carries them
    from layer to layer); without them, a layer that may reuse keys is refused. A layer with
    per-layer inputs reads its own from `context.per_layer_inputs`."""
    typed = bool(config.global_layers or config.shared_kv_layers)
    cos, sin, mask = (None, None, None) if config.global_layers else context_of_layer(context, index, config)
    carried = states

    def at(site, value):
        nonlocal carried
        value, carried = apply_at(site, value, index, interventions, config.num_layers, carried)
        return value

    def carrying(f):
        """`f(x) -> (value, record fields)` as a branch of `one_kind`, `(x, states) -> (value,
        fields, states)`: a branch is traced on its own, so the stateful interventions' states
        go in and come out as values rather than through `carried`."""

        def branch(x, states):
            nonlocal carried
            outer, carried = carried, states
            try:
                return (*f(x), carried)
            finally:
                carried = outer

        return branch

    refuse_absent_sites(interventions, config)
    h = at("resid_pre", h)
    split, linear_state = {}, None
    if splits_layer(interventions):
        if isinstance(prefix, KeyValueBuffer):
            raise ValueError("a layer split per head takes a (keys, values) prefix, not a KeyValueBuffer")
        B, S, D = h.shape
        Hs = config.split_heads  # among linear-attention layers, rows past a layer's own heads are zeros
        per_head = jnp.broadcast_to(h[:, :, None, :], (B, S, Hs, D))
        split = {name: at(name, per_head) for name in ("q_in", "k_in", "v_in")}

        def split_attention(split):
            H = config.num_heads
            xq, xk, xv = (pre_norm(p, "attn_norm", split[name][:, :, :H], config) for name in ("q_in", "k_in", "v_in"))
            q, k, v = head_projections(p, xq, xk, xv, cos, sin, config)
            if prefix is not None:  # each query head reads its group's keys and values
                G = H // config.num_kv_heads
                k = jnp.concatenate([jnp.repeat(prefix[0], G, axis=2).astype(k.dtype), k], axis=1)
                v = jnp.concatenate([jnp.repeat(prefix[1], G, axis=2).astype(v.dtype), v], axis=1)
            probs, heads = attend(q, k, v, mask, config, sinks=p.get("sinks"))
            heads = at("head_out", _as_head_out(gated_heads(p, xq, heads, config), config))
            per_head_o = p["o"].reshape(H, config.v_head_dim, D)
            own = heads[:, :, :H, : config.v_head_dim]
            result = at("head_result", _widened(project(own, per_head_o, "bshe,hed->bshd"), D, Hs))
            a = at("attn_out", _attention_written(p, jnp.sum(result, axis=2), config))
            return a, dict(q=q, k=k, v=v, attn_probs=probs, head_out=heads, head_result=result)

        def split_linear(split):  # each value head's query, key and value inputs (gated_delta_net_heads)
            Hv = config.linear_value_heads
            xs = tuple(pre_norm(p, "attn_norm", split[name][:, :, :Hv], config) for name in ("q_in", "k_in", "v_in"))
            state = None if prefix is None else prefix.linear
            shape = linear_shape(config)
            heads, state = gated_delta_net_heads(p, xs, shape, valid=context.valid, state=state, heads_only=True)
            heads = at("head_out", _as_head_out(heads, config))
            results = linear_output(p, heads[:, :, :Hv, : shape.value_dim], per_head=True)
            result = at("head_result", _widened(results, D, Hs))
            a = at("attn_out", _after_sublayer(p, "attn_post_norm", jnp.sum(result, axis=2), config))
            return a, dict(head_out=heads, head_result=result, linear_state=state)

        if config.mixed_mixers:
            check_mixer_prefix(prefix, config)
            linear = in_layers(index, config.linear_layers, config)
            a, mixed, carried = one_kind(linear, carrying(split_attention), carrying(split_linear), split, carried)
        else:
            a, mixed = split_attention(split)
        q, k, v, probs, heads = (mixed[name] for name in ("q", "k", "v", "attn_probs", "head_out"))
        split["head_result"], linear_state = mixed["head_result"], mixed.get("linear_state")
    elif typed:  # Gemma 4: each layer type's own attention shapes, keys shared among layers of a type
        if isinstance(prefix, KeyValueBuffer):
            raise ValueError(
                "a model whose attention comes in two shapes or shares keys and values takes a (keys, values) "
                "prefix, not a KeyValueBuffer: decode it with generate, not generate_orders"
            )

        def typed_branch(full: bool):
            @carrying
            def branch(operand):
                x, shared = operand
                w, tc, q, k, v, probs, heads, shared = _typed_heads(p, x, index, context, config, full, prefix, shared)
                widest = at("head_out", _widened(heads, config.widest_head_dim))
                a = at("attn_out", attention_output(w, widest[..., : tc.head_dim], tc))
                K, Dh = config.most_kv_heads, config.widest_head_dim
                fields = dict(q=_widened(q, Dh), k=_widened(k, Dh, K), v=_widened(v, Dh, K), attn_probs=probs)
                return a, dict(fields, head_out=widest, shared_kv=shared)

            return branch

        x = pre_norm(p, "attn_norm", h, config)
        full = _is_full(index, config)
        a, mixed, carried = one_kind(full, typed_branch(False), typed_branch(True), (x, shared_kv), carried)
        q, k, v, probs, heads = (mixed[name] for name in ("q", "k", "v", "attn_probs", "head_out"))
        shared_kv = mixed["shared_kv"]
    elif config.mixed_mixers:  # each layer its own mixer only: attention or linear attention
        check_mixer_prefix(prefix, config)

        @carrying
        def attention_branch(h):
            kv = None if prefix is None else (prefix.keys, prefix.values)
            q, k, v, probs, heads = attention_heads(p, pre_norm(p, "attn_norm", h, config), cos, sin, mask, config, kv)
            heads = at("head_out", _as_head_out(heads, config))
            a = at("attn_out", attention_output(p, heads[:, :, : config.num_heads, : config.v_head_dim], config))
            return a, dict(q=q, k=k, v=v, attn_probs=probs, head_out=heads)

        @carrying
        def linear_branch(h):
            x = pre_norm(p, "attn_norm", h, config)
            state = None if prefix is None else prefix.linear
            shape = linear_shape(config)
            heads, state = gated_delta_net(p, x, shape, valid=context.valid, state=state, heads_only=True)
            heads = at("head_out", _as_head_out(heads, config))
            out = linear_output(p, heads[:, :, : shape.value_heads, : shape.value_dim])
            a = at("attn_out", _after_sublayer(p, "attn_post_norm", out, config))
            return a, {"linear_state": state, "head_out": heads}

        a, mixed, carried = one_kind(
            in_layers(index, config.linear_layers, config), attention_branch, linear_branch, h, carried
        )
        q, k, v, probs, heads = (mixed[name] for name in ("q", "k", "v", "attn_probs", "head_out"))
        linear_state = mixed["linear_state"]
    else:
        q, k, v, probs, heads = attention_heads(p, pre_norm(p, "attn_norm", h, config), cos, sin, mask, config, prefix)
        heads = at("head_out", heads)
        a = at("attn_out", attention_output(p, heads, config))
    mlp_in = at("mlp_in", h if config.parallel_residual else h + a)
    x = pre_norm(p, "mlp_norm", mlp_in, config)
    acting = acting_sites(interventions)

    @carrying
    def sparse(x):
        return mixture(
            p,
            x,
            config,
            at,
            edited_weights="expert_weights" in acting,
            edited_hidden="expert_hidden" in acting,
            residual=mlp_in,
        )

    def dense_of(w):
        @carrying
        def dense(x):
            hidden = mlp_hidden(w, x, config)
            widest = at("mlp_hidden", _widened(hidden, config.widest_mlp))
            return mlp_output(w, widest[..., : hidden.shape[-1]], config), {"mlp_hidden": widest}

        return dense

    dense = dense_of(p)
    if config.mixed_mlps:  # each layer runs its own kind's MLP only
        m, parts, carried = one_kind(in_layers(index, config.dense_layers, config), sparse, dense, x, carried)
    elif config.wide_mlp_layers:  # Gemma 4's double-wide MLPs beside the others
        wide = dense_of(_Renamed(p, _WIDE))
        m, parts, carried = one_kind(in_layers(index, config.wide_mlp_layers, config), dense, wide, x, carried)
    else:
        m, parts, carried = (sparse if config.is_moe else dense)(x, carried)
    m = at("mlp_out", m)
    added, per_layer = a + m, None
    if config.per_layer_input_size:  # Gemma 4's per-layer inputs, read by the residual after the MLP
        per_layer = at("per_layer_out", per_layer_output(p, h + a + m, index, context, config))
        added = added + per_layer
    if config.layer_scalar:  # out = s (h + a + m + e), as h + delta
        scale = p["layer_scalar"]
        added = (scale - 1) * h + scale * added
    out = at("resid_post", h + at("delta", added))
    return LayerRecord(
        index=index,
        h=h,
        attn=a,
        mlp=m,
        out=out,
        q=q,
        k=k,
        v=v,
        attn_probs=probs,
        head_out=heads,
        mlp_in=mlp_in,
        linear_state=linear_state,
        per_layer=per_layer,
        states=carried,
        shared_kv=shared_kv,
        **split,
        **parts,
    )


class LayerContext(NamedTuple):
    """What every layer of one run shares: rotary tables `(cos, sin)` `[S, R]` (None in a family
    without rotary embeddings) and the attention mask `[B, S, T]` of the full-attention layers,
    and those of the sliding layers (`local_rotary` None where they share the full layers'
    tables; `mask` None where every layer slides, `local_mask` None where none does), and
    Gemma 4's per-layer inputs of the rows (`jaxdepth.core.model.per_layer_inputs`; None in a
    model without them). `context_of_layer` picks a layer's."""

    rotary: Optional[tuple]
    mask: Optional[Array]
    local_rotary: Optional[tuple] = None
    local_mask: Optional[Array] = None
    valid: Optional[Array] = None  # [B, S]: which of the rows are real, what linear attention zeroes
    per_layer_inputs: Optional[Array] = None  # [B, S, L, P]: each row's per-layer inputs (Gemma 4)


def _context(rotary_of: Callable[[bool], Optional[tuple]], mask_of: Callable[[int], Array], config: ModelConfig):
    """A `LayerContext` from `rotary_of(local)` and `mask_of(window)` (0: no window)."""
    sliding = config.sliding_layers
    rotary = rotary_of(False) if config.positions == "rotary" else None
    own_local_tables = any(sliding) and rotary is not None and config.local_rope_theta
    return LayerContext(
        rotary=rotary,
        mask=None if all(sliding) else mask_of(0),
        local_rotary=rotary_of(True) if own_local_tables else None,
        local_mask=mask_of(config.sliding_window) if any(sliding) else None,
    )


def context_of_layer(context: LayerContext, index, config: ModelConfig):
    """`(cos, sin, mask)` of layer `index` (traced or not): the sliding layers' where the layer
    slides (`ModelConfig.layer_types`), the full-attention layers' otherwise; the identity
    rotation (cos 1, sin 0) in a layer without positions (`ModelConfig.nope_layers`)."""
    sliding = config.sliding_layers
    full = (None, None) if context.rotary is None else context.rotary
    local = full if context.local_rotary is None else context.local_rotary
    if full[0] is not None and local[0].shape[-1] != full[0].shape[-1]:
        if not isinstance(index, (int, np.integer)):
            raise ValueError(
                "the sliding and the full-attention layers rotate heads of different widths (Gemma 4's full-attention "
                "layers' own heads): a traced layer index cannot pick one table; layer_step picks each layer type's"
            )
        sliding = (sliding[index],) * config.num_layers  # the layer's own type's tables, picked here
    if not any(sliding):
        cos, sin, mask = (*full, context.mask)
    elif all(sliding):
        cos, sin, mask = (*local, context.local_mask)
    else:
        slides = jnp.asarray(sliding)[index]
        pick = lambda a, b: None if a is None else jnp.where(slides, a, b)  # noqa: E731
        cos, sin, mask = pick(local[0], full[0]), pick(local[1], full[1]), pick(context.local_mask, context.mask)
    if config.nope_layers:  # the identity rotation, exactly: x * 1 + rotate_half(x) * 0 = x
        still = in_layers(index, config.nope_layers, config)
        cos, sin = jnp.where(still, jnp.ones_like(cos), cos), jnp.where(still, jnp.zeros_like(sin), sin)
    return cos, sin, mask


def layer_context(h, valid, config, offset: int = 0) -> LayerContext:
    """Rotary tables and the attention masks shared by every layer of a forward on `h`, whose
    rows are positions `offset, offset+1, ...` of the prompt (`valid` covers all of them)."""
    B, S, _ = h.shape
    T = offset + S
    valid = jnp.ones((B, T), bool) if valid is None else valid
    long = longrope_rows(valid, config)
    rotary_of = lambda local: tuple(t[..., offset:, :] for t in rotary_tables(T, config, local, long))  # noqa: E731
    context = _context(rotary_of, lambda window: attention_mask(valid, offset, window), config)
    return context._replace(valid=valid[:, offset:]) if config.mixed_mixers else context


def piece_context(valid: Bool[Array, "B T"], start, width: int, config: ModelConfig) -> LayerContext:
    """The `layer_step` context of a piece of `width` rows, positions `start..start+width-1`
    (`start` may be traced), whose prefix is a key/value buffer covering all T positions
    (`prefix = (keys, values)`, `[B, T, K, Dh]` each): the queries attend to the buffer's
    valid positions before `start` and, causally, to the piece's own keys, so the buffer may
    hold anything from `start` on. Keys are `[buffer T | piece width]`."""
    T = valid.shape[1]
    rows = jnp.arange(width)
    long = longrope_rows(valid, config)

    def rotary_of(local):
        tables = rotary_tables(T, config, local, long)
        return tuple(jax.lax.dynamic_slice_in_dim(t, start, width, axis=t.ndim - 2) for t in tables)

    def mask_of(window):
        query, key = start + rows[:, None], jnp.arange(T)[None, :]
        earlier = (key < start) & ((query - key < window) if window else True)
        own = rows[None, :] <= rows[:, None]
        if window:
            own = own & (rows[:, None] - rows[None, :] < window)
        earlier = earlier[None] & valid[:, None, :]
        own = own[None] & jax.lax.dynamic_slice_in_dim(valid, start, width, axis=1)[:, None]
        return jnp.concatenate([jnp.broadcast_to(earlier, own.shape[:2] + (T,)), own], axis=2)

    return _context(rotary_of, mask_of, config)


def step_context(
    valid: Bool[Array, "B T"], positions: Int[Array, " B"], config: ModelConfig, *, buffered: bool = False
) -> LayerContext:
    """The `layer_step` context of one new token per prompt, prompt b's at `positions[b]`,
    whose prefix is a key/value buffer of T positions (`prefix = (keys, values)`,
    `[B, T, K, Dh]` each; a decoding cache): the token attends to the buffer's valid positions
    before its own (within the sliding window where the layer slides) and to itself. Keys are
    `[buffer T | the token]`; rotary tables are `[B, 1, R]`. `buffered`: the prefix is a
    `KeyValueBuffer`, into which the token's key is written at its own position (which `valid`
    then marks): keys are the buffer's T."""
    T = valid.shape[1]
    where = positions[:, None]
    keys = jnp.arange(T)[None, :]
    # transformers decides longrope's factors by the positions of each call: a decoded token's own
    long = None if config.rope_type != "longrope" else positions + 1 > config.rope_original_max_position

    def rotary_of(local):
        tables = rotary_tables(T, config, local, long)
        rows = jnp.arange(positions.shape[0])
        return tuple((t[rows, positions] if t.ndim == 3 else t[positions])[:, None, :] for t in tables)

    def mask_of(window):
        if buffered:
            return ((keys <= where) & valid & ((where - keys < window) if window else True))[:, None, :]
        earlier = (keys < where) & valid & ((where - keys < window) if window else True)
        return jnp.concatenate([earlier, jnp.ones_like(where, bool)], axis=1)[:, None, :]

    return _context(rotary_of, mask_of, config)


def check_layer_rows(tree, num_layers: int, what: str) -> None:
    """Refuse a pytree whose leaves do not all have `num_layers` rows (one per layer): indexed by a
    traced layer, a shorter one would be clamped to its last row silently."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        shape = jnp.shape(leaf)
        if not shape or shape[0] != num_layers:
            raise ValueError(
                f"{what}{jax.tree_util.keystr(path)} must have a leading layer axis of {num_layers} "
                f"(one row per layer), got shape {shape}"
            )


def layer_row(tree, i):
    """Row `i` (traced) of every leaf's leading axis."""
    return jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, i, keepdims=False), tree)


def every_layer_rows(params: Params, config: ModelConfig) -> Params:
    """The per-layer params a scan over the layers slices: all of them but those read in place
    (`jaxdepth.core.parameters.kind_slots`: the MLP weights of one kind among layers of two
    kinds, and the experts')."""
    stacked = kind_slots(config)
    return {name: w for name, w in params["layers"].items() if name not in stacked}


@jax.tree_util.register_pytree_node_class
class LayerWeights(Mapping):
    """One layer's weights where some are read in place (`jaxdepth.core.parameters.kind_slots`):
    the rows a scan slices, this layer's, and the stacks read in place, indexed only where read.
    Among layers of two kinds (`ModelConfig.mixed_mlps`) a stack is read in its kind's branch
    of the layer (`one_kind`): a dense layer never reads the experts' weights, nor a sparse one
    the dense MLP's. The experts' weights are read block by block, each block's one expert
    (`jaxdepth.core.experts.expert_outputs`), never copied whole per layer."""

    def __init__(self, rows: Params, stacks: Params, slots: Params):
        self.rows, self.stacks, self.slots = rows, stacks, slots

    def __getitem__(self, name: str):
        if name in self.rows:
            return self.rows[name]
        if name in self.stacks:
            return jax.lax.dynamic_index_in_dim(self.stacks[name], self.slots[name], keepdims=False)
        raise KeyError(name)

    def __contains__(self, name) -> bool:
        return name in self.rows or name in self.stacks

    def __iter__(self):
        return iter([*self.rows, *self.stacks])

    def __len__(self) -> int:
        return len(self.rows) + len(self.stacks)

    def tree_flatten(self):
        """The pytree's children: the sliced rows, the stacks and their slots."""
        return (self.rows, self.stacks, self.slots), None

    @classmethod
    def tree_unflatten(cls, _, children):
        """The weights again from `tree_flatten`'s children."""
        return cls(*children)


def layer_weights(rows: Params, params: Params, i, config: ModelConfig) -> Params:
    """Layer `i`'s weights (`i` traced or not) from its slice `rows` of `every_layer_rows` and
    the stacks in `params` it reads in place (a `LayerWeights`; `rows` alone in a dense model)."""
    slots = kind_slots(config)
    if not slots:
        return rows
    stacks = {name: w for name, w in params["layers"].items() if name in slots}
    return LayerWeights(rows, stacks, {name: jnp.maximum(jnp.asarray(slots[name])[i], 0) for name in stacks})


def layer_params(params: Params, i, config: ModelConfig) -> Params:
    """The weights of layer `i` (traced or not) from the layer-stacked params."""
    return layer_weights(layer_row(every_layer_rows(params, config), i), params, i, config)


class MixerPrefix(NamedTuple):
    """One layer's prefix (`layer_step`) in a model with linear-attention layers
    (`ModelConfig.mixed_mixers`): the keys and values of the P earlier positions `[B, P, K, Dh]`,
    which an attention layer attends to, and the `LinearState` at position P, from which a
    linear-attention layer continues (its convolution's last inputs and the delta rule's state:
    what the earlier positions leave it, a function of its inputs there alone). Stacked over
    every layer (`[L, ...]` leaves, as a `(keys, values)` prefix); each layer reads its kind's
    part, the other kind's rows are zeros. `prefix[0]` and `prefix[1]` are the keys and values,
    as in a `(keys, values)` prefix."""

    keys: Array
    values: Array
    linear: LinearState


def check_mixer_prefix(prefix, config: ModelConfig) -> None:
    """Refuse a prefix a model with linear-attention layers cannot run from: anything but a
    `MixerPrefix` (a linear-attention layer continues from a recurrent state, which keys and
    values do not hold; a `KeyValueBuffer` holds no state)."""
    if prefix is not None and not isinstance(prefix, MixerPrefix):
        raise ValueError(
            f"a model with linear-attention layers runs from a MixerPrefix (keys, values and each linear-attention "
            f"layer's LinearState), not a {type(prefix).__name__}: linear attention carries a recurrent state, "
            "which keys and values do not hold"
        )


def refuse_linear_prefix(config: ModelConfig, what: str) -> None:
    """Refuse `what`, a run from keys and values of earlier positions that does not carry the
    linear-attention layers' states yet, in a model with linear-attention layers."""
    if config.mixed_mixers:
        raise ValueError(
            f"{what} is not implemented for a model with linear-attention layers yet: they carry a recurrent state "
            "(a MixerPrefix), not keys and values"
        )


def refuse_typed_attention(config: ModelConfig, what: str) -> None:
    """Refuse `what` (a computation of one layer's attention outside `layer_step`) where the
    layers' attention comes in two shapes (`ModelConfig.global_layers`) or layers share keys
    and values (`shared_kv_layers`): which weights and keys a layer reads depends on its type,
    which `layer_step` picks."""
    if config.global_layers or config.shared_kv_layers:
        raise ValueError(
            f"{what} is not implemented for a model whose full-attention layers have attention shapes of their own or "
            "whose layers share keys and values (Gemma 4): run layer_step, which picks each layer's own"
        )


def refuse_shared_key_values(config: ModelConfig, what: str) -> None:
    """Refuse `what` (a run that does not carry the shared keys and values from layer to layer)
    in a model with `shared_kv_layers`."""
    if config.shared_kv_layers:
        raise ValueError(
            f"{what} is not implemented for a model whose layers {list(config.shared_kv_layers)} reuse earlier "
            "layers' keys and values (Gemma 4): run every layer from boundary 0, one layer per step"
        )


def empty_shared_kv(config: ModelConfig, batch: int, keys: int, dtype) -> Optional[dict]:
    """The keys and values shared among layers before the first layer (`layer_step`'s
    `shared_kv`): zeros `[batch, keys, K, Dh]` per layer type, in the type's shapes (a layer
    that reads them before any layer of its type wrote its own attends to nothing: its
    attention writes zeros). None in a model whose layers share none."""
    if not config.shared_kv_layers:
        return None
    sliding = config.sliding_layers
    types = {"sliding": False, "full": True}
    slots = {}
    for kind, full in types.items():
        if any(s != full for s in sliding):
            tc = attention_config(config, full)
            slots[kind] = tuple(jnp.zeros((batch, keys, tc.num_kv_heads, tc.head_dim), dtype) for _ in range(2))
    return slots


def _layer_types(config: ModelConfig):
    """Gemma 4's layer types that some layer has: `(kind, full, layers of it that compute their
    own keys and values)`, as `empty_shared_kv` keys its slots."""
    sliding = config.sliding_layers
    for kind, full in (("sliding", False), ("full", True)):
        if any(s != full for s in sliding):
            own = tuple(i for i, s in enumerate(sliding) if s != full and i not in config.shared_kv_layers)
            yield kind, full, own


def shared_kv_at(key_values: tuple[Array, Array], boundary, config: ModelConfig) -> Optional[dict]:
    """The keys and values shared among layers as they stand at `boundary` (0..L, traced or not)
    of a run whose layers' keys and values are `key_values = (keys, values)`, `[L, B, T, K, Dh]`
    each as its records hold them (`LayerRecord.k`, `v`; `jaxdepth.core.loops.clean_key_values`
    of a clean run): per layer type, those of the last layer of that type before the boundary
    that computes its own, in the type's shapes, or zeros where none does (`empty_shared_kv`).
    What a run from that boundary starts from (`jaxdepth.core.loops.LayerRun.shared_kv`), as a
    suffix run's prefix holds the keys of earlier positions. None in a model that shares none."""
    if not config.shared_kv_layers:
        return None
    keys, values = key_values
    slots = {}
    for kind, full, own in _layer_types(config):
        tc = attention_config(config, full)
        last = np.array([max((i for i in own if i < b), default=-1) for b in range(config.num_layers + 1)])
        source = jnp.asarray(last)[boundary]

        def pick(a, source=source, tc=tc):
            row = layer_row(a, jnp.maximum(source, 0))[..., : tc.num_kv_heads, : tc.head_dim]
            return jnp.where(source >= 0, row, jnp.zeros_like(row))

        slots[kind] = (pick(keys), pick(values))
    return slots


def piece_shared_kv(shared: Optional[dict], start, width: int) -> Optional[dict]:
    """The shared keys and values `shared` (each `[B, T, K, Dh]`, a buffer of every position) laid
    out as a piece of `width` rows from position `start` (traced or not) attends to them
    (`piece_context`: keys `[buffer T | piece width]`): the buffer, then its own rows of the
    piece, which the layer that wrote them computed at the piece's positions."""
    if shared is None:
        return None
    piece = lambda a: jnp.concatenate([a, jax.lax.dynamic_slice_in_dim(a, start, width, axis=1)], axis=1)  # noqa: E731
    return {kind: tuple(piece(a) for a in kv) for kind, kv in shared.items()}


def written_shared_kv(shared: Optional[dict], index, key_values: tuple[Array, Array], config: ModelConfig):
    """`shared` (as `empty_shared_kv`) after layer `index` (traced or not) wrote its keys and
    values `key_values` (`[B, T, K, Dh]` each, as its record holds them, as wide as the widest
    layer's) into its type's slot, where it computes its own; unchanged elsewhere. What a loop
    that runs a layer over all its positions in pieces carries to the next layer."""
    if shared is None:
        return None
    out = dict(shared)
    for kind, full, own in _layer_types(config):
        tc = attention_config(config, full)
        writes = in_layers(index, own, config)
        new = tuple(a[..., : tc.num_kv_heads, : tc.head_dim].astype(s.dtype) for a, s in zip(key_values, shared[kind]))
        out[kind] = tuple(jnp.where(writes, n, s) for n, s in zip(new, shared[kind]))
    return out


def layer_key_values(p: Params, h: Float[Array, "B T D"], index, context: LayerContext, config: ModelConfig):
    """Layer `index`'s own rotated keys and values `[B, T, K, Dh]` of its input `h` (`p` its
    weights, `index` traced or not), with its type's weights and rotary tables where the layers'
    attention comes in two shapes (Gemma 4), as wide as the widest layer's
    (`ModelConfig.most_kv_heads`, `widest_head_dim`; the records' shapes). A layer of
    `shared_kv_layers` reads other keys than these (`layer_step`)."""
    x = pre_norm(p, "attn_norm", h, config)
    if not (config.global_layers or config.shared_kv_layers):
        cos, sin, _ = context_of_layer(context, index, config)
        return key_values(p, x, cos, sin, config)
    K, Dh = config.most_kv_heads, config.widest_head_dim

    def of_type(full: bool):
        def run(x):
            tc = attention_config(config, full)
            w = _Renamed(p, _GLOBAL) if full and config.global_layers else p
            cos, sin, _ = _context_of_type(context, index, full, config)
            return tuple(_widened(a, Dh, K) for a in key_values(w, x, cos, sin, tc))

        return run

    full = _is_full(index, config)
    return of_type(full)(x) if isinstance(full, bool) else jax.lax.cond(full, of_type(True), of_type(False), x)


@functools.lru_cache(maxsize=64)
def attention_config(config: ModelConfig, full: bool) -> ModelConfig:
    """The config of one layer type's attention (Gemma 4's full-attention layers, `full`, or
    sliding ones): its head width and key/value heads, and whether its values are its keys;
    `config` itself where the layers' attention has one shape."""
    if not config.global_layers and not config.shared_kv_layers:
        return config
    common = dict(global_head_dim=0, global_kv_heads=0, layer_types=(), shared_kv_layers=(), wide_mlp_layers=())
    if full:
        return dataclasses.replace(config, head_dim=config.full_head_dim, num_kv_heads=config.full_kv_heads, **common)
    own = config.keys_as_values and not config.global_layers  # every layer attends fully
    return dataclasses.replace(config, keys_as_values=own, rope_type="default", rotary_dim=0, rope_factor=1.0, **common)


class _Renamed(Mapping):
    """A layer's weights read under other names: `names[name]` for those it lists (a
    full-attention layer's own attention rows, `global_q`, ..., under the attention's names)."""

    def __init__(self, p: Params, names: Mapping[str, str]):
        self.p, self.names = p, names

    def __getitem__(self, name: str):
        return self.p[self.names.get(name, name)]

    def __contains__(self, name) -> bool:
        return self.names.get(name, name) in self.p

    def __iter__(self):
        return iter(self.p)

    def __len__(self) -> int:
        return len(self.p)


_GLOBAL = {name: f"global_{name}" for name in ("q", "k", "v", "o", "q_norm", "k_norm")}
_WIDE = {name: f"wide_{name}" for name in ("gate", "up", "down")}


def _as_head_out(heads, config: ModelConfig):
    """A layer's heads' outputs `[B, S, H, Dh]` (a linear-attention layer's value heads') in site
    `head_out`'s shape among layers of the two mixers (`ModelConfig.head_out_shape`),
    zero-padded past the layer's own; unchanged in every other model."""
    if not config.mixed_mixers:
        return heads
    rows, width = config.head_out_shape
    return _widened(heads, width, rows)


def _widened(x, width: int, heads: Optional[int] = None):
    """`x` zero-padded to `width` on its last axis (and to `heads` on the one before)."""
    pad = [(0, 0)] * x.ndim
    pad[-1] = (0, width - x.shape[-1])
    if heads is not None:
        pad[-2] = (0, heads - x.shape[-2])
    return x if all(p == (0, 0) for p in pad) else jnp.pad(x, pad)


def _is_full(index, config: ModelConfig):
    """Whether layer `index` (traced or not) attends fully (a Python bool where every layer's
    type is the same)."""
    full = tuple(i for i, slides in enumerate(config.sliding_layers) if not slides)
    if len(full) in (0, config.num_layers):
        return bool(full)
    return in_layers(index, full, config)


def _context_of_type(context: LayerContext, index, full: bool, config: ModelConfig):
    """`(cos, sin, mask)` of a layer of one type (`full` or sliding): `context_of_layer` where
    the type is known, so the tables may differ in width between the types."""
    rotary = (None, None) if context.rotary is None else context.rotary
    if full:
        cos, sin, mask = (*rotary, context.mask)
    else:
        cos, sin = rotary if context.local_rotary is None else context.local_rotary
        mask = context.local_mask
    if config.nope_layers:
        still = in_layers(index, config.nope_layers, config)
        cos, sin = jnp.where(still, jnp.ones_like(cos), cos), jnp.where(still, jnp.zeros_like(sin), sin)
    return cos, sin, mask


def _typed_heads(p: Params, x, index, context: LayerContext, config: ModelConfig, full: bool, prefix, shared):
    """One layer type's attention up to the heads' outputs (Gemma 4; `full` or sliding), in the
    type's own shapes: `(weights, type config, q, k, v, probs, heads, shared)`. The layer's keys
    and values are its own (the prefix's first, sliced to the type's shapes) or, in a layer of
    `shared_kv_layers`, those its type's slot of `shared` holds; a layer that computes its own
    writes them there."""
    tc = attention_config(config, full)
    w = _Renamed(p, _GLOBAL) if full and config.global_layers else p
    cos, sin, mask = _context_of_type(context, index, full, config)
    q = _rotated(_qk_norm(w, "q_norm", _projected(w, x, "q", config.num_heads, tc), tc), cos, sin, tc)
    K, Dh = tc.num_kv_heads, tc.head_dim

    def own():
        k, v = key_values(w, x, cos, sin, tc)
        if prefix is not None:
            k = jnp.concatenate([prefix[0][..., :K, :Dh].astype(k.dtype), k], axis=1)
            v = jnp.concatenate([prefix[1][..., :K, :Dh].astype(v.dtype), v], axis=1)
        return k, v

    reuses = in_layers(index, config.shared_kv_layers, config)
    if shared is None:
        if config.shared_kv_layers and (not isinstance(reuses, bool) or reuses):
            refuse_shared_key_values(config, "a run of a layer without the keys and values shared before it")
        k, v = own()
    else:
        kind = "full" if full else "sliding"
        if isinstance(reuses, bool):
            k, v = shared[kind] if reuses else own()
        else:
            k, v = jax.lax.cond(reuses, lambda: tuple(shared[kind]), own)
        shared = {**shared, kind: (k, v)}
    probs, heads = attend(q, k, v, mask, tc)
    return w, tc, q, k, v, probs, heads, shared


def per_layer_output(p: Params, x: Float[Array, "B S D"], index, context: LayerContext, config: ModelConfig):
    """What Gemma 4's per-layer input adds to the residual `x` (= h + a + m) of layer `index`:
    `norm((act(x W_gate) * per-layer input) W_proj)`, the input the layer's own of
    `context.per_layer_inputs`."""
    if context.per_layer_inputs is None:
        raise ValueError(
            "this model's layers read per-layer inputs of the tokens (Gemma 4): give them to the run "
            "(per_layer_inputs=jaxdepth.core.model.per_layer_inputs(params, tokens, h0, config))"
        )
    own = jax.lax.dynamic_index_in_dim(context.per_layer_inputs, index, axis=2, keepdims=False)
    gated = ACTIVATIONS[config.activation](project(x, p["ple_gate"])) * own.astype(x.dtype)
    return norm(project(gated, p["ple_proj"]), p["ple_norm"], config)


def in_layers(index, layers: tuple, config: ModelConfig):
    """Whether layer `index` (traced or not) is one of `layers` (the dense among sparse ones,
    the linear-attention ones, those without positions)."""
    among = np.isin(np.arange(config.num_layers), layers)
    return bool(among[index]) if isinstance(index, (int, np.integer)) else jnp.asarray(among)[index]


def linear_shape(config: ModelConfig) -> LinearAttentionShape:
    """The shapes of `config`'s linear-attention layers."""
    return LinearAttentionShape(
        key_heads=config.linear_key_heads,
        value_heads=config.linear_value_heads,
        key_dim=config.linear_key_dim,
        value_dim=config.linear_value_dim,
        conv_kernel=config.linear_conv_kernel,
        eps=config.rms_norm_eps,
    )


def one_kind(second, first: Callable, second_fn: Callable, *operands):
    """`second_fn(*operands)` where `second` (a traced or Python bool) holds, else
    `first(*operands)`: one `lax.cond`, so a layer runs its own kind's computation only (under
    `vmap` with a batched `second`, both run and one is selected). Both return a tuple whose
    last-but-one element is a dict of record fields: a field only one of them computes is
    zeros where the other runs, so every layer's record has the same fields."""
    shapes = [jax.eval_shape(f, *operands)[-2] for f in (first, second_fn)]

    def filled(f, other):
        def run(*args):
            *head, parts, tail = f(*args)
            parts = dict(parts)
            for name, shape in other.items():  # the union of both's fields, None where neither has it
                if parts.get(name) is None:
                    parts[name] = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shape)
            return (*head, parts, tail)

        return run

    branches = (filled(first, shapes[1]), filled(second_fn, shapes[0]))
    if isinstance(second, bool):
        return branches[second](*operands)
    return jax.lax.cond(second, branches[1], branches[0], *operands)
