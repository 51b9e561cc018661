"""How accurate is integrated gradients in bfloat16? The studies' IG (left Riemann rule) of each
GSM8K prompt in float32 and in bf16, on the same tokens, compared layer by layer.

Per prompt and layer, in each precision: F(x) and F(b), and the completeness gap
|sum_t IG[t] - (F(x) - F(b))| relative to that precision's own |F(x) - F(b)|. Between them:
the bf16 attribution error of each layer, max_t |IG_bf16[t] - IG_f32[t]| / |F_f32(x) - F_f32(b)|
(the unit completeness is measured in, so it reads beside the gaps), and its median over the
layers; and, per token, the relative error of the attribution summed over the layers,
S[t] = sum_l IG_l[t]: |S_bf16[t] - S_f32[t]| / max_t |S_f32[t]| (`token_sum_error`) and
|S_bf16[t] - S_f32[t]| / |S_f32[t]| (`token_sum_own_error`, large where S_f32[t] is near zero).

    python experiments/ig_precision.py --rows 0,1,3   # SmolLM2, 64 steps (2 CPU cores: ~30 min a row)
    python experiments/ig_precision.py --rows 0,1 --steps 16 --narrow bf16-matmuls \
        --cache results/ig_precision_bf16_matmuls --out experiments/results/ig_precision_bf16_matmuls.json

Each (prompt, precision) result is cached in `--cache` as it finishes (keyed by a hash of the
model, the prompt's tokens and the steps), so a killed run resumes with what it had; the report
(`--out`) is rewritten after each prompt. `--narrow bf16-matmuls` compares float32 with bf16
weight matrices beside float32 activations instead (the products read bf16 inputs and accumulate
in float32; docs/precision.md). Without bf16 matrix units (AMX, avx512_bf16) the CPU converts to
float32 around every bf16 product, so there bf16 is a precision check, not a speed mode; the
times are recorded with the CPU they ran on all the same.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time

import numpy as np

import jaxdepth
from benchmarking.machine import cpu_description
from jaxdepth.analyses.ig import Execution, FixedRule
from jaxdepth.analyses.integrated_gradients import integrated_gradients_of_answers
from jaxdepth.core.atomic import atomic_write
from jaxdepth.lab.prompts import encode, format_short, read_rows

HERE = os.path.dirname(os.path.abspath(__file__))
# What float32 is compared against: every weight and activation in bf16 (`--dtype bfloat16`),
# or only the layers' weight matrices in bf16 with float32 activations, the products reading
# bf16 inputs and accumulating in float32 (`ModelWeights.with_matmul_dtype`).
NARROW = {
    "bfloat16": lambda model: jaxdepth.load(model, dtype="bfloat16"),
    "bf16-matmuls": lambda model: jaxdepth.load(model, dtype="float32").with_matmul_dtype("bfloat16"),
}


def cache_path(cache: str, model_name: str, tokens: np.ndarray, steps: int, precision: str) -> str:
    """Where one (prompt, precision) result is kept: its name says what the numbers depend on."""
    key = hashlib.sha256(repr((model_name, np.asarray(tokens).tolist(), steps)).encode()).hexdigest()[:12]
    return os.path.join(cache, f"{key}_{precision}.npz")


def run_ig(model, batch, steps: int, path: str, precision: str) -> dict:
    """The studies' IG of the one prompt of `batch` with `model`, from the cache `path` if it is
    there, else computed and cached: attributions `[L, T]` (valid tokens only), gap `[L]`
    (signed, as the library reports it), F(x), F(b) `[L]`, the seconds it took (compilation
    included) and the CPU it ran on."""
    if os.path.exists(path):
        with np.load(path) as stored:
            return {k: stored[k] for k in stored.files}
    start = time.perf_counter()
    r = integrated_gradients_of_answers(
        model.params, batch, model.config, rule=FixedRule("left", steps), execution=Execution(progress=False)
    )
    seconds = time.perf_counter() - start
    n = int(batch.lengths[0])
    if np.any(r.attributions[0, :, n:]):
        raise RuntimeError("integrated gradients attributed something to padding")
    result = dict(
        tokens=np.asarray(batch.tokens[0, :n]),
        attributions=r.attributions[0, :, :n],
        gap=r.gap[0],
        f_input=r.f_input[0],
        f_baseline=r.f_baseline[0],
        seconds=np.float64(seconds),
        cpu=np.array(cpu_description()),
        precision=np.array(precision),
    )
    with atomic_write(path, "wb") as f:
        np.savez(f, **result)
    return result


def compare(f32: dict, bf16: dict, narrow: str = "bfloat16") -> dict:
    """Per layer and per token, how far the `narrow` IG (`bf16`) is from the float32 one (see the
    module's docstring), with each precision's own F values and relative completeness gaps."""
    if not np.array_equal(f32["tokens"], bf16["tokens"]):
        raise ValueError("the two precisions' results are of different prompts")
    a32, a16 = f32["attributions"].astype(np.float64), bf16["attributions"].astype(np.float64)
    own = {}
    for name, r in (("float32", f32), (narrow, bf16)):
        delta = np.abs(float(r["f_input"]) - r["f_baseline"].astype(np.float64))
        own[name] = dict(
            f_input=float(r["f_input"]),
            f_baseline=r["f_baseline"].tolist(),
            gap=(np.abs(r["gap"].astype(np.float64)) / delta).tolist(),
            seconds=float(r["seconds"]),
            cpu=str(r["cpu"]),
        )
    scale = np.abs(float(f32["f_input"]) - f32["f_baseline"].astype(np.float64))
    error = np.abs(a16 - a32).max(-1) / scale
    s32, s16 = a32.sum(0), a16.sum(0)
    token_sum_error = np.abs(s16 - s32) / np.abs(s32).max()
    with np.errstate(divide="ignore", invalid="ignore"):
        token_sum_own_error = np.abs(s16 - s32) / np.abs(s32)
    return dict(
        **own,
        attribution_error=error.tolist(),
        max_attribution_error=float(error.max()),
        median_attribution_error=float(np.median(error)),
        worst_layer=int(error.argmax()),
        f_input_relative_difference=abs(own[narrow]["f_input"] - own["float32"]["f_input"])
        / abs(own["float32"]["f_input"]),
        token_sum_error=token_sum_error.tolist(),
        max_token_sum_error=float(token_sum_error.max()),
        median_token_sum_error=float(np.median(token_sum_error)),
        median_token_sum_own_error=float(np.nanmedian(token_sum_own_error)),
        token_sum_own_error=[None if not np.isfinite(e) else float(e) for e in token_sum_own_error],
    )


def layer_groups(prompts: dict, width: int, narrow: str = "bfloat16") -> list:
    """Per group of `width` layers, over every prompt and layer in it: the largest and median bf16
    attribution error, and the largest and median completeness gap in each precision."""
    if not prompts:
        return []
    L = len(next(iter(prompts.values()))["attribution_error"])
    groups = []
    for first in range(0, L, width):
        last = min(first + width, L)

        def pick(per_layer):
            return np.array([per_layer(p)[first:last] for p in prompts.values()])

        error = pick(lambda p: p["attribution_error"])
        gap32, gap16 = pick(lambda p: p["float32"]["gap"]), pick(lambda p: p[narrow]["gap"])
        groups.append(
            dict(
                layers=f"{first}-{last - 1}",
                max_error=float(error.max()),
                median_error=float(np.median(error)),
                max_gap_f32=float(gap32.max()),
                median_gap_f32=float(np.median(gap32)),
                max_gap_bf16=float(gap16.max()),
                median_gap_bf16=float(np.median(gap16)),
            )
        )
    return groups


def table(report: dict) -> str:
    """A compact plain-text table: per prompt, then per group of layers over all prompts."""

    def pct(v):
        return f"{100 * v:.2f}%"

    lines = [
        f"{report['model']}, left rule, {report['steps']} steps; CPU: {report['cpu']}",
        "",
        f"{'prompt':<12} {'tokens':>6} {'f32 F(x)':>9} {'bf16 F(x)':>9} {'max err':>8} {'(layer)':>7} "
        f"{'med err':>8} {'max gap32':>9} {'max gap16':>9} {'s f32':>6} {'s bf16':>6}",
    ]
    for name, p in report["prompts"].items():
        f32, bf16 = p["float32"], p[report.get("narrow", "bfloat16")]
        lines.append(
            f"{name:<12} {p['tokens']:>6} {f32['f_input']:>9.4f} {bf16['f_input']:>9.4f} "
            f"{pct(p['max_attribution_error']):>8} {p['worst_layer']:>7} "
            f"{pct(p['median_attribution_error']):>8} {pct(max(f32['gap'])):>9} {pct(max(bf16['gap'])):>9} "
            f"{f32['seconds']:>6.0f} {bf16['seconds']:>6.0f}"
        )
    lines += [
        "",
        f"{'layers':<8} {'max err':>8} {'med err':>8} {'max gap32':>9} {'max gap16':>9} "
        f"{'med gap32':>9} {'med gap16':>9}",
    ]
    for g in report["layer_groups"]:
        lines.append(
            f"{g['layers']:<8} {pct(g['max_error']):>8} {pct(g['median_error']):>8} "
            f"{pct(g['max_gap_f32']):>9} {pct(g['max_gap_bf16']):>9} "
            f"{pct(g['median_gap_f32']):>9} {pct(g['median_gap_bf16']):>9}"
        )
    lines.append(
        "err: max_t |IG_bf16 - IG_f32| / |F_f32(x) - F_f32(b)|; gap: |completeness gap| / |F(x) - F(b)| "
        "in that precision; seconds include compilation"
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument(
        "--data",
        default=os.path.join(HERE, "..", "..", "shared", "data", "gsm8k_test_sample.jsonl"),
        help="GSM8K JSONL",
    )
    parser.add_argument("--rows", default="0,1", help="GSM8K rows, comma-separated")
    parser.add_argument("--steps", type=int, default=64, help="left Riemann steps")
    parser.add_argument(
        "--narrow",
        choices=sorted(NARROW),
        default="bfloat16",
        help="compared with float32: bf16 everywhere, or bf16 weight matrices with float32 activations",
    )
    parser.add_argument("--group", type=int, default=10, help="layers per group in the summary")
    parser.add_argument("--cache", default="results/ig_precision", help="each (prompt, precision) result")
    parser.add_argument("--out", default="experiments/results/ig_precision.json")
    args = parser.parse_args(argv)

    # float32 explicitly: a converted folder may be stored in another dtype.
    f32 = jaxdepth.load(args.model, dtype="float32")
    bf16 = None  # loaded when a narrow result is not cached
    rows = read_rows("gsm8k", args.data)
    report = dict(
        model=args.model,
        steps=args.steps,
        rule="left",
        narrow=args.narrow,
        cpu=cpu_description(),
        data=os.path.basename(args.data),
        prompts={},
        layer_groups=[],
    )
    for i in map(int, args.rows.split(",")):
        name, prompt = f"gsm8k_row{i}", format_short(rows[i])
        batch = encode(f32.tokenizer, [prompt], context=f32.config.max_position_embeddings)
        tokens = batch.tokens[0, : int(batch.lengths[0])]
        results = {}
        for precision in ("float32", args.narrow):
            path = cache_path(args.cache, args.model, tokens, args.steps, precision)
            if precision != "float32" and bf16 is None and not os.path.exists(path):
                bf16 = NARROW[args.narrow](args.model)
            model = f32 if precision == "float32" else bf16
            results[precision] = run_ig(model, batch, args.steps, path, precision)
            print(
                f"{name} {precision}: {float(results[precision]['seconds']):.0f} s on {results[precision]['cpu']}",
                flush=True,
            )
        report["prompts"][name] = dict(
            tokens=len(tokens),
            prompt=prompt.question + prompt.answer,
            **compare(results["float32"], results[args.narrow], args.narrow),
        )
        report["layer_groups"] = layer_groups(report["prompts"], args.group, args.narrow)
        with atomic_write(args.out, "w") as f:
            json.dump(report, f, indent=1)
    print(table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
