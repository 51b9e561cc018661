"""Which integrated-gradients rule should the study use by default? The wall-clock time, end to
end, of the published rule (left Riemann, 256 steps) against the adaptive rule at a 1%
certified tolerance, on whole GSM8K prompts, every layer, through the study's own functions
(`integrated_gradients_of_answers` with the left and the adaptive rule).

Each (prompt, rule) runs after its computations are compiled (compilation is timed apart), on a
quiet machine (it waits until other processes use under a fifth of a core, and records how much
they used while it ran). Each result is saved as it finishes, so a rerun skips what is done.

    python experiments/ig_default_rule.py --data ../shared/data/gsm8k_test_sample.jsonl --rows 0,1,3

On 2 CPU cores (an Intel Xeon with AVX-512) the three rows take about 88 minutes with the
published rule and 59 with the adaptive rule (1.27x, 1.67x and 1.89x; docs/performance.md).
Per layer, the fixed rule's seconds and the adaptive rule's evaluations are kept too: the report
compares the adaptive rule's time with what its evaluations cost at the fixed rule's speed on
the same layers.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Optional

import jax
import numpy as np

from benchmarking.machine import CpuMeter, cpu_description, wait_quiet
from jaxdepth.analyses import integrated_gradients as ig
from jaxdepth.analyses.ig import Execution, rules as ig_rules
from jaxdepth.core.batch import LengthBuckets
from jaxdepth.core.atomic import atomic_write
from jaxdepth.core.sweep import auto_chunk_size
from jaxdepth.lab.prompts import encode, format_short, read_rows
from jaxdepth.lab.sources import load
import study_ig_paths as paths

# The adaptive rule runs with a budget of 2048 evaluations per layer, the one its recorded results
# were measured with (the library's default is now the fixed rule's 256: never dearer); the
# "adaptive-1%-budget-512" rule left early layers of GSM8K prompts uncertified.
RULES = {
    "left-256": dict(rule="left", steps=256),
    "adaptive-1%": dict(rule="adaptive", tolerance=0.01, max_evaluations=2048),
    "adaptive-1%-budget-512": dict(rule="adaptive", tolerance=0.01, max_evaluations=512),
}
DEFAULT_RULES = ("left-256", "adaptive-1%")


def rule_of(spec: dict) -> ig_rules.Rule:
    """The rule value of a spec of `RULES` (the specs stay dicts: the report records them as its
    runs' settings)."""
    return ig_rules.rule_of(
        spec["rule"], spec.get("steps", ig_rules.DEFAULT_STEPS), spec.get("tolerance"), spec.get("max_evaluations")
    )


def compile_rule(model, batch, spec: dict) -> float:
    """Compile what `run_rule` will run on `batch` (its last layer only: no suffix, cheap);
    returns the seconds it took."""
    p, config = model.params, model.config
    prompt = batch.prompt(0, LengthBuckets(4, geometric=False))
    start = time.perf_counter()
    x, b, inputs, _ = paths.ig_inputs(p, prompt, config)
    last = config.num_layers - 1
    rule = rule_of(spec)
    if isinstance(rule, ig_rules.AdaptiveRule):
        largest = ig_rules.largest_call(config, prompt.tokens.shape[1])
        for size in sorted({s for n in range(1, 4 * largest) for s in ig_rules.call_sizes(n, largest)}):
            jax.block_until_ready(
                paths.path_points(
                    p, prompt, x, b, inputs, layer=last, alphas=np.linspace(0, 1, size), config=config, chunk_size=size
                )
            )
    else:
        alphas, weights = rule.nodes()
        chunk = auto_chunk_size(config, prompt.tokens.shape[1], rule.steps, grad=True)
        jax.block_until_ready(
            paths.ig_of_layer(
                p,
                prompt,
                jax.numpy.int32(last),
                paths.study_path(x, b, inputs, last, "layer"),
                config,
                alphas=jax.numpy.asarray(alphas, jax.numpy.float32),
                weights=jax.numpy.asarray(weights, jax.numpy.float32),
                chunk_size=chunk,
            )
        )
    return time.perf_counter() - start


def run_rule(model, batch, spec: dict) -> dict:
    """One timed run of a rule on a one-prompt `batch`: seconds, evaluations and accuracy; per
    layer, the fixed rule's seconds (layer 0's include the clean forward before it) and the
    adaptive rule's evaluations."""
    p, config = model.params, model.config
    if len(batch) != 1:
        raise ValueError(f"one prompt at a time, got {len(batch)}")
    finished = []  # the fixed rule's layers, as they finish
    rule = rule_of(spec)
    with CpuMeter() as meter:
        if isinstance(rule, ig_rules.AdaptiveRule):
            r = ig.integrated_gradients_of_answers(p, batch, config, rule=rule)
            evaluations, converged = int(r.evaluations.sum()), int(r.converged.sum())
            per_layer = dict(layer_evaluations=r.evaluations[0].tolist())
        else:
            start = time.perf_counter()
            on_layer = lambda: finished.append(time.perf_counter())  # noqa: E731
            r = ig.integrated_gradients_of_answers(
                p, batch, config, rule=rule, execution=Execution(progress=True, on_layer=on_layer)
            )
            evaluations, converged = rule.steps * config.num_layers, None
            per_layer = dict(layer_seconds=np.diff([start] + finished).tolist())
    delta = np.abs(r.f_input[0] - r.f_baseline[0].astype(np.float64))
    relative_gap = np.abs(r.gap[0]) / delta
    return dict(
        seconds=meter.wall,
        other_processes_cores=meter.others,
        evaluations=evaluations,
        ms_per_evaluation=1000 * meter.wall / evaluations,
        converged_layers=converged,
        largest_relative_gap=float(relative_gap.max()),
        median_relative_gap=float(np.median(relative_gap)),
        layers_with_gap_over_1pct=int((relative_gap > 0.01).sum()),
        **per_layer,
    )


def layer_matched_seconds(fixed: dict, adaptive: dict) -> Optional[float]:
    """What the adaptive rule's evaluations would cost at the fixed rule's measured cost per
    evaluation of each layer (an evaluation of an early layer runs more layers): the time the
    adaptive rule would take at the fixed rule's speed, on the same prompt, layers and machine."""
    if "layer_seconds" not in fixed or "layer_evaluations" not in adaptive:
        return None
    steps = fixed["evaluations"] / len(fixed["layer_seconds"])
    return float(sum(n * s / steps for n, s in zip(adaptive["layer_evaluations"], fixed["layer_seconds"])))


def markdown(report: dict) -> str:
    lines = [
        f"CPU: {report['cpu']}",
        "",
        "| prompt | tokens | rule | wall-clock (s) | gradient evaluations | ms / evaluation "
        "| largest gap | layers with gap > 1% | layers certified | speed-up over left-256 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in report["prompts"].items():
        base = row["rules"].get("left-256", {}).get("seconds")
        for rule, r in row["rules"].items():
            speedup = f"{base / r['seconds']:.2f}x" if base else ""
            certified = "-" if r["converged_layers"] is None else r["converged_layers"]
            lines.append(
                f"| {name} | {row['tokens']} | {rule} | {r['seconds']:.0f} | {r['evaluations']:,} "
                f"| {r['ms_per_evaluation']:.0f} | {100 * r['largest_relative_gap']:.2f}% "
                f"| {r['layers_with_gap_over_1pct']} | {certified} | {speedup} |"
            )
    for name, row in report["prompts"].items():
        fixed = row["rules"].get("left-256")
        for rule, r in row["rules"].items():
            matched = layer_matched_seconds(fixed, r) if fixed and rule != "left-256" else None
            if matched:
                lines.append(
                    f"\n{name}, {rule}: {r['seconds']:.0f} s against {matched:.0f} s for the same "
                    f"evaluations at left-256's measured cost per evaluation of each layer "
                    f"({r['seconds'] / matched:.2f}x the fixed rule's time per evaluation)"
                )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--data", required=True, help="GSM8K JSONL (e.g. ../shared/data/gsm8k_test_sample.jsonl)")
    parser.add_argument("--rows", default="0,1,3")
    parser.add_argument("--rules", default=",".join(DEFAULT_RULES), help=f"among {', '.join(RULES)}")
    parser.add_argument("--out", default="experiments/results/ig_default_rule.json")
    parser.add_argument(
        "--quiet-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for a quiet machine before each run (0: do not wait, and record quiet as unknown)",
    )
    args = parser.parse_args(argv)
    unknown = sorted(set(args.rules.split(",")) - set(RULES))
    if unknown:
        parser.error(f"unknown rule(s) {', '.join(unknown)}: choose among {', '.join(RULES)}")

    report = json.load(open(args.out)) if os.path.exists(args.out) else {"prompts": {}}
    for key, value in (("cpu", cpu_description()), ("model", args.model)):
        report[key] = report.get(key, value)
        if report[key] != value:
            parser.error(f"{args.out} was measured with {key} {report[key]!r}, not {value!r}: give another --out")
    model = load(args.model)
    rows = read_rows("gsm8k", args.data)
    for i in map(int, args.rows.split(",")):
        name, prompt = f"gsm8k_row{i}", format_short(rows[i])
        batch = encode(model.tokenizer, [prompt], context=model.config.max_position_embeddings)
        text = prompt.question + prompt.answer
        if report["prompts"].get(name, {}).get("prompt") != text:  # new, or another data file's row
            report["prompts"][name] = {"tokens": int(batch.lengths[0]), "prompt": text, "rules": {}}
        entry = report["prompts"][name]
        for rule in args.rules.split(","):
            spec = RULES[rule]
            if entry["rules"].get(rule, {}).get("settings") == spec:
                continue  # measured with these settings: kept
            compile_seconds = compile_rule(model, batch, spec)
            # quiet: whether the machine became quiet before the run; None when it was not waited for
            quiet = wait_quiet(args.quiet_timeout) is not None if args.quiet_timeout > 0 else None
            result = run_rule(model, batch, spec)
            entry["rules"][rule] = dict(result, settings=spec, compile_seconds=compile_seconds, quiet=quiet)
            with atomic_write(args.out, "w") as f:
                json.dump(report, f, indent=1)
            print(f"{name} {rule}: {result['seconds']:.0f} s, {result['evaluations']} evaluations", flush=True)
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
