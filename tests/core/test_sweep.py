"""Sweeps in chunks: the same results whatever the chunk bound, in as few equal chunks as the
bound allows (no chunk of padding)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config
from jaxdepth.core.sweep import (
    CPU_GRADIENT_MIN_WIDTH,
    auto_chunk_size,
    chunk_layout,
    cpu_gradient_width,
    member_bytes,
    sweep,
    sweep_sum,
)


def _chunks_of(chunk_size, n):
    """(number of chunks, members per chunk) of a sweep of n members, read off its program."""
    jaxpr = jax.make_jaxpr(lambda x: sweep(jnp.sin, x, chunk_size))(jnp.zeros(n)).jaxpr
    scans = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    if not scans:
        return 1, n
    (scan,) = scans
    return scan.params["length"], scan.invars[-1].aval.shape[1]


@pytest.mark.parametrize(
    "n, bound, expected",
    [
        (256, 253, (2, 128)),
        (256, 29, (9, 29)),
        (256, 200, (2, 128)),
        (10, 4, (3, 4)),
        (256, 256, (1, 256)),
        (7, 1, (7, 1)),
    ],
)
def test_chunks_are_as_few_and_as_equal_as_the_bound_allows(n, bound, expected):
    chunks, size = _chunks_of(bound, n)
    assert (chunks, size) == expected == chunk_layout(n, bound)  # the program runs the layout it says
    assert size <= bound and chunks * size - n < chunks  # under one padded member per chunk


@pytest.mark.parametrize("bound", [1, 3, 29, 128, 253, 256])
def test_results_do_not_depend_on_the_bound(bound):
    x = jnp.asarray(np.random.default_rng(0).normal(size=(256, 3)), jnp.float32)
    fn = lambda v: v * 3.0 - v * v  # exactly rounded: any vector width gives the same bits  # noqa: E731
    np.testing.assert_array_equal(sweep(fn, x, bound), jax.vmap(fn)(x))
    np.testing.assert_allclose(sweep_sum(fn, x, bound), jax.vmap(fn)(x).sum(0), rtol=1e-6)


@pytest.mark.parametrize("seq_len,width", [(1, 1024), (16, 64), (64, 16), (100, 8), (270, 8), (4096, 8)])
def test_a_cpu_runs_gradients_about_a_thousand_rows_wide(seq_len, width):
    assert cpu_gradient_width(seq_len) == width


def test_only_a_cpu_holds_gradient_sweeps_below_their_memory_bound():
    config = tiny_config()
    T = 270
    room = 100 * member_bytes(config, T, grad=True, stored=True)  # memory for 100 gradients
    bound = lambda **kw: auto_chunk_size(config, T, 256, stored=True, memory_budget=room, **kw)  # noqa: E731
    assert bound(grad=True, platform="gpu") == 100
    assert bound(grad=True, platform="cpu") == CPU_GRADIENT_MIN_WIDTH
    assert bound(grad=False, platform="cpu") > 100  # forward sweeps keep the memory bound
    tight = auto_chunk_size(config, T, 256, grad=True, stored=True, memory_budget=room // 50, platform="cpu")
    assert tight == 2  # memory still bounds it where it is tighter


@pytest.mark.parametrize("dense_layers", [(), (0,)], ids=["sparse", "dense-first"])
def test_a_mixtures_member_bytes_bound_its_compiled_forward(dense_layers):
    """A mixture's sweep members are sized by its experts' rows, router and outputs, not by a
    dense MLP of the experts' width: the estimate bounds what the compiled forward (softmaxed,
    as the output statistics read it) holds, and by no more than a few times."""
    from conftest import tiny_moe_config
    from jaxdepth.core.model import forward, random_params

    config = tiny_moe_config(
        hidden_size=256,
        intermediate_size=128,
        num_experts=64,
        experts_per_token=8,
        num_layers=4,
        vocab_size=2000,
        max_position_embeddings=1024,
        dense_layers=dense_layers,
        dense_size=1024 if dense_layers else 0,
    )
    params = random_params(config, 0)
    for T in (64, 256):
        tokens = jnp.zeros((1, T), jnp.int32)
        compiled = jax.jit(lambda p, t: jax.nn.softmax(forward(p, t, config), -1)).lower(params, tokens).compile()
        held = compiled.memory_analysis().temp_size_in_bytes + compiled.memory_analysis().output_size_in_bytes
        assert held <= member_bytes(config, T) <= 4 * held, T
