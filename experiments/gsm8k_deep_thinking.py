"""The deep-thinking ratio against correctness on GSM8K (issue item: "DTR against the answer's
correctness, and Think@n selection against majority vote and the mean").

Each GSM8K prompt (the studies' instruction and question, METHODS §8) is answered `--samples`
times, sampled at `--temperature`, up to `--new-tokens` tokens; each answer's tokens are read
by the logit lens (`jaxdepth.analyses.generated_depth`): its deep-thinking ratio (DTR, the share
of its tokens that settle at or after layer ceil(rho L)) and whether its final answer is right
(read as GSM8K's evaluation reads it). The prompts run in chunks of `--chunk`, each chunk's
result saved atomically as `OUT/chunk_NNN.npz` as soon as it is done: a rerun computes only the
chunks not saved yet, and the summary is rewritten from every chunk present after each one.

The summary (`OUT/summary.md`, `OUT/summary.json`) gives:
- the accuracy of one sample (the mean), of the majority vote of all samples (self-consistency)
  and of Think@n (the vote of the deepest `keep` share of samples by DTR);
- the mean DTR of the right and of the wrong answers, with bootstrap intervals over prompts;
- the accuracy of the answers per DTR quartile, and beside it per length quartile (the
  baseline the deep-thinking paper sets DTR against);
- the point-biserial correlation of DTR, and of length, with correctness.

    python experiments/gsm8k_deep_thinking.py                      # the 250 rows of ../shared/data
    python experiments/gsm8k_deep_thinking.py --prompts 20 --chunk 5 --samples 2 --new-tokens 64

The embedded model (`smollm2`) needs no network; `--data` is a JSONL of GSM8K rows (question,
answer), by default the sample beside the repository where it exists, else the hub's test split.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchmarking.machine import cpu_description  # noqa: E402
from benchmarking.report import log, write_json_atomic  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SHARED_SAMPLE = os.path.join(HERE, "..", "..", "shared", "data", "gsm8k_test_sample.jsonl")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--data", default=SHARED_SAMPLE if os.path.exists(SHARED_SAMPLE) else None)
    p.add_argument("--prompts", type=int, default=250, help="the first N rows")
    p.add_argument("--chunk", type=int, default=10, help="prompts per saved chunk")
    p.add_argument("--samples", type=int, default=4, help="answers per prompt")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--new-tokens", type=int, default=256, help="new tokens per answer")
    p.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples over prompts")
    p.add_argument("--out", default=os.path.join(HERE, "results", "gsm8k_deep_thinking"))
    return p.parse_args(argv)


def run_chunks(args) -> None:
    """Every chunk not saved yet, each saved as it is done."""
    import jaxdepth
    from jaxdepth.analyses.generated_depth import Reading, generated_depth
    from jaxdepth.lab.prompts import encode, load_prompts

    prompts = load_prompts("gsm8k", args.data, limit=args.prompts)
    chunks = [prompts[i : i + args.chunk] for i in range(0, len(prompts), args.chunk)]
    todo = [i for i in range(len(chunks)) if not os.path.exists(_chunk_path(args, i))]
    log(f"{len(prompts)} prompts in {len(chunks)} chunks; {len(chunks) - len(todo)} saved, {len(todo)} to run")
    if not todo:
        return
    model = jaxdepth.load(args.model)
    eos = model.tokenizer.eos_token_id
    reading = Reading(
        max_new_tokens=args.new_tokens,
        samples=args.samples,
        temperature=args.temperature,
        eos_ids=() if eos is None else (int(eos),),
    )
    for i in todo:
        start = time.perf_counter()
        batch = encode(model.tokenizer, chunks[i])
        result = generated_depth(model.params, batch, model.config, model.tokenizer.decode, reading)
        result.save(_chunk_path(args, i))
        log(
            f"chunk {i + 1}/{len(chunks)}: {time.perf_counter() - start:.0f} s, "
            f"{int(result.correct.sum())}/{result.correct.size} answers right, mean DTR {result.dtr.mean():.3f}"
        )
        write_summary(args)


def _chunk_path(args, i: int) -> str:
    return os.path.join(args.out, f"chunk_{i:03d}.npz")


def _interval(values_per_prompt: list, resamples: int, seed: int = 0) -> tuple[float, float, float]:
    """The mean of all values pooled, and a 95% percentile bootstrap interval resampling prompts
    (each prompt's values move together)."""
    rng = np.random.default_rng(seed)
    kept = [np.asarray(v, float) for v in values_per_prompt if len(v)]
    if not kept:
        return float("nan"), float("nan"), float("nan")
    means = []
    for _ in range(resamples):
        drawn = rng.integers(0, len(kept), len(kept))
        means.append(np.concatenate([kept[j] for j in drawn]).mean())
    return float(np.concatenate(kept).mean()), *map(float, np.percentile(means, [2.5, 97.5]))


def _quartile_accuracy(score: np.ndarray, correct: np.ndarray) -> list[dict]:
    """Accuracy of the answers in each quartile of `score` (ties kept in one quartile)."""
    edges = np.quantile(score, [0.25, 0.5, 0.75])
    which = np.searchsorted(edges, score, side="right")
    rows = []
    for q in range(4):
        inside = which == q
        rows.append(
            dict(
                quartile=q + 1,
                answers=int(inside.sum()),
                low=float(score[inside].min()) if inside.any() else float("nan"),
                high=float(score[inside].max()) if inside.any() else float("nan"),
                accuracy=float(correct[inside].mean()) if inside.any() else float("nan"),
            )
        )
    return rows


def _point_biserial(score: np.ndarray, correct: np.ndarray) -> float:
    if correct.all() or not correct.any() or np.ptp(score) == 0:
        return float("nan")
    return float(np.corrcoef(score, correct.astype(float))[0, 1])


def summarize(results: list, resamples: int) -> dict:
    """The summary of the chunks' `GeneratedDepthResult`s (module docstring)."""
    dtr = np.concatenate([r.dtr for r in results])  # [N, S]
    correct = np.concatenate([r.correct for r in results])
    length = np.concatenate([r.counted.sum(-1) for r in results]).astype(float)
    accuracies = [r.accuracies() for r in results]
    sizes = np.asarray([r.dtr.shape[0] for r in results], float)
    accuracy = {k: float(np.dot([a[k] for a in accuracies], sizes) / sizes.sum()) for k in accuracies[0]}
    right = [d[c] for d, c in zip(dtr, correct)]
    wrong = [d[~c] for d, c in zip(dtr, correct)]
    return dict(
        prompts=int(dtr.shape[0]),
        samples=int(dtr.shape[1]),
        answers=int(dtr.size),
        right_answers=int(correct.sum()),
        accuracy=accuracy,
        dtr_right=_interval(right, resamples),
        dtr_wrong=_interval(wrong, resamples),
        dtr_quartiles=_quartile_accuracy(dtr.ravel(), correct.ravel()),
        length_quartiles=_quartile_accuracy(length.ravel(), correct.ravel()),
        dtr_correlation=_point_biserial(dtr.ravel(), correct.ravel()),
        length_correlation=_point_biserial(length.ravel(), correct.ravel()),
        settings=results[0].settings,
        num_layers=int(results[0].num_layers),
    )


def _markdown(s: dict, cpu: str) -> str:
    a = s["accuracy"]
    lines = [
        "# The deep-thinking ratio against correctness on GSM8K",
        "",
        f"{s['prompts']} prompts x {s['samples']} samples = {s['answers']} answers, {s['right_answers']} right; "
        f"up to {s['settings']['max_new_tokens']} new tokens at temperature {s['settings']['temperature']}; "
        f"rho {s['settings']['rho']}, settling at JSD <= {s['settings']['threshold']} bits, "
        f"{s['num_layers']} layers. Computed on {cpu}.",
        "",
        "| selection | accuracy |",
        "|---|---|",
        f"| one sample (mean) | {a['mean']:.3f} |",
        f"| majority vote of {s['samples']} | {a['majority']:.3f} |",
        f"| Think@n (deepest {s['settings']['keep']:.0%} by DTR) | {a['think@n']:.3f} |",
        "",
        "| answers | mean DTR | 95% interval (bootstrap over prompts) |",
        "|---|---|---|",
    ]
    for name, key in (("right", "dtr_right"), ("wrong", "dtr_wrong")):
        mean, lo, hi = s[key]
        lines.append(f"| {name} | {mean:.3f} | {lo:.3f} - {hi:.3f} |")
    lines += ["", "| quartile | DTR range | accuracy | length range (tokens) | accuracy |", "|---|---|---|---|---|"]
    for d, n in zip(s["dtr_quartiles"], s["length_quartiles"]):
        lines.append(
            f"| {d['quartile']} | {d['low']:.3f} - {d['high']:.3f} ({d['answers']}) | {d['accuracy']:.3f} | "
            f"{n['low']:.0f} - {n['high']:.0f} ({n['answers']}) | {n['accuracy']:.3f} |"
        )
    lines += [
        "",
        f"Point-biserial correlation with correctness: DTR {s['dtr_correlation']:.3f}, "
        f"length {s['length_correlation']:.3f}.",
        "",
    ]
    return "\n".join(lines)


def write_summary(args) -> dict:
    """`OUT/summary.md` and `.json` from every chunk saved so far."""
    from jaxdepth.analyses.generated_depth import GeneratedDepthResult
    from jaxdepth.core.atomic import atomic_write

    paths = sorted(glob.glob(os.path.join(args.out, "chunk_*.npz")))
    if not paths:
        return {}
    summary = summarize([GeneratedDepthResult.load(p) for p in paths], args.resamples)
    cpu = cpu_description()
    write_json_atomic(os.path.join(args.out, "summary.json"), {**summary, "cpu": cpu, "chunks": len(paths)})
    with atomic_write(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(_markdown(summary, cpu))
    return summary


def main(argv=None) -> None:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    run_chunks(args)
    summary = write_summary(args)
    if summary:
        print(_markdown(summary, cpu_description()))


if __name__ == "__main__":
    main()
