"""Running many interventions as one compiled computation, in bounded memory."""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import numpy as np

from jaxdepth.config import ModelConfig

# Host/device memory a sweep may use for the activations of its members at once when no budget
# is given; conservative so that a laptop CPU never swaps.
DEFAULT_MEMORY_BUDGET = 2 * 1024**3


def sweep(fn: Callable[[Any], Any], members: Any, chunk_size: Optional[int] = None) -> Any:
    """`vmap(fn)(members)`, evaluated `chunk_size` members at a time (`lax.map` batches).

    `members` is a pytree whose leaves share a leading sweep axis. Chunking changes only the
    memory bound, not the result: each chunk is the same vmapped computation.
    """
    n = jax.tree.leaves(members)[0].shape[0]
    if chunk_size is None or chunk_size >= n:
        return jax.vmap(fn)(members)
    return jax.lax.map(fn, members, batch_size=max(1, int(chunk_size)))


def member_bytes(config: ModelConfig, seq_len: int, *, grad: bool = False, bytes_per: int = 4) -> int:
    """Rough peak activation bytes of one sweep member (one forward at batch 1, `seq_len` tokens).

    Counts the live layer activations (residual, q/k/v, MLP hidden, attention scores) and the
    float32 output distribution `[T, V]` that output statistics need. With `grad=True` the
    rematerialised backward also keeps one residual per layer.
    """
    c = config
    per_layer = seq_len * (4 * c.hidden_size + (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
                           + 3 * c.intermediate_size) + c.num_heads * seq_len * seq_len
    out = 3 * seq_len * c.vocab_size
    total = per_layer + out
    if grad:
        total += c.num_layers * seq_len * c.hidden_size + per_layer + out
    return total * bytes_per


def auto_chunk_size(config: ModelConfig, seq_len: int, n_members: int, *, grad: bool = False,
                    memory_budget: Optional[int] = None) -> int:
    """The largest chunk of sweep members whose activations fit in `memory_budget` bytes."""
    budget = DEFAULT_MEMORY_BUDGET if memory_budget is None else memory_budget
    per = member_bytes(config, seq_len, grad=grad)
    return int(np.clip(budget // per, 1, max(n_members, 1)))
