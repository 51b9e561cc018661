"""Attribution patching against the exact residual erasure of the same scalar, on real prompts.

The scalar is the integrated-gradients objective F (the summed teacher-forced probability of the
answer tokens). For every boundary l = 0..L and position t, the exact erasure replaces h_l[t] by
the baseline (the mean residual of the first 10 prompts, METHODS §4) and measures the change of
F; attribution patching estimates all of them from one forward and one backward pass. Per
prompt, over the cells (l, t) with t at or before the last answer-predicting position, it
reports the Spearman rank correlation of estimate and exact change, the share of the exact
top-5% cells (by |change|) that are in the estimate's top 5%, and the time of each (the
estimate compiled before it is timed).

    python experiments/attribution_patching.py --data ../shared/data/gsm8k_test_sample.jsonl

Prompts are GSM8K rows without the studies' instruction ('Problem: ... Solution: ...', as the
embedded prompts): the exact erasure costs (L+1) x T forwards of T tokens per prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from jaxdepth.analyses import attribution, erasure
from jaxdepth.core.atomic import atomic_write
from jaxdepth.lab.sources import load
from jaxdepth.lab.prompts import encode, format_short, read_rows

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_DATA = os.path.join(HERE, "..", "..", "shared", "data", "gsm8k_test_sample.jsonl")


def ranks(x: np.ndarray) -> np.ndarray:
    """Ranks from 0, ties sharing their mean rank (what Spearman's correlation needs)."""
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    return ((ends - counts + ends - 1) / 2)[inverse]


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.corrcoef(ranks(a), ranks(b))[0, 1])


def top_share(estimate: np.ndarray, exact: np.ndarray, fraction: float = 0.05) -> float:
    """Share of the exact top-`fraction` cells (by magnitude) that the estimate's top also holds."""
    k = max(1, int(round(fraction * len(exact))))
    top = lambda x: set(np.argsort(-np.abs(x), kind="stable")[:k].tolist())  # noqa: E731
    return len(top(estimate) & top(exact)) / k


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--data", default=DEFAULT_DATA, help="GSM8K JSONL")
    parser.add_argument("--prompts", type=int, default=5, help="the first N rows of --data")
    parser.add_argument(
        "--rows",
        help="comma-separated row indices instead of the first --prompts (the exact "
        "erasure costs about T^2: long prompts take tens of minutes on a small CPU)",
    )
    parser.add_argument("--out", default="results/attribution_patching.json")
    args = parser.parse_args(argv)

    model = load(args.model)
    p, c = model.params, model.config
    rows = read_rows("gsm8k", args.data)
    chosen = [int(i) for i in args.rows.split(",")] if args.rows else list(range(args.prompts))
    batch = encode(model.tokenizer, [format_short(rows[i]) for i in chosen], context=c.max_position_embeddings)
    baseline = erasure.mean_residuals(p, encode(model.tokenizer, [format_short(r) for r in rows[:10]]), c)
    print(f"{args.model}: L={c.num_layers}; GSM8K rows {chosen}, lengths {batch.lengths.tolist()}")

    report = []
    for i in range(len(batch)):
        one = batch.select(slice(i, i + 1))
        # Compiled first, untimed (each prompt length is its own computation); the exact erasure's
        # compilation stays in its time, a few seconds of minutes.
        attribution.attribution_patching(p, one, c, baseline)
        start = time.perf_counter()
        est = attribution.attribution_patching(p, one, c, baseline)
        est_s = time.perf_counter() - start
        start = time.perf_counter()
        exact = erasure.residual_erasure(p, one, c, baseline, erasure.Erasure(effect="answer_probability_change"))
        exact_s = time.perf_counter() - start
        last = int(one.lengths[0]) - 2  # the last answer-predicting position
        e, x = est.patching[0, :, : last + 1].ravel(), exact.effects[0, :, : last + 1].ravel()
        g = est.grad_x_act[0, :, : last + 1].ravel()
        row = dict(
            prompt=chosen[i],
            tokens=int(one.lengths[0]),
            cells=len(x),
            f_input=float(est.f_input[0]),
            spearman=spearman(e, x),
            top5_share=top_share(e, x),
            grad_x_act_spearman=spearman(g, x),
            grad_x_act_top5_share=top_share(g, x),
            max_abs_exact=float(np.abs(x).max()),
            estimate_s=est_s,
            exact_s=exact_s,
        )
        report.append(row)
        print(json.dumps(row))
    print(
        "\n| row | tokens | F(x) | Spearman (patching) | top-5% share (patching) | Spearman (grad x act) "
        "| top-5% share (grad x act) | patching (s) | exact erasure (s) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in report:
        print(
            f"| {r['prompt']} | {r['tokens']} | {r['f_input']:.3f} | {r['spearman']:.3f} | {r['top5_share']:.2f} "
            f"| {r['grad_x_act_spearman']:.3f} | {r['grad_x_act_top5_share']:.2f} | {r['estimate_s']:.2f} "
            f"| {r['exact_s']:.0f} |"
        )
    with atomic_write(args.out, "w") as f:
        json.dump(dict(model=args.model, data=args.data, rows=report), f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
