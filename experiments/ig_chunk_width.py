"""How wide a vmap of gradient evaluations is fastest per evaluation on this CPU? Integrated
gradients of one layer of a whole GSM8K prompt through the study's own computation
(`study_ig_paths.ig_of_layer`), the same steps in chunks of each width, compiled first, then
timed on a quiet machine.

A chunk's memory bound (`auto_chunk_size`) says how wide a vmap fits, not how wide runs best:
on a 136-token prompt the bound is 29, while the adaptive rule's calls of 8 and 16 nodes ran at
0.86x the fixed rule's time per evaluation on the same layers (experiments/ig_default_rule.py).

    python experiments/ig_chunk_width.py --data ../shared/data/gsm8k_test_sample.jsonl --row 0 --widths 8,16,22,32
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

from jaxdepth.analyses.ig.rules import quadrature
from jaxdepth.core.batch import LengthBuckets
from jaxdepth.core.sweep import auto_chunk_size, chunk_layout
from jaxdepth.lab.prompts import encode, format_short, read_rows
from jaxdepth.lab.sources import load

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmarking.machine import Clock, cpu_description  # noqa: E402
import study_ig_paths as paths  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--data", required=True, help="GSM8K JSONL (e.g. ../shared/data/gsm8k_test_sample.jsonl)")
    parser.add_argument("--row", type=int, default=0)
    parser.add_argument("--layer", type=int, default=0, help="the attributed layer (0 runs every layer after it)")
    parser.add_argument("--steps", type=int, default=64, help="left-Riemann steps of each timed call")
    parser.add_argument("--widths", default="8,16,32", help="vmap widths to time; 'auto' is the memory bound")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument(
        "--quiet-timeout",
        type=float,
        default=120.0,
        help="seconds to wait for a quiet machine before each timed call (0: do not wait)",
    )
    args = parser.parse_args(argv)

    model = load(args.model)
    p, config = model.params, model.config
    batch = encode(
        model.tokenizer, [format_short(read_rows("gsm8k", args.data)[args.row])], context=config.max_position_embeddings
    )
    prompt = batch.prompt(0, LengthBuckets(4, geometric=False))
    T = prompt.tokens.shape[1]
    x, b, inputs, _ = paths.ig_inputs(p, prompt, config)
    alphas, weights = (jnp.asarray(v, jnp.float32) for v in quadrature("left", args.steps))
    path = paths.study_path(x, b, inputs, args.layer, "layer")
    bound = auto_chunk_size(config, T, args.steps, grad=True)
    clock = Clock(quiet_s=args.quiet_timeout, repeat=args.repeat)
    print(f"{cpu_description()}; {T} positions (padded), layer {args.layer}, {args.steps} steps; memory bound {bound}")
    print(
        "| width asked | chunks | members per chunk | ms per gradient evaluation | others' cores |\n"
        "|---|---|---|---|---|"
    )
    for width in [bound if w == "auto" else int(w) for w in args.widths.split(",")]:
        run = lambda: jax.block_until_ready(
            paths.ig_of_layer(  # noqa: E731
                p, prompt, jnp.int32(args.layer), path, config, alphas=alphas, weights=weights, chunk_size=width
            )
        )
        t = clock.compiled(f"width {width}", run)
        chunks, members = chunk_layout(args.steps, width)  # as the sweep splits them
        print(f"| {width} | {chunks} | {members} | {1e3 * t.run_s / args.steps:.0f} | {t.others_all} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
