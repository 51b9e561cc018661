"""How accurate is integrated gradients per rule and step count? The completeness gap and the
attribution error of every layer against a converged reference, with the gradient evaluations
each rule spends.

Rules: left Riemann (the published rule), midpoint and Gauss-Legendre at a fixed number of
steps, and the adaptive rule (`jaxdepth.analyses.ig.rules`) at several tolerances. The
reference is the adaptive rule at a tight tolerance with a large budget: its certificate
(sum_i |e_i| + |φ(1) - F(x)| <= tolerance |F(x) - F(b)|) says which layers converged, and the
attribution difference between it and the next looser tolerance says how far its per-token
values can still move (the certificate bounds only their sum).

The fixed rules are evaluated from shared nodes: every layer's φ and per-token integrand on the
uniform grid k / N (N = --max-steps) give left Riemann at every power of two n <= N (nodes
i / n) and midpoint at n <= N / 2 (nodes (i + 1/2) / n, odd grid points), and the
Gauss-Legendre nodes of each n <= --gauss-max are evaluated beside them. A fixed rule's time is
its evaluations times the measured time per evaluation of this sweep. The adaptive runs go from
the reference's tolerance to the loosest and share their nodes (`SharedNodes`: a looser run
evaluates only what a tighter one did not); an adaptive row's time is its evaluations times the
measured time per evaluation of the adaptive calls. Neither counts compilation.

    python experiments/ig_accuracy.py                  # the arithmetic prompt, N = 256 (2 CPU cores: ~30 min)
    python experiments/ig_accuracy.py --no-arithmetic --max-steps 1024 --gauss-max 64 \\
        --data ../shared/data/gsm8k_test_sample.jsonl --rows 0,1,3
    # the GSM8K table (2 CPU cores: ~3 h per row; an H200: ~4 min)

Per-layer evaluations are cached in the output folder (`--out`), so a killed run resumes where it
stopped; each prompt's finished rows are written to `--summaries` (a small JSON per prompt, kept
with the project, with the device its times were measured on) as soon as the prompt is done, and
a rerun with the same settings reads them back. `--only-finished` writes the table and figure
of the finished prompts without computing the others.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from benchmarking.machine import cpu_description
from jaxdepth.analyses.ig.rules import RULE_VERSION, AdaptiveRule, largest_call, quadrature, run_rule, summarise
from jaxdepth.core.batch import LengthBuckets
from jaxdepth.core.atomic import atomic_write
from jaxdepth.lab.case_study import ARITHMETIC_PROMPT
from jaxdepth.lab.sources import load
from jaxdepth.lab.prompts import encode, format_short, read_rows
from study_ig_paths import ig_inputs, path_points

TOLERANCES = (0.1, 0.03, 0.01)
REFERENCE_TOLERANCE = 2e-3
# Every adaptive run's budget per layer: the reference at 0.2% needs up to 1,471 evaluations on a
# layer of GSM8K row 0.
REFERENCE_BUDGET = 4096
GROUP = 32  # nodes per vmapped chunk of the fixed-rule sweep


def fixed_nodes(max_steps: int, gauss_max: int) -> tuple[np.ndarray, dict]:
    """All nodes the fixed rules need and, per (rule, steps), the indices of its nodes in them
    and its weights."""
    grid = np.arange(max_steps) / max_steps
    nodes, rules = [grid], {}
    n = 8
    while n <= max_steps:
        rules[("left", n)] = (np.arange(n) * (max_steps // n), np.full(n, 1.0 / n))
        if 2 * n <= max_steps:
            rules[("midpoint", n)] = ((2 * np.arange(n) + 1) * (max_steps // (2 * n)), np.full(n, 1.0 / n))
        n *= 2
    offset, n = max_steps, 8
    while n <= gauss_max:
        alphas, weights = quadrature("gauss", n)
        nodes.append(alphas)
        rules[("gauss", n)] = (offset + np.arange(n), weights)
        offset, n = offset + n, 2 * n
    return np.concatenate(nodes), rules


def evaluate_layers(args, x, b, inputs, config, nodes: np.ndarray, cache: str, desc: str, device: str):
    """φ `[L, n]` and the per-token integrand `[L, n, T]` of every layer at `nodes`, one layer per
    call (one compiled computation), each layer cached in `cache` as it finishes, and the seconds
    per gradient evaluation of the calls that did not compile (kept in the cache too, with the
    `device` they were measured on: times from another device are dropped, the values kept)."""
    L = config.num_layers
    stored = dict(np.load(cache)) if os.path.exists(cache) else {}
    if stored and not np.array_equal(stored.get("nodes"), nodes):
        stored = {}
    if str(stored.get("device", device)) != device:
        stored.pop("seconds"), stored.pop("timed_layers")
    stored["device"] = np.array(device)
    stored.setdefault("seconds", np.float64(0.0))
    stored.setdefault("timed_layers", np.int64(0))
    alphas = jnp.asarray(nodes, jnp.float32)
    compiled = False
    for layer in tqdm(range(L), desc=desc):
        if f"phi{layer}" in stored:
            continue
        start = time.perf_counter()
        phi, g = path_points(*args, x, b, inputs, layer=layer, alphas=alphas, config=config, chunk_size=GROUP)
        phi, g = np.asarray(phi), np.asarray(g)
        if compiled:  # the first call of a process compiles: not timed
            stored["seconds"] = stored["seconds"] + (time.perf_counter() - start)
            stored["timed_layers"] = stored["timed_layers"] + 1
        compiled = True
        stored.update({f"phi{layer}": phi, f"integrand{layer}": g, "nodes": nodes})
        with atomic_write(cache, "wb") as f:
            np.savez(f, **stored)
    phi = np.stack([stored[f"phi{layer}"] for layer in range(L)]).astype(np.float64)
    integrand = np.stack([stored[f"integrand{layer}"] for layer in range(L)]).astype(np.float64)
    timed = int(stored["timed_layers"])
    return phi, integrand, float(stored["seconds"]) / (timed * len(nodes)) if timed else float("nan")


class SharedNodes:
    """Every gradient evaluation of one prompt's adaptive runs, by (layer, α), kept in a file.

    The reference (the tightest tolerance) runs first; every run starts from the same partition
    and splits the largest errors first, so a looser run's nodes are nearly all nodes of the
    reference, and it reads them here instead of evaluating them again. A call is
    `run_rule`'s (`call(layer, alphas, grad, chunk) -> (phi, integrand)`): the nodes not held
    yet are evaluated in one call of the same size (the compiled computations are the rule's
    own). The file is rewritten every `save_every` seconds and by `save()`, so a killed run
    replays what it had (the rule is deterministic) and goes on from there. `seconds` and
    `evaluated` (slots of the calls, padding included) give the measured time per evaluation;
    a process's first call of each size compiles, and is not timed. Times measured on another
    device (`device`) are dropped when the file is read, the values kept.
    """

    def __init__(self, path: str, evaluate, device: str, save_every: float = 60.0):
        self.path, self.evaluate, self.device, self.save_every = path, evaluate, device, save_every
        self.values: dict[tuple[int, float], tuple[np.float32, np.ndarray]] = {}
        self.seconds, self.evaluated = 0.0, 0
        self._compiled: set[int] = set()
        if os.path.exists(path):
            stored = np.load(path)
            for layer, alpha, phi, g in zip(stored["layer"], stored["alpha"], stored["phi"], stored["integrand"]):
                self.values[int(layer), float(alpha)] = phi, g
            if str(stored["device"]) == device:
                self.seconds, self.evaluated = float(stored["seconds"]), int(stored["evaluated"])
        self._saved = time.monotonic()

    def __call__(self, layer: int, alphas: np.ndarray, grad: bool, chunk: int):
        if not grad:  # forward-only grid points: not shared
            return self.evaluate(layer, alphas, grad, chunk)
        missing = sorted({float(a) for a in alphas} - {a for (l, a) in self.values if l == layer})
        if missing:
            padded = np.asarray(missing + missing[-1:] * (len(alphas) - len(missing)), np.float32)
            start = time.perf_counter()
            phi, integrand = (np.asarray(v) for v in self.evaluate(layer, padded, grad, chunk))
            if len(padded) in self._compiled:
                self.seconds += time.perf_counter() - start
                self.evaluated += len(padded)
            self._compiled.add(len(padded))
            for a, p, g in zip(missing, phi, integrand):
                self.values[layer, a] = p, g
            if time.monotonic() - self._saved > self.save_every:
                self.save()
        held = [self.values[layer, float(a)] for a in alphas]
        return np.array([p for p, _ in held]), np.stack([g for _, g in held])

    def save(self) -> None:
        keys = sorted(self.values)
        with atomic_write(self.path, "wb") as f:
            np.savez(
                f,
                layer=np.array([l for l, _ in keys], np.int32),
                alpha=np.array([a for _, a in keys]),
                phi=np.array([self.values[k][0] for k in keys], np.float32),
                integrand=np.stack([self.values[k][1] for k in keys]),
                seconds=self.seconds,
                evaluated=self.evaluated,
                device=self.device,
            )
        self._saved = time.monotonic()

    @property
    def seconds_per_evaluation(self) -> float:
        return self.seconds / self.evaluated if self.evaluated else float("nan")


def errors(attributions: np.ndarray, f_input: float, f_baseline: np.ndarray, reference: np.ndarray) -> dict:
    """Per layer: the relative completeness gap |sum_t A - (F(x) - F(b))| / |F(x) - F(b)| and the
    attribution error max_t |A - A_ref| / max_t |A_ref|."""
    gap = np.abs(attributions.sum(-1) - (f_input - f_baseline)) / np.abs(f_input - f_baseline)
    error = np.abs(attributions - reference).max(-1) / np.abs(reference).max(-1)
    return dict(gap=gap, error=error)


def summary_row(rule: str, steps, evaluations: int, seconds: float, per_layer: dict, note: str = "") -> dict:
    gap, error = per_layer["gap"], per_layer["error"]
    return dict(
        rule=rule,
        steps=steps,
        evaluations=int(evaluations),
        seconds=float(seconds),
        max_gap=float(gap.max()),
        worst_gap_layer=int(gap.argmax()),
        layers_gap_over_1pct=int((gap > 0.01).sum()),
        max_error=float(error.max()),
        median_error=float(np.median(error)),
        note=note,
        gap=gap.tolist(),
        error=error.tolist(),
    )


def accuracy_of_prompt(
    model,
    batch,
    name: str,
    max_steps: int,
    gauss_max: int,
    tolerances,
    out: str,
    reference_tolerance: float = REFERENCE_TOLERANCE,
    budget: int = REFERENCE_BUDGET,
    model_name: str = "",
) -> dict:
    p, config, L = model.params, model.config, model.config.num_layers
    prompt = batch.prompt(0, LengthBuckets(4, geometric=False))  # every rule at this length: the least padding
    x, b, inputs, f_input = ig_inputs(p, prompt, config)
    f_input = float(f_input)
    device = device_description()  # what every time of this prompt is measured on

    # The caches' names say what their values depend on: the model, the prompt's tokens at their
    # padded length, and the adaptive rule's version; any other model or prompt starts afresh.
    key = hashlib.sha256(repr((model_name, prompt.tokens.tolist(), RULE_VERSION)).encode()).hexdigest()[:12]
    stem = os.path.join(out, f"{name}_{key}")
    shared = SharedNodes(
        f"{stem}_adaptive_nodes.npz",
        lambda layer, alphas, grad, chunk: path_points(
            p, prompt, x, b, inputs, layer=layer, alphas=alphas, config=config, grad=grad, chunk_size=chunk
        ),
        device,
    )

    def adaptive(tolerance, on_layer):
        """The adaptive rule's result, cached in `out` (a rerun resumes), its nodes shared."""
        path = f"{stem}_adaptive_{tolerance:g}_{budget}.npz"
        if os.path.exists(path):
            return dict(np.load(path))
        rule = AdaptiveRule(tolerance=tolerance, max_evaluations=budget)
        rules = run_rule(
            shared,
            range(L),
            f_input,
            rule,
            largest=largest_call(config, prompt.tokens.shape[1]),
            on_done=on_layer,
        )
        shared.save()
        r = summarise(rules)
        with atomic_write(path, "wb") as f:
            np.savez(f, **{k: np.asarray(v) for k, v in r.items()})
        return r

    nodes, rules = fixed_nodes(max_steps, gauss_max)
    phi, integrand, per_eval = evaluate_layers(
        (p, prompt), x, b, inputs, config, nodes, f"{stem}_nodes.npz", f"{name}: fixed-rule nodes (layers)", device
    )
    adaptive_runs = {}
    with tqdm(total=L * (len(tolerances) + 1), desc=f"{name}: adaptive runs (layers)") as bar:
        for tolerance in [reference_tolerance] + list(tolerances):
            adaptive_runs[tolerance] = adaptive(tolerance, bar.update)
    reference = adaptive_runs[reference_tolerance]
    adaptive_per_eval = shared.seconds_per_evaluation
    ref = reference["attributions"].astype(np.float64)
    f_baseline = reference["f_baseline"]
    rows = []

    if not np.allclose(phi[:, 0], f_baseline, rtol=1e-4, atol=1e-6):
        raise RuntimeError("F(b) of the node sweep and of the adaptive rule disagree")
    for rule, n in sorted(rules):
        index, weights = rules[(rule, n)]
        attributions = np.einsum("k,lkt->lt", weights, integrand[:, index])
        rows.append(
            summary_row(
                rule,
                n,
                n * L,
                n * L * per_eval,
                errors(attributions, f_input, f_baseline, ref),
                "time = evaluations x measured seconds per evaluation",
            )
        )

    adaptive_rows = {}
    for tolerance in tolerances:
        r = adaptive_runs[tolerance]
        evaluations = r["evaluations"].sum()
        adaptive_rows[tolerance] = summary_row(
            "adaptive",
            tolerance,
            evaluations,
            evaluations * adaptive_per_eval,
            errors(r["attributions"].astype(np.float64), f_input, f_baseline, ref),
            f"{int(r['converged'].sum())}/{L} layers converged",
        )
    rows += adaptive_rows.values()
    reference_row = summary_row(
        "adaptive (reference)",
        reference_tolerance,
        reference["evaluations"].sum(),
        reference["evaluations"].sum() * adaptive_per_eval,
        errors(ref, f_input, f_baseline, ref),
        f"{int(reference['converged'].sum())}/{L} layers converged",
    )
    return dict(
        prompt=name,
        tokens=int(prompt.valid.sum()),
        device=device,
        f_input=f_input,
        f_baseline=f_baseline.tolist(),
        seconds_per_evaluation=per_eval,
        adaptive_seconds_per_evaluation=adaptive_per_eval,
        reference=dict(
            tolerance=reference_tolerance,
            budget=budget,
            converged=reference["converged"].tolist(),
            evaluations=reference["evaluations"].tolist(),
            bound=(reference["bound"] / np.abs(f_input - f_baseline)).tolist(),
            # How far the reference's per-token values can still move: its difference from
            # the next looser tolerance, relative to max |A_ref| per layer.
            self_consistency=adaptive_rows[min(tolerances)]["error"] if tolerances else None,
        ),
        rows=rows + [reference_row],
    )


