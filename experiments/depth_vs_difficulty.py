"""Depth score against difficulty, as the first study ("Do Language Models Use Their Depth
Efficiently?", Csordás et al. 2025) plots it: against MQuAKE's number of hops (2, 3, 4) and
against MATH's levels (1-5).

Per difficulty group (N prompts of one level, in the study's order: shuffled with
`random.Random(42)`, the first N kept), every layer is skipped in the future mode with the split
at each prompt's answer start: skipped while the question is read, measured from the first answer
token on (METHODS §3, `layer_skip(..., splits="answer_start")`). The group's depth score
(METHODS §6) comes with a bootstrap interval over its prompts. Each group is one `run_study`
dataset (`math_level3`, `mquake_2hops`, ...), so its result is cached, resumed and written
atomically like any other run: a rerun computes only the groups not done yet. The summary
(`<dataset>_depth_vs_difficulty.json` / `.csv`) and the figure (`.png` / `.pdf`) are rewritten
from the results at the end, under `OUT/<model>/`.

On an accelerator machine with network access (or a filled Hugging Face cache):

    python experiments/depth_vs_difficulty.py --model Qwen/Qwen2.5-7B --dataset mquake \\
        --prompts 20 --dtype bfloat16 --mesh 1x1
    python experiments/depth_vs_difficulty.py --model meta-llama/Llama-3.1-8B --dataset math \\
        --subject intermediate_algebra --prompts 20 --dtype bfloat16 --mesh 1x1

(`--mesh 1x8` spreads a 70B model over 8 devices.) `--subject intermediate_algebra --prompts 20`
is the study's own selection of MATH problems; without `--subject` every subject is used.
Offline, pass the rows with `--data` (MATH: JSONL rows with problem, level, type, solution;
MQuAKE: JSONL rows, or the published `.json` list, with questions, answer and the hop chain).

The study's code splits MQuAKE prompts at the answer start, as here; for MATH it draws four
split positions inside each solution instead (every fourth token), which this script does not do.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import os
import random
import sys
from typing import Optional, Sequence

import numpy as np

from jaxdepth.analyses import effective_depth as ed
from jaxdepth.analyses import uncertainty
from jaxdepth.core.atomic import atomic_write
from jaxdepth.lab.prompts import MATH_SUBJECTS, DATASETS, DatasetError, Prompt, encode, load_prompts, math_subject
from jaxdepth.lab.study import StudyPrompts, StudySettings, model_results_key, run_study, saved_model_name

DIFFICULTY_DATASETS = ("math", "mquake")
STUDY_ORDER_SEED = 42  # the study's code shuffles each level's rows with random.Random(42)
CSV_FIELDS = (
    "model",
    "dataset",
    "subject",
    "difficulty",
    "label",
    "group",
    "prompts",
    "measured_prompts",
    "depth_score",
    "low",
    "high",
    "num_layers",
)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="anything jaxdepth.lab.sources.load accepts")
    parser.add_argument("--dataset", default="mquake", choices=DIFFICULTY_DATASETS)
    parser.add_argument("--data", help="local JSONL (or .json list) rows instead of the hub")
    parser.add_argument(
        "--subject",
        choices=MATH_SUBJECTS,
        help="MATH only: one subject (the study's: intermediate_algebra); default: all",
    )
    parser.add_argument("--levels", type=int, nargs="+", help="difficulties to run (default: all of the dataset)")
    parser.add_argument("--prompts", type=int, default=20, help="prompts per difficulty")
    parser.add_argument("--max-tokens", type=int, help="skip prompts longer than this many tokens")
    parser.add_argument(
        "--resamples",
        type=int,
        default=uncertainty.DEFAULT_RESAMPLES,
        help="bootstrap resamples of each group's prompts (0: no interval)",
    )
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float32"])
    parser.add_argument("--mesh", default=None, help="DATAxMODEL, e.g. 1x8 for a 70B model on 8 devices")
    parser.add_argument("--memory-budget", type=int, help="bytes of device memory a sweep may use")
    parser.add_argument("--out", default="results/depth_vs_difficulty")
    args = parser.parse_args(argv)
    if args.subject is not None and args.dataset != "math":
        parser.error("--subject applies to --dataset math only")
    levels = DATASETS[args.dataset].levels
    if args.levels and not set(args.levels) <= set(levels):
        parser.error(f"--levels of {args.dataset} must be among {list(levels)}")
    return args


def dataset_tag(dataset: str, subject: Optional[str]) -> str:
    """'math', 'math-geometry' or 'mquake': the prefix of the group names and summary files."""
    return dataset if subject is None else f"{dataset}-{subject}"


def group_name(dataset: str, subject: Optional[str], difficulty: int) -> str:
    """The `run_study` dataset name of one difficulty group: 'math_level3', 'mquake_2hops'."""
    suffix = f"level{difficulty}" if dataset == "math" else f"{difficulty}hops"
    return f"{dataset_tag(dataset, subject)}_{suffix}"


def prompts_by_difficulty(dataset: str, data: Optional[str], subject: Optional[str]) -> dict[int, list[Prompt]]:
    """Every prompt of the dataset (of one MATH subject) grouped by difficulty, each group in the
    study's order (the file order shuffled by `random.Random(42)`)."""
    where = None if subject is None else (lambda row: math_subject(row) == subject)
    groups: dict[int, list[Prompt]] = {}
    for prompt in load_prompts(dataset, data, where=where):
        if prompt.difficulty is not None:
            groups.setdefault(prompt.difficulty, []).append(prompt)
    for group in groups.values():
        random.Random(STUDY_ORDER_SEED).shuffle(group)
    return groups


