"""Every loop over the layers: the one module that runs `jaxdepth.core.layer.layer_step` layer
after layer. Everything else (the forward, every analysis) calls these.

- `run_layers`: layers start..L-1 on a residual, one `lax.scan` from boundary 0 (differentiable,
  optionally rematerialised) or a `fori_loop` from a traced boundary (forward only); with taps,
  a prefix of keys and values, and stateful interventions carried through the loop; or the
  layers of a `jaxdepth.core.structure.LayerOrder` (dropped, swapped, repeated, parallel): which
  of these, one `LayerRun` value, whose `check` holds every refusal;
- `run_grouped_orders`: many concrete layer orders at once, layer-major (each distinct layer of
  a step once, on the rows of every order that runs it there);
- `run_layer`: one layer at a traced index (a site's value set inside it);
- `run_layers_in_pieces`: layers from a boundary on, each over position pieces (`Pieces`) in
  order against a key/value buffer (erasure's suffix runs);
- `suffix_value_and_grad`: a metric of the last boundary and its gradient with respect to a
  boundary, the backward walked layer by layer (each layer recomputed, or run from its stored
  matmul outputs);
- `clean_key_values`: every layer's keys and values read off a residual stream; `clean_prefix`:
  the prefix of a suffix run from it (with linear-attention layers' states: `linear_state_at`);
- `final_residual`: boundary L, where `resid_pre` interventions with layer index L act;
- `token_step`: one position's step through one layer against the clean run's keys and values
  (a layer as a function of one vector, what a Jacobian differentiates);
- `map_layers`, `scan_layers`: a function of the layer index over every layer, one at a time or
  carried from layer to layer (forward or reverse): the loops of analyses that run a layer's
  linearisation rather than the layer itself.

`LayerRun.start` (a boundary) may be traced but not batched: under `vmap` a batched trip count would run
every member for the longest one. Sweep over members that share it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float

from jaxdepth.core.config import ModelConfig
from jaxdepth.core.execution import refuse_fields, refuse_unknown
from jaxdepth.core.layer import (
    KeyValueBuffer,
    LayerContext,
    MixerPrefix,
    Params,
    in_layers,
    Tap,
    check_layer_rows,
    context_of_layer,
    empty_shared_kv,
    every_layer_rows,
    input_key_values,
    layer_key_values,
    layer_context,
    layer_params,
    layer_row,
    layer_step,
    layer_weights,
    linear_shape,
    piece_context,
    piece_shared_kv,
    refuse_linear_prefix,
    refuse_shared_key_values,
    shared_kv_at,
    written_shared_kv,
)
from jaxdepth.core.linear_attention import LinearState
from jaxdepth.core.sites import (
    InterventionsLike,
    StatefulIntervention,
    apply_at,
    check_layer_indices,
    initial_states,
    splits_layer,
)
from jaxdepth.core.structure import GroupedSteps, LayerOrder, check_order

__all__ = [
    "final_residual",
    "LayerRun",
    "refuse_run_keywords",
    "run_layers",
    "run_grouped_orders",
    "run_layer",
    "Pieces",
    "run_layers_in_pieces",
    "clean_key_values",
    "clean_prefix",
    "linear_state_at",
    "suffix_value_and_grad",
    "stored_layers",
    "token_step",
    "token_chain_step",
    "shared_row_at",
    "map_layers",
    "scan_layers",
]


def final_residual(h_last, config: ModelConfig, interventions, states: tuple = ()):
    """Boundary L, the final norm's input: `resid_pre` interventions act here with layer index
    L, except those whose layer-indexed data has only L rows (`jaxdepth.core.sites.Intervention`);
    stateful ones with the `states` the layers left them."""
    L = config.num_layers
    return apply_at("resid_pre", h_last, L, check_layer_indices(interventions, L), L, states, final=True)[0]


@dataclasses.dataclass(frozen=True)
class LayerRun:
    """Which layers a driver runs, and against what: the one place their capabilities are
    declared (`check`). Built at trace time (its fields may hold tracers); not a pytree.

    start: the boundary the residual is at, 0 (the Python int, the default: one `lax.scan`,
        differentiable) or any other boundary in 0..L, traced or not (a forward-only
        `fori_loop` from it; the layers before it are not computed). Traced, never batched.
    prefix: `(keys, values)`, `[L, B, P, K, Dh]` each (a slice of `clean_key_values`): the
        residual holds positions P..T-1 only, the first P entering every layer through these.
        Under an `order`, `[N, G, B, P, K, Dh]` (step, group member).
    order: a `jaxdepth.core.structure.LayerOrder` `[N, G]` run instead of layers 0..L-1
        (from boundary 0 only).
    context: a `LayerContext` replacing the one built from `valid` and the prefix's length
        (rows that are not consecutive positions, `jaxdepth.core.layer.step_context`).
    remat: wrap each layer in `jax.checkpoint` (from boundary 0 only): a gradient through
        the stack keeps one residual per layer.
    shared_kv: the keys and values shared among layers as they stand at `start` (Gemma 4's
        `shared_kv_layers`; `jaxdepth.core.layer.shared_kv_at` of the clean run's keys and
        values, every position's): what the layers from `start` on that reuse the keys of a
        layer before it read, as the prefix holds the keys of earlier positions. Required
        from a boundary other than 0 in such a model; None: none computed yet (boundary 0)."""

    start: Any = 0
    prefix: Optional[Any] = None
    order: Optional[LayerOrder] = None
    context: Optional[LayerContext] = None
    remat: bool = False
    shared_kv: Optional[dict] = None

    @property
    def from_zero(self) -> bool:
        """Whether this run is the scan over every layer (start is the Python int 0)."""
        return isinstance(self.start, int) and not isinstance(self.start, bool) and self.start == 0

    @property
    def offset(self) -> int:
        """Positions before the residual's first row: the prefix's length P (0 without one)."""
        return 0 if self.prefix is None else jnp.shape(self.prefix[0])[3 if self.order is not None else 2]

    def check(self, config: ModelConfig, ivs: tuple) -> None:
        """Refuse what `run_layers` cannot run: a boundary outside 0..L, `remat` or an `order`
        from a boundary other than 0, prefix rows other than one per layer (per step and group
        member under an order), a malformed order, a stateful intervention in a parallel step."""
        L = config.num_layers
        if not self.from_zero and not isinstance(self.start, jax.core.Tracer) and not 0 <= int(self.start) <= L:
            raise ValueError(f"start must be a boundary in 0..{L}, got {self.start}")
        if not self.from_zero and self.shared_kv is None:
            refuse_shared_key_values(
                config,
                "a run from a boundary other than 0 without the keys and values shared at it "
                "(LayerRun(shared_kv=jaxdepth.core.layer.shared_kv_at(...)))",
            )
        if self.remat and not self.from_zero:
            raise ValueError("remat is for gradients through every layer: run from start 0")
        if self.order is None:
            check_layer_rows(self.prefix, L, "prefix")
            return
        if not any(isinstance(a, jax.core.Tracer) for a in self.order):
            check_order(self.order, L)  # a traced order is the caller's to check (`check_order`)
        if not self.from_zero:
            raise ValueError("a layer order runs from boundary 0: drop the layers before it from the order instead")
        layers, used = self.order
        if jnp.ndim(layers) != 2 or jnp.shape(layers) != jnp.shape(used):
            raise ValueError(
                f"run_layers takes one layer order, layers and used [steps, group], got {jnp.shape(layers)} and "
                f"{jnp.shape(used)}: vmap over a stack of orders"
            )
        N, G = jnp.shape(layers)
        if G > 1:
            refuse_shared_key_values(config, "a layer order with parallel steps")
        if G > 1 and any(isinstance(iv, StatefulIntervention) for iv in ivs):
            raise ValueError("a stateful intervention's state has no order among the layers of a parallel step")
        for leaf in jax.tree.leaves(self.prefix):
            if jnp.shape(leaf)[:2] != (N, G):
                raise ValueError(
                    f"prefix rows under a layer order are [steps, group] = {(N, G)}, got {jnp.shape(leaf)}"
                )

    def check_grouped(self, grouped: GroupedSteps, shared: bool, ivs: tuple) -> None:
        """Refuse what `run_grouped_orders` cannot run: a start, order or remat (the grouped
        orders run from boundary 0, their own steps), stateful interventions, a prefix that is
        not one (keys, values) per step and group of residuals per order, a `KeyValueBuffer`
        prefix without its context."""
        if not self.from_zero or self.order is not None or self.remat:
            raise ValueError("grouped orders run their own steps from boundary 0: give only prefix= and context=")
        if any(isinstance(iv, StatefulIntervention) for iv in ivs):
            raise ValueError("grouped orders take stateless interventions: run a stateful one under vmap of run_layers")
        if self.prefix is not None and (shared or len(self.prefix) != len(grouped.steps)):
            raise ValueError(
                "prefix holds each order's keys and values: one (keys, values) per step and group, h per order"
            )
        if self.context is None and self.prefix is not None and isinstance(self.prefix[0][0], KeyValueBuffer):
            raise ValueError("KeyValueBuffer prefixes take their context: step_context(..., buffered=True)")


def refuse_run_keywords(function: str, options: dict) -> None:
    """A `TypeError` for fields of `LayerRun` (the keywords `run_layers` once took on their own)
    passed to `function`, showing the `LayerRun` that says the same; other unknown keywords are
    named as such."""
    refuse_fields(function, options, LayerRun, "run=jaxdepth.core.loops.LayerRun", "which layers run")
    refuse_unknown(function, options)


def run_layers(
    params: Params,
    h: Float[Array, "B S D"],
    config: ModelConfig,
    *,
    valid: Optional[Bool[Array, "B T"]] = None,
    interventions: InterventionsLike = None,
    tap: Optional[Tap] = None,
    tap_inputs: Any = None,
    run: LayerRun = LayerRun(),
    per_layer_inputs: Optional[Array] = None,
    **loose,
):
    """Run decoder layers start..L-1 on the residual `h` `[B, S, D]` = h_start (`h_0` by
    default), applying `interventions`: a site `Intervention` (`jaxdepth.core.sites`), a
    `StatefulIntervention`, or a sequence of them. `run` (a `LayerRun`) says which layers run
    and against what; `LayerRun.check` refuses what cannot run.

    From `run.start` 0 (the default) every layer runs as one `lax.scan` over the stacked
    weights: differentiable, and `run.remat` wraps the layer in `jax.checkpoint`, so a gradient
    through the stack keeps one residual per layer instead of every intermediate activation.
    Any other boundary in 0..L, or a traced one, runs a `fori_loop` from it: the layers before
    it are not computed at all, which is the saving when an intervention at layer or boundary
    `start` leaves everything before it clean. Forward only (no reverse-mode), and tap rows of
    the layers not run are zeros.

    `tap(record, x)` is called for every layer run with that layer's `LayerRecord` and the
    layer's slice of `tap_inputs` (a pytree with a leading layer axis, or None); its results
    are stacked on a leading layer axis. Reduce inside the tap: that is what keeps sweeps over
    all layers from holding `[L, B, T, D]` (or worse) per sweep member.

    `run.prefix = (keys, values)`, `[L, B, P, K, Dh]` each (a slice of `clean_key_values`),
    runs only a suffix: `h` holds positions P..T-1, and the first P positions enter every layer
    only through these keys and values. That is exact when the interventions change nothing
    before position P (causal attention), and it saves the prefix's queries, MLPs and outputs.
    `valid` then covers all T positions; intervention data covers the S suffix rows.

    `run.order` (a `jaxdepth.core.structure.LayerOrder` `[N, G]`, from boundary 0 only) runs
    its steps instead of layers 0..L-1 (`_run_order`): taps are then stacked `[N, G, ...]`
    (step, group member), the prefix has those leading axes too, and `tap_inputs` rows are
    read by each layer's original index, as interventions address it.

    `run.context` (a `LayerContext`) replaces the one built from `valid` and the prefix's
    length: the rotary tables and masks of rows that are not consecutive positions, such as one
    new token per prompt at each prompt's own position (`jaxdepth.core.layer.step_context`).

    `per_layer_inputs` `[B, S, L, P]`: Gemma 4's per-layer inputs of the rows
    (`jaxdepth.core.model.token_per_layer_inputs`: of the tokens' clean embeddings, whatever
    the run does to its residual), which its layers read (placed in the context). Its layers
    that share keys and values (`ModelConfig.shared_kv_layers`) read those the loop carries
    from the layers before them: from `run.shared_kv` (the clean run's at `run.start`), which
    each later layer that computes its own overwrites (`jaxdepth.core.layer.empty_shared_kv`
    from boundary 0).

    The old keywords (`start=`, `prefix=`, `order=`, `context=`, `remat=`) are refused with the
    `LayerRun` that says the same. Returns `(h_L [B, S, D], taps)` where `h_L` is the last
    boundary (after any edit at boundary L).
    """
    refuse_run_keywords("run_layers", loose)
    L = config.num_layers
    ivs = check_layer_indices(interventions, L)
    run.check(config, ivs)
    check_layer_rows(tap_inputs, L, "tap_inputs")
    context = layer_context(h, valid, config, run.offset) if run.context is None else run.context
    if per_layer_inputs is not None:
        context = context._replace(per_layer_inputs=per_layer_inputs)
    states = initial_states(ivs)
    shared = run.shared_kv
    if shared is None:
        shared = empty_shared_kv(config, h.shape[0], run.offset + h.shape[1], h.dtype)
    prefix = run.prefix
    if run.order is not None:
        body = _run_order(params, config, run.order, ivs, context, tap, tap_inputs)
        (h_last, states, _), taps = jax.lax.scan(
            jax.checkpoint(body) if run.remat else body, (h, states, shared), (run.order, prefix)
        )
        return final_residual(h_last, config, ivs, states), taps

    def record(p, i, h, states, known, shared=None):
        return layer_step(p, h, i, context, config, ivs, known, states, shared_kv=shared)

    if run.from_zero:

        def layer(carry, xs):
            h, states, shared = carry
            rows, index, tap_x, known = xs
            r = record(layer_weights(rows, params, index, config), index, h, states, known, shared)
            return (r.out, r.states, r.shared_kv), None if tap is None else tap(r, tap_x)

        xs = (every_layer_rows(params, config), jnp.arange(L), tap_inputs, prefix)
        carry = (h, states, shared)
        (h_last, states, _), taps = jax.lax.scan(jax.checkpoint(layer) if run.remat else layer, carry, xs)
        return final_residual(h_last, config, ivs, states), taps

    def record_at(i, h, states, shared):
        known = None if prefix is None else layer_row(prefix, i)
        return record(layer_params(params, i, config), i, h, states, known, shared)

    if tap is None:

        def step(i, carry):
            r = record_at(i, *carry)
            return r.out, r.states, r.shared_kv

        h_last, states, _ = jax.lax.fori_loop(run.start, L, step, (h, states, shared))
        return final_residual(h_last, config, ivs, states), None

    def tapped(i, r):
        return tap(r, None if tap_inputs is None else layer_row(tap_inputs, i))

    shapes = jax.eval_shape(lambda h, states, shared: tapped(0, record_at(0, h, states, shared)), h, states, shared)
    buffers = jax.tree.map(lambda s: jnp.zeros((L,) + s.shape, s.dtype), shapes)

    def body(i, carry):
        h, states, shared, bufs = carry
        r = record_at(i, h, states, shared)
        return r.out, r.states, r.shared_kv, jax.tree.map(lambda b, y: b.at[i].set(y), bufs, tapped(i, r))

    h_last, states, _, taps = jax.lax.fori_loop(run.start, L, body, (h, states, shared, buffers))
    return final_residual(h_last, config, ivs, states), taps


def _run_order(params: Params, config: ModelConfig, order: LayerOrder, ivs, context, tap, tap_inputs):
    """The scan body of `run_layers(run=LayerRun(order=...))` (checked by `LayerRun.check`):
    one step of the order, `(h, states)` carried. A step of one layer sets h to its output
    (`where`, so the identity order is the plain forward bit for bit); a step of several adds
    each one's output minus h; a step of none keeps h. Every group member runs (a vmapped
    stack of orders has no per-member shapes); the unused ones' results are discarded."""
    G = jnp.shape(order.layers)[1]

    def step(carry, xs):
        h, states, shared = carry
        (index, use), known = xs
        records = [
            layer_step(
                layer_params(params, index[g], config),
                h,
                index[g],
                context,
                config,
                ivs,
                None if known is None else layer_row(known, g),
                states,
                shared_kv=shared,
            )
            for g in range(G)
        ]
        if G == 1:
            new = jnp.where(use[0], records[0].out, h)
            states = jax.tree.map(lambda a, b: jnp.where(use[0], a, b), records[0].states, states)
            shared = jax.tree.map(lambda a, b: jnp.where(use[0], a, b), records[0].shared_kv, shared)
        else:
            zero = jnp.zeros((), h.dtype)
            alone, added = zero, h
            for g, r in enumerate(records):  # x + 0 is x: `alone` is the one used output, exactly
                alone = alone + jnp.where(use[g], r.out, zero)
                added = added + jnp.where(use[g], r.out - h, zero)
            count = jnp.sum(use)
            new = jnp.where(count == 0, h, jnp.where(count == 1, alone, added))
        if tap is None:
            return (new, states, shared), None
        tapped = [
            tap(r, None if tap_inputs is None else layer_row(tap_inputs, index[g])) for g, r in enumerate(records)
        ]
        return (new, states, shared), jax.tree.map(lambda *rows: jnp.stack(rows), *tapped)

    return step


def run_grouped_orders(
    params: Params,
    h: Float[Array, "*C B S D"],
    config: ModelConfig,
    grouped: GroupedSteps,
    *,
    valid: Optional[Bool[Array, "B T"]] = None,
    interventions: InterventionsLike = None,
    tap: Optional[Tap] = None,
    run: LayerRun = LayerRun(),
    **loose,
):
    """Every order of `grouped` (`jaxdepth.core.structure.group_orders`: C concrete orders) run
    layer-major: at each step each distinct layer runs once, as one computation over the rows of
    all the orders that run it there. `run_layers(order=...)` vmapped over a stack of orders
    computes the same, but each order's layer on its own rows, reading (and copying) that
    layer's weights once per order per step: with few rows per order, as in decoding, the
    weights' memory traffic is the cost.

    `h` is `[C, B, S, D]` (each order's own residual) or `[B, S, D]`, a residual every order
    starts from (a prefill): then the orders whose steps so far are the same compute them once
    (every drop and swap of layer l shares layers 0..l-1 with the intact model).

    `run` (a `LayerRun`, checked by `LayerRun.check_grouped`) takes a prefix and a context
    only: `run.prefix` (keys and values of earlier positions) and the taps are per step and
    group, as the plan's `steps` are: `prefix[n][j] = (keys, values)`, `[members, B, P, K, Dh]`
    each, the rows of group j's member orders (or a `jaxdepth.core.layer.KeyValueBuffer` of
    such rows, as decoding keeps them, with its `run.context`); `tap(record, None)` results
    come back the same way (a tuple per step of one result per group, with a leading member
    axis). `interventions` apply to every order as `run_layers` applies them (stateful ones are
    refused: an order's state would have to follow it across groups). The old `context=` and
    `prefix=` keywords are refused with the `LayerRun` that says the same. Returns
    `(h_L [C, B, S, D], taps)`."""
    refuse_run_keywords("run_grouped_orders", loose)
    L, C = config.num_layers, grouped.num_orders
    shared = jnp.ndim(h) == 3
    if not shared and (jnp.ndim(h) != 4 or jnp.shape(h)[0] != C):
        raise ValueError(f"h is [B, S, D] (shared) or [orders={C}, B, S, D], got {jnp.shape(h)}")
    if len(grouped.steps) != len(grouped.applied) or any(len(a) != C for a in grouped.applied):
        raise ValueError("a malformed GroupedSteps: build it with jaxdepth.core.structure.group_orders")
    ivs = check_layer_indices(interventions, L)
    run.check_grouped(grouped, shared, ivs)
    prefix, context = run.prefix, run.context
    if context is None:
        offset = 0 if prefix is None else jnp.shape(prefix[0][0][0])[2]
        context = layer_context(h if shared else h[0], valid, config, offset)
    rows = jnp.expand_dims(h, 0) if shared else h  # one row per class of orders with the same residual
    class_of = [0] * C if shared else list(range(C))
    taps = []
    for n, (groups, applied) in enumerate(zip(grouped.steps, grouped.applied)):
        outs, step_taps, input_row = [], [], []
        for j, (layer, members) in enumerate(groups):
            inputs = sorted({class_of[c] for c in members})  # each distinct residual once
            input_row.append([inputs.index(class_of[c]) for c in members])
            x = rows if inputs == list(range(len(rows))) else rows[np.asarray(inputs)]
            known = None if prefix is None else prefix[n][j]

            def run(x, known, layer=layer):
                r = layer_step(layer_params(params, layer, config), x, layer, context, config, ivs, known, ())
                return r.out, None if tap is None else tap(r, None)

            out, tapped = jax.vmap(run)(x, known)
            if tap is not None and shared:  # one row per member, as a decoding prefix needs
                tapped = jax.tree.map(lambda a, picks=np.asarray(input_row[-1]): a[picks], tapped)
            outs.append(out)
            step_taps.append(tapped)
        taps.append(tuple(step_taps))
        # the new classes: orders with the same residual before this step and the same layers in it
        found: dict = {}
        for c in range(C):
            key = (class_of[c], tuple((j, input_row[j][i]) for j, i in applied[c]))
            class_of[c] = found.setdefault(key, len(found))
        rows = jnp.stack([_combined(rows[old], [outs[j][r] for j, r in apps]) for old, apps in found])
    h_last = rows[np.asarray(class_of)]
    return jax.vmap(lambda x: final_residual(x, config, ivs))(h_last), tuple(taps)


def _combined(h, outputs):
    """A step's result on residual h: h itself (no layer), the one layer's output (bit for bit),
    or h plus each parallel layer's contribution, added in the group's order as `_run_order`
    adds them."""
    if len(outputs) == 1:
        return outputs[0]
    added = h
    for out in outputs:
        added = added + (out - h)
    return added


def run_layer(
    params: Params,
    layer,
    h: Float[Array, "B T D"],
    config: ModelConfig,
    *,
    valid=None,
    interventions=None,
    context: Optional[LayerContext] = None,
    prefix: Optional[tuple[Array, Array]] = None,
    per_layer_inputs: Optional[Array] = None,
    shared_kv: Optional[dict] = None,
):
    """The `LayerRecord` of layer `layer` (traced or not) run on its input `h` under
    `interventions` (stateful ones start from their initial state). `context` and `prefix` as
    in `jaxdepth.core.layer.layer_step` (this layer's keys and values `[B, P, K, Dh]`), for rows
    that are not a prompt's first positions: one position against a key/value buffer
    (`jaxdepth.core.layer.piece_context`). `per_layer_inputs` `[B, S, L, P]` and `shared_kv`
    as in `run_layers` (`LayerRun.shared_kv`: the keys and values shared at the layer's own
    boundary, which a layer that reuses an earlier layer's reads; in the piece layout,
    `jaxdepth.core.layer.piece_shared_kv`, with a piece context); the record's `shared_kv`
    is then the slot after the layer."""
    ivs = check_layer_indices(interventions, config.num_layers)
    context = layer_context(h, valid, config) if context is None else context
    if per_layer_inputs is not None:
        context = context._replace(per_layer_inputs=per_layer_inputs)
    p = layer_params(params, layer, config)
    return layer_step(p, h, layer, context, config, ivs, prefix, initial_states(ivs), shared_kv=shared_kv)


class Pieces(NamedTuple):
    """The position pieces `run_layers_in_pieces` runs, in order: pieces `first..last` (traced
    or not, never batched: they are loop bounds) of `width` positions each (static), piece j
    holding positions j * width .. (j + 1) * width - 1."""

    first: Any
    last: Any
    width: int


def run_layers_in_pieces(
    params: Params,
    h: Float[Array, "B T D"],
    start,
    key_value_buffers: tuple[Array, Array],
    valid: Bool[Array, "B T"],
    config: ModelConfig,
    *,
    pieces: Optional[Pieces] = None,
    interventions_of=None,
    clean_inputs: Optional[Float[Array, "Lp1 B T D"]] = None,
    per_layer_inputs: Optional[Array] = None,
    **loose,
) -> Float[Array, "B T D"]:
    """Layers start..L-1 on `h` `[B, T, D]` = h_start, each over the position pieces
    `pieces.first..pieces.last` (`pieces.width` positions each, a `Pieces`) in order, every
    piece's queries reading a key/value buffer (`key_value_buffers = (keys, values)`,
    `[L, B, T, K, Dh]` each, e.g. `clean_key_values` of a clean run) into which each piece
    writes its own keys and values. Returns the last boundary `[B, T, D]` before any edit at
    boundary L (`final_residual` applies those): positions before the first piece keep `h`,
    those after the last piece are stale.

    `interventions_of(rows)` gives the interventions of the piece of positions `rows [width]`
    (traced), whose position masks have `width` rows; stateful ones and split sites are
    refused. Exact when nothing before the first piece changes (causal attention): the buffer
    holds the clean keys there. `start` and the pieces' bounds may be traced, not batched
    (they are loop bounds). Forward only. The old `first_piece=`, `last_piece=` and `width=`
    keywords are refused with the `Pieces` that says the same.

    In a model with linear-attention layers, `clean_inputs` (every layer's clean input `[L(+1),
    B, T, D]`, the stream the buffers were read off) gives each such layer its state where the
    first piece begins: the layer run on its clean input at the positions before it (with the
    interventions of those positions), which nothing before the first piece changes, as the
    buffer's keys. Its pieces then carry the state from one to the next, as its keys go into
    the buffer.

    `per_layer_inputs` `[B, T, L, P]` (Gemma 4's, every position's; each piece reads its own
    rows). In a model whose layers share keys and values, the slot at `start` is the one the
    buffers give (`jaxdepth.core.layer.shared_kv_at`: the clean run's); a layer that computes
    its own keys writes its whole buffer into its type's slot once its pieces have run, and a
    later layer that reuses them reads that buffer (`piece_shared_kv`), as in the full forward."""
    if loose:
        old = {"first_piece": "first", "last_piece": "last", "width": "width"}
        named = [f"{old[k]}=..." for k in loose if k in old]
        if named:
            raise TypeError(
                f"run_layers_in_pieces() takes its pieces as one value: pieces=jaxdepth.core.loops.Pieces("
                f"{', '.join(named)}), not {', '.join(k for k in loose if k in old)} on their own"
            )
        raise TypeError(f"run_layers_in_pieces() got unexpected keyword arguments: {', '.join(loose)}")
    if pieces is None or interventions_of is None:
        raise TypeError("run_layers_in_pieces() takes pieces=Pieces(first, last, width) and interventions_of=")
    keys, values = key_value_buffers
    first_piece, last_piece, width = pieces
    T = h.shape[1]
    if config.mixed_mixers and clean_inputs is None:
        raise ValueError(
            "a model with linear-attention layers runs in pieces from each layer's state where the first piece "
            "begins: pass clean_inputs= (every layer's clean input, the stream the buffers were read off)"
        )

    def layer(i, carry):
        h, shared = carry
        p = layer_params(params, i, config)
        state = None
        if config.mixed_mixers:  # the state where the first piece begins, from the clean inputs before it
            ivs = check_layer_indices(interventions_of(jnp.arange(T)), config.num_layers)
            state = linear_state_at(p, i, clean_inputs[i], valid, first_piece * width, config, ivs)

        def piece(j, carry):
            h, k_buf, v_buf, state = carry
            first = j * width
            ivs = check_layer_indices(interventions_of(first + jnp.arange(width)), config.num_layers)
            if any(isinstance(iv, StatefulIntervention) for iv in ivs):
                raise ValueError("stateful interventions carry their state layer after layer, not piece by piece")
            if splits_layer(ivs):
                raise ValueError(
                    "a layer split per head keeps keys and values per query head; the pieces' buffers hold the "
                    "key/value heads': run split sites without pieces"
                )
            x = jax.lax.dynamic_slice_in_dim(h, first, width, axis=1)
            prefix = (k_buf, v_buf) if state is None else MixerPrefix(k_buf, v_buf, state)
            context = piece_context(valid, first, width, config)
            if per_layer_inputs is not None:
                rows = jax.lax.dynamic_slice_in_dim(per_layer_inputs, first, width, axis=1)
                context = context._replace(per_layer_inputs=rows)
            shared_kv = piece_shared_kv(shared, first, width)
            r = layer_step(p, x, i, context, config, ivs, prefix, shared_kv=shared_kv)
            put = lambda buf, new: jax.lax.dynamic_update_slice_in_dim(buf, new, first, axis=1)
            return put(h, r.out), put(k_buf, r.k[:, T:]), put(v_buf, r.v[:, T:]), r.linear_state

        h, k_buf, v_buf, _ = jax.lax.fori_loop(first_piece, last_piece + 1, piece, (h, keys[i], values[i], state))
        return h, written_shared_kv(shared, i, (k_buf, v_buf), config)

    shared = shared_kv_at((keys, values), start, config)
    return jax.lax.fori_loop(start, config.num_layers, layer, (h, shared))[0]


def linear_state_at(p: Params, index, h: Float[Array, "B T D"], valid, position, config: ModelConfig, interventions=()):
    """Layer `index`'s linear-attention state at `position` (traced or not) of its input `h`
    (`p` its weights, `interventions` checked; zeros where the layer is attention's): the layer
    run on `h` with only the positions before `position` valid (of `valid`, all by default),
    whose state is then what they leave (`jaxdepth.core.linear_attention.gated_delta_net`)."""
    B, T, _ = h.shape
    valid = jnp.ones((B, T), bool) if valid is None else valid
    before = valid & (jnp.arange(T) < position)[None, :]
    zeros = LinearState.zeros(B, linear_shape(config), h.dtype)
    run = lambda: layer_step(p, h, index, layer_context(h, before, config), config, interventions).linear_state  # noqa: E731
    return jax.lax.cond(in_layers(index, config.linear_layers, config), run, lambda: zeros)


def clean_prefix(params: Params, hs: Float[Array, "Lp1 B T D"], length: int, config: ModelConfig, *, valid=None):
    """Every layer's prefix of the first `length` positions (static), read off the clean
    residual stream `hs` (from `residual_stream`): what a suffix run from position `length`
    takes (`LayerRun.prefix`). `(keys, values)` `[L, B, length, K, Dh]` (`clean_key_values`
    there); in a model with linear-attention layers a `jaxdepth.core.layer.MixerPrefix`, each
    linear layer's state at `length` beside the attention layers' keys and values."""
    if not config.mixed_mixers:
        keys, values = clean_key_values(params, hs, config, valid=valid)
        return keys[:, :, :length], values[:, :, :length]
    if config.rope_type == "longrope":  # its keys' factors depend on the prompt's whole length
        raise ValueError("clean_prefix of a model with linear-attention layers and longrope is not implemented")
    B, T = hs.shape[1:3]
    valid = jnp.ones((B, T), bool) if valid is None else valid
    # one run of each layer with only the prefix valid: a linear layer's state is then the
    # prefix's, and the keys, read off each position's input alone, are the whole run's
    context = layer_context(hs[0], valid & (jnp.arange(T) < length)[None, :], config)

    def one(i):
        r = layer_step(layer_params(params, i, config), hs[i], i, context, config)
        return r.k[:, :length], r.v[:, :length], r.linear_state

    return MixerPrefix(*map_layers(one, config))


def clean_key_values(params: Params, hs: Float[Array, "Lp1 B T D"], config: ModelConfig, *, valid=None):
    """Every layer's rotated keys and values, `([L, B, T, K, Dh], [L, B, T, K, Dh])`, read off
    the clean residual stream `hs` (from `residual_stream`): the `prefix` of a suffix run.

    Where the layers' attention comes in two shapes or shares keys and values (Gemma 4), as the
    records hold them (`jaxdepth.core.layer.LayerRecord.k`): as wide as the widest layer's,
    and a layer of `shared_kv_layers` has the row of the layer whose keys it reads
    (`ModelConfig.kv_source`); `jaxdepth.core.layer.shared_kv_at` reads the slot at a boundary
    off them."""
    refuse_linear_prefix(config, "clean_key_values (a suffix run's prefix)")
    context = layer_context(hs[0], valid, config)
    if config.global_layers or config.shared_kv_layers:
        own = map_layers(lambda i: layer_key_values(layer_params(params, i, config), hs[i], i, context, config), config)
        source = np.array([config.kv_source(i) for i in range(config.num_layers)])
        return tuple(a[source] for a in own)

    def key_values(p, h, i):
        cos, sin, _ = context_of_layer(context, i, config)
        return input_key_values(p, h, cos, sin, config)

    return jax.vmap(key_values)(every_layer_rows(params, config), hs[:-1], jnp.arange(config.num_layers))


def suffix_value_and_grad(
    params,
    z,
    start,
    config: ModelConfig,
    head,
    *,
    valid=None,
    interventions=None,
    backward: Backward = "recompute",
    per_layer_inputs=None,
    shared_kv=None,
):
    """`head(h_L)` when h_start = z, and its gradient with respect to z, running only layers
    start..L-1 (`layer_step`, with `interventions` at their sites, as every loop).

    The layers before `start` are neither run nor differentiated; the backward walks the layers
    in reverse, one `jax.vjp` each. `backward` says what the forward keeps for it:
    'recompute' (default): each layer's input, the backward recomputing that layer (three layer
    passes per gradient: forward, forward again, backward); 'stored': each layer's matmul
    outputs as well (`_PullbackLayout`), the backward running from them (two passes, about twice
    the activations of a forward per layer, `jaxdepth.core.sweep.member_bytes(stored=True)`);
    an int k: the last k layers stored, the others recomputed (`stored_layers`), where memory
    holds some layers' matmul outputs but not all. `start` may be traced but not batched.

    `per_layer_inputs` `[B, T, L, P]` and `shared_kv` (the slot at `start`) as in `run_layers`.
    In a model whose layers share keys and values the gradient also flows from a layer that
    reuses keys to the input of the layer that computed them: there the layers run as one
    differentiable scan carrying the slot (those before `start` passed by, `lax.cond`), each
    layer rematerialised ('recompute') or keeping its matmul outputs ('stored'); a backward
    that stores some layers only is refused.
    """
    L = config.num_layers
    k = stored_layers(backward, L)
    ivs = _without_state(check_layer_indices(interventions, L))
    context = layer_context(z, valid, config)
    if per_layer_inputs is not None:
        context = context._replace(per_layer_inputs=per_layer_inputs)
    if config.shared_kv_layers:
        return _shared_value_and_grad(params, z, start, config, head, context, ivs, shared=shared_kv, stored=k)
    apply = lambda i, h: layer_step(layer_params(params, i, config), h, i, context, config, ivs).out
    layout = _PullbackLayout.of(params, z, context, config, ivs) if k else None
    first_stored = start if k == L else L if k == 0 else jnp.maximum(start, L - k)  # start..first_stored-1 recompute
    to_row = lambda i: i - (L - k)  # layer i's row in the stored buffers  # noqa: E731

    def recompute_step(i, carry):
        h, inputs = carry
        return apply(i, h), inputs.at[i].set(h)

    def store_step(i, carry):
        h, kept = carry
        out, saved = layout.linearize(params, i, h, context, config, ivs)
        return out, tuple(b if b is None else b.at[to_row(i)].set(r) for b, r in zip(kept, saved))

    # (each loop is traced only where it has layers to run: 'stored' and 'recompute' are one loop each)
    h = z
    if k < L:
        h, inputs = jax.lax.fori_loop(start, first_stored, recompute_step, (z, jnp.zeros((L - k,) + z.shape, z.dtype)))
    if k > 0:
        h, kept = jax.lax.fori_loop(first_stored, L, store_step, (h, layout.buffers(k)))
    # Interventions at boundary L sit between the last layer and the head.
    value, grad = jax.value_and_grad(lambda h: head(final_residual(h, config, ivs)))(h)

    def stored_back(n, g):
        i = L - 1 - n
        return layout.pullback(params, i, kept, to_row(i), config)(g)[0]

    def recomputed_back(n, g):
        i = first_stored - 1 - n
        _, pullback = jax.vjp(lambda h: apply(i, h), inputs[i])
        return pullback(g)[0]

    if k > 0:
        grad = jax.lax.fori_loop(0, L - first_stored, stored_back, grad)
    if k < L:
        grad = jax.lax.fori_loop(0, first_stored - start, recomputed_back, grad)
    return value, grad


def _shared_value_and_grad(params, z, start, config: ModelConfig, head, context, ivs, *, shared, stored: int):
    """`suffix_value_and_grad` where layers share keys and values: one scan over every layer
    carrying `(h, slot)`, layers before `start` skipped, differentiated whole."""
    L = config.num_layers
    if stored not in (0, L):
        raise ValueError(
            f"a backward that stores {stored} of {L} layers is not implemented for a model whose layers share keys "
            "and values: take 'recompute' or 'stored'"
        )
    if shared is None:
        raise ValueError(
            "a suffix gradient of a model whose layers share keys and values starts from the slot at its boundary: "
            "pass shared_kv=jaxdepth.core.layer.shared_kv_at(clean keys and values, start, config)"
        )
    policy = jax.checkpoint_policies.dots_saveable if stored == L else None

    def body(carry, i):
        def apply(carry):
            r = layer_step(layer_params(params, i, config), carry[0], i, context, config, ivs, shared_kv=carry[1])
            return r.out, r.shared_kv

        return jax.lax.cond(i >= start, apply, lambda carry: carry, carry), None

    def value(z):
        (h, _), _ = jax.lax.scan(jax.checkpoint(body, policy=policy), (z, shared), jnp.arange(L))
        return head(final_residual(h, config, ivs))

    return jax.value_and_grad(value)(z)


# What a suffix gradient keeps for its backward: 'recompute', 'stored', or the number of layers
# (the last ones) whose matmul outputs are kept (`suffix_value_and_grad`).
Backward = Any


def stored_layers(backward: Backward, num_layers: int) -> int:
    """How many of the last layers keep their matmul outputs under `backward`: 'stored' all,
    'recompute' none, an int k itself (0..L). Anything else is refused ('auto' is the drivers'
    to resolve, `jaxdepth.analyses.ig.path.choose_backward`)."""
    if isinstance(backward, str):
        if backward in ("stored", "recompute"):
            return num_layers if backward == "stored" else 0
    elif isinstance(backward, int) and not isinstance(backward, bool) and 0 <= backward <= num_layers:
        return backward
    raise ValueError(
        f"backward must be 'recompute', 'stored' or a number of stored layers in 0..{num_layers} here ('auto' is "
        f"chosen by the drivers, `choose_backward`), got {backward!r}"
    )


@dataclasses.dataclass(frozen=True)
class _PullbackLayout:
    """What `jax.vjp` of one layer keeps for its backward (its residuals): their tree, shapes, and
    which of them are the layer's own weights. The layer index is traced, so every layer keeps
    the same tree; the forward stores each layer's residuals in a buffer `[L, ...]` (skipped
    layers cost nothing), the backward rebuilds that layer's pullback from them. The weights are
    read again from `params` rather than stored: a buffer would copy the whole model."""

    treedef: jax.tree_util.PyTreeDef
    shapes: tuple
    from_weights: tuple  # per residual: the index of the layer weight it is, or None

    @staticmethod
    def _linearize(params, i, h, context, config, ivs):
        p = layer_params(params, i, config)
        # Keep the matmuls' outputs only; the elementwise work between them (norms, softmax, the
        # gate) is recomputed in the backward. Half the bytes of keeping everything, and faster
        # on CPU, where writing fresh memory costs more than that arithmetic (SmolLM2-135M's
        # shape, 100 tokens, 8 steps, AMD EPYC: layer 0 4.87 s against 5.19 s keeping all).
        step = jax.checkpoint(
            lambda h: layer_step(p, h, i, context, config, ivs).out, policy=jax.checkpoint_policies.dots_saveable
        )
        out, pullback = jax.vjp(step, h)
        saved, treedef = jax.tree_util.tree_flatten(pullback)
        weights = jax.tree_util.tree_leaves(p)
        from_weights = tuple(next((j for j, w in enumerate(weights) if r is w), None) for r in saved)
        return out, saved, treedef, from_weights

    @classmethod
    def of(cls, params, z, context, config, ivs):
        found = {}

        def trace(i, h):
            _, saved, found["treedef"], found["from_weights"] = cls._linearize(params, i, h, context, config, ivs)
            return saved

        shapes = jax.eval_shape(trace, jnp.int32(0), z)
        return cls(found["treedef"], tuple(shapes), found["from_weights"])

    def linearize(self, params, i, h, context, config, ivs):
        """Layer i at h: its output and the residuals to store (None where a weight is kept)."""
        out, saved, treedef, from_weights = self._linearize(params, i, h, context, config, ivs)
        # shapes and dtypes only: eval_shape keeps weak types (a Python float in an intervention)
        signature = lambda arrays: tuple((a.shape, a.dtype) for a in arrays)  # noqa: E731
        if (treedef.num_leaves, signature(saved), from_weights) != (
            self.treedef.num_leaves,
            signature(self.shapes),
            self.from_weights,
        ):
            raise AssertionError("a layer's pullback kept different residuals in two traces of it")
        return out, tuple(None if j is not None else r for j, r in zip(from_weights, saved))

    def buffers(self, rows: int) -> tuple:
        """Zeroed buffers for `rows` layers' residuals (None where a weight is kept)."""
        return tuple(
            None if j is not None else jnp.zeros((rows,) + r.shape, r.dtype)
            for j, r in zip(self.from_weights, self.shapes)
        )

    def pullback(self, params, i, kept, row, config: ModelConfig):
        """Layer i's pullback, from its residuals stored at `row` of `kept` and its weights."""
        weights = jax.tree_util.tree_leaves(layer_params(params, i, config))
        saved = [weights[j] if j is not None else k[row] for j, k in zip(self.from_weights, kept)]
        return jax.tree_util.tree_unflatten(self.treedef, saved)


def _without_state(ivs):
    """`ivs`, refusing stateful interventions: the backward walks the layers one by one."""
    if any(isinstance(iv, StatefulIntervention) for iv in ivs):
        raise ValueError(
            "suffix_value_and_grad walks the layers backwards one at a time and cannot carry a stateful "
            "intervention's state: differentiate run_layers (start 0) instead"
        )
    return ivs


def token_step(
    params: Params,
    index,
    x: Float[Array, " D"],
    keys: Float[Array, "L T K Dh"],
    values: Float[Array, "L T K Dh"],
    valid: Bool[Array, " T"],
    position,
    config: ModelConfig,
    *,
    inputs: Optional[Float[Array, "L T D"]] = None,
    per_layer_inputs: Optional[Float[Array, "T L P"]] = None,
) -> Float[Array, " D"]:
    """h_{l+1}[t] as a function of h_l[t] = `x` alone: layer `index` (l) run on one position
    (`position`, t; traced or not) of one prompt, which attends to the keys and values of its
    positions before t (`keys[l]`, `values[l]`, the clean run's) and to its own. At the clean
    input it equals the full forward's output there. A linear-attention layer continues from
    its state at t instead (`linear_state_at`), read off its clean `inputs` (every layer's
    input h_l of the prompt, which a model with linear-attention layers needs).

    Gemma 4: `per_layer_inputs` (the prompt's `[T, L, P]`) give the position its own; a layer
    that reuses an earlier layer's keys and values reads those of the clean run (`keys`, as
    the records hold them: `jaxdepth.core.layer.shared_kv_at`), the position's own included,
    which its input does not move."""
    clean = (keys, values, valid, position, inputs, per_layer_inputs)
    return _token_record(params, index, x, clean, config, None).out[0, 0]


def _token_record(params: Params, index, x, clean, config: ModelConfig, shared_row):
    """The record of `token_step` (`clean` its keys, values, valid, position, inputs and
    per-layer inputs), the shared keys' row at the position `shared_row` where given."""
    keys, values, valid, position, inputs, per_layer_inputs = clean
    context = piece_context(valid[None], position, 1, config)
    if per_layer_inputs is not None:
        rows = jax.lax.dynamic_slice_in_dim(per_layer_inputs[None], position, 1, axis=1)
        context = context._replace(per_layer_inputs=rows)
    shared = piece_shared_kv(shared_kv_at((keys[:, None], values[:, None]), index, config), position, 1)
    if shared_row is not None:
        shared = {
            kind: tuple(jnp.concatenate([a[:, :-1], r[None, None]], axis=1) for a, r in zip(kv, shared_row[kind]))
            for kind, kv in shared.items()
        }
    prefix = (keys[index][None], values[index][None])
    if config.mixed_mixers:
        if inputs is None:
            raise ValueError("token_step of a model with linear-attention layers needs inputs= (every layer's h_l)")
        p = layer_params(params, index, config)
        state = linear_state_at(p, index, inputs[index][None], valid[None], position, config)
        prefix = MixerPrefix(*prefix, state)
    return run_layer(params, index, x[None, None], config, context=context, prefix=prefix, shared_kv=shared)


def shared_row_at(keys: Float[Array, "L T K Dh"], values, boundary, position, config: ModelConfig) -> Optional[dict]:
    """The row at `position` of the keys and values shared among layers at `boundary` of the
    clean run of one prompt (`keys`, `values` as its records hold them;
    `jaxdepth.core.layer.shared_kv_at`): `{kind: (k [K, Dh], v [K, Dh])}`, what a chain of
    `token_chain_step`s starts from at that boundary. None in a model that shares none."""
    shared = shared_kv_at((keys[:, None], values[:, None]), boundary, config)
    if shared is None:
        return None
    return {
        kind: tuple(jax.lax.dynamic_index_in_dim(a[0], position, keepdims=False) for a in kv)
        for kind, kv in shared.items()
    }


def token_chain_step(
    params: Params,
    index,
    state: tuple,
    keys: Float[Array, "L T K Dh"],
    values: Float[Array, "L T K Dh"],
    valid: Bool[Array, " T"],
    position,
    config: ModelConfig,
    *,
    inputs: Optional[Float[Array, "L T D"]] = None,
    per_layer_inputs: Optional[Float[Array, "T L P"]] = None,
) -> tuple:
    """`token_step` of a position whose input moves at every layer of a chain, in a model whose
    layers share keys and values: `state = (x [D], row)`, the position's input and the shared
    keys' and values' row at the position (`shared_row_at`: the clean run's at the chain's first
    boundary), to `(h_{l+1}[t], row after the layer)`. A layer that reuses keys reads the row,
    one that computes its own writes it: h_L[t] as a function of h_l[t] runs through the keys a
    later layer reuses, which `token_step` (each layer against the clean run's) holds fixed."""
    x, row = state
    clean = (keys, values, valid, position, inputs, per_layer_inputs)
    r = _token_record(params, index, x, clean, config, row)
    return r.out[0, 0], {kind: tuple(a[0, -1] for a in kv) for kind, kv in r.shared_kv.items()}


def map_layers(fn, config: ModelConfig):
    """`fn(l)` for every layer index l = 0..L-1, one layer at a time (`lax.map`: one layer's
    intermediates alive at once), the results stacked on a leading `[L]` axis."""
    return jax.lax.map(fn, jnp.arange(config.num_layers))


def scan_layers(step, carry, config: ModelConfig, *, reverse: bool = False):
    """`carry` through `step(carry, l) -> (carry, out)` for l = 0..L-1, or L-1..0 with
    `reverse` (a backward chain: J_l^T applied after J_{l+1}^T): `(carry, outs [L, ...])`,
    one `lax.scan` over the layer indices."""
    return jax.lax.scan(step, carry, jnp.arange(config.num_layers), reverse=reverse)
