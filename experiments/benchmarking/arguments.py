"""The benchmark's command line."""

from __future__ import annotations

import argparse
import os

from .machine import PEAK_SIZES

ALIASES = {
    "contrib": "contributions",
    "cosine": "contributions",
    "lens": "logit_lens",
    "skip": "layer_skip",
    "ig": "integrated_gradients",
}
# The shared data samples live beside the checkout (`../shared/data/`, see DESIGN.md).
EXPERIMENTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DATA = os.path.normpath(os.path.join(EXPERIMENTS, "..", "..", "shared", "data", "gsm8k_test_sample.jsonl"))


def parse_args(argv=None, description=None):
    from jaxdepth.lab.registry import ANALYSES, default_analyses

    from .cases import CASES

    # what `jaxdepth run` runs by default, each with its benchmark case
    defaults = default_analyses()

    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument(
        "--model",
        default="smollm2",
        help="an embedded jaxdepth model name or a .gguf file: jaxdepth converts it, transformers "
        "reads the same file with its GGUF loader",
    )
    p.add_argument("--data", default=DEFAULT_DATA, help="GSM8K JSONL file")
    p.add_argument("--analyses", default=",".join(defaults), help="comma-separated subset of " + ", ".join(defaults))
    p.add_argument("--prompts", type=int, default=10, help="prompts for contributions and logit lens")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="truncate every prompt to this many tokens (default: full length); the "
        "per-analysis caps below apply on top of it",
    )
    p.add_argument("--skip-prompts", type=int, default=2, help="prompts for layer skip")
    p.add_argument("--skip-max-tokens", type=int, default=64, help="token cap for layer skip")
    p.add_argument(
        "--erasure-prompts", type=int, default=1, help="prompts for residual erasure and attribution patching"
    )
    p.add_argument(
        "--erasure-max-tokens", type=int, default=32, help="token cap for residual erasure and attribution patching"
    )
    p.add_argument("--ig-prompts", type=int, default=1, help="prompts for integrated gradients")
    p.add_argument("--ig-max-tokens", type=int, default=16, help="token cap for integrated gradients")
    p.add_argument(
        "--ig-steps",
        type=int,
        default=16,
        help="integrated-gradients steps (left Riemann). The studies use 256; at 30 layers "
        "that is 7,680 forward+backward passes per prompt, about an hour on 2 CPU cores "
        "for jaxdepth alone, so the default runs 16 and the full-workload table "
        "extrapolates (both implementations cost exactly linear in steps)",
    )
    p.add_argument(
        "--ig-tolerance",
        type=float,
        default=0.01,
        help="the adaptive integrated-gradients preset: it also runs on the IG workload, and the full-study "
        "extrapolation is given a second time with it in place of the published 256-step rule "
        "(0 = leave it out)",
    )
    p.add_argument(
        "--baseline-prompts",
        type=int,
        default=10,
        help="erasure baseline: mean residuals over the first N prompts of --data (full length)",
    )
    p.add_argument("--seed", type=int, default=123, help="split-position seed (layer skip)")
    p.add_argument(
        "--torch-threads",
        type=int,
        default=os.cpu_count(),
        help="torch intra-op threads for the reference (default: every core, as jax uses)",
    )
    p.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        help="before each timed call, wait up to this many seconds for other processes to "
        "leave the CPU (under 0.2 cores busy over 3 s); 0 = do not wait. The CPU time "
        "other processes take during each timing is reported either way",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="timed calls per analysis and side; the tables report their median (jaxdepth's first, "
        "compiling call is timed apart)",
    )
    p.add_argument(
        "--peak-sizes",
        default=",".join(map(str, PEAK_SIZES)),
        help="the square matmuls (their sizes, comma-separated) of the matmul peak, beside the model's MLP shape "
        "(smaller ones measure a lower peak, in less time)",
    )
    p.add_argument("--no-reference", action="store_true", help="time jaxdepth only (no agreement check)")
    p.add_argument("--out", default="results/benchmark.json", help="JSON copy of the tables")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    try:
        args.peak_sizes = tuple(int(n) for n in args.peak_sizes.split(","))
    except ValueError:
        p.error(f"--peak-sizes {args.peak_sizes}: want comma-separated sizes, e.g. 2048,4096")
    if min(args.peak_sizes) < 1:
        p.error("--peak-sizes must be at least 1")
    names = [ALIASES.get(a.strip(), a.strip()) for a in args.analyses.replace(" ", ",").split(",") if a.strip()]
    unknown = sorted(set(names) - set(ANALYSES))
    if unknown:
        p.error(f"unknown analyses {unknown}; known: {', '.join(ANALYSES)}")
    missing = sorted(set(names) - set(CASES))
    if missing:
        p.error(f"no benchmark case for {missing} (a registered analysis needs one in CASES)")
    args.analyses = [a for a in ANALYSES if a in names]
    return args
