"""A mixture of experts in place of a layer's MLP: the router, the choice of experts and the
experts run on the tokens that chose them.

The pieces, in the order `jaxdepth.core.layer.layer_step` runs them (each a site of
`jaxdepth.core.sites`, where an intervention may change it):

    router_logits     x W_router (+ its bias, GPT-OSS)                        [B, T, E]
    router_probs      the router's scores: softmax (or sigmoid, DeepSeek-V3)  [B, T, E]
                      of the logits, float32
    router_selection  what the k best are picked by: the scores (+ DeepSeek's [B, T, E]
                      learned correction), among the kept groups' experts
    expert_weights    each expert's weight in the output: the chosen ones'    [B, T, E]
                      scores (renormalised to sum 1 and scaled where the family does), 0
                      elsewhere
    expert_out        each chosen expert's output, before its weight          [B, T, k, D]
    shared_out        the shared experts' output (DeepSeek), every token's    [B, T, D]
                      (Gemma 4: its dense MLP's, after that MLP's own post-norm)
    mlp_out           the weighted sum of the chosen experts' outputs (plus   [B, T, D]
                      the shared experts'; Gemma 4: that sum after the
                      experts' own post-norm), after the MLP's post-norm

Interventions on the routing, as data (a layer index and an expert mask per constructor, so a
stack of them vmaps over layers and experts): `forbid_experts` (never chosen: the next best
take their places), `force_experts` (chosen whatever their score, their weights their own
scores), `drop_experts` (their weights zeroed, the others' kept: their share of the output
removed) and `route` (the weights replaced).

The experts that run are the k of the largest selection, as transformers' `topk` picks them;
where an intervention edits `expert_weights`, the experts with a nonzero weight run instead,
and a token left with more than k of them gets NaN outputs (the k experts a token computes are
fixed by the shapes: more would be silently dropped).

How the experts run (`expert_outputs`): the T*k (token, expert) assignments are sorted by
expert and laid out in blocks of b rows, each block one expert's, padded where an expert's
count is not a multiple of b; one `lax.map` over the blocks multiplies each by its own expert's
weights, indexed, never copied per token. The number of blocks is bounded by the shapes alone
(at most (A + E (b - 1)) / b for A assignments, and at most A), so the program is static and
vmaps: under a sweep each member sorts its own assignments, routing on its own residual. With
b = A / 2E the padded rows are at most 1.5 A: the executed FLOPs are at most 1.5 k/E of the
dense equivalent's (E experts on every token), on a CPU and on an accelerator alike. One token
(decoding) takes k blocks of one row: exactly its k experts' weights are read.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxdepth.core.config import ModelConfig
from jaxdepth.core.primitives import gated_units, project
from jaxdepth.core.sites import Intervention, InterventionError

__all__ = [
    "router_logits",
    "router_scores",
    "selection_of",
    "choose_experts",
    "shared_experts",
    "chosen_weights",
    "dense_weights",
    "experts_of_weights",
    "block_rows",
    "executed_rows",
    "expert_outputs",
    "combine_experts",
    "forbid_experts",
    "force_experts",
    "drop_experts",
    "route",
    "follow_routing",
]


def router_logits(p, x: Float[Array, "B T D"], config: ModelConfig) -> Float[Array, "B T E"]:
    """The router's logits of one layer (`p`) on the MLP's normed input `x` (plus its bias where
    the family has one)."""
    logits = project(x, p["router"])
    return logits + p["router_bias"] if config.router_bias else logits


def router_scores(logits: Float[Array, "B T E"], config: ModelConfig) -> Float[Array, "B T E"]:
    """The router's scores of each expert: the softmax of its logits ('sigmoid' routers: each
    logit's sigmoid), in float32 as transformers computes them."""
    logits = logits.astype(jnp.float32)
    return jax.nn.sigmoid(logits) if config.router == "sigmoid" else jax.nn.softmax(logits, axis=-1)


def selection_of(p, scores: Float[Array, "B T E"], config: ModelConfig) -> Float[Array, "B T E"]:
    """What the router picks its experts by: the scores, plus DeepSeek-V3's learned correction
    (`p['router_correction']`) where the family has one."""
    return scores + p["router_correction"] if config.router_correction else scores


