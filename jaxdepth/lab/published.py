"""The effective depths the second study published (Table 1 of "What Affects the Effective Depth
of Large Language Models?", Hu, Zhou, Zhang 2025), as rows shaped like `jaxdepth.lab.table.collect`'s,
so a reproduction prints and plots next to them.

Source: the study's Table 1, and its authors' notebook `exp3_universal_metric_simple.ipynb`
(github.com/AheadOFpotato/what_affects_effective_depth, commit ea5402c), which prints all 12
models x 3 datasets; the four Instruct rows on GSM8K are also METHODS §7. Those runs used 8-bit
weights and 10 prompts per dataset (5 on AIME24, per the notebook's file names): agreement
within a few layers is what to expect, not equality. One published cell is an artefact:
DeepSeek-R1-Distill-Qwen-1.5B's KL ED on GSM8K is 1 (ratio 0.07), where its other datasets give
20-24.
"""

from __future__ import annotations

from jaxdepth.analyses.effective_depth import EffectiveDepth

__all__ = [
    "published_rows",
    "comparison_markdown",
    "DATASETS",
    "METHODS",
    "TABLE1",
    "LONG_COT_PAIRS",
]


DATASETS = ("gsm8k", "hellaswag", "aime24")
METHODS = ("cosine", "kl", "overlap")

# model -> (layers, {dataset: (cosine ED, KL ED, overlap ED)})
TABLE1 = {
    "Qwen/Qwen2.5-1.5B-Instruct": (28, {"gsm8k": (20, 22, 23), "hellaswag": (16, 21, 23), "aime24": (19, 23, 23)}),
    "Qwen/Qwen2.5-7B-Instruct": (28, {"gsm8k": (20, 25, 26), "hellaswag": (17, 25, 26), "aime24": (18, 25, 26)}),
    "Qwen/Qwen2.5-14B-Instruct": (48, {"gsm8k": (32, 41, 45), "hellaswag": (27, 40, 45), "aime24": (30, 42, 45)}),
    "Qwen/Qwen2.5-32B-Instruct": (64, {"gsm8k": (46, 58, 60), "hellaswag": (43, 60, 61), "aime24": (43, 58, 60)}),
    "Qwen/Qwen2.5-Math-1.5B": (28, {"gsm8k": (16, 22, 23), "hellaswag": (16, 20, 23), "aime24": (16, 23, 23)}),
    "Qwen/Qwen2.5-Math-7B": (28, {"gsm8k": (11, 23, 24), "hellaswag": (16, 23, 24), "aime24": (16, 23, 24)}),
    "Qwen/Qwen2.5-14B": (48, {"gsm8k": (30, 40, 45), "hellaswag": (27, 40, 45), "aime24": (30, 42, 45)}),
    "Qwen/Qwen2.5-32B": (64, {"gsm8k": (46, 57, 59), "hellaswag": (43, 60, 61), "aime24": (46, 59, 60)}),
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B": (
        28,
        {"gsm8k": (16, 1, 23), "hellaswag": (17, 20, 23), "aime24": (17, 24, 24)},
    ),
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B": (
        28,
        {"gsm8k": (16, 24, 25), "hellaswag": (16, 24, 25), "aime24": (16, 24, 24)},
    ),
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-14B": (
        48,
        {"gsm8k": (30, 39, 44), "hellaswag": (26, 40, 44), "aime24": (30, 41, 44)},
    ),
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B": (
        64,
        {"gsm8k": (42, 55, 58), "hellaswag": (42, 58, 61), "aime24": (46, 57, 58)},
    ),
}

# (size, base model, its long-CoT distillation). DeepSeek distilled R1 into Qwen2.5-Math-1.5B and
# -7B and into Qwen2.5-14B and -32B: those are the bases the study pairs, so the 1.5B and 7B
# bases are the Math models.
LONG_COT_PAIRS = (
    ("1.5B", "Qwen/Qwen2.5-Math-1.5B", "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"),
    ("7B", "Qwen/Qwen2.5-Math-7B", "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"),
    ("14B", "Qwen/Qwen2.5-14B", "deepseek-ai/DeepSeek-R1-Distill-Qwen-14B"),
    ("32B", "Qwen/Qwen2.5-32B", "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B"),
)


def published_rows() -> list[dict]:
    """Table 1 as rows of `jaxdepth.lab.table.collect`'s shape (model, dataset, method, layers, ed,
    ratio), the ratio computed as METHODS §6 defines it, (ED + 1) / L."""
    rows = []
    for model, (layers, per_dataset) in TABLE1.items():
        for dataset, depths in per_dataset.items():
            for method, ed in zip(METHODS, depths):
                rows.append(
                    {
                        "model": model,
                        "dataset": dataset,
                        "method": method,
                        "layers": layers,
                        "ed": ed,
                        "ratio": round(EffectiveDepth(ed, layers, "published").ratio, 4),
                    }
                )
    return rows


def comparison_markdown(ours: list[dict], *, datasets=DATASETS) -> str:
    """A Markdown table of our effective depths next to the published ones, 'ours / published'
    per method, for every (model, dataset) either side has; '-' where a side has no result,
    'none' where its curve does not cross (METHODS §6)."""
    published = {(r["model"], r["dataset"], r["method"]): r for r in published_rows()}
    mine = {(r["model"], r["dataset"], r["method"]): r for r in ours}
    keys = sorted({k[:2] for k in list(published) + list(mine) if k[1] in datasets})
    cell = lambda r: "-" if r is None else "none" if r["ed"] is None else f"{r['ed']} ({r['ratio']:.2f})"
    lines = [
        "| model | dataset | L | " + " | ".join(f"{m} ED: jaxdepth / published" for m in METHODS) + " |",
        "|---|---|---|" + "---|" * len(METHODS),
    ]
    for model, dataset in keys:
        layers = next(r["layers"] for k, r in list(mine.items()) + list(published.items()) if k[:2] == (model, dataset))
        cells = [f"{cell(mine.get((model, dataset, m)))} / {cell(published.get((model, dataset, m)))}" for m in METHODS]
        lines.append(f"| {model} | {dataset} | {layers} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
