"""Reproduce Table 1 of "What Affects the Effective Depth of Large Language Models?" (Hu, Zhou,
Zhang 2025) and its figures: cosine, KL and top-5-overlap effective depth of all 12 models
(Qwen2.5 Instruct 1.5B-32B; the bases Qwen2.5-Math-1.5B, -Math-7B, Qwen2.5-14B, -32B; and their
long-CoT distillations DeepSeek-R1-Distill-Qwen 1.5B-32B) on GSM8K, HellaSwag and AIME24, with
the published numbers alongside (`jaxdepth.lab.published`), and the paired base vs long-CoT figure.

Meant for an accelerator machine with network access (or a filled Hugging Face cache):

    python experiments/reproduce_table1.py --out results/table1 --dtype bfloat16 --mesh 1x8

Each model is loaded from the hub (or `--local-dir/<name>` when given), every result is saved
and reused on a rerun, and the tables and figures are rewritten at the end, from whatever
results exist: `--models` with a subset, run on several machines into one `--out`, fills the
table piece by piece. `--published-only` draws the published numbers alone (no model needed).
"""

import argparse
import contextlib
import os

import jax

from jaxdepth.lab import plots, published
from jaxdepth.core.atomic import atomic_write
from jaxdepth.lab.sources import load
from jaxdepth.lab.prompts import DATASETS, encode, load_prompts
from jaxdepth.lab.results import load_result
from jaxdepth.core.sharding import mesh_from_spec
from jaxdepth.lab.study import StudyPrompts, StudySettings, run_study
from jaxdepth.lab.table import collect, result_identity, to_markdown, write_table

MODELS = list(published.TABLE1)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--datasets", nargs="+", default=["gsm8k", "hellaswag", "aime24"])
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--mesh", default=None, help="DATAxMODEL, e.g. 1x8 for a 32B model on 8 devices")
    parser.add_argument("--local-dir", help="folder holding <model name>/ HF checkpoints instead of the hub")
    parser.add_argument(
        "--data",
        nargs="*",
        default=[],
        metavar="NAME=PATH",
        help="local JSONL files instead of the hub, e.g. gsm8k=../shared/data/gsm8k_test_sample.jsonl",
    )
    parser.add_argument("--out", default="results/table1")
    parser.add_argument(
        "--published-only",
        action="store_true",
        help="draw the base vs long-CoT figure of the published numbers only (no model is loaded)",
    )
    args = parser.parse_args(argv)

    if args.published_only:
        write_table1_figures(args.out, {"published": published.published_rows()}, args.datasets, [])
        return
    mesh = None if args.mesh is None else mesh_from_spec(args.mesh)
    settings = StudySettings(num_prompts=args.prompts)
    data = dict(spec.split("=", 1) for spec in args.data)
    for name in args.models:
        source = os.path.join(args.local_dir, name.split("/")[-1]) if args.local_dir else name
        model = load(source, dtype=args.dtype, mesh=mesh)
        for dataset in args.datasets:
            prompts = load_prompts(
                dataset, data.get(dataset), limit=None if DATASETS[dataset].max_tokens else args.prompts
            )
            batch = encode(
                model.tokenizer,
                prompts,
                max_tokens=DATASETS[dataset].max_tokens,
                context=model.config.max_position_embeddings,
                limit=args.prompts,
            )
            with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
                run_study(
                    model,
                    name,
                    StudyPrompts(dataset, batch),
                    args.out,
                    analyses=("contributions", "logit_lens"),
                    settings=settings,
                )
        del model

    rows = collect([args.out])
    print(to_markdown(rows), end="")
    write_table(rows, os.path.join(args.out, "table1"))
    comparison = published.comparison_markdown(rows, datasets=args.datasets)
    with atomic_write(os.path.join(args.out, "table1_vs_published.md"), "w") as f:
        f.write(comparison)
    print("\njaxdepth vs published (8-bit weights there: expect agreement within a few layers):")
    print(comparison, end="")
    # every model with results under --out, not only this run's: runs on several machines fill in
    write_table1_figures(
        args.out,
        {"published": published.published_rows(), "jaxdepth": rows},
        args.datasets,
        sorted({r["model"] for r in rows}),
    )


def write_table1_figures(out, sources, datasets, models):
    """The paired base vs long-CoT figure, and each dataset's curves of every model on a
    relative depth axis (from the saved results of `models`)."""
    figures = os.path.join(out, "figures")
    plots.save_figure(
        plots.long_cot_figure(sources, published.LONG_COT_PAIRS, datasets=datasets),
        os.path.join(figures, "base_vs_long_cot"),
    )
    for dataset in datasets:
        for kind in ("contributions", "logit_lens"):
            curves = {}
            # each model's folder is named by its fingerprint too: found by what its results record
            for folder, _, files in sorted(os.walk(out)):
                if f"{kind}.npz" not in files:
                    continue
                result = load_result(os.path.join(folder, f"{kind}.npz"))
                identity = result_identity(result, folder)
                if identity["model"] in models and identity["dataset"] == dataset:
                    curves.setdefault(identity["model"].split("/")[-1], result)
            if curves:
                plots.save_figure(
                    plots.relative_depth_figure(curves, title=f"{kind} on {dataset}"),
                    os.path.join(figures, f"{kind}_{dataset}_relative_depth"),
                )
    print(f"figures in {figures}")


if __name__ == "__main__":
    main()