def choose_experts(selection: Float[Array, "B T E"], config: ModelConfig) -> Int[Array, "B T k"]:
    """The k experts of the largest `selection` per token, best first (`lax.top_k`, as
    `torch.topk` orders them); with `router_groups` > 1 among the experts of the
    `router_groups_kept` groups whose two best selections sum highest (DeepSeek-V3)."""
    if config.router_groups > 1:
        G, E = config.router_groups, config.num_experts
        grouped = selection.reshape(selection.shape[:-1] + (G, E // G))
        group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
        kept = jax.lax.top_k(group_scores, config.router_groups_kept)[1]
        keep = jnp.any(kept[..., None] == jnp.arange(G), axis=-2)
        selection = jnp.where(jnp.repeat(keep, E // G, axis=-1), selection, -jnp.inf)
    return jax.lax.top_k(selection, config.experts_per_token)[1]


def chosen_weights(scores: Float[Array, "B T E"], chosen: Int[Array, "B T k"], config: ModelConfig):
    """The chosen experts' weights `[B, T, k]`: their scores, renormalised to sum to 1 where the
    family does (`ModelConfig.normalize_expert_weights`; a sigmoid router adds 1e-20 to the sum,
    as DeepSeek does), times `expert_scale`."""
    weights = jnp.take_along_axis(scores, chosen, axis=-1)
    if config.normalize_expert_weights:
        total = jnp.sum(weights, axis=-1, keepdims=True)
        weights = weights / (total + 1e-20 if config.router == "sigmoid" else total)
    return weights * config.expert_scale if config.expert_scale != 1.0 else weights


def shared_experts(p, x: Float[Array, "B T D"], config: ModelConfig) -> Float[Array, "B T D"]:
    """The shared experts' output: one gated MLP of width `shared_expert_size` that every token
    runs (DeepSeek's `n_shared_experts` experts, fused)."""
    units = gated_units(project(x, p["shared_gate"]), project(x, p["shared_up"]), config)
    return project(units, p["shared_down"])


def dense_weights(weights: Float[Array, "B T k"], chosen: Int[Array, "B T k"], config: ModelConfig):
    """`[B, T, E]`: each expert's weight, the chosen ones' `weights`, 0 for the others."""
    one_hot = jax.nn.one_hot(chosen, config.num_experts, dtype=weights.dtype)
    return jnp.einsum("btk,btke->bte", weights, one_hot)


def experts_of_weights(weights: Float[Array, "B T E"], config: ModelConfig):
    """`(chosen [B, T, k], too_many [B, T])` of an edited weight vector: the experts of the k
    largest |weight| (each nonzero one where there are at most k), and where a token has more
    than k nonzero weights (its output is then NaN: `combine_experts`)."""
    chosen = jax.lax.top_k(jnp.abs(weights), config.experts_per_token)[1]
    return chosen, jnp.sum(weights != 0, axis=-1) > config.experts_per_token


def block_rows(assignments: int, num_experts: int) -> int:
    """The rows b of a block of `expert_outputs`: A / 2E for A assignments of E experts (so the
    padding adds at most half of A), at least 1."""
    return max(1, assignments // (2 * num_experts))


def _blocks(assignments: int, num_experts: int) -> tuple[int, int]:
    """`(b, blocks)`: the rows of a block (`block_rows`) and how many blocks `expert_outputs`
    runs, bounded by the shapes alone."""
    rows = block_rows(assignments, num_experts)
    # Each expert with c > 0 assignments takes ceil(c / b) <= (c + b - 1) / b blocks, and <= c.
    used = min(num_experts, assignments)
    return rows, max(1, min(assignments, (assignments + used * (rows - 1)) // rows))


def executed_rows(tokens: int, config: ModelConfig) -> int:
    """The rows the experts of one layer multiply for `tokens` tokens (`expert_outputs`: every
    block, padding included, runs): between k * tokens and 1.5 k * tokens, where E experts on
    every token would be E * tokens."""
    rows, blocks = _blocks(tokens * config.experts_per_token, config.num_experts)
    return rows * blocks


def expert_outputs(
    p, x: Float[Array, "B T D"], chosen: Int[Array, "B T k"], config: ModelConfig, at=None, edited: bool = False
):
    """`(outputs [B, T, k, D], hidden [B, T, k, F])`: the output of each chosen expert on its
    token's normed input `x`, and its hidden activations (the gated units before the down
    projection), the experts' gated MLPs (`p['expert_gate']`, `['expert_up']` `[E, D, F]`,
    `['expert_down']` `[E, F, D]`, and their biases where the family has them) run on the tokens
    that chose them alone (module docstring). `at(site, value)` applies the interventions at
    `expert_hidden` where `edited` (one acts there): the edited units then enter the down
    projection; otherwise the blocks' units enter it as computed, and `hidden` is only their
    view in the tokens' order (dropped by XLA where nothing reads it)."""
    B, T, D = x.shape
    k, E = chosen.shape[-1], config.num_experts
    N, A = B * T, B * T * k
    b, blocks = _blocks(A, E)
    expert = chosen.reshape(A)
    counts = jnp.bincount(expert, length=E)
    per_expert = (counts + b - 1) // b  # blocks of each expert
    last_block = jnp.cumsum(per_expert)  # one past each expert's last block
    order = jnp.argsort(expert, stable=True)
    sorted_expert = expert[order]
    rank = jnp.arange(A) - (jnp.cumsum(counts) - counts)[sorted_expert]  # within its expert's group
    first_row = (last_block - per_expert)[sorted_expert] * b
    row = jnp.zeros(A, jnp.int32).at[order].set((first_row + rank).astype(jnp.int32))
    token = jnp.full(blocks * b, N, jnp.int32).at[row].set(jnp.arange(A, dtype=jnp.int32) // k)
    rows = jnp.concatenate([x.reshape(N, D), jnp.zeros((1, D), x.dtype)])[token].reshape(blocks, b, D)
    # a block past the last used one is all padding (token N, a zero row): its expert is any
    block_expert = jnp.minimum(jnp.searchsorted(last_block, jnp.arange(blocks), side="right"), E - 1)

    def linear(block_expert, inputs, name):
        weight = partial(jax.lax.dynamic_index_in_dim, index=block_expert, keepdims=False)
        y = project(inputs, weight(p[f"expert_{name}"]))
        return y + weight(p[f"expert_{name}_bias"]) if config.mlp_bias else y

    def units(block):
        xs, e = block
        return gated_units(linear(e, xs, "gate"), linear(e, xs, "up"), config)

    hidden = jax.lax.map(units, (rows, block_expert))  # [blocks, b, F]
    F = hidden.shape[-1]
    in_order = hidden.reshape(blocks * b, F)[row].reshape(B, T, k, F)
    if edited:
        in_order = at("expert_hidden", in_order)
        hidden = jnp.zeros((blocks * b, F), hidden.dtype).at[row].set(in_order.reshape(A, F)).reshape(blocks, b, F)
    out = jax.lax.map(lambda block: linear(block[1], block[0], "down"), (hidden, block_expert))
    return out.reshape(blocks * b, D)[row].reshape(B, T, k, D), in_order


def combine_experts(outputs: Float[Array, "B T k D"], weights: Float[Array, "B T k"], too_many=None):
    """The mixture's output `[B, T, D]`: the experts' outputs weighted and summed, NaN at the
    tokens marked `too_many` (more experts weighted than computed)."""
    out = jnp.einsum("btkd,btk->btd", outputs, weights.astype(outputs.dtype))
    return out if too_many is None else jnp.where(too_many[..., None], jnp.nan, out)


# ----------------------------------------------------------------------------- interventions


def _expert_mask(experts, what: str):
    """An expert mask `[E]` or `[B, T, E]` as float32 (1: the expert is meant)."""
    mask = jnp.asarray(experts)
    if mask.dtype == bool or jnp.issubdtype(mask.dtype, jnp.integer):
        mask = mask.astype(jnp.float32)
    if mask.ndim not in (1, 3):
        raise InterventionError(f"{what} must be [E] or [B, T, E], got shape {mask.shape}")
    return mask


def _fits(data: Array, value: Array, what: str) -> None:
    try:
        fits = data.shape[-1] == value.shape[-1] and jnp.broadcast_shapes(data.shape, value.shape) == value.shape
    except ValueError:
        fits = False
    if not fits:
        raise InterventionError(f"{what} of shape {data.shape} does not fit the site's value {value.shape}")


def _counted(mask, most: int, what: str) -> None:
    """Refuse a concrete mask meaning more than `most` experts of one token."""
    if isinstance(mask, jax.core.Tracer):
        return
    count = int(jnp.max(jnp.sum(mask > 0, axis=-1)))
    if count > most:
        raise InterventionError(f"{what} names {count} experts of one token; at most {most} can be")


def _set_where(value, layer, data):
    at, mask, new = data
    _fits(mask, value, "the expert mask")
    return jnp.where((layer == at) & (mask > 0), new.astype(value.dtype), value)


def _expert_edit(site: str, layer, mask, new: float) -> Intervention:
    return Intervention(
        site, _set_where, (jnp.asarray(layer, jnp.int32), mask, jnp.asarray(new, jnp.float32)), layer_index=0
    )


def forbid_experts(layer, experts, config: ModelConfig) -> Intervention:
    """Never choose the `experts` (a mask `[E]`, or `[B, T, E]` per token, 1 meaning the expert)
    at layer `layer` (an int, negative from the end; an int array of them stacks interventions
    for `vmap`): their selection is -inf, so the next best take their places, weighted by their
    own scores (renormalised over the new choice where the family renormalises)."""
    mask = _expert_mask(experts, "the forbidden experts")
    _counted(mask, config.num_experts - config.experts_per_token, "forbid_experts")
    return _expert_edit("router_selection", layer, mask, -jnp.inf)


def force_experts(layer, experts, config: ModelConfig) -> Intervention:
    """Choose the `experts` (a mask as in `forbid_experts`, at most k per token) at layer
    `layer` whatever their scores: their selection is +inf, the best of the others fill the
    remaining places, and each chosen expert is weighted by its own score (renormalised over
    the choice where the family renormalises)."""
    mask = _expert_mask(experts, "the forced experts")
    _counted(mask, config.experts_per_token, "force_experts")
    return _expert_edit("router_selection", layer, mask, jnp.inf)


def drop_experts(layer, experts) -> Intervention:
    """Remove the `experts`' share of the output at layer `layer` (a mask as in
    `forbid_experts`): their weights become 0, the other chosen experts keep theirs (nothing is
    renormalised and no expert takes the place)."""
    return _expert_edit("expert_weights", layer, _expert_mask(experts, "the dropped experts"), 0.0)


def _route(value, layer, data):
    at, weights = data
    _fits(weights, value, "the routing weights")
    return jnp.where(layer == at, jnp.broadcast_to(weights, value.shape).astype(value.dtype), value)


def route(layer, weights, config: ModelConfig) -> Intervention:
    """Replace the routing of layer `layer`: each expert's weight `weights` (`[E]`, or
    `[B, T, E]` per token); the experts with a nonzero weight run, at most k per token (refused
    where the weights are concrete; traced, a token given more gets NaN outputs:
    `combine_experts`)."""
    weights = jnp.asarray(weights, jnp.float32)
    if weights.ndim not in (1, 3):
        raise InterventionError(f"the routing weights must be [E] or [B, T, E], got shape {weights.shape}")
    _counted(weights != 0, config.experts_per_token, "route")
    return Intervention("expert_weights", _route, (jnp.asarray(layer, jnp.int32), weights), layer_index=0)


def _follow(value, layer, choice):
    chosen = choice[layer]  # [B, T, k], best first
    k = chosen.shape[-1]
    # k, k-1, .., 1 at the chosen experts in their order, the others far below: the top k are
    # these, so ordered. Finite (not -inf), so that a group holding one chosen expert still
    # scores above the groups holding none where the router keeps the best groups (DeepSeek-V3)
    rank = jnp.einsum("btke,k->bte", jax.nn.one_hot(chosen, value.shape[-1], dtype=jnp.float32), k - jnp.arange(k))
    return jnp.where(rank > 0, rank, -1e30).astype(value.dtype)


def follow_routing(choice: Int[Array, "L B T k"]) -> Intervention:
    """Every layer l chooses the experts `choice[l]` (`[B, T, k]`, another run's
    `expert_choice`, best first), in that order, whatever its own selection: so another input's
    expert values line up slot by slot with that run's (the corrupt values of the clean run's
    experts, as attribution patching of expert neurons reads them). Each chosen expert is
    weighted by this run's own scores."""
    return Intervention("router_selection", _follow, jnp.asarray(choice, jnp.int32), layer_data=True)
