"""Reproduce Table 1 of "What Affects the Effective Depth of Large Language Models?" (Hu, Zhou,
Zhang 2025) and its curves: cosine, KL and top-5-overlap effective depth of Qwen2.5 instruct
models and DeepSeek-R1-Distill-Qwen on GSM8K, HellaSwag and AIME24, with the published numbers
alongside.

Meant for an accelerator machine with network access (or a filled Hugging Face cache):

    python experiments/reproduce_table1.py --out results/table1 --dtype bfloat16 --mesh 1x8

Each model is loaded from the hub (or `--local-dir/<name>` when given), every result is saved
and reused on a rerun, and the table and overlay figures are rewritten at the end.
"""

import argparse
import contextlib
import os

import jax

from jaxdepth import plots
from jaxdepth.loading import load
from jaxdepth.prompts import DATASETS, encode, load_prompts
from jaxdepth.results import load_result
from jaxdepth.core.sharding import make_mesh
from jaxdepth.study import StudySettings, result_folder, run_study
from jaxdepth.table import collect, to_markdown, write_table

MODELS = [
    "Qwen/Qwen2.5-1.5B-Instruct",
    "Qwen/Qwen2.5-7B-Instruct",
    "Qwen/Qwen2.5-14B-Instruct",
    "Qwen/Qwen2.5-32B-Instruct",
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B",
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-14B",
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B",
]

# Table 1 of the study on GSM8K: (cosine ED, KL ED, overlap ED, L). 8-bit weights, 10 prompts:
# expect agreement within a few layers, not exactly.
PUBLISHED_GSM8K = {
    "Qwen/Qwen2.5-1.5B-Instruct": (20, 22, 23, 28),
    "Qwen/Qwen2.5-7B-Instruct": (20, 25, 26, 28),
    "Qwen/Qwen2.5-14B-Instruct": (32, 41, 45, 48),
    "Qwen/Qwen2.5-32B-Instruct": (46, 58, 60, 64),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--datasets", nargs="+", default=["gsm8k", "hellaswag", "aime24"])
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--mesh", default=None, help="DATAxMODEL, e.g. 1x8 for a 32B model on 8 devices")
    parser.add_argument("--local-dir", help="folder holding <model name>/ HF checkpoints instead of the hub")
    parser.add_argument("--data", nargs="*", default=[], metavar="NAME=PATH",
                        help="local JSONL files instead of the hub, e.g. gsm8k=../shared/data/gsm8k_test_sample.jsonl")
    parser.add_argument("--out", default="results/table1")
    args = parser.parse_args()

    mesh = None
    if args.mesh:
        data, model_axis = (int(x) for x in args.mesh.split("x"))
        mesh = make_mesh(data=data, model=model_axis)
    settings = StudySettings(num_prompts=args.prompts)
    data = dict(spec.split("=", 1) for spec in args.data)
    for name in args.models:
        source = os.path.join(args.local_dir, name.split("/")[-1]) if args.local_dir else name
        model = load(source, dtype=args.dtype, mesh=mesh)
        for dataset in args.datasets:
            prompts = load_prompts(dataset, data.get(dataset),
                                   limit=None if DATASETS[dataset].max_tokens else args.prompts)
            batch = encode(model.tokenizer, prompts, max_tokens=DATASETS[dataset].max_tokens,
                           context=model.config.max_position_embeddings, limit=args.prompts)
            with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
                run_study(model, name, dataset, batch, args.out, analyses=("contributions", "logit_lens"),
                          settings=settings)
        del model

    rows = collect([args.out])
    print(to_markdown(rows), end="")
    write_table(rows, os.path.join(args.out, "table1"))
    print("\npublished (GSM8K, cosine / KL / overlap ED, L):")
    for name, (cos, kl, ov, layers) in PUBLISHED_GSM8K.items():
        if name not in args.models:
            continue
        ours = {r["method"]: r["ed"] for r in rows if r["model"] == name and r["dataset"] == "gsm8k"}
        print(f"  {name}: published {cos} / {kl} / {ov} (L={layers}); jaxdepth "
              f"{ours.get('cosine')} / {ours.get('kl')} / {ours.get('overlap')}")
    for dataset in args.datasets:
        for kind in ("contributions", "logit_lens"):
            curves = {}
            for name in args.models:
                path = os.path.join(result_folder(args.out, name, dataset), f"{kind}.npz")
                if os.path.isfile(path):
                    curves[name.split("/")[-1]] = load_result(path)
            if curves:
                plots.save_figure(plots.relative_depth_figure(curves, title=f"{kind} on {dataset}"),
                                  os.path.join(args.out, "figures", f"{kind}_{dataset}_relative_depth"))


if __name__ == "__main__":
    main()
