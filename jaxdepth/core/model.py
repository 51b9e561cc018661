"""The decoder forward pass: embed -> `lax.scan` over layers -> final norm -> unembed.

Axis glossary (used in every shape annotation of the package)
-------------------------------------------------------------
batch     B   prompts in a batch, right-padded; `valid[b, t]` marks real tokens
layer     L   decoder layers l = 0..L-1; residual boundaries h_0..h_L are L+1 ("boundary")
seq       T   token positions
embed     D   residual width (`hidden_size`)
heads     H   query heads
kv_heads  K   key/value heads; query head h reads kv head h // (H // K)
head_dim  Dh  per-head width
ffn       F   MLP width (`intermediate_size`)
vocab     V   vocabulary

Params are a plain nested dict of arrays (see `PARAM_SHAPES`); every per-layer weight is
stacked on a leading layer axis, so the layer loop is a single `lax.scan`. Weights are stored
`[in, out]` (`x @ W`). Pass params as an argument to jitted functions, never close over them:
closed-over arrays become constants that XLA folds, and compile time explodes.

Numerics follow Hugging Face transformers: RMSNorm in float32 then cast back before the weight
multiply, rotate-half rotary embedding with float32 angles, attention softmax in float32 with a
finite mask value.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from jaxdepth.core.config import ModelConfig
from jaxdepth.core.sites import SITE_TABLE, Intervention, InterventionsLike, apply_at, check_layer_indices

Params = dict[str, Any]


def param_shapes(config: ModelConfig) -> Params:
    """The shape of every parameter, as a nested dict mirroring the params pytree."""
    c = config
    L, D, F = c.num_layers, c.hidden_size, c.intermediate_size
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    layers = {
        "attn_norm": (L, D),
        "q": (L, D, q),
        "k": (L, D, kv),
        "v": (L, D, kv),
        "o": (L, q, D),
        "mlp_norm": (L, D),
        "gate": (L, D, F),
        "up": (L, D, F),
        "down": (L, F, D),
    }
    if c.qkv_bias:
        layers.update({"q_bias": (L, q), "k_bias": (L, kv), "v_bias": (L, kv)})
    if c.qk_norm:
        layers.update({"q_norm": (L, c.head_dim), "k_norm": (L, c.head_dim)})
    shapes = {"embed": (c.vocab_size, D), "layers": layers, "final_norm": (D,)}
    if not c.tie_word_embeddings:
        shapes["lm_head"] = (D, c.vocab_size)
    return shapes


def check_params(params: Params, config: ModelConfig) -> None:
    """Raise if the params pytree does not have exactly the structure and shapes of `config`."""
    expected = param_shapes(config)
    got = jax.tree.map(lambda x: tuple(x.shape), params)
    if (
        jax.tree.structure(expected, is_leaf=lambda x: isinstance(x, tuple))
        != jax.tree.structure(got, is_leaf=lambda x: isinstance(x, tuple))
        or expected != got
    ):
        raise ValueError(f"params do not match the config.\nexpected: {expected}\ngot:      {got}")


def random_params(config: ModelConfig, seed: int = 0, scale: float = 0.05, dtype=np.float32) -> Params:
    """Random params (normal weights, norm weights around 1) for tests and benchmarks.

    Drawn with numpy: one jitted sampler per parameter shape would compile for seconds."""
    rng = np.random.default_rng(seed)

    def draw(path, shape):
        x = rng.standard_normal(shape)
        return (1.0 + 0.1 * x if "norm" in jax.tree_util.keystr(path) else scale * x).astype(dtype)

    return jax.tree_util.tree_map_with_path(draw, param_shapes(config), is_leaf=lambda x: isinstance(x, tuple))


# ----------------------------------------------------------------------------- building blocks


def rms_norm(x: Float[Array, "*b D"], weight: Float[Array, " D"], eps: float) -> Float[Array, "*b D"]:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def rotary_frequencies(config: ModelConfig) -> np.ndarray:
    """The rotary inverse frequencies [Dh/2], float32, as HF computes them, bit for bit.

    Computed on the host with numpy, never by the compiler. The angle at position t is
    t * inv_freq, so a 1e-5 relative error in one frequency moves a tiny model's late logits by
    3e-4, and XLA may evaluate the same float32 formula differently on different CPUs (traced,
    the llama3 blend came out 2 ulps from HF's on one). Here each step is the float32 IEEE
    operation torch performs, in HF's order, so the bits are the same on every machine; the
    power is correctly rounded (torch's own is within an ulp of that, depending on the CPU).
    Rope type 'llama3' divides the low frequencies by `rope_factor` and blends the middle band
    smoothly (Llama 3.1 / 3.2).
    """
    f32 = np.float32
    Dh = config.head_dim
    exponents = np.arange(0, Dh, 2).astype(f32) / f32(Dh)
    # torch casts the Python base to float32 and raises it to the float32 exponents
    power = (np.float64(f32(config.rope_theta)) ** exponents.astype(np.float64)).astype(f32)
    inv_freq = f32(1) / power
    if config.rope_type == "default":
        return inv_freq
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


def rotary_tables(seq_len: int, config: ModelConfig) -> tuple[Float[Array, "T Dh"], Float[Array, "T Dh"]]:
    """cos and sin of the rotate-half rotary embedding, computed in float32 as HF does."""
    inv_freq = rotary_frequencies(config)
    angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rotary(x: Float[Array, "B T N Dh"], cos, sin) -> Float[Array, "B T N Dh"]:
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, None, :].astype(x.dtype), sin[:, None, :].astype(x.dtype)
    return x * cos + rotated * sin


def key_values(p: Params, x: Float[Array, "B T D"], cos, sin, config: ModelConfig):
    """Rotated keys and values `[B, T, K, Dh]` of one layer on its normed input `x`."""
    B, T, _ = x.shape
    K, Dh = config.num_kv_heads, config.head_dim
    k, v = x @ p["k"], x @ p["v"]
    if config.qkv_bias:
        k, v = k + p["k_bias"], v + p["v_bias"]
    k = k.reshape(B, T, K, Dh)
    if config.qk_norm:  # Qwen3: each key head normalised before the rotation
        k = rms_norm(k, p["k_norm"], config.rms_norm_eps)
    return apply_rotary(k, cos, sin), v.reshape(B, T, K, Dh)


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
    """
    B, S, _ = x.shape
    H, Dh = config.num_heads, config.head_dim
    q = x @ p["q"]
    if config.qkv_bias:
        q = q + p["q_bias"]
    q = q.reshape(B, S, H, Dh)
    if config.qk_norm:
        q = rms_norm(q, p["q_norm"], config.rms_norm_eps)
    q = apply_rotary(q, cos, sin)
    k, v = key_values(p, x, cos, sin, config)
    if prefix is not None:
        k, v = jnp.concatenate([prefix[0], k], axis=1), jnp.concatenate([prefix[1], v], axis=1)
    probs, heads = attend(q, k, v, mask)
    return q, k, v, probs, heads


def attend(
    q: Float[Array, "B S H Dh"], k: Float[Array, "B T N Dh"], v: Float[Array, "B T N Dh"], mask: Bool[Array, "B S T"]
):
    """Softmax attention of the (rotated) queries over keys and values of N heads, where N divides
    H: query head h reads key/value head h // (H // N). N = K is grouped-query attention; N = H
    gives every query head keys and values of its own (the per-head readers of
    `jaxdepth.analyses.edges`). Returns `(probs [B, H, S, T], heads [B, S, H, Dh])`."""
    B, S, H, Dh = q.shape
    N = k.shape[2]
    # Group query heads by the kv head they read: head h = kv * G + g.
    grouped = q.reshape(B, S, N, H // N, Dh)
    scores = jnp.einsum("btkgd,bskd->bkgts", grouped, k, preferred_element_type=jnp.float32)
    scores = scores * (Dh**-0.5)
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    heads = jnp.einsum("bkgts,bskd->btkgd", weights, v).reshape(B, S, H, Dh)
    return weights.reshape(B, H, S, -1), heads


def attention(
    p: Params,
    x: Float[Array, "B S D"],
    cos,
    sin,
    mask: Bool[Array, "B S T"],
    config: ModelConfig,
    prefix: Optional[tuple[Array, Array]] = None,
) -> Float[Array, "B S D"]:
    """The attention output a (after o_proj) of one layer; `prefix` as in `attention_heads`."""
    heads = attention_heads(p, x, cos, sin, mask, config, prefix)[-1]
    return heads.reshape(heads.shape[:2] + (-1,)) @ p["o"]


def mlp_hidden(p: Params, x: Float[Array, "B T D"]) -> Float[Array, "B T F"]:
    return jax.nn.silu(x @ p["gate"]) * (x @ p["up"])


def mlp(p: Params, x: Float[Array, "B T D"]) -> Float[Array, "B T D"]:
    return mlp_hidden(p, x) @ p["down"]


def attention_mask(valid: Bool[Array, "B T"], offset: int = 0) -> Bool[Array, "B S T"]:
    """Causal mask restricted to valid keys: the query at position t sees keys s <= t with
    valid[s]. The queries are positions `offset..T-1` (all of them by default)."""
    T = valid.shape[1]
    causal = jnp.arange(T)[None, :] <= jnp.arange(offset, T)[:, None]
    return causal[None] & valid[:, None, :]


# ----------------------------------------------------------------------------- the layer loop


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerRecord:
    """What a tap sees of layer `index`, every site after its interventions (`jaxdepth.core.sites`):
    its input `h` (= h_l, site `resid_pre`), the queries `q` `[B,S,H,Dh]`, keys and values `k`,
    `v` `[B,T,K,Dh]` (rotated; with a prefix, T = P + S), attention probabilities `attn_probs`
    `[B,H,S,T]`, the heads' outputs `head_out` `[B,S,H,Dh]`, the sublayer outputs `attn` (= a_l)
    and `mlp` (= m_l), the MLP's `mlp_hidden` `[B,S,F]`, and its output `out` (= h_{l+1}).
    Only what a tap reads is kept: XLA drops the rest."""

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
    mlp_hidden: Optional[Array] = None

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
    interventions: tuple[Intervention, ...] = (),
    prefix=None,
) -> LayerRecord:
    """One pre-norm decoder layer (`p` holds its weights) with every intervention at its site:
    `a = Attn(norm(h))`, `m = MLP(norm(h + a))`, `out = h + a + m`. The one layer body of every
    driver (the scanned stack, suffix runs, the gradient path).

    `context = (cos, sin, mask)` from `layer_context`; `index` the (traced) layer index;
    `prefix` the keys and values of earlier positions, as in `attention_heads`."""
    eps = config.rms_norm_eps
    cos, sin, mask = context
    at = lambda site, value: apply_at(site, value, index, interventions, config.num_layers)
    h = at("resid_pre", h)
    q, k, v, probs, heads = attention_heads(p, rms_norm(h, p["attn_norm"], eps), cos, sin, mask, config, prefix)
    heads = at("head_out", heads)
    a = at("attn_out", heads.reshape(heads.shape[:2] + (-1,)) @ p["o"])
    hidden = at("mlp_hidden", mlp_hidden(p, rms_norm(h + a, p["mlp_norm"], eps)))
    m = at("mlp_out", hidden @ p["down"])
    out = at("resid_post", h + at("delta", a + m))
    return LayerRecord(
        index=index, h=h, attn=a, mlp=m, out=out, q=q, k=k, v=v, attn_probs=probs, head_out=heads, mlp_hidden=hidden
    )


def layer_context(h, valid, config, offset: int = 0):
    """Rotary tables and the attention mask shared by every layer of a forward on `h`, whose
    rows are positions `offset, offset+1, ...` of the prompt (`valid` covers all of them)."""
    B, S, _ = h.shape
    T = offset + S
    valid = jnp.ones((B, T), bool) if valid is None else valid
    cos, sin = rotary_tables(T, config)
    return cos[offset:], sin[offset:], attention_mask(valid, offset)


def piece_context(valid: Bool[Array, "B T"], start, width: int, config: ModelConfig):
    """The `layer_step` context of a piece of `width` rows, positions `start..start+width-1`
    (`start` may be traced), whose prefix is a key/value buffer covering all T positions
    (`prefix = (keys, values)`, `[B, T, K, Dh]` each): the queries attend to the buffer's
    valid positions before `start` and, causally, to the piece's own keys, so the buffer may
    hold anything from `start` on. Keys are `[buffer T | piece width]`."""
    T = valid.shape[1]
    cos, sin = rotary_tables(T, config)
    cos, sin = (jax.lax.dynamic_slice_in_dim(table, start, width) for table in (cos, sin))
    rows = jnp.arange(width)
    earlier = (jnp.arange(T) < start)[None, None, :] & valid[:, None, :]
    own = (rows[None, :] <= rows[:, None])[None] & jax.lax.dynamic_slice_in_dim(valid, start, width, axis=1)[:, None]
    return cos, sin, jnp.concatenate([jnp.broadcast_to(earlier, own.shape[:2] + (T,)), own], axis=2)


def clean_key_values(params: Params, hs: Float[Array, "Lp1 B T D"], config: ModelConfig, *, valid=None):
    """Every layer's rotated keys and values, `([L, B, T, K, Dh], [L, B, T, K, Dh])`, read off
    the clean residual stream `hs` (from `residual_stream`): the `prefix` of a suffix run."""
    cos, sin, _ = layer_context(hs[0], valid, config)
    kv = lambda p, h: key_values(p, rms_norm(h, p["attn_norm"], config.rms_norm_eps), cos, sin, config)
    return jax.vmap(kv)(params["layers"], hs[:-1])


def final_residual(h_last, config: ModelConfig, interventions):
    """Boundary L, the final norm's input: `resid_pre` interventions act here with layer index
    L, except those whose layer-indexed data has only L rows (`jaxdepth.core.sites.Intervention`)."""
    L = config.num_layers
    return apply_at("resid_pre", h_last, L, check_layer_indices(interventions, L), L, final=True)


def run_layers(
    params: Params,
    h0: Float[Array, "B T D"],
    config: ModelConfig,
    *,
    valid: Optional[Bool[Array, "B T"]] = None,
    interventions: InterventionsLike = None,
    tap: Optional[Tap] = None,
    tap_inputs: Any = None,
    remat: bool = False,
):
    """Run every decoder layer on the residual `h0` (one `lax.scan` over `layer_step`),
    applying `interventions`: a site `Intervention` (`jaxdepth.core.sites`) or a sequence of
    them.

    `tap(record, x)` is called inside the scan for every layer with that layer's `LayerRecord`
    and the layer's slice of `tap_inputs` (a pytree with a leading layer axis, or None); its
    results are stacked on a leading layer axis. Reduce inside the tap: that is what keeps
    sweeps over all layers from holding `[L, B, T, D]` (or worse) per sweep member.

    `remat=True` wraps the layer in `jax.checkpoint`, so a gradient through the stack keeps one
    residual per layer instead of every intermediate activation.

    Returns `(h_L, taps)` where `h_L` is the last boundary (after any edit at boundary L).
    """
    ivs = check_layer_indices(interventions, config.num_layers)
    check_layer_rows(tap_inputs, config.num_layers, "tap_inputs")
    context = layer_context(h0, valid, config)

    def layer(h, xs):
        p, index, tap_x = xs
        record = layer_step(p, h, index, context, config, ivs)
        return record.out, None if tap is None else tap(record, tap_x)

    xs = (params["layers"], jnp.arange(config.num_layers), tap_inputs)
    h_last, taps = jax.lax.scan(jax.checkpoint(layer) if remat else layer, h0, xs)
    return final_residual(h_last, config, ivs), taps


def run_layers_from(
    params: Params,
    h_start: Float[Array, "B S D"],
    start,
    config: ModelConfig,
    *,
    valid: Optional[Bool[Array, "B T"]] = None,
    interventions: InterventionsLike = None,
    tap: Optional[Tap] = None,
    tap_inputs: Any = None,
    prefix: Optional[tuple[Array, Array]] = None,
):
    """`run_layers` from boundary `start` on: `h_start` is h_start, layers start..L-1 run.

    The layers before `start` are not computed at all, which is the saving when an
    intervention at layer or boundary `start` leaves everything before it clean. Tap rows of
    the layers not run are zeros. `start` may be traced but must not be batched (under `vmap`
    a batched trip count would run every member for the longest one): sweep over members that
    share `start`, and loop over starts outside the `vmap`. Forward only (no reverse-mode).

    `prefix = (keys, values)`, `[L, B, P, K, Dh]` each (a slice of `clean_key_values`), runs
    only a suffix: `h_start` holds positions P..T-1, and the first P positions enter every
    layer only through these keys and values. That is exact when the intervention changes
    nothing before position P (causal attention), and it saves the prefix's queries, MLPs and
    outputs. `valid` then covers all T positions; intervention masks cover the S suffix rows.
    """
    L = config.num_layers
    if not isinstance(start, jax.core.Tracer) and not 0 <= int(start) <= L:
        raise ValueError(f"start must be a boundary in 0..{L}, got {start}")
    ivs = check_layer_indices(interventions, L)
    check_layer_rows(tap_inputs, L, "tap_inputs")
    check_layer_rows(prefix, L, "prefix")
    offset = 0 if prefix is None else prefix[0].shape[2]
    context = layer_context(h_start, valid, config, offset)

    def record(i, h):
        return layer_step(
            layer_params(params, i), h, i, context, config, ivs, None if prefix is None else _index(prefix, i)
        )

    if tap is None:
        h_last = jax.lax.fori_loop(start, config.num_layers, lambda i, h: record(i, h).out, h_start)
        return final_residual(h_last, config, ivs), None

    def tapped(i, r):
        return tap(r, None if tap_inputs is None else _index(tap_inputs, i))

    shapes = jax.eval_shape(lambda h: tapped(0, record(0, h)), h_start)
    buffers = jax.tree.map(lambda s: jnp.zeros((config.num_layers,) + s.shape, s.dtype), shapes)

    def body(i, carry):
        h, bufs = carry
        r = record(i, h)
        return r.out, jax.tree.map(lambda b, y: b.at[i].set(y), bufs, tapped(i, r))

    h_last, taps = jax.lax.fori_loop(start, config.num_layers, body, (h_start, buffers))
    return final_residual(h_last, config, ivs), taps


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


def _index(tree, i):
    """Row `i` (traced) of every leaf's leading axis."""
    return jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, i, keepdims=False), tree)


