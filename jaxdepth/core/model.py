"""The decoder: its params, embed -> the layers (`jaxdepth.core.loops.run_layers`, each layer
`jaxdepth.core.layer.layer_step`) -> final norm -> unembed, and the forwards built on them.

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

Params are a plain nested dict of arrays (see `param_shapes`, derived from the parameters'
declaration, `jaxdepth.core.parameters`); every per-layer weight is stacked on a leading layer
axis, so the layer loop is a single `lax.scan`. Weights are stored `[in, out]` (`x @ W`). Pass
params as an argument to jitted functions, never close over them: closed-over arrays become
constants that XLA folds, and compile time explodes.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from jaxdepth.core.config import ModelConfig
from jaxdepth.core.layer import LayerRecord, Params, norm
from jaxdepth.core.primitives import project
from jaxdepth.core.loops import run_layers
from jaxdepth.core.parameters import param_shapes
from jaxdepth.core.sites import InterventionsLike

__all__ = [
    "check_params",
    "random_params",
    "check_tokens",
    "embed",
    "per_layer_inputs",
    "token_per_layer_inputs",
    "unembed",
    "forward",
    "layer_inputs",
    "tap_residual",
    "residual_stream",
]


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
        # norm weights scale by about one (Gemma's by norm_offset + w, so w about 0)
        is_norm = jax.tree_util.keystr(path).endswith(("norm']", "layer_scalar']"))
        return (1.0 - config.norm_offset + 0.1 * x if is_norm else scale * x).astype(dtype)

    return jax.tree_util.tree_map_with_path(draw, param_shapes(config), is_leaf=lambda x: isinstance(x, tuple))


def check_tokens(tokens, config: ModelConfig) -> None:
    """Clear errors for token ids the model cannot take."""
    if tokens.shape[-1] > config.max_position_embeddings:
        raise ValueError(
            f"sequence of {tokens.shape[-1]} tokens exceeds the model's context of {config.max_position_embeddings}"
        )
    if tokens.size and (tokens.min() < 0 or tokens.max() >= config.vocab_size):
        raise ValueError(f"token ids must lie in [0, {config.vocab_size}), got [{tokens.min()}, {tokens.max()}]")


def embed(
    params: Params,
    tokens: Int[Array, "B T"],
    config: ModelConfig,
    offset: int = 0,
    *,
    positions: Optional[Int[Array, "B T"]] = None,
) -> Float[Array, "B T D"]:
    """h_0: the token embeddings, scaled as the family scales them (Gemma) and with learned
    position embeddings added (GPT-2), the tokens sitting at positions `offset, offset+1, ...`,
    or at `positions` (each token's own, e.g. one new token per prompt while decoding)."""
    h = jnp.asarray(params["embed"])[tokens]  # (numpy params, closed over, cannot take traced tokens)
    if config.embed_scale != 1.0:
        h = h * jnp.asarray(config.embed_scale, h.dtype)
    if config.positions == "learned":
        if positions is not None:
            h = h + jnp.asarray(params["pos_embed"])[positions]
        else:
            h = h + jax.lax.dynamic_slice_in_dim(params["pos_embed"], offset, tokens.shape[-1])
    return h


def per_layer_inputs(
    params: Params, tokens: Int[Array, "B T"], h0: Float[Array, "B T D"], config: ModelConfig
) -> Optional[Float[Array, "B T L P"]]:
    """Gemma 4's per-layer inputs of `tokens` (`ModelConfig.per_layer_input_size` P), from their
    embeddings `h0` (`embed`'s, before any intervention): each layer's P dims per token,
    `(norm(h0 W / sqrt(D)) + E[token] * sqrt(P)) / sqrt(2)` with the projection W
    (`ple_model_proj`, its norm `ple_proj_norm`) and the per-layer embeddings E (`ple_embed`),
    as transformers computes them. None in a model without them. A run takes them as its
    `per_layer_inputs` (`jaxdepth.core.loops.run_layers`), the rows of its own positions."""
    if not config.per_layer_input_size:
        return None
    L, P = config.num_layers, config.per_layer_input_size
    lookup = jnp.asarray(params["ple_embed"])[tokens]
    lookup = lookup * jnp.asarray(np.sqrt(P), lookup.dtype)
    projected = project(h0, params["ple_model_proj"]) * jnp.asarray(config.hidden_size**-0.5, h0.dtype)
    projected = norm(projected.reshape(h0.shape[:-1] + (L, P)), params["ple_proj_norm"], config)
    return (projected + lookup.reshape(tokens.shape + (L, P)).astype(h0.dtype)) * jnp.asarray(2**-0.5, h0.dtype)


def token_per_layer_inputs(
    params: Params, tokens: Int[Array, "B T"], config: ModelConfig
) -> Optional[Float[Array, "B T L P"]]:
    """The per-layer inputs of `tokens` (`per_layer_inputs`) from their clean embeddings
    (`embed`): what every run of those tokens gives its layers, whatever it does to the
    residual stream. An intervention at h_0, an interpolated or replaced residual at a later
    boundary (integrated gradients, erasure), a run from a later boundary: the layers still
    read these, an input of the layers, not of the residual stream, as they read the tokens'
    positions. None in a model without them."""
    if not config.per_layer_input_size:
        return None
    return per_layer_inputs(params, tokens, embed(params, tokens, config), config)


def unembed(params: Params, h: Float[Array, "*b D"], config: ModelConfig) -> Float[Array, "*b V"]:
    """The final norm then the LM head (and the family's logit soft-cap), as float32 logits (the
    logit lens applies it to any h_l)."""
    x = norm(h, params["final_norm"], config, params.get("final_norm_bias"))
    if config.tie_word_embeddings:
        logits = jnp.einsum("...d,vd->...v", x, params["embed"], preferred_element_type=jnp.float32)
    else:
        logits = jnp.einsum("...d,dv->...v", x, params["lm_head"], preferred_element_type=jnp.float32)
    if config.final_softcap:
        logits = jnp.tanh(logits / config.final_softcap) * config.final_softcap
    return logits


def forward(
    params: Params,
    tokens: Int[Array, "B T"],
    config: ModelConfig,
    *,
    valid: Optional[Bool[Array, "B T"]] = None,
    interventions: InterventionsLike = None,
) -> Float[Array, "B T V"]:
    """Logits of the model on `tokens`, under `interventions` (none by default)."""
    h0 = embed(params, tokens, config)
    extra = per_layer_inputs(params, tokens, h0, config)
    h, _ = run_layers(params, h0, config, valid=valid, interventions=interventions, per_layer_inputs=extra)
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
    h0 = embed(params, tokens, config)
    read = lambda r, x: (r.out, None if tap is None else tap(r, x))
    extra = per_layer_inputs(params, tokens, h0, config)
    final, (outs, taps) = run_layers(
        params, h0, config, valid=valid, interventions=interventions, tap=read, per_layer_inputs=extra
    )
    return jnp.concatenate([h0[None], outs], axis=0), final, taps


def tap_residual(record: LayerRecord, _) -> Float[Array, "B T D"]:
    """Tap returning each layer's input h_l."""
    return record.h


def residual_stream(
    params: Params, tokens: Int[Array, "B T"], config: ModelConfig, *, valid=None, interventions=None
) -> Float[Array, "Lp1 B T D"]:
    """All L+1 residual boundaries h_0..h_L, stacked on a leading axis."""
    h0 = embed(params, tokens, config)
    h_last, hs = run_layers(
        params,
        h0,
        config,
        valid=valid,
        interventions=interventions,
        tap=tap_residual,
        per_layer_inputs=per_layer_inputs(params, tokens, h0, config),
    )
    return jnp.concatenate([hs, h_last[None]], axis=0)