def group_summary(result, *, resamples: int) -> dict:
    """Depth score of one group's layer-skip result (its 'layer' part), its bootstrap interval
    and the per-layer quantities it is made of."""
    part = result.part("layer")
    L = part.later.shape[0]
    measured = int((part.split_positions >= 0).any(axis=1).sum())
    try:
        score = ed.depth_score(part.later)
    except ValueError:  # every effect zero: no score
        score = None
    low = high = level = None
    if resamples > 0 and score is not None:
        interval = uncertainty.depth_score_interval(part, resamples=resamples)
        low, high, level = interval.low, interval.high, interval.level
    effect = ed.depth_effects(part.later)
    return {
        "prompts": int(part.later_per_prompt.shape[0]),
        "measured_prompts": measured,
        "depth_score": score,
        "low": low,
        "high": high,
        "interval_level": level,
        "resamples": resamples,
        "num_layers": L,
        "layer_effect": effect.tolist(),
        "output_effect": np.asarray(part.output, np.float64).tolist(),
    }


def depth_vs_difficulty_figure(rows: Sequence[dict], *, title: str):
    """Depth score (bars) per difficulty, with the bootstrap interval as error bars; a group
    without a score is left empty. The axis spans the layers 0..L-1."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(1.2 * len(rows) + 2.5, 3.4), layout="constrained")
    FigureCanvasAgg(fig)  # Agg, whatever backend pyplot may be using elsewhere
    ax = fig.subplots()
    x = np.arange(len(rows))
    scores = np.array([np.nan if r["depth_score"] is None else r["depth_score"] for r in rows])
    ax.bar(x, scores, color="C0", width=0.6)
    for xi, row, score in zip(x, rows, scores):
        if row["low"] is not None and row["high"] is not None:
            ax.errorbar(xi, score, yerr=[[score - row["low"]], [row["high"] - score]], color="k", capsize=4)
    ax.set_xticks(x, [f"{r['label']}\n(n={r['measured_prompts']})" for r in rows])
    ax.set(ylabel="depth score (layer)", ylim=(0, rows[0]["num_layers"] - 1))
    ax.grid(axis="y", alpha=0.3)
    level = next((r["interval_level"] for r in rows if r["interval_level"] is not None), None)
    ax.set_title(
        title + ("" if level is None else f"\n(error bars: {level:.0%} bootstrap interval over prompts)"), fontsize=10
    )
    return fig


def write_summary(rows: Sequence[dict], base: str, meta: dict) -> list[str]:
    """`base.json` (every field, with the run's settings) and `base.csv` (one row per
    difficulty), each written atomically; returns both paths."""
    with atomic_write(base + ".json", "w") as f:
        json.dump({**meta, "groups": list(rows)}, f, indent=2)
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=CSV_FIELDS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    with atomic_write(base + ".csv", "w") as f:
        f.write(text.getvalue())
    return [base + ".json", base + ".csv"]


def run_groups(model, args, groups: dict[int, list[Prompt]], levels: Sequence[int]) -> list[dict]:
    """Layer skip at the answer start on each difficulty group through `run_study` (cached and
    resumed); one summary row per group that has prompts."""
    settings = StudySettings(
        num_prompts=args.prompts,
        options={"skip_sublayers": ("layer",), "skip_mode": "future", "skip_split": "answer_start"},
        memory_budget=args.memory_budget,
    )
    spec = DATASETS[args.dataset]
    rows = []
    for level in levels:
        label = spec.level_format.format(level)
        if not groups.get(level):
            print(f"{label}: no prompt of this difficulty in the data; skipped")
            continue
        batch = encode(
            model.tokenizer,
            groups[level],
            max_tokens=args.max_tokens,
            context=model.config.max_position_embeddings,
            limit=args.prompts,
        )
        name = group_name(args.dataset, args.subject, level)
        results = run_study(
            model,
            saved_model_name(args.model, args.dtype),
            StudyPrompts(name, batch),
            args.out,
            analyses=("layer_skip",),
            settings=settings,
        )
        row = {
            "model": args.model,
            "dataset": args.dataset,
            "subject": args.subject or "all",
            "difficulty": level,
            "label": label,
            "group": name,
            **group_summary(results["layer_skip"], resamples=args.resamples),
        }
        score = "undefined" if row["depth_score"] is None else f"{row['depth_score']:.2f}"
        print(
            f"{label}: depth score {score} on {row['measured_prompts']} prompts"
            + ("" if row["low"] is None else f" [{row['low']:.2f}, {row['high']:.2f}]")
        )
        rows.append(row)
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    import jax

    from jaxdepth.lab import plots
    from jaxdepth.core.sharding import is_writer, mesh_from_spec
    from jaxdepth.lab.sources import load

    try:
        groups = prompts_by_difficulty(args.dataset, args.data, args.subject)
    except DatasetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    levels = args.levels or DATASETS[args.dataset].levels
    if not any(groups.get(level) for level in levels):
        print(f"error: no {args.dataset} prompt of difficulty {list(levels)} in the data", file=sys.stderr)
        return 2
    try:
        mesh = None if args.mesh is None else mesh_from_spec(args.mesh)
        model = load(args.model, dtype=args.dtype, mesh=mesh)
        if model.tokenizer is None:
            raise ValueError(f"the model from {args.model} has no tokenizer; prompts cannot be encoded")
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
        rows = run_groups(model, args, groups, levels)
    if not is_writer():
        return 0
    tag = dataset_tag(args.dataset, args.subject)
    # beside the model's study results, in its folder (its name and fingerprint)
    key = model_results_key(model, saved_model_name(args.model, args.dtype))[0]
    base = os.path.join(args.out, key, f"{tag}_depth_vs_difficulty")
    meta = {
        "model": args.model,
        "dataset": args.dataset,
        "subject": args.subject or "all",
        "data": args.data,
        "prompts_per_group": args.prompts,
        "max_tokens": args.max_tokens,
        "dtype": args.dtype,
        "layer_skip": {"mode": "future", "splits": "answer_start", "sublayer": "layer"},
        "order": f"file order shuffled by random.Random({STUDY_ORDER_SEED}), first N",
    }
    paths = write_summary(rows, base, meta)
    shown = os.path.basename(os.path.normpath(args.model)) if os.path.exists(args.model) else args.model
    fig = depth_vs_difficulty_figure(rows, title=f"{shown} on {tag}: depth score against difficulty")
    paths.extend(plots.save_figure(fig, base))
    print("wrote " + ", ".join(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
