"""`CompileClock` counts the compilations made while it is open, and their seconds; a call that
reuses a compiled program counts nothing."""

import jax
import jax.numpy as jnp

from jaxdepth.core.compilation import CompileClock, compiler_options, jit


def test_the_clock_counts_each_new_program_once():
    @jit
    def scaled(x):
        return jnp.tanh(x) * 3.0

    compiler_options()  # its one probe compilation, made once per process, out of the way
    x, y, z, w = jnp.ones(5), jnp.zeros(5), jnp.ones(7), jnp.ones(9)  # eager ops compile too
    with CompileClock() as first:
        jax.block_until_ready(scaled(x))
    assert first.compilations == 1 and first.seconds > 0 and first.cache_hits == 0
    with CompileClock() as again:
        jax.block_until_ready(scaled(y))  # same shape: the compiled program is reused
    assert again.compilations == 0 and again.seconds == 0.0
    with CompileClock() as other:
        jax.block_until_ready(scaled(z))  # a new shape compiles anew
    assert other.compilations == 1
    with CompileClock() as closed:
        pass
    jax.block_until_ready(scaled(w))  # after the clock closed: not counted
    assert closed.compilations == 0
