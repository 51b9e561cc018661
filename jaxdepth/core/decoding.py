"""Generation: greedy or sampled decoding with a key/value cache, under interventions and in any
layer order (`jaxdepth.core.structure`), as one pure function to `jit` and `vmap`.

Prompts are right-padded (`valid` marks the real tokens, a prefix of each row): each prompt's
new tokens take the positions after its own last token, so a batch of ragged prompts decodes
exactly as each prompt alone would (no position shift to correct, as left padding would need).
The prompt runs once (the prefill), keeping every step's keys and values in a buffer of
`T + max_new_tokens` positions; each new token then runs alone at its own position against
that buffer (`jaxdepth.core.layer.step_context`) and writes its keys and values into it.

Under Phi-3's 'longrope' scaling, transformers' generate recomputes the whole sequence once, at
the step whose token reaches past the original context, so that every key is rotated by the long
factors from then on; so does this loop, per prompt (a `lax.cond`: under `vmap` it runs every
step, so a vmapped longrope decoding costs a full forward per step).

Interventions act in the prefill and in every decoding step, on the rows of that call: the
prompt's T positions, then one position per step. Their data must therefore fit any number of
positions (a position mask of one entry, `[1]` or `[B, 1]`, or none); a mask of the prompt's
T positions fails the shape check at trace time. Stateful interventions and split sites are
refused: their state and per-head keys have no meaning across decoding steps.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from jaxdepth.core.config import ModelConfig
from jaxdepth.core.execution import refuse_fields, refuse_unknown
from jaxdepth.core.layer import KeyValueBuffer, MixerPrefix, Params, step_context
from jaxdepth.core.loops import LayerRun, run_grouped_orders, run_layers
from jaxdepth.core.model import embed, per_layer_inputs, unembed
from jaxdepth.core.sites import InterventionsLike, StatefulIntervention, check_layer_indices, splits_layer
from jaxdepth.core.structure import GroupedSteps, LayerOrder, identity_order

__all__ = ["Generated", "Decoding", "generate", "generate_orders", "check_prompt_mask"]


class Generated(NamedTuple):
    """New tokens `[B, max_new_tokens]` (int32; `pad_id` after each row's end) and how many
    each row generated `[B]` (its end-of-sequence token included)."""

    tokens: Int[Array, "B N"]
    lengths: Int[Array, " B"]


@dataclasses.dataclass(frozen=True)
class Decoding:
    """How `generate` picks each new token, where a row ends, and what fills it after.

    eos_ids: a row ends after it emits one of these token ids (default none: every row runs
        to `max_new_tokens`).
    pad_id: the token id filling each row's tokens after its end (int32).
    temperature: 0 (the default) picks the most likely token (greedy); > 0 samples from the
        logits divided by it, drawing with `key` (a `jax.random` key, folded with the step).
    key: the random key of sampling (None: greedy only).

    A pytree whose one leaf is the key: `eos_ids`, `pad_id` and `temperature` are static, so
    a `jit` of `generate` traces one program per choice of them and takes keys as data.
    Checked where decoding starts (a pytree's fields may be placeholders while jax rebuilds
    it)."""

    eos_ids: Sequence[int] = ()
    pad_id: int = 0
    temperature: float = 0.0
    key: Optional[Array] = None

    def __post_init__(self):
        object.__setattr__(self, "eos_ids", tuple(int(e) for e in self.eos_ids))  # hashable: static in a jit


jax.tree_util.register_dataclass(Decoding, data_fields=["key"], meta_fields=["eos_ids", "pad_id", "temperature"])


def _refuse_decoding_keywords(function: str, options: dict) -> None:
    """A `TypeError` for `eos_ids=`, `pad_id=`, `temperature=` or `key=` passed to `function`
    on their own, showing the `Decoding` that says the same; other unknown keywords are named
    as such."""
    refuse_fields(
        function, options, Decoding, "decoding=jaxdepth.core.decoding.Decoding", "how tokens are picked and rows end"
    )
    refuse_unknown(function, options)


def check_prompt_mask(valid, max_new_tokens: int, config: ModelConfig) -> None:
    """Refuse prompts `generate` cannot take, where `valid` is concrete: a row that is not a
    right-padded prefix of real tokens, an empty row, or a prompt whose real tokens and
    `max_new_tokens` exceed the model's context (`max_position_embeddings`).

    Each prompt's own length counts, not the padded one: its new tokens take the positions after
    its last real token, so the last position any prompt uses is its length + `max_new_tokens`
    - 1 (the last new token is read off, never fed back: one less). Padding past the context
    (`valid` longer than `max_position_embeddings`) is refused too: the prefill runs every
    padded position, and a learned position table has none past the context."""
    valid = np.asarray(valid, bool)
    lengths = valid.sum(axis=1)
    if (lengths == 0).any():
        raise ValueError(f"prompt {int(np.argmax(lengths == 0))} has no tokens")
    prefix = np.arange(valid.shape[1])[None, :] < lengths[:, None]
    if (valid != prefix).any():
        raise ValueError(
            f"prompt {int(np.argmax((valid != prefix).any(axis=1)))} is not right-padded: generation takes each "
            "prompt's real tokens first, then padding"
        )
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    context = config.max_position_embeddings
    longest = int(np.argmax(lengths))
    if lengths[longest] + max_new_tokens > context:
        raise ValueError(
            f"prompt {longest} has {int(lengths[longest])} tokens: with {max_new_tokens} new tokens they exceed the "
            f"model's context of {context}; ask for at most {max(context - int(lengths[longest]), 0)} new tokens "
            "or shorten the prompt"
        )
    if valid.shape[1] > context:
        raise ValueError(
            f"the prompts are padded to {valid.shape[1]} positions, past the model's context of {context}: pad them "
            f"to at most {context} (the longest has {int(lengths[longest])} tokens)"
        )


def _pick(logits: Float[Array, "B V"], temperature: float, key) -> Int[Array, " B"]:
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)


def _read_key_values(record, _):
    if record.linear_state is not None:  # linear attention: its state after the prompt, too
        return record.k, record.v, record.linear_state
    return record.k, record.v


def _new_key_values(record, _):
    if record.linear_state is not None:
        return record.k[:, -1], record.v[:, -1], record.linear_state
    return record.k[:, -1], record.v[:, -1]  # keys are [buffer | the new token]


def _cache(taps, extra: int, lead: int = 2):
    """The decoding cache from the prefill's taps: the keys and values (`lead` axes before the
    batch: a layer order's steps and groups, or a group's members) with room for `extra` new tokens (a
    `MixerPrefix` with the linear-attention states in a hybrid model)."""
    keys, values = _grow(taps[0], lead + 1, extra), _grow(taps[1], lead + 1, extra)
    return (keys, values) if len(taps) == 2 else MixerPrefix(keys, values, taps[2])


def _written(cache, new, rows, at, lead: int = 2):
    """The cache after a step (`lead` axes before the batch, as `_cache`): its new keys and
    values written at positions `at`, and the linear-attention layers' states replaced by the
    step's."""
    where = (slice(None),) * lead + (rows, at)
    keys, values = cache[0].at[where].set(new[0]), cache[1].at[where].set(new[1])
    return (keys, values) if len(new) == 2 else MixerPrefix(keys, values, new[2])


