"""What Qwen3.5's gated delta rule costs in jaxdepth: `gated_delta_rule` chunked (chunk 64) and
recurrent (a scan over positions), beside transformers' `torch_chunk_gated_delta_rule` (torch,
where installed), at a Qwen3.5-shaped layer (16 key heads, 32 value heads, dims 128), batch 1.

    python experiments/benchmark_linear_attention.py            # T = 256, 1024, 4096 (minutes)
    python experiments/benchmark_linear_attention.py --quick    # a tiny shape (seconds)

Times are the median of `--repeats` runs after a first, compiling one; the last column, seconds
per thousand positions, stays flat where the cost is linear in T. Name the CPU (`lscpu`) beside
every number.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchmarking.machine import cpu_description  # noqa: E402
from benchmarking.on_device import time_jaxdepth  # noqa: E402
from jaxdepth.core.linear_attention import gated_delta_rule  # noqa: E402

SHAPES = {
    "qwen3.5": dict(key_heads=16, value_heads=32, key_dim=128, value_dim=128, lengths=(256, 1024, 4096)),
    "tiny": dict(key_heads=2, value_heads=4, key_dim=16, value_dim=16, lengths=(64, 256)),
}


def inputs(T: int, s: dict, seed: int = 0):
    rng = np.random.default_rng(seed)
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    q, k = f(1, T, s["key_heads"], s["key_dim"]), f(1, T, s["key_heads"], s["key_dim"])
    v = f(1, T, s["value_heads"], s["value_dim"])
    g = -np.exp(rng.uniform(-5, 1, (1, T, s["value_heads"]))).astype(np.float32)
    beta = (1 / (1 + np.exp(-f(1, T, s["value_heads"])))).astype(np.float32)
    return q, k, v, g, beta


def main(argv=None) -> list[dict]:
    """Run the timings; returns one row per (T, method): seconds, seconds per 1k positions."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny shape, for a smoke test")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=64)
    args = parser.parse_args(argv)
    s = SHAPES["tiny" if args.quick else "qwen3.5"]
    try:
        import torch
        from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule
    except ImportError:
        torch = None
    print(f"CPU: {cpu_description()}; jax {jax.__version__} on {jax.devices()[0].platform}")
    print(f"shape: {s['key_heads']} key heads, {s['value_heads']} value heads, dims {s['key_dim']}/{s['value_dim']}")
    chunked = jax.jit(lambda *a: gated_delta_rule(*a, chunk=args.chunk))
    recurrent = jax.jit(lambda *a: gated_delta_rule(*a))
    print(f"{'T':>6} {'method':<26} {'seconds':>10} {'s per 1k positions':>20}")
    rows = []
    for T in s["lengths"]:
        x = inputs(T, s)
        runs = {
            f"jaxdepth chunked ({args.chunk})": lambda: jax.block_until_ready(chunked(*x)),
            "jaxdepth recurrent": lambda: jax.block_until_ready(recurrent(*x)),
        }
        if torch is not None:
            tx = [torch.from_numpy(a) for a in x]

            def torch_run():
                with torch.no_grad():
                    torch_chunk_gated_delta_rule(*tx, chunk_size=args.chunk, use_qk_l2norm_in_kernel=True)

            runs[f"transformers chunked ({args.chunk})"] = torch_run
        for name, run in runs.items():
            seconds = time_jaxdepth(run, args.repeats).median_s  # a first call compiles (or warms up)
            print(f"{T:>6} {name:<26} {seconds:>10.4f} {1000 * seconds / T:>20.4f}", flush=True)
            rows.append(dict(T=T, method=name, seconds=seconds, per_1k=1000 * seconds / T))
    return rows


if __name__ == "__main__":
    main()