def device_description() -> str:
    """What the times were measured on: the CPU model and its vector extensions, or the
    accelerator's kind (e.g. 'NVIDIA H200')."""
    device = jax.devices()[0]
    return cpu_description() if device.platform == "cpu" else device.device_kind


def markdown(report: dict) -> str:
    lines = []
    for prompt in report["prompts"]:
        lines += [
            f"### {prompt['prompt']} ({prompt['tokens']} tokens, F(x) = {prompt['f_input']:.3f}; "
            f"times on {prompt.get('device', 'an unrecorded device')})",
            "",
            "| rule | steps / tolerance | gradient evaluations | time (s) | largest gap (layer) "
            "| layers with gap > 1% | largest attribution error | median attribution error |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in prompt["rows"]:
            lines.append(
                f"| {r['rule']} | {r['steps']} | {r['evaluations']:,} | {r['seconds']:.0f} "
                f"| {100 * r['max_gap']:.2f}% ({r['worst_gap_layer']}) | {r['layers_gap_over_1pct']} "
                f"| {100 * r['max_error']:.2f}% | {100 * r['median_error']:.2f}% |"
            )
        lines.append("")
    return "\n".join(lines)


def figure(report: dict):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2 * len(report["prompts"])), layout="constrained")
    axes = fig.subplots(len(report["prompts"]), 2, squeeze=False)
    styles = {"left": "o-", "midpoint": "s-", "gauss": "^-", "adaptive": "D-"}
    for (gap_ax, err_ax), prompt in zip(axes, report["prompts"]):
        for rule, style in styles.items():
            rows = [r for r in prompt["rows"] if r["rule"] == rule]
            if not rows:
                continue
            evaluations = [r["evaluations"] for r in rows]
            gap_ax.plot(evaluations, [max(r["max_gap"], 1e-6) for r in rows], style, label=rule, ms=4)
            err_ax.plot(evaluations, [max(r["max_error"], 1e-6) for r in rows], style, label=rule, ms=4)
        published = next((r for r in prompt["rows"] if r["rule"] == "left" and r["steps"] == 256), None)
        for ax, key, label in (
            (gap_ax, "max_gap", "largest |completeness gap| / |F(x) - F(b)|"),
            (err_ax, "max_error", "largest attribution error (of max |A_ref|)"),
        ):
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("gradient evaluations per prompt (all layers)")
            ax.set_ylabel(label)
            ax.axhline(0.01, color="0.6", lw=0.8, ls="--")
            if published is not None:
                ax.plot(
                    [published["evaluations"]], [max(published[key], 1e-6)], "k*", ms=12, label="published (left, 256)"
                )
            ax.grid(True, which="both", alpha=0.3)
        gap_ax.set_title(f"{prompt['prompt']}: worst layer's completeness gap")
        err_ax.set_title("worst layer's attribution error against the reference")
        gap_ax.legend(fontsize=8)
    return fig


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument(
        "--max-steps",
        type=int,
        default=256,
        help="left Riemann up to this many steps, midpoint up to half of it (a power of two)",
    )
    parser.add_argument("--gauss-max", type=int, default=32, help="Gauss-Legendre up to this many steps")
    parser.add_argument("--tolerances", default=",".join(map(str, TOLERANCES)), help="the adaptive rule's tolerances")
    parser.add_argument("--reference-tolerance", type=float, default=REFERENCE_TOLERANCE)
    parser.add_argument(
        "--budget",
        type=int,
        default=REFERENCE_BUDGET,
        help="gradient evaluations per layer at most, for every adaptive run",
    )
    parser.add_argument("--no-arithmetic", action="store_true", help="leave out the arithmetic prompt")
    parser.add_argument("--data", help="GSM8K JSONL: its --rows join the prompts")
    parser.add_argument("--rows", default="0,1,2", help="GSM8K rows (with --data)")
    parser.add_argument("--out", default="results/ig_accuracy", help="the evaluation caches (large)")
    parser.add_argument(
        "--summaries",
        default="experiments/results/ig_accuracy",
        help="each prompt's finished rows, the table, its figure",
    )
    parser.add_argument(
        "--only-finished",
        action="store_true",
        help="write the table and figure of the prompts already finished (with these settings) and compute nothing",
    )
    args = parser.parse_args(argv)
    if args.max_steps < 16 or args.max_steps & (args.max_steps - 1):
        parser.error("--max-steps must be a power of two >= 16")

    model = None if args.only_finished else load(args.model)
    prompts = [] if args.no_arithmetic else [("arithmetic", ARITHMETIC_PROMPT)]
    if args.data:
        rows = read_rows("gsm8k", args.data)
        prompts += [(f"gsm8k_row{i}", format_short(rows[int(i)])) for i in args.rows.split(",")]
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.summaries, exist_ok=True)
    tolerances = sorted((float(t) for t in args.tolerances.split(",")), reverse=True)
    report = dict(model=args.model, max_steps=args.max_steps, gauss_max=args.gauss_max, prompts=[])
    for name, prompt in prompts:
        settings = dict(
            model=args.model,
            prompt=prompt.question + prompt.answer,
            max_steps=args.max_steps,
            gauss_max=args.gauss_max,
            tolerances=tolerances,
            reference_tolerance=args.reference_tolerance,
            budget=args.budget,
        )
        summary = os.path.join(args.summaries, f"{name}.json")
        done = json.load(open(summary)) if os.path.exists(summary) else None
        if done is not None and done.get("settings") != settings:
            done = None
        if done is None and args.only_finished:
            print(f"{name}: not finished with these settings, left out")
            continue
        if done is None:
            batch = encode(model.tokenizer, [prompt], context=model.config.max_position_embeddings)
            done = dict(
                accuracy_of_prompt(
                    model,
                    batch,
                    name,
                    args.max_steps,
                    args.gauss_max,
                    tolerances,
                    args.out,
                    args.reference_tolerance,
                    args.budget,
                    model_name=args.model,
                ),
                settings=settings,
            )
            with atomic_write(summary, "w") as f:
                json.dump(done, f, indent=1)
        report["prompts"].append(done)
        print(markdown(dict(prompts=report["prompts"][-1:])))
    if not report["prompts"]:
        print("no prompt is finished with these settings: nothing to write")
        return 1
    with atomic_write(os.path.join(args.summaries, "ig_accuracy.json"), "w") as f:
        json.dump(report, f, indent=1)
    with atomic_write(os.path.join(args.summaries, "ig_accuracy.md"), "w") as f:
        f.write(markdown(report))
    fig = figure(report)
    with atomic_write(os.path.join(args.summaries, "ig_accuracy.png"), "wb") as f:
        fig.savefig(f, format="png", dpi=130)
    print(f"wrote {args.summaries}/ig_accuracy.json, .md and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