def layer_params(params: Params, i) -> Params:
    """The weights of layer `i` (traced or not) from the layer-stacked params."""
    return _index(params["layers"], i)


def check_tokens(tokens, config: ModelConfig) -> None:
    """Clear errors for token ids the model cannot take."""
    if tokens.shape[-1] > config.max_position_embeddings:
        raise ValueError(
            f"sequence of {tokens.shape[-1]} tokens exceeds the model's context of {config.max_position_embeddings}"
        )
    if tokens.size and (tokens.min() < 0 or tokens.max() >= config.vocab_size):
        raise ValueError(f"token ids must lie in [0, {config.vocab_size}), got [{tokens.min()}, {tokens.max()}]")


def embed(params: Params, tokens: Int[Array, "B T"]) -> Float[Array, "B T D"]:
    return params["embed"][tokens]


def unembed(params: Params, h: Float[Array, "*b D"], config: ModelConfig) -> Float[Array, "*b V"]:
    """Final RMSNorm then the LM head, as float32 logits (the logit lens applies it to any h_l)."""
    x = rms_norm(h, params["final_norm"], config.rms_norm_eps)
    if config.tie_word_embeddings:
        return jnp.einsum("...d,vd->...v", x, params["embed"], preferred_element_type=jnp.float32)
    return jnp.einsum("...d,dv->...v", x, params["lm_head"], preferred_element_type=jnp.float32)


