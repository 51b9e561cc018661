"""Running many interventions as one compiled computation, in bounded memory."""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxdepth.core.config import ModelConfig
from jaxdepth.core.experts import executed_rows
from jaxdepth.core.sharding import DATA

__all__ = [
    "available_memory_budget",
    "chunk_layout",
    "sweep",
    "sweep_sum",
    "weighted_sum",
    "member_bytes",
    "auto_chunk_size",
    "cpu_gradient_width",
    "MEMORY_FRACTION",
    "FALLBACK_MEMORY_BUDGET",
    "CPU_GRADIENT_ROWS",
    "CPU_GRADIENT_MIN_WIDTH",
]


# Share of the free device (or host, on CPU) memory a sweep's activations may take when no budget
# is given: the rest is left to params, XLA's temporaries and whatever else runs.
MEMORY_FRACTION = 0.25
FALLBACK_MEMORY_BUDGET = 2 * 1024**3  # when the free memory cannot be read

# How wide a vmap of gradients runs fastest on a CPU, where memory allows more: about this many
# rows (members x tokens) per chunk, and never fewer than `CPU_GRADIENT_MIN_WIDTH` members.
# Wider chunks are slower per gradient there, not faster: their activations outgrow the caches.
# Measured with SmolLM2-135M's IG (layer 12 of a GSM8K prompt, stored backward, AMD EPYC with
# AVX-512, 2 cores), ms per gradient by width: 16 tokens 39 (8) / 31 (64) / 34 (256); 64 tokens
# 135 (8) / 133 (16) / 163 (32); 135 tokens 318 (4) / 306 (8) / 355 (16); 270 tokens 763 (4) /
# 704-746 (8) / 819 (12) / 840 (16) / 1041 (32); an Intel Xeon gave the same shape
# (experiments/results/ig_chunk_width.md). Accelerators run the widest chunk that fits.
CPU_GRADIENT_ROWS = 1024
CPU_GRADIENT_MIN_WIDTH = 8


def available_memory_budget(fraction: float = MEMORY_FRACTION) -> int:
    """`fraction` of the free memory of the first device: accelerator memory from the runtime's
    statistics, host memory (MemAvailable) on CPU. With several processes, the smallest of
    theirs: every process must compile the same chunk sizes, or their collectives never meet."""
    budget = _local_memory_budget(fraction)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        # in MiB: without jax_enable_x64 the gather runs in int32, where bytes past 2 GiB wrap to
        # a negative budget
        mib = multihost_utils.process_allgather(np.int32(min(budget >> 20, np.iinfo(np.int32).max)))
        budget = max(int(np.min(mib)), 1) << 20
    return budget


def _local_memory_budget(fraction: float) -> int:
    device = jax.local_devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        return int(fraction * (stats["bytes_limit"] - stats.get("bytes_in_use", 0)))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(fraction * int(line.split()[1]) * 1024)
    except OSError:
        pass
    return FALLBACK_MEMORY_BUDGET


