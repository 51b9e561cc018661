"""Which XLA:CPU options make the analyses fastest on this CPU? Times the workloads that dominate
the analyses under each option set, on random weights of the embedded model's shape.

Workloads: a `[1024, D] x [D, F]` matmul (GFLOP/s), a full forward at 1 x 64 and 8 x 64 tokens
(seconds), and a chunk of 16 integrated-gradients steps of 16 positions from boundary 1 (seconds).
Each in float32 and, with `--bf16-matmuls`, also with the layers' weight matrices in bf16 beside
float32 activations (`ModelWeights.with_matmul_dtype`; the matmul then multiplies bf16 inputs into
float32). `jaxdepth/core/compilation.py` keeps the option sets that win here on every CPU measured
(`CPU_COMPILER_OPTIONS` for float32 programs, `CPU_NARROW_COMPILER_OPTIONS` for bf16 ones).

    python experiments/compile_options.py            # every option set, ~3 min on 2 cores
    python experiments/compile_options.py ynn_dot default --bf16-matmuls
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxdepth.core.loops import suffix_value_and_grad
from jaxdepth.core.compilation import CPU_COMPILER_OPTIONS, CPU_NARROW_COMPILER_OPTIONS
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.model import forward, random_params, unembed
from jaxdepth.core.weights import ModelWeights

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmarking.machine import cpu_description  # noqa: E402

# SmolLM2-135M's shape (the embedded default model).
CONFIG = ModelConfig(
    model_type="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    qkv_bias=False,
)
OPTION_SETS = {
    "default": {},
    "ynn_dot": dict(CPU_COMPILER_OPTIONS),
    "xnn_dot": {"xla_cpu_experimental_xnn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"},
    "onednn": {"xla_cpu_use_onednn": True},
    "onednn_dot": {"xla_cpu_experimental_onednn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"},
    "narrow": dict(CPU_NARROW_COMPILER_OPTIONS),
}


def median_seconds(fn, *args, repeats: int = 5) -> float:
    jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def measure(options: dict, params, rng, config: ModelConfig = CONFIG) -> dict:
    """The four workloads' timings under XLA `options` (`params` of `config`'s shape)."""
    jit = lambda f: jax.jit(f, compiler_options=options)  # noqa: E731
    D, F = config.hidden_size, config.intermediate_size
    # the matmul in the weights' type: float32, or bf16 inputs accumulated in float32
    narrow = params["layers"]["up"].dtype
    a = jnp.asarray(rng.standard_normal((1024, D)), narrow)
    b = jnp.asarray(rng.standard_normal((D, F)), narrow)
    product = lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32)  # noqa: E731
    tokens = lambda B: jnp.asarray(rng.integers(0, config.vocab_size, (B, 64)))  # noqa: E731
    zs = jnp.asarray(rng.standard_normal((16, 1, 16, D)), jnp.float32)

    def ig_chunk(params, zs):
        def objective(h):  # a stand-in for F: one token's probability at the last 4 positions
            return jnp.sum(jax.nn.softmax(unembed(params, h[:, -4:], config), -1)[..., 7])

        return jax.vmap(lambda z: suffix_value_and_grad(params, z, 1, config, objective)[1])(zs)

    run_forward = jit(lambda p, t: forward(p, t, config))
    return {
        "matmul GFLOP/s": 2 * 1024 * D * F / median_seconds(jit(product), a, b, repeats=20) / 1e9,
        "forward 1x64 s": median_seconds(run_forward, params, tokens(1)),
        "forward 8x64 s": median_seconds(run_forward, params, tokens(8)),
        "IG 16 steps x 16 tokens s": median_seconds(jit(ig_chunk), params, zs, repeats=3),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sets", nargs="*", help=f"option sets to time (default: all of {', '.join(OPTION_SETS)})")
    parser.add_argument(
        "--bf16-matmuls", action="store_true", help="also time each set with the weight matrices in bf16"
    )
    args = parser.parse_args(argv)
    unknown = sorted(set(args.sets) - set(OPTION_SETS))
    if unknown:
        parser.error(f"unknown option sets {unknown}; choose from {', '.join(OPTION_SETS)}")
    if jax.default_backend() != "cpu":
        parser.error("these are XLA:CPU options; the default backend is " + jax.default_backend())
    params = jax.device_put(random_params(CONFIG))
    precisions = {"": params}
    if args.bf16_matmuls:
        precisions["+bf16mm"] = ModelWeights(params, CONFIG, None, "random").with_matmul_dtype("bfloat16").params
    rng = np.random.default_rng(0)
    print(f"{cpu_description()}, jax {jax.__version__}")
    header = None
    for name in args.sets or list(OPTION_SETS):
        for suffix, weights in precisions.items():
            try:
                row = measure(OPTION_SETS[name], weights, rng)
            except Exception as error:  # an option this XLA does not know
                print(f"{name + suffix:18s} failed: {str(error).splitlines()[0][:100]}")
                continue
            if header is None:
                header = list(row)
                print(f"{'options':18s} " + " ".join(f"{h:>26s}" for h in header))
            print(f"{name + suffix:18s} " + " ".join(f"{row[h]:26.3f}" for h in header), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