def forward(
    params: Params,
    tokens: Int[Array, "B T"],
    config: ModelConfig,
    *,
    valid: Optional[Bool[Array, "B T"]] = None,
    interventions: InterventionsLike = None,
) -> Float[Array, "B T V"]:
    """Logits of the model on `tokens`, under `interventions` (none by default)."""
    h, _ = run_layers(params, embed(params, tokens), config, valid=valid, interventions=interventions)
    return unembed(params, h, config)


def layer_inputs(params, tokens, config: ModelConfig, *, valid=None, interventions=None, tap=None):
    """The run under `interventions`, as suffix runs (`run_layers_from`) start from it:
    `(inputs [L+1, B, T, D], final [B, T, D], taps)`: every layer's input as the layer receives
    it, before the layer's own interventions (row L: h_L before those of the final residual),
    the final residual after them, and `tap`'s results (as `run_layers` returns them).

    A suffix run from boundary l starts from `inputs[l]` and applies the interventions of
    layer l itself, so they act once, as in the full forward: from the residual after them
    (`residual_stream`), an intervention that adds a vector would add it twice. Without
    interventions, `inputs` is the residual stream h_0..h_L."""
    h0 = embed(params, tokens)
    read = lambda r, x: (r.out, None if tap is None else tap(r, x))
    final, (outs, taps) = run_layers(params, h0, config, valid=valid, interventions=interventions, tap=read)
    return jnp.concatenate([h0[None], outs], axis=0), final, taps


def tap_residual(record: LayerRecord, _) -> Float[Array, "B T D"]:
    """Tap returning each layer's input h_l."""
    return record.h


def residual_stream(
    params: Params, tokens: Int[Array, "B T"], config: ModelConfig, *, valid=None, interventions=None
) -> Float[Array, "Lp1 B T D"]:
    """All L+1 residual boundaries h_0..h_L, stacked on a leading axis."""
    h_last, hs = run_layers(
        params, embed(params, tokens), config, valid=valid, interventions=interventions, tap=tap_residual
    )
    return jnp.concatenate([hs, h_last[None]], axis=0)
