"""Matmul FLOPs of a decoder's pieces: what padding choices (`jaxdepth.core.padding`) and the
benchmarks' FLOP models are built from. The elementwise work (norms, rotary, softmax) is left
out: it is a few percent of a layer at the studies' shapes."""

from __future__ import annotations

from jaxdepth.core.config import ModelConfig
from jaxdepth.core.experts import executed_rows

__all__ = [
    "layer_flops",
    "lm_head_flops",
    "forward_flops",
]


def layer_flops(config: ModelConfig, queries: int, keys: int, layers: int = 1) -> float:
    """Matmul FLOPs of `layers` decoder layers over `queries` positions attending to `keys`: 2 x
    matmul parameters per position (q, k, v, o, and the MLP's gate, up and down, or up and down
    in a plain MLP; in a mixture of experts, the router and each expert on the rows it runs,
    `jaxdepth.core.experts.executed_rows`; among dense and sparse layers, their mean over the
    model's layers) plus attention scores and values (4 queries keys H Dh, the full square as
    both implementations compute it)."""
    c = config
    attention_weights = (
        c.hidden_size * c.num_heads * c.head_dim
        + 2 * c.hidden_size * c.num_kv_heads * c.head_dim
        + c.num_heads * c.head_dim * c.hidden_size
    )
    mlp_weights = (3 if c.mlp == "gated" else 2) * c.hidden_size * c.intermediate_size
    if c.is_moe:  # the router on every position, the experts on the rows they run
        mlp = 2.0 * (queries * c.hidden_size * c.num_experts + executed_rows(queries, c) * mlp_weights)
        if c.mixed_mlps:  # the mean over the model's layers, its dense ones a gated MLP each
            dense = 2.0 * queries * 3 * c.hidden_size * c.dense_width
            mlp = (len(c.expert_layers) * mlp + len(c.dense_layers) * dense) / c.num_layers
    else:
        mlp = 2.0 * queries * mlp_weights
    return layers * (2.0 * queries * attention_weights + mlp + 4.0 * queries * keys * c.num_heads * c.head_dim)


def lm_head_flops(config: ModelConfig, positions: int) -> float:
    """Matmul FLOPs of the LM head at `positions` positions."""
    return 2.0 * positions * config.hidden_size * config.vocab_size


def forward_flops(config: ModelConfig, T: int, lm_head: bool = True) -> float:
    """Matmul FLOPs of one forward pass over T tokens (the LM head at every position if asked)."""
    return layer_flops(config, T, T, config.num_layers) + (lm_head_flops(config, T) if lm_head else 0.0)
