"""Unit tier: `jaxdepth.core.loops.LayerRun`, the one value saying which layers a driver runs
and against what: every refusal in `LayerRun.check`, the old keywords refused with the value
that says the same, and each kind of run giving what it gave as keywords (the same programs)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config
from jaxdepth.core.loops import LayerRun, Pieces, clean_key_values, run_grouped_orders, run_layers
from jaxdepth.core.loops import run_layers_in_pieces
from jaxdepth.core.model import embed, random_params, residual_stream
from jaxdepth.core.structure import group_orders, identity_order, stack_orders

CONFIG = tiny_config(num_layers=3)
L, B, T = CONFIG.num_layers, 2, 7
PARAMS = random_params(CONFIG, seed=4, scale=0.2)
TOKENS = np.random.default_rng(1).integers(0, CONFIG.vocab_size, (B, T))
VALID = np.arange(T)[None, :] < np.array([[T], [5]])


@pytest.mark.parametrize(
    "old, shown",
    [
        ({"start": 1}, r"run=jaxdepth\.core\.loops\.LayerRun\(start=1\)"),
        ({"remat": True}, r"run=jaxdepth\.core\.loops\.LayerRun\(remat=True\)"),
        ({"order": identity_order(L)}, r"run=jaxdepth\.core\.loops\.LayerRun\(order=\.\.\.\)"),
        ({"start": 1, "prefix": None}, r"LayerRun\(start=1, prefix=None\), not start, prefix on their own"),
    ],
)
def test_the_old_keywords_are_refused_with_the_run_value(old, shown):
    h0 = embed(PARAMS, TOKENS, CONFIG)
    with pytest.raises(TypeError, match=shown):
        run_layers(PARAMS, h0, CONFIG, **old)
    plan = group_orders(stack_orders([identity_order(L)]), L)
    with pytest.raises(TypeError, match=r"run=jaxdepth\.core\.loops\.LayerRun\(context=None\)"):
        run_grouped_orders(PARAMS, h0, CONFIG, plan, context=None)
    with pytest.raises(TypeError, match="unexpected keyword arguments: stride"):
        run_layers(PARAMS, h0, CONFIG, stride=2)


def test_the_old_piece_keywords_are_refused_with_the_pieces_value():
    h0 = embed(PARAMS, TOKENS, CONFIG)
    buffers = (jnp.zeros((L, B, T, CONFIG.num_kv_heads, CONFIG.head_dim)),) * 2
    with pytest.raises(TypeError, match=r"pieces=jaxdepth\.core\.loops\.Pieces\(first=\.\.\., last=\.\.\., width"):
        run_layers_in_pieces(
            PARAMS, h0, 0, buffers, VALID, CONFIG, first_piece=0, last_piece=0, width=T, interventions_of=None
        )


def test_what_cannot_run_is_refused_in_one_place():
    h0 = embed(PARAMS, TOKENS, CONFIG)
    for run, message in (
        (LayerRun(start=L + 1), rf"start must be a boundary in 0\.\.{L}"),
        (LayerRun(start=1, remat=True), "remat is for gradients through every layer"),
        (LayerRun(start=1, order=identity_order(L)), "a layer order runs from boundary 0"),
        (LayerRun(prefix=(jnp.zeros((L - 1, B, 2, 1, 1)),) * 2), "prefix"),
        (LayerRun(order=stack_orders([identity_order(L)])), "vmap over a stack of orders"),
    ):
        with pytest.raises(ValueError, match=message):
            run_layers(PARAMS, h0, CONFIG, valid=VALID, run=run)
    plan = group_orders(stack_orders([identity_order(L)]), L)
    with pytest.raises(ValueError, match="grouped orders run their own steps from boundary 0"):
        run_grouped_orders(PARAMS, h0, CONFIG, plan, run=LayerRun(start=1))


def test_each_run_gives_what_the_plain_run_gives():
    """Remat, the identity order, a traced start 0 and a prefix of clean keys and values change
    no number of the forward: each equals the plain scan (remat and the order bit for bit)."""
    h0 = embed(PARAMS, TOKENS, CONFIG)
    plain = np.asarray(run_layers(PARAMS, h0, CONFIG, valid=VALID)[0])
    remat = run_layers(PARAMS, h0, CONFIG, valid=VALID, run=LayerRun(remat=True))[0]
    ordered = run_layers(PARAMS, h0, CONFIG, valid=VALID, run=LayerRun(order=identity_order(L)))[0]
    assert np.array_equal(remat, plain) and np.array_equal(ordered, plain)
    traced = jax.jit(lambda h, s: run_layers(PARAMS, h, CONFIG, valid=VALID, run=LayerRun(start=s))[0])
    np.testing.assert_allclose(traced(h0, jnp.int32(0)), plain, rtol=0, atol=1e-5 * np.abs(plain).max())
    P = 3
    hs = residual_stream(PARAMS, TOKENS, CONFIG, valid=VALID)
    keys, values = clean_key_values(PARAMS, hs, CONFIG, valid=VALID)
    suffix = run_layers(PARAMS, h0[:, P:], CONFIG, valid=VALID, run=LayerRun(prefix=(keys[:, :, :P], values[:, :, :P])))
    np.testing.assert_allclose(suffix[0], plain[:, P:], rtol=0, atol=1e-5 * np.abs(plain).max())


def test_pieces_run_as_before():
    """`run_layers_in_pieces` with `Pieces` over every position is the forward from boundary 0."""
    h0 = embed(PARAMS, TOKENS, CONFIG)
    plain = np.asarray(run_layers(PARAMS, h0, CONFIG, valid=VALID)[0])
    hs = residual_stream(PARAMS, TOKENS, CONFIG, valid=VALID)
    buffers = clean_key_values(PARAMS, hs, CONFIG, valid=VALID)
    width = 1
    got = run_layers_in_pieces(
        PARAMS, h0, 0, buffers, VALID, CONFIG, pieces=Pieces(0, T - 1, width), interventions_of=lambda rows: ()
    )
    np.testing.assert_allclose(got, plain, rtol=0, atol=1e-5 * np.abs(plain).max())