def generate(
    params: Params,
    tokens: Int[Array, "B T"],
    config: ModelConfig,
    *,
    max_new_tokens: int,
    valid: Optional[Bool[Array, "B T"]] = None,
    interventions: InterventionsLike = None,
    order: Optional[LayerOrder] = None,
    decoding: Decoding = Decoding(),
    **loose,
) -> Generated:
    """Up to `max_new_tokens` new tokens `[B, max_new_tokens]` after each right-padded prompt
    of `tokens` `[B, T]` (`valid` marks the real tokens, default all), as `decoding` says (a
    `Decoding`): greedy by default or sampled at its temperature with its key, a row ending
    after it emits one of its `eos_ids` (then filled with its `pad_id`); the loop ends when
    every row has. `interventions` and `order` (default the identity) apply to every forward
    call (module docstring). Pure: `jit` it with `config` and `max_new_tokens` static
    (`decoding` is a pytree whose key alone is data), and `vmap` it over intervention data or
    a stack of orders (`jaxdepth.core.structure.stack_orders`) to decode many configurations
    at once (`generate_orders` decodes many concrete orders faster). The old `eos_ids=`,
    `pad_id=`, `temperature=` and `key=` keywords are refused with the `Decoding` that says
    the same."""
    _refuse_decoding_keywords("generate", loose)
    B = tokens.shape[0]
    options = _loop_options(max_new_tokens, decoding)
    ivs, valid, lengths = _prepared(tokens, config, valid, interventions, options)
    order = identity_order(config.num_layers) if order is None else order
    rows = jnp.arange(B)

    def prefill(h0):
        h, taps = run_layers(
            params,
            h0,
            config,
            valid=valid,
            interventions=ivs,
            tap=_read_key_values,
            run=LayerRun(order=order),
            per_layer_inputs=per_layer_inputs(params, tokens, h0, config),
        )
        return h, _cache(taps, max_new_tokens)

    def step(x, context, cache, at):
        run = LayerRun(order=order, context=context, prefix=cache)
        h, new = run_layers(params, x, config, interventions=ivs, tap=_new_key_values, run=run)
        return h, _written(cache, new, rows, at)

    def refill_where_long_factors_begin(h, cache, at, seen, out):
        """The rows whose token at `at` is the first past longrope's original context: their
        whole sequence so far run again (the long factors throughout, as transformers does), its
        keys and values replacing the buffer's and its output at `at` the step's."""
        crossing = at == config.rope_original_max_position

        def refill(_):
            written = lengths[:, None] + jnp.arange(max_new_tokens)[None, :]  # out[:, j] sits at lengths + j
            sequence = jnp.pad(tokens, ((0, 0), (0, max_new_tokens))).at[rows[:, None], written].set(out)
            h_all, kv_all = run_layers(
                params,
                embed(params, sequence, config),
                config,
                valid=seen,
                interventions=ivs,
                tap=_read_key_values,
                run=LayerRun(order=order),
            )
            pick = lambda new, old: jnp.where(crossing.reshape((1, 1, B) + (1,) * (new.ndim - 3)), new, old)  # noqa: E731
            return jnp.where(crossing[:, None, None], h_all[rows, at][:, None], h), jax.tree.map(pick, kv_all, cache)

        return jax.lax.cond(jnp.any(crossing), refill, lambda _: (h, cache), None)

    after_step = refill_where_long_factors_begin if config.rope_type == "longrope" else None
    return _decode(params, tokens, config, valid, lengths, options, prefill, step, after_step=after_step)