def chunk_layout(n: int, chunk_size: Optional[int]) -> tuple[int, int]:
    """`(n_chunks, chunk)`: how a sweep of `n` members runs under the bound `chunk_size` (None:
    all at once). As few chunks as the bound allows, made equal: a bound just under n / k would
    otherwise pad the last chunk with nearly a whole chunk of wasted members (256 members under a
    bound of 253: two chunks of 128, not 506 evaluations). A chunk is rounded up to a multiple of
    the mesh's `data` axis, so its members shard evenly."""
    chunk = n if chunk_size is None else int(np.clip(chunk_size, 1, n))
    chunk = -(-n // -(-n // chunk))
    data = _data_axis_size()
    if data > 1:
        chunk = -(-chunk // data) * data
    return -(-n // chunk), chunk


def _chunked(members: Any, chunk_size: Optional[int]):
    """`members` split into equal chunks `[n_chunks, chunk, ...]` (`chunk_layout`; the last
    padded by repeating the last member), with `n`, the number of real members."""
    n = jax.tree.leaves(members)[0].shape[0]
    n_chunks, chunk = chunk_layout(n, chunk_size)
    padded = n_chunks * chunk

    def to_chunks(x):
        if padded > n:
            x = jnp.concatenate([x, jnp.repeat(x[-1:], padded - n, axis=0)])
        return x.reshape((n_chunks, chunk) + x.shape[1:])

    return jax.tree.map(to_chunks, members), n


def _vmapped_chunk(fn):
    """`vmap(fn)` over one chunk, its members split over the mesh's `data` axis if there is one."""
    data = _data_axis_size()

    def run_chunk(xs):
        if data > 1:
            xs = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, P(DATA, *([None] * (x.ndim - 1)))), xs)
        return jax.vmap(fn)(xs)

    return run_chunk


def sweep(fn: Callable[[Any], Any], members: Any, chunk_size: Optional[int] = None) -> Any:
    """`vmap(fn)(members)`, evaluated `chunk_size` members at a time.

    `members` is a pytree whose leaves share a leading sweep axis. Chunking changes only the
    memory bound, not the result: every chunk is the same vmapped computation (the last one is
    padded by repeating a member, whose results are dropped). When a mesh with a `data` axis is
    active (`jax.set_mesh`), each chunk's members are split over that axis.
    """
    chunks, n = _chunked(members, chunk_size)
    run_chunk = _vmapped_chunk(fn)
    n_chunks = jax.tree.leaves(chunks)[0].shape[0]
    if n_chunks == 1:
        return jax.tree.map(lambda y: y[:n], run_chunk(jax.tree.map(lambda x: x[0], chunks)))
    out = jax.lax.map(run_chunk, chunks)
    return jax.tree.map(lambda y: y.reshape((-1,) + y.shape[2:])[:n], out)


def sweep_sum(fn: Callable[[Any], Any], members: Any, chunk_size: Optional[int] = None) -> Any:
    """`sum_i fn(members[i])` (leaf by leaf), evaluated `chunk_size` members at a time.

    The same chunks as `sweep`, but the results are summed as the chunks run (a `lax.scan`
    carrying the sum), so a sweep of n members returning `[T, D]` each holds one `[T, D]`
    sum, not `[n, T, D]`. Padding members count zero."""
    chunks, n = _chunked(members, chunk_size)
    n_chunks, chunk = jax.tree.leaves(chunks)[0].shape[:2]
    real = (jnp.arange(n_chunks * chunk) < n).reshape(n_chunks, chunk)
    run_chunk = _vmapped_chunk(fn)

    def add_chunk(total, item):
        xs, keep = item
        ys = run_chunk(xs)
        return jax.tree.map(lambda t, y: t + jnp.tensordot(keep.astype(y.dtype), y, axes=1), total, ys), None

    shapes = jax.eval_shape(fn, jax.tree.map(lambda x: x[0, 0], chunks))
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    return jax.lax.scan(add_chunk, zeros, (chunks, real))[0]


def weighted_sum(fn: Callable[[Any], Any], alphas, weights, chunk_size: Optional[int] = None) -> Any:
    """`sum_k weights[k] fn(alphas[k])` (leaf by leaf; a weight cast to each leaf's dtype): a
    quadrature rule's sum of `fn` along a path, `sweep_sum` over the nodes `chunk_size` at a
    time."""

    def member(node):
        alpha, weight = node
        return jax.tree.map(lambda y: weight.astype(y.dtype) * y, fn(alpha))

    return sweep_sum(member, (alphas, weights), chunk_size)


def _data_axis_size() -> int:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or DATA not in mesh.axis_names:
        return 1
    return mesh.shape[DATA]


def member_bytes(
    config: ModelConfig, seq_len: int, *, grad: bool = False, stored: Union[bool, int] = False, bytes_per: int = 4
) -> int:
    """Rough peak activation bytes of one sweep member (one forward at batch 1, `seq_len` tokens).

    Counts the live layer activations (residual, q/k/v, MLP hidden or the experts' rows,
    attention scores) and the
    float32 output distribution `[T, V]` that output statistics need. With `grad=True` the
    rematerialised backward also keeps one residual per layer; with `stored=True` instead, each
    layer's matmul outputs (`jaxdepth.core.loops.suffix_value_and_grad`'s 'stored'); with an
    int k, the last k layers' matmul outputs and the others' residuals.
    """
    c = config
    per_layer = (
        seq_len * (4 * c.hidden_size + (c.num_heads + 2 * c.num_kv_heads) * c.head_dim)
        + _mlp_values(c, seq_len)
        + c.num_heads * seq_len * seq_len
    )
    out = 3 * seq_len * c.vocab_size
    total = per_layer + out
    if grad:
        matmul_outputs = (
            seq_len * (3 * c.hidden_size + (c.num_heads + 2 * c.num_kv_heads) * c.head_dim)
            + _mlp_values(c, seq_len, matmuls=True)
            + c.num_heads * seq_len * seq_len
        )
        k = c.num_layers if stored is True else int(stored)  # layers keeping their matmul outputs
        kept = k * matmul_outputs + (c.num_layers - k) * seq_len * c.hidden_size + per_layer
        total += kept + out
    return total * bytes_per


def _mlp_values(c: ModelConfig, seq_len: int, matmuls: bool = False) -> int:
    """The values a layer's MLP holds live for `seq_len` tokens (`matmuls`: its matmul outputs
    only), in its costliest layer: a dense MLP's hidden units and gate, or a mixture's expert
    rows (`jaxdepth.core.experts.executed_rows`, each with its gathered input and output), its
    router's scores, the chosen experts' outputs and the shared experts'."""
    per_unit = 2 if matmuls else 3
    dense = per_unit * seq_len * c.dense_width if c.dense_mlp_layers else 0
    if not c.is_moe:
        return dense
    rows = executed_rows(seq_len, c)
    experts = rows * (per_unit * c.intermediate_size + 2 * c.hidden_size)
    routed = seq_len * (3 * c.num_experts + c.experts_per_token * c.hidden_size + per_unit * c.shared_expert_size)
    return max(dense, experts + routed)


def auto_chunk_size(
    config: ModelConfig,
    seq_len: int,
    n_members: int,
    *,
    grad: bool = False,
    stored: Union[bool, int] = False,
    memory_budget: Optional[int] = None,
    extra_bytes: int = 0,
    platform: Optional[str] = None,
) -> int:
    """The largest chunk of sweep members whose activations (`member_bytes`, and `extra_bytes`
    more each: what a member holds beyond one forward, say the gradients it returns) fit in
    `memory_budget` bytes (default: `available_memory_budget()`, read when the sweep starts).
    A sweep of gradients on a CPU (`platform`, default JAX's default backend) is also held to
    `cpu_gradient_width(seq_len)`, where it runs fastest."""
    budget = available_memory_budget() if memory_budget is None else memory_budget
    per = member_bytes(config, seq_len, grad=grad, stored=stored) + extra_bytes
    chunk = budget // per
    if grad and (platform or jax.default_backend()) == "cpu":
        chunk = min(chunk, cpu_gradient_width(seq_len))
    return int(np.clip(chunk, 1, max(n_members, 1)))


def cpu_gradient_width(seq_len: int) -> int:
    """The widest chunk of gradients a CPU runs at its best speed per gradient: the power of two
    nearest below `CPU_GRADIENT_ROWS / seq_len`, at least `CPU_GRADIENT_MIN_WIDTH`."""
    return max(CPU_GRADIENT_MIN_WIDTH, 1 << max(0, (CPU_GRADIENT_ROWS // max(seq_len, 1)).bit_length() - 1))
