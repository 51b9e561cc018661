"""The decoder written as its edges: every reader computes from an input of its own.

`edge_forward` is the forward pass of `jaxdepth.core.model` in which each reader of
`jaxdepth.analyses.edges.graph` (each query head's query, key and value inputs, each MLP's
input, the logits) reads the residual stream plus a change of its own, and which returns every
writer's output. The readers' changes are what edge attribution needs:

- `probes`: zeros added to every reader's input; the gradient with respect to them is the
  gradient at every reader's input, from one backward pass (EAP);
- `add = (reader, value)`: one reader's input moved by `value`; patching edge u -> v alone is
  `add = (v, a_corrupt[u] - a_clean[u])`, and exact from v's layer on (`start`);
- `patch = (mask, corrupt)`: every edge u -> v of `mask [W, R]` carries u's corrupt output:
  v reads `corrupt[u] - current[u]` more, where `current[u]` is what u writes in this very run
  (so patches compose: a patched edge upstream changes what later writers write).

With grouped-query attention the key and value readers are per query head: the G query heads
of a group read keys and values projected from inputs of their own, each through the group's
`[D, K, Dh]` weights (no per-head copy of the weights). With no change at any reader the run
equals `jaxdepth.core.model.forward` (to float rounding: the per-head projections sum in
another order).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxdepth.core.config import ModelConfig
from jaxdepth.core.model import Params, apply_rotary, attend, layer_context, mlp_hidden, rms_norm, unembed


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EdgeRun:
    """What `edge_forward` returns: `logits [B, V]` at each row's `last` position, every
    writer's output `writers [W, B, T, D]` (graph order; rows of layers before `start` are
    zeros, the input row is `h` when `start` is 0) and the residual boundaries
    `residuals [L+1, B, T, D]` (h_0..h_L; rows before `start` are zeros)."""

    logits: Float[Array, "B V"]
    writers: Float[Array, "W B T D"]
    residuals: Float[Array, "Lp1 B T D"]


def reader_probes(config: ModelConfig, batch: int, seq_len: int, dtype=jnp.float32) -> dict:
    """Zeros of the shape of every reader's input: `q`, `k`, `v` `[L, B, T, H, D]` (per query
    head), `mlp` `[L, B, T, D]`, `logits` `[B, T, D]`."""
    L, H, D = config.num_layers, config.num_heads, config.hidden_size
    head = jnp.zeros((L, batch, seq_len, H, D), dtype)
    return {
        "q": head,
        "k": head,
        "v": head,
        "mlp": jnp.zeros((L, batch, seq_len, D), dtype),
        "logits": head[0, :, :, 0],
    }


def head_projections(p: Params, xq, xk, xv, cos, sin, config: ModelConfig):
    """Rotated queries, keys and values `[B, T, H, Dh]` of every query head from its own normed
    inputs `[B, T, H, D]`; the key and value inputs of the G heads of a group are projected
    with that group's weights."""
    B, T, H, _ = xq.shape
    K, Dh = config.num_kv_heads, config.head_dim

    def project(x, name, heads):
        w = p[name].reshape(-1, heads, Dh)
        grouped = x.reshape(B, T, heads, H // heads, -1)
        y = jnp.einsum("btkgd,dke->btkge", grouped, w)
        if config.qkv_bias:
            y = y + p[f"{name}_bias"].reshape(heads, 1, Dh)
        return y.reshape(B, T, H, Dh)

    q, k, v = project(xq, "q", H), project(xk, "k", K), project(xv, "v", K)
    if config.qk_norm:
        q = rms_norm(q, p["q_norm"], config.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], config.rms_norm_eps)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