def generate_orders(
    params: Params,
    tokens: Int[Array, "B T"],
    config: ModelConfig,
    grouped: GroupedSteps,
    *,
    max_new_tokens: int,
    valid: Optional[Bool[Array, "B T"]] = None,
    interventions: InterventionsLike = None,
    decoding: Decoding = Decoding(),
    **loose,
) -> Generated:
    """`generate` under each of many concrete layer orders, `grouped` =
    `jaxdepth.core.structure.group_orders(stack_orders(orders), L)`: new tokens
    `[orders, B, max_new_tokens]`, each order's what `generate(order=...)` gives it (the same
    arithmetic; under sampling, each order draws with the same `decoding.key` as alone).

    Where `vmap(generate)` over the stacked orders runs every order's layer on that order's
    rows, here every distinct layer of a step runs once on the rows of all the orders that run
    it there (`jaxdepth.core.loops.run_grouped_orders`), and the prompt's steps that orders
    share run once. The orders are static: `jit` with `grouped` static, one program per set of
    orders (its size grows with the distinct layers per step). Refuses longrope models (their
    mid-decoding refill is `generate`'s alone): vmap `generate` there. `eos_ids=`, `pad_id=`,
    `temperature=` and `key=` on their own are refused with the `Decoding` that says the same."""
    _refuse_decoding_keywords("generate_orders", loose)
    if config.rope_type == "longrope":
        raise ValueError("generate_orders does not refill longrope's long factors: vmap generate over the orders")
    if config.per_layer_input_size:
        raise ValueError("generate_orders takes no per-layer inputs (Gemma 4): vmap generate over the orders")
    options = _loop_options(max_new_tokens, decoding)
    ivs, valid, lengths = _prepared(tokens, config, valid, interventions, options)
    if grouped.num_orders < 1:
        raise ValueError("no orders to decode")

    per_group = lambda f, tree: tuple(tuple(f(member) for member in groups) for groups in tree)  # noqa: E731
    rows = jnp.arange(tokens.shape[0])
    if config.mixed_mixers:  # the keys and values concatenated at each step, the states replaced, as `generate`

        def prefill(h0):
            h, taps = run_grouped_orders(
                params, h0, config, grouped, valid=valid, interventions=ivs, tap=_read_key_values
            )
            return h, per_group(lambda t: _cache(t, max_new_tokens, lead=1), taps)

        def step(x, context, cache, at):
            run = LayerRun(context=context, prefix=cache)
            h, new = run_grouped_orders(params, x, config, grouped, interventions=ivs, tap=_new_key_values, run=run)
            written = lambda old, new: _written(old, new, rows, at, lead=1)  # noqa: E731
            return h, tuple(tuple(map(written, olds, news)) for olds, news in zip(cache, new))

        return _decode(params, tokens, config, valid, lengths, options, prefill, step, orders=grouped.num_orders)

    def prefill(h0):  # the buffers head-major, as KeyValueBuffer keeps them
        h, taps = run_grouped_orders(params, h0, config, grouped, valid=valid, interventions=ivs, tap=_read_key_values)
        return h, jax.tree.map(lambda a: _grow(jnp.swapaxes(a, 2, 3), 3, max_new_tokens), taps)

    def step(x, context, cache, at):
        prefix = per_group(lambda kv: KeyValueBuffer(kv[0], kv[1], jnp.broadcast_to(at, kv[0].shape[:2])), cache)
        run = LayerRun(context=context, prefix=prefix)
        return run_grouped_orders(params, x, config, grouped, interventions=ivs, tap=_read_key_values, run=run)

    return _decode(
        params, tokens, config, valid, lengths, options, prefill, step, orders=grouped.num_orders, buffered=True
    )


