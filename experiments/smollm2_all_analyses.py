"""Every analysis on the embedded SmolLM2-135M-Instruct, with the effective-depth numbers and the
wall time of each analysis (first call, compilation included, and a second, warm call).

    python experiments/smollm2_all_analyses.py --data ../shared/data/gsm8k_test_sample.jsonl

Erasure and integrated gradients sweep every (boundary, position) and (layer, step) of a prompt;
on a 2-core CPU run them on a few prompts (`--detail-prompts`) and fewer IG steps.
"""

import argparse
import os
import time

from jaxdepth.lab.sources import load
from jaxdepth.lab.prompts import encode, load_prompts
from jaxdepth.lab.registry import ANALYSES
from jaxdepth.lab.study import StudySettings, run_analysis

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_DATA = os.path.join(HERE, "..", "..", "shared", "data", "gsm8k_test_sample.jsonl")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--data", default=DEFAULT_DATA, help="GSM8K JSONL")
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--detail-prompts", type=int, default=1)
    parser.add_argument("--ig-steps", type=int, default=32)
    parser.add_argument(
        "--analyses", default=None, help="comma-separated (default: every analysis the model's layers allow)"
    )
    parser.add_argument("--warm", action="store_true", help="time a second call too (compilation excluded)")
    args = parser.parse_args()

    model = load(args.model)
    if args.analyses is None:  # the experts analysis reads a mixture of experts, which a dense model has not
        args.analyses = ",".join(n for n in ANALYSES if n != "experts" or model.config.is_moe)
    batch = encode(
        model.tokenizer,
        load_prompts("gsm8k", args.data, limit=args.prompts),
        context=model.config.max_position_embeddings,
    )
    settings = StudySettings(
        num_prompts=args.prompts, detail_prompts=args.detail_prompts, options={"ig_steps": args.ig_steps}
    )
    print(
        f"{args.model}: L={model.config.num_layers}; {len(batch)} GSM8K prompts, "
        f"{int(batch.valid.sum())} tokens (mean {batch.lengths.mean():.0f}); erasure/IG on "
        f"{args.detail_prompts} prompt(s), IG {args.ig_steps} steps"
    )
    times = {}
    for name in args.analyses.split(","):
        start = time.perf_counter()
        result = run_analysis(name, model, batch, settings, progress=False)
        times[name] = [time.perf_counter() - start]
        if args.warm:
            start = time.perf_counter()
            run_analysis(name, model, batch, settings, progress=False)
            times[name].append(time.perf_counter() - start)
        for phrase in ANALYSES[name].summary(result):
            print(f"  {phrase}")
    print("\nwall time per analysis (s): " + ("first call / warm call" if args.warm else "first call"))
    for name, t in times.items():
        print(f"  {name:22s} " + " / ".join(f"{x:7.1f}" for x in t))


if __name__ == "__main__":
    main()
