"""What a mixture-of-experts layer costs in jaxdepth: the rows its experts multiply, against the
top-k minimum and the dense equivalent (every expert on every token), and the measured time of
the mixture beside transformers' own block (torch, batch 1, where torch is installed).

    python experiments/benchmark_experts.py                  # a tiny and a Qwen3-30B-A3B-shaped layer
    python experiments/benchmark_experts.py --shapes tiny    # the tiny one only (seconds)

The FLOPs are those of the program jaxdepth runs (`jaxdepth.core.experts.executed_rows`: every
block, padding included, is multiplied; the program is static, so this is exact), the router's
included. Times are the median of `--repeats` runs after a first, compiling one; each side runs
alone on the machine's cores. Name the CPU (`lscpu`) beside every number.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxdepth.core import experts
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.layer import mixture

SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=32, num_experts=8, experts_per_token=2),
    # Qwen3-30B-A3B's layer: D 2048, 128 experts of 768, 8 per token
    "qwen3-30b-a3b": dict(hidden_size=2048, intermediate_size=768, num_experts=128, experts_per_token=8),
}


def layer_config(shape: str) -> ModelConfig:
    s = SHAPES[shape]
    return ModelConfig(
        model_type="qwen3_moe",
        vocab_size=8,
        num_layers=1,
        num_heads=4,
        num_kv_heads=4,
        head_dim=s["hidden_size"] // 4,
        rope_theta=1e4,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        qkv_bias=False,
        normalize_expert_weights=True,
        **s,
    )


def flops(config: ModelConfig, tokens: int) -> dict:
    """The mixture's matmul FLOPs: executed by jaxdepth, the top-k minimum, the dense equivalent."""
    D, F, E, k = config.hidden_size, config.intermediate_size, config.num_experts, config.experts_per_token
    router, per_row = 2 * tokens * D * E, 6 * D * F
    return dict(
        executed=router + experts.executed_rows(tokens, config) * per_row,
        minimum=router + tokens * k * per_row,
        dense=router + tokens * E * per_row,
    )


def _median_time(fn, repeats: int) -> float:
    fn()  # compile / warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def time_jaxdepth(config: ModelConfig, tokens: int, repeats: int) -> float:
    rng = np.random.default_rng(0)
    D, F, E = config.hidden_size, config.intermediate_size, config.num_experts
    p = {
        "router": jnp.asarray(rng.standard_normal((D, E)) * 0.05, jnp.float32),
        "expert_gate": jnp.asarray(rng.standard_normal((E, D, F)) * 0.05, jnp.float32),
        "expert_up": jnp.asarray(rng.standard_normal((E, D, F)) * 0.05, jnp.float32),
        "expert_down": jnp.asarray(rng.standard_normal((E, F, D)) * 0.05, jnp.float32),
    }
    x = jnp.asarray(rng.standard_normal((1, tokens, D)), jnp.float32)
    run = jax.jit(lambda p, x: mixture(p, x, config, lambda site, value: value)[0])
    return _median_time(lambda: run(p, x).block_until_ready(), repeats)


def time_transformers(config: ModelConfig, tokens: int, repeats: int):
    """transformers' Qwen3-MoE block (its expert loop over the experts hit), or None without torch."""
    try:
        import torch
        import transformers
    except ImportError:
        return None
    hf = transformers.Qwen3MoeConfig(
        hidden_size=config.hidden_size,
        moe_intermediate_size=config.intermediate_size,
        num_experts=config.num_experts,
        num_experts_per_tok=config.experts_per_token,
        norm_topk_prob=True,
    )
    block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(hf).eval()
    with torch.no_grad():
        for w in block.parameters():
            w.normal_(0, 0.05)
        x = torch.randn(1, tokens, config.hidden_size)
        return _median_time(lambda: block(x), repeats)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 300])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-reference", action="store_true", help="skip transformers' block")
    args = parser.parse_args(argv)
    rows = []
    for shape in args.shapes:
        config = layer_config(shape)
        for tokens in args.tokens:
            f = flops(config, tokens)
            row = dict(shape=shape, tokens=tokens, **{f"{k}_gflop": v / 1e9 for k, v in f.items()})
            row["executed_over_minimum"] = f["executed"] / f["minimum"]
            row["executed_over_dense"] = f["executed"] / f["dense"]
            row["jaxdepth_s"] = time_jaxdepth(config, tokens, args.repeats)
            row["transformers_s"] = None if args.no_reference else time_transformers(config, tokens, args.repeats)
            rows.append(row)
            print(json.dumps(row))
    print(f"machine: {platform.processor() or platform.machine()}, jax {jax.__version__}, devices {jax.devices()}")
    return dict(rows=[dataclasses.asdict(r) if dataclasses.is_dataclass(r) else r for r in rows])


if __name__ == "__main__":
    main()