class _LoopOptions(NamedTuple):
    """How a decoding loop runs: `generate`'s static options and its key."""

    max_new_tokens: int
    eos_ids: tuple
    pad_id: int
    temperature: float
    key: Optional[Array]


def _loop_options(max_new_tokens: int, decoding: Decoding) -> _LoopOptions:
    return _LoopOptions(max_new_tokens, tuple(decoding.eos_ids), decoding.pad_id, decoding.temperature, decoding.key)


def _prepared(tokens, config: ModelConfig, valid, interventions, decoding: _LoopOptions):
    """The checked interventions, the prompt mask (all real by default) and each prompt's length."""
    ivs = check_layer_indices(interventions, config.num_layers)
    if any(isinstance(iv, StatefulIntervention) for iv in ivs) or splits_layer(ivs):
        raise ValueError(
            "generation takes site interventions at unsplit sites: a stateful intervention's state and a split "
            "layer's per-head keys do not carry from one decoding step to the next"
        )
    if decoding.temperature < 0 or (decoding.temperature > 0 and decoding.key is None):
        raise ValueError("sampling needs temperature > 0 and a key (temperature 0 decodes greedily)")
    valid = jnp.ones(tokens.shape, bool) if valid is None else jnp.asarray(valid, bool)
    if not isinstance(valid, jax.core.Tracer):
        check_prompt_mask(valid, decoding.max_new_tokens, config)
    return ivs, valid, jnp.sum(valid, axis=1).astype(jnp.int32)


