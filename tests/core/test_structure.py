"""Unit tier: the order of the layers as data (`jaxdepth.core.structure`,
`run_layers(run=LayerRun(order=...))`): the identity order is the plain forward, a dropped
layer is `sites.skip`, a swap is the forward on hand-swapped weights, a parallel step is a
hand-written parallel block, a repeated layer runs twice, and a vmapped stack of orders is each
order alone."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_close, tiny_config
from jaxdepth.core import sites
from jaxdepth.core.loops import LayerRun, run_grouped_orders, run_layer, run_layers
from jaxdepth.core.model import embed, random_params
from jaxdepth.core.structure import (
    LayerOrder,
    describe_order,
    drop_block,
    group_orders,
    identity_order,
    layer_order,
    parallel_block,
    repeat_block,
    reverse_block,
    stack_orders,
    swap_pair,
)

CONFIG = tiny_config(num_layers=5, qkv_bias=True)
L, B, T = CONFIG.num_layers, 2, 9
# Two compiled programs (a scan, unrolled layer calls) may round float32 differently: a few
# ulps of the residual's largest entry
REL = 1e-6
PARAMS = random_params(CONFIG, seed=3, scale=0.2)
TOKENS = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (B, T))
VALID = np.arange(T)[None, :] < np.array([[T], [6]])  # the second prompt right-padded


def final(order=None, interventions=None, params=PARAMS):
    h0 = embed(params, TOKENS, CONFIG)
    run = jax.jit(
        lambda p, h, o, ivs: run_layers(p, h, CONFIG, valid=VALID, interventions=ivs, run=LayerRun(order=o))[0]
    )
    return np.asarray(run(params, h0, order, interventions))


def by_hand(steps):
    """The residual after running `steps` (layer indices, or tuples of them in parallel) one
    `run_layer` call at a time, jitted as `final` is (an eager run rounds differently)."""

    def run(params):
        h = embed(params, TOKENS, CONFIG)
        for step in steps:
            group = step if isinstance(step, tuple) else (step,)
            outs = [run_layer(params, i, h, CONFIG, valid=VALID).out for i in group]
            h = outs[0] if len(outs) == 1 else h + sum(out - h for out in outs)
        return h

    return np.asarray(jax.jit(run)(PARAMS))


def test_the_identity_order_is_the_plain_forward_bit_for_bit():
    assert np.array_equal(final(identity_order(L)), final())


def test_a_dropped_layer_is_a_skipped_layer():
    for layer in range(L):
        skipped = final(interventions=sites.skip("delta", layer, np.ones(T)))
        assert np.array_equal(final(drop_block(L, layer, 1)), skipped), layer


def test_a_swap_is_the_forward_on_swapped_weights():
    for first in range(L - 1):
        swapped = jax.tree.map(lambda w: w, PARAMS)
        swapped["layers"] = jax.tree.map(lambda w: w[np.r_[:first, first + 1, first, first + 2 : L]], PARAMS["layers"])
        expected = final(params=swapped)
        assert_close(final(swap_pair(L, first)), expected, f"swap {first}", tol=REL * np.abs(expected).max())


def test_reversed_repeated_and_parallel_blocks_are_the_layers_run_by_hand():
    cases = {
        "reverse 1..3": (reverse_block(L, 1, 3), [0, 3, 2, 1, 4]),
        "repeat 2..3 twice": (repeat_block(L, 2, 2, 2), [0, 1, 2, 3, 2, 3, 4]),
        "parallel 1..2": (parallel_block(L, 1, 2), [0, (1, 2), 3, 4]),
        "parallel 0..4": (parallel_block(L, 0, 5), [(0, 1, 2, 3, 4)]),
    }
    for name, (order, steps) in cases.items():
        expected = by_hand(steps)
        assert_close(final(order), expected, name, tol=REL * np.abs(expected).max())
    # the text form names the same steps
    assert describe_order(parallel_block(L, 1, 2)) == "0 (1 2) 3 4"


def test_interventions_address_layers_by_their_original_index():
    # skipping layer 2 in the order (0 2 1 3 4) leaves (0 1 3 4): layer 2 is skipped where it runs
    skip_2 = sites.skip("delta", 2, np.ones(T))
    assert np.array_equal(final(swap_pair(L, 1), skip_2), final(layer_order(L, [0, 1, 3, 4])))
    # a layer run twice meets its interventions twice: adding v at layer 3 twice adds 2v there
    v = np.random.default_rng(1).standard_normal(CONFIG.hidden_size).astype(np.float32)
    twice = final(layer_order(L, [3, 3]), sites.add("resid_post", 3, v, np.ones(T)))
    once = lambda h: run_layer(PARAMS, 3, h, CONFIG, valid=VALID).out + v  # noqa: E731
    h = np.asarray(jax.jit(lambda h: once(once(h)))(embed(PARAMS, TOKENS, CONFIG)))
    assert_close(twice, h, "layer 3 twice with its intervention", tol=REL * np.abs(h).max())


def test_a_vmapped_stack_of_orders_is_each_order_alone():
    orders = [
        identity_order(L),
        drop_block(L, 1, 2),
        swap_pair(L, 3),
        parallel_block(L, 2, 2),
        repeat_block(L, 0, 1, 3),
    ]
    stacked = stack_orders(orders)
    assert stacked.layers.shape == (5, 7, 2)  # the longest order (7 steps), the widest group (2)
    h0 = embed(PARAMS, TOKENS, CONFIG)
    run = jax.jit(jax.vmap(lambda o: run_layers(PARAMS, h0, CONFIG, valid=VALID, run=LayerRun(order=o))[0]))
    together = np.asarray(run(LayerOrder(*map(jnp.asarray, stacked))))
    for i, order in enumerate(orders):
        assert np.array_equal(together[i], final(order)), describe_order(order)


def test_taps_under_an_order_are_per_step_and_group_member():
    h0 = embed(PARAMS, TOKENS, CONFIG)
    _, taps = run_layers(
        PARAMS, h0, CONFIG, valid=VALID, tap=lambda r, _: r.index, run=LayerRun(order=parallel_block(L, 1, 2))
    )
    assert taps.shape == (4, 2)
    assert np.asarray(taps)[:, 0].tolist() == [0, 1, 3, 4] and int(taps[1, 1]) == 2


@pytest.mark.parametrize(
    "steps, message",
    [
        ([0, 5], "outside 0..4"),
        ([0, -1], "outside 0..4"),  # -1 is no alias of the last layer here
        ([], "empty layer order"),
        ([0, ()], "empty group"),
        ([(1, 1)], "twice in one parallel step"),
    ],
)
def test_orders_that_cannot_run_are_refused(steps, message):
    with pytest.raises(ValueError, match=message):
        layer_order(L, steps)


def test_refusals_of_whole_orders():
    h0 = embed(PARAMS, TOKENS, CONFIG)
    run = lambda order: run_layers(PARAMS, h0, CONFIG, run=LayerRun(order=order))  # noqa: E731  (concrete: checked)
    with pytest.raises(ValueError, match="outside 0..4"):
        run(LayerOrder(np.array([[0], [7]], np.int32), np.ones((2, 1), bool)))
    with pytest.raises(ValueError, match="empty layer order"):
        run(LayerOrder(np.zeros((2, 1), np.int32), np.zeros((2, 1), bool)))
    with pytest.raises(ValueError, match="vmap over a stack"):
        run(stack_orders([identity_order(L)]))
    with pytest.raises(ValueError, match="does not fit"):
        drop_block(L, 4, 2)
    with pytest.raises(ValueError, match="empty order"):
        drop_block(L, 0, L)
    with pytest.raises(ValueError, match="from boundary 0"):
        run_layers(PARAMS, embed(PARAMS, TOKENS, CONFIG), CONFIG, run=LayerRun(start=1, order=identity_order(L)))


GROUPED_ORDERS = [
    identity_order(L),
    drop_block(L, 1, 2),
    swap_pair(L, 3),
    parallel_block(L, 2, 2),
    repeat_block(L, 0, 1, 3),
    drop_block(L, 4, 1),
]


def test_the_layer_major_plan_by_hand():
    plan = group_orders(stack_orders(GROUPED_ORDERS[:3]), L)  # identity, drop 1..2, swap 3-4
    assert plan.num_orders == 3
    assert plan.steps[0] == ((0, (0, 1, 2)),)
    assert plan.steps[1] == ((1, (0, 2)), (3, (1,)))  # the drop runs layer 3 at step 1
    assert plan.steps[2] == ((2, (0, 2)), (4, (1,)))
    assert plan.steps[3] == ((3, (0,)), (4, (2,)))  # the swap runs layer 4 first; the drop has ended
    assert plan.applied[3] == (((0, 0),), (), ((1, 0),))  # a padding step leaves the drop as it is
    assert plan.steps[4] == ((3, (2,)), (4, (0,)))
    parallel = group_orders(stack_orders([parallel_block(L, 2, 2)]), L)
    assert parallel.steps[2] == ((2, (0,)), (3, (0,))) and parallel.applied[2] == (((0, 0), (1, 0)),)
    with pytest.raises(ValueError, match="a stack of orders"):
        group_orders(identity_order(L), L)
    with pytest.raises(ValueError, match="outside"):
        group_orders(stack_orders([identity_order(L + 1)]), L)


@pytest.mark.parametrize("shared", [True, False], ids=["one residual shared", "a residual per order"])
def test_layer_major_orders_are_each_order_alone(shared):
    """run_grouped_orders equals run_layers(run=LayerRun(order=...)) of each order, residual and taps, whether
    the orders share their input (a prefill: shared steps computed once) or each has its own."""
    h0 = embed(PARAMS, TOKENS, CONFIG)
    plan = group_orders(stack_orders(GROUPED_ORDERS), L)
    h_in = h0 if shared else jnp.stack([h0 * (1 + 0.1 * c) for c in range(len(GROUPED_ORDERS))])
    tap = lambda r, _: r.k  # noqa: E731
    run = jax.jit(lambda h: run_grouped_orders(PARAMS, h, CONFIG, plan, valid=VALID, tap=tap))
    together, taps = run(h_in)
    alone = jax.jit(lambda h, o: run_layers(PARAMS, h, CONFIG, valid=VALID, tap=tap, run=LayerRun(order=o)))
    # a group's matmul holds the rows of several orders: a kernel blocked for more rows may sum
    # in another order, about 10 ulps of the largest entry after five layers
    tol = 2 * REL
    for c, order in enumerate(GROUPED_ORDERS):
        h, keys = alone(h0 if shared else h_in[c], order)
        assert_close(np.asarray(together[c]), np.asarray(h), describe_order(order), tol=tol * np.abs(h).max())
        for n, groups in enumerate(plan.steps):  # order c's keys at step n, from the group of its layer
            for g, (j, i) in enumerate(plan.applied[n][c]):
                assert groups[j][0] == int(order.layers[n, g])
                np.testing.assert_allclose(taps[n][j][i], keys[n, g], rtol=0, atol=tol * np.abs(keys).max())


def test_layer_major_refusals():
    plan = group_orders(stack_orders(GROUPED_ORDERS[:2]), L)
    h0 = embed(PARAMS, TOKENS, CONFIG)
    with pytest.raises(ValueError, match="orders=2"):
        run_grouped_orders(PARAMS, jnp.stack([h0] * 3), CONFIG, plan, valid=VALID)
    counter = sites.StatefulIntervention(("resid_post",), lambda site, v, i, data, s: (v, s), None, jnp.zeros(()))
    with pytest.raises(ValueError, match="stateless"):
        run_grouped_orders(PARAMS, h0, CONFIG, plan, valid=VALID, interventions=counter)
