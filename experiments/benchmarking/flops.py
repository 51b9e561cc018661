"""Matmul FLOPs of the pieces every case's FLOP model is built from."""

from __future__ import annotations


def layer_flops(c, queries: int, keys: int, layers: int) -> float:
    """Matmul FLOPs of `layers` decoder layers over `queries` positions attending to `keys`."""
    layer_params = (
        c.hidden_size * c.num_heads * c.head_dim
        + 2 * c.hidden_size * c.num_kv_heads * c.head_dim
        + c.num_heads * c.head_dim * c.hidden_size
        + 3 * c.hidden_size * c.intermediate_size
    )
    return layers * (2.0 * queries * layer_params + 4.0 * queries * keys * c.num_heads * c.head_dim)


def forward_flops(c, T: int, lm_head: bool = True) -> float:
    """Matmul FLOPs of one forward pass over T tokens: 2 x matmul params per token (q, k, v, o,
    gate, up, down; the LM head if asked) plus attention scores and values (4 T^2 H Dh per
    layer, the full square as both implementations compute it)."""
    return layer_flops(c, T, T, c.num_layers) + (lm_head_flops(c, T) if lm_head else 0.0)


def lm_head_flops(c, T: int) -> float:
    return 2.0 * T * c.hidden_size * c.vocab_size


def answers(one) -> int:
    """How many answer-predicting positions a one-prompt batch has (where the LM head is read)."""
    return len(one.answer_positions(0)[0])