def _grow(a, axis: int, extra: int):
    """`a` padded with `extra` positions on `axis` (a key/value buffer's room for new tokens)."""
    return jnp.pad(a, [(0, 0)] * axis + [(0, extra)] + [(0, 0)] * (a.ndim - axis - 1))


def _decode(
    params,
    tokens,
    config: ModelConfig,
    valid,
    lengths,
    decoding: _LoopOptions,
    prefill,
    step,
    *,
    orders: Optional[int] = None,
    after_step=None,
    buffered: bool = False,
) -> Generated:
    """The decoding loop of `generate` and `generate_orders` (`decoding`, their options) on
    prompts of `lengths` (their `valid` tokens, `_prepared`): `prefill(h0)` gives the prompt's
    last boundary and the key/value cache; `step(x, context, cache, at)` runs one new token per
    prompt (at positions `at`) and writes its keys and values into the cache (`buffered`: the
    step writes them before the token attends, `KeyValueBuffer`s, whose mask is
    `step_context(..., buffered=True)`); `after_step` may amend what a step gives. With
    `orders` C, the residuals, tokens and ends carry a leading axis of C orders."""
    max_new_tokens, eos_ids, pad_id, temperature, key = decoding
    B = tokens.shape[0]
    rows = jnp.arange(B)
    eos = jnp.asarray(tuple(eos_ids) or (-1,), jnp.int32)  # -1 is no token: nothing ends a row
    per_order = (lambda f: f) if orders is None else jax.vmap
    keyed = lambda n: None if temperature == 0 else jax.random.fold_in(key, n)  # noqa: E731

    def pick(h_last, n):  # every order draws as it would alone: the same key for each
        return per_order(lambda x: _pick(unembed(params, x, config), temperature, keyed(n)))(h_last)

    h, cache = prefill(embed(params, tokens, config))
    lead = () if orders is None else (orders,)
    first = pick(h[..., rows, lengths - 1, :], 0)
    out = jnp.full(lead + (B, max_new_tokens), pad_id, jnp.int32).at[..., 0].set(first)
    done = jnp.isin(first, eos)
    seen = jnp.pad(valid, ((0, 0), (0, max_new_tokens)))

    def running(carry):
        n, *_, done = carry
        return (n < max_new_tokens) & ~jnp.all(done)

    def one_step(carry):
        n, token, cache, seen, out, count, done = carry
        at = lengths + n - 1  # the previous token's position
        seen = seen.at[rows, at].set(True)
        x = per_order(lambda t: embed(params, t[:, None], config, positions=at[:, None]))(token)
        context = step_context(seen, at, config, buffered=buffered)
        if orders is None and config.per_layer_input_size:  # the new token's own (Gemma 4)
            context = context._replace(per_layer_inputs=per_layer_inputs(params, token[:, None], x, config))
        h, cache = step(x, context, cache, at)
        if after_step is not None:
            h, cache = after_step(h, cache, at, seen, out)
        token = pick(h[..., 0, :], n)
        out = out.at[..., n].set(jnp.where(done, pad_id, token))
        count = count + ~done
        return n + 1, token, cache, seen, out, count, done | jnp.isin(token, eos)

    carry = (jnp.int32(1), first, cache, seen, out, jnp.ones(lead + (B,), jnp.int32), done)
    out, count = jax.lax.while_loop(running, one_step, carry)[-3:-1]
    return Generated(out, count)
