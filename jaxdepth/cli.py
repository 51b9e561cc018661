"""The `jaxdepth` command: `convert` a checkpoint, `run` the analyses on a model."""

from __future__ import annotations

import argparse
import sys
import time


def _convert(args) -> int:
    import numpy as np

    from conversion.checkpoint import save_converted
    from jaxdepth.loading import convert_source

    dtype = {"float32": np.float32, "bfloat16": "bfloat16"}[args.dtype]
    if dtype == "bfloat16":
        import ml_dtypes
        dtype = ml_dtypes.bfloat16
    start = time.perf_counter()
    converted = convert_source(args.source, dtype=dtype)
    path = save_converted(converted, args.out_dir, overwrite=args.overwrite)
    c = converted.config
    print(f"converted {args.source} ({c.model_type}, {c.num_layers} layers, d={c.hidden_size}) "
          f"to {path} in {time.perf_counter() - start:.1f} s")
    return 0


def _run(args) -> int:
    from jaxdepth import effective_depth as ed
    from jaxdepth.loading import load
    from jaxdepth.prompts import DATASETS, encode, load_prompts
    from jaxdepth.study import StudySettings, run_study

    start = time.perf_counter()
    model = load(args.model)
    if model.tokenizer is None:
        raise SystemExit(f"error: the model from {args.model} has no tokenizer; prompts cannot be encoded")
    print(f"loaded {args.model} in {time.perf_counter() - start:.1f} s")
    settings = StudySettings(num_prompts=args.prompts, seed=args.seed, ig_steps=args.ig_steps)
    analyses = args.analyses.split(",") if args.analyses else None
    for name in args.dataset:
        path = args.data if len(args.dataset) == 1 else None
        prompts = load_prompts(name, path, limit=None if DATASETS[name].max_tokens else args.prompts)
        batch = encode(model.tokenizer, prompts, max_tokens=DATASETS[name].max_tokens,
                       context=model.config.max_position_embeddings, limit=args.prompts)
        print(f"{name}: {len(batch)} prompts, {int(batch.valid.sum())} tokens")
        kwargs = {} if analyses is None else {"analyses": analyses}
        results = run_study(model, args.model, name, batch, args.out, settings=settings, **kwargs)
        if "contributions" in results:
            print(f"  cosine ED:  {ed.cosine_effective_depth(results['contributions'].mean_cosine)}")
        if "logit_lens" in results:
            lens = results["logit_lens"]
            print(f"  KL ED:      {ed.kl_effective_depth(lens.kl)}")
            print(f"  overlap ED: {ed.overlap_effective_depth(lens.overlap)}")
        if "layer_skip" in results:
            print(f"  depth score (layer skip): {ed.depth_score(results['layer_skip']['layer'].later):.2f}")
    print(f"total {time.perf_counter() - start:.1f} s; results in {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxdepth", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    convert = sub.add_parser("convert", help="convert a model to a jaxdepth checkpoint folder")
    convert.add_argument("source", help="HF folder, hub id, .gguf file, converted folder, or 'smollm2'")
    convert.add_argument("out_dir")
    convert.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    convert.add_argument("--overwrite", action="store_true")
    convert.set_defaults(func=_convert)

    run = sub.add_parser("run", help="run the analyses on a model and prompt set")
    run.add_argument("--model", default="smollm2", help="anything jaxdepth.load accepts (default: smollm2)")
    run.add_argument("--dataset", nargs="+", default=["gsm8k"], choices=["gsm8k", "hellaswag", "aime24"])
    run.add_argument("--data", help="local JSONL file for the dataset (default: the hub via `datasets`)")
    run.add_argument("--prompts", type=int, default=10)
    run.add_argument("--analyses", help="comma-separated subset of: contributions,logit_lens,"
                     "layer_skip,erasure,integrated_gradients (default: all)")
    run.add_argument("--seed", type=int, default=123)
    run.add_argument("--ig-steps", type=int, default=256)
    run.add_argument("--out", default="results")
    run.set_defaults(func=_run)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