def edge_forward(
    params: Params,
    h: Float[Array, "B T D"],
    valid,
    last: Int[Array, " B"],
    config: ModelConfig,
    *,
    start=0,
    probes: Optional[dict] = None,
    add: Optional[tuple] = None,
    patch: Optional[tuple] = None,
    shift: Optional[tuple] = None,
    prefix: Optional[tuple] = None,
) -> EdgeRun:
    """The forward pass from residual boundary `start` (`h` = h_start; `h` = the embeddings for
    start 0), each reader's input changed as the module docstring says (`probes`, `add`,
    `patch`, any together). `last [B]`: the position whose logits each row returns.
    `shift = (node, factor, delta)` adds `factor * delta[u]` to the output of every writer u of
    one node (`node` 0: the input; 2l + 1: the heads of layer l; 2l + 2: the MLP of layer l;
    `delta [W, B, T, D]`): the paths of EAP-IG's 'activations' variant.

    `prefix = (keys, values)`, `[L, B, P, K, Dh]` each (the clean run's, `clean_key_values`),
    runs only positions P.. (`h` and every `[.., B, T, D]` argument and result then hold those
    S = T - P rows; `valid` and `last` still count all T positions). Exact when nothing
    differs before position P, as where a clean and a corrupt prompt share their first P
    tokens: the queries of the suffix read the prefix's keys and values, which no change
    reaches.

    `start` may be traced but not batched (under `vmap`, members that share it): the layers
    before it are not run. A `patch` must then hold no edge into those layers, and its
    `corrupt` rows for writers before `start` are read as they are (`current` = zeros there:
    pass `corrupt - clean` for them)."""
    L, H, D = config.num_layers, config.num_heads, config.hidden_size
    R_l = 3 * H + 1  # readers per layer
    eps = config.rms_norm_eps
    B, T, _ = h.shape  # T: the rows run (S with a prefix)
    offset = 0 if prefix is None else prefix[0].shape[2]
    cos, sin, mask = layer_context(h, valid, config, offset)
    G = H // config.num_kv_heads
    dtype = h.dtype
    from_embeddings = isinstance(start, int) and start == 0
    missing = None  # per writer, what its output lacks of its corrupt value (filled as writers run)
    if patch is not None:
        patch_mask, missing = patch
        if from_embeddings:
            missing = missing.at[0].add(-h.astype(missing.dtype))
        missing = missing.astype(dtype)

    def shifted(outputs, node, first: int, count: int):
        if shift is None:
            return outputs
        target, factor, delta = shift
        moved = jax.lax.dynamic_slice_in_dim(delta, first, count, axis=0).astype(dtype)
        return outputs + jnp.where(target == node, factor, 0).astype(dtype) * moved

    if shift is not None and from_embeddings:
        h = shifted(h[None], 0, 0, 1)[0]

    def readers_change(layer, first: int, count: int, diff):
        """`[count, B, T, D]`: the change of readers `layer * R_l + first ...` from `patch` and
        `add` (zeros where neither acts)."""
        total = jnp.zeros((count, B, T, D), dtype)
        if patch is not None:
            m = jax.lax.dynamic_slice_in_dim(patch_mask, layer * R_l + first, count, axis=1).astype(dtype)
            total = total + jnp.einsum("wr,wbtd->rbtd", m, diff)
        if add is not None:
            reader, value = add
            hit = (jnp.arange(count) + layer * R_l + first) == reader
            total = total + hit[:, None, None, None].astype(dtype) * value.astype(dtype)[None]
        return total

    def probe(name, layer):
        if probes is None:
            return 0.0
        x = probes[name] if layer is None else jax.lax.dynamic_index_in_dim(probes[name], layer, keepdims=False)
        return x.astype(dtype)

    def run_layer(carry, xs):
        h, diff = carry
        p, layer, known = xs
        change = readers_change(layer, 0, 3 * H, diff) if (patch is not None or add is not None) else None

        def head_input(kind: int, name: str):
            x = h[:, :, None, :] + probe(name, layer)
            if change is not None:
                x = x + jnp.moveaxis(change[kind * H : (kind + 1) * H], 0, 2)
            return rms_norm(jnp.broadcast_to(x, (B, T, H, D)), p["attn_norm"], eps)

        q, k, v = head_projections(p, head_input(0, "q"), head_input(1, "k"), head_input(2, "v"), cos, sin, config)
        if known is not None:  # the prefix's keys and values, each query head its group's
            k = jnp.concatenate([jnp.repeat(known[0], G, axis=2).astype(k.dtype), k], axis=1)
            v = jnp.concatenate([jnp.repeat(known[1], G, axis=2).astype(v.dtype), v], axis=1)
        heads = attend(q, k, v, mask)[1]
        first = 1 + layer * (H + 1)
        head_out = jnp.einsum("bthe,hed->hbtd", heads, p["o"].reshape(H, config.head_dim, D))
        head_out = shifted(head_out, 2 * layer + 1, first, H)
        if diff is not None:
            own = jax.lax.dynamic_slice_in_dim(diff, first, H, axis=0)
            diff = jax.lax.dynamic_update_slice_in_dim(diff, own - head_out, first, axis=0)
        attn = jnp.sum(head_out, axis=0)
        x = h + attn + probe("mlp", layer)
        if patch is not None or add is not None:
            x = x + readers_change(layer, 3 * H, 1, diff)[0]
        m = shifted((mlp_hidden(p, rms_norm(x, p["mlp_norm"], eps)) @ p["down"])[None], 2 * layer + 2, first + H, 1)[0]
        if diff is not None:
            own = jax.lax.dynamic_index_in_dim(diff, first + H, keepdims=False)
            diff = jax.lax.dynamic_update_index_in_dim(diff, own - m, first + H, axis=0)
        return (h + attn + m, diff), (jnp.concatenate([head_out, m[None]]), h)

    def layer(carry, xs):
        if from_embeddings:
            return run_layer(carry, xs)
        zeros = (jnp.zeros((H + 1, B, T, D), dtype), jnp.zeros((B, T, D), dtype))
        return jax.lax.cond(xs[1] >= start, run_layer, lambda c, _: (c, zeros), carry, xs)

    xs = (params["layers"], jnp.arange(L), prefix)
    (h_last, diff), (outs, inputs) = jax.lax.scan(layer, (h, missing), xs)
    x = h_last + probe("logits", None)
    if patch is not None or add is not None:
        x = x + readers_change(L, 0, 1, diff)[0]
    logits = unembed(params, x[jnp.arange(B), last - offset], config)
    first_row = h if from_embeddings else jnp.zeros_like(h)
    writers = jnp.concatenate([first_row[None], outs.reshape((-1, B, T, D))])
    return EdgeRun(logits, writers, jnp.concatenate([inputs, h_last[None]]))
