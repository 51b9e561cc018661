"""Benchmark: jaxdepth's edge attribution against the EAP-IG package's formulation in PyTorch
(`experiments/reference_edges_torch.py`) on the embedded model, the same pairs and the same
machine, in one run.

The workload: `--pairs` addition pairs (`jaxdepth.lab.circuit_tasks.addition_pairs`), logit
difference; EAP for every edge; EAP-IG over the inputs at `--steps` steps (α = k / steps, the
package's rule); exact patching of the `--top` edges of the EAP-IG scores, each edge alone; the
greedy search for the fewest edges reaching 80% faithfulness (`--target`) from the EAP-IG
scores, both sides evaluating the same geometric grid of sizes and its refinement, one patched
run per size; EAP-IG with the MLP hidden units' scores (node scores are sums of edge scores, in
every phase); EAP-IG with every edge's score at every position.
Each implementation runs in a process of its own, so that each reports its own peak memory
(resident set size, the model included); model loading is not timed. jaxdepth's times are
given for the first call (compilation included) and for a second call (compiled;
`--compiled-calls`); the reference has nothing to compile. The results of the two are
compared (the largest difference relative to the largest score or effect).

    python experiments/benchmark_edges.py                 # the workload of the issue, ~15 min on 2 cores
    python experiments/benchmark_edges.py --pairs 2 --steps 2 --top 4   # a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

PHASES = ("eap", "eap_ig", "patching", "greedy", "neurons", "positions")
GRID = 12  # the sizes `find_circuit` evaluates at once, and its refinement


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--pairs", type=int, default=20)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--top", type=int, default=100)
    parser.add_argument("--target", type=float, default=0.8, help="the greedy circuit's faithfulness")
    parser.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES), help="the phases to run (all)")
    parser.add_argument(
        "--compiled-calls",
        type=int,
        default=1,
        help="jaxdepth's calls of each computation after its first (compiling) one; the last gives its compiled "
        "time (0: the first call only, no compiled time)",
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=os.cpu_count(),
        help="the reference's torch intra-op threads (default: every core, as jax uses)",
    )
    parser.add_argument("--out", default=None, help="write the report as JSON here too")
    parser.add_argument("--impl", choices=("jax", "torch"), help=argparse.SUPPRESS)  # one side, in its process
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.compiled_calls < 0 or args.torch_threads < 1:
        parser.error("--compiled-calls must be at least 0 and --torch-threads at least 1")
    return args


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


def _task(args):
    from jaxdepth.lab.circuit_tasks import addition_pairs
    from jaxdepth.lab.sources import load

    model = load(args.model)
    return model, addition_pairs(model.tokenizer, args.pairs)


def run_jax(args) -> dict:
    from jaxdepth.analyses.edges.circuit import CircuitSearch, find_circuit
    from jaxdepth.analyses.edges.pairs import logit_difference
    from jaxdepth.analyses.edges.patching import edge_effects
    from jaxdepth.analyses.edges.scores import Scoring, edge_attribution, ranked_edges
    from jaxdepth.analyses.ig.rules import FixedRule

    model, task = _task(args)
    pairs = task.prompt_pairs()
    p, c = model.params, model.config
    ig = lambda detail=(): edge_attribution(  # noqa: E731
        p, pairs, c, logit_difference, Scoring("eap-ig-inputs", FixedRule(steps=args.steps), detail=detail)
    )
    found = {}  # the EAP-IG scores the patching and greedy phases start from, and their top edges

    def searched():  # the EAP-IG phase's scores, or computed untimed where it is not a phase
        if "eap_ig" not in found:
            found["eap_ig"] = ig()
        return found["eap_ig"]

    def top():
        return ranked_edges(searched().scores.sum(0), model_graph(c))[: args.top]

    def keep_scores(r):
        found["eap_ig"] = r
        return {"eap_ig": r.scores.sum(0)}

    phases = {
        "eap": (lambda: edge_attribution(p, pairs, c, logit_difference), lambda r: {"eap": r.scores.sum(0)}),
        "eap_ig": (ig, keep_scores),
        "patching": (lambda: edge_effects(p, pairs, c, logit_difference, top()), lambda r: {"effects": r}),
        "greedy": (
            lambda: find_circuit(
                p, pairs, c, logit_difference, searched(), CircuitSearch(target=args.target, order="greedy")
            ),
            lambda r: {"greedy": np.array([len(r.edges), r.faithfulness])},
        ),
        "neurons": (lambda: ig(detail=["neurons"]), lambda r: {"neurons": r.neuron_scores.sum(0)}),
        "positions": (lambda: ig(detail=["positions"]), lambda r: {"positions": r.position_scores.sum(0)}),
    }
    if "patching" in args.phases or "greedy" in args.phases:
        searched()  # before the timed phases when the EAP-IG phase does not run
    times, results = {}, {}
    for name in args.phases:
        run, keep = phases[name]
        times[name] = [_timed(run) for _ in range(1 + args.compiled_calls)]
        results.update(keep(times[name][-1][1]))
    if found:
        scores = found["eap_ig"]
        results.update(top=top(), scores_mean=scores.mean, f=np.array([scores.f_clean.mean(), scores.f_corrupt.mean()]))
    np.savez(os.path.join(args.work, "jax.npz"), **results)
    return {
        "times": {k: [t for t, _ in v] for k, v in times.items()},
        "peak_rss_gb": peak_rss_gb(),
        "prefix": pairs.shared_prefix(),
        "length": int(pairs.clean.shape[1]),
    }


def model_graph(config):
    from jaxdepth.analyses.edges.graph import EdgeGraph

    return EdgeGraph.of(config)


def run_torch(args) -> dict:
    import torch

    from reference_edges_torch import EdgeReference

    torch.set_num_threads(args.torch_threads)
    model, task = _task(args)
    pairs = task.prompt_pairs()
    ref = EdgeReference(model.params, model.config)
    as_torch = lambda x, dtype: torch.as_tensor(np.array(x), dtype=dtype)
    inputs = (
        as_torch(pairs.clean, torch.long),
        as_torch(pairs.corrupt, torch.long),
        as_torch(pairs.valid, torch.bool),
        as_torch(pairs.last, torch.long),
        as_torch(pairs.labels, torch.long),
    )
    jax_side = np.load(os.path.join(args.work, "jax.npz"))
    graph = model_graph(model.config)
    masks = []
    for w, r in jax_side["top"] if "top" in jax_side else ():
        mask = np.zeros(graph.edge_mask.shape, bool)
        mask[w, r] = True
        masks.append(mask)

    def patching():
        with torch.no_grad():
            f_clean = ref.patched(*inputs, [np.zeros_like(graph.edge_mask)])[0]
        return f_clean[None] - ref.patched(*inputs, masks)

    detail = lambda **kw: ref.attribute(*inputs, steps=args.steps, **kw)  # noqa: E731
    phases = {
        "eap": (lambda: ref.eap(*inputs).numpy(), "eap"),
        "eap_ig": (lambda: ref.eap(*inputs, steps=args.steps).numpy(), "eap_ig"),
        "patching": (patching, "effects"),
        "greedy": (lambda: greedy_circuit(ref, inputs, jax_side, graph, args.target), "greedy"),
        "neurons": (lambda: detail(neurons=True)["neurons"].numpy(), "neurons"),
        "positions": (lambda: detail(per_position=True)["scores"].numpy(), "positions"),
    }
    times, results = {}, {}
    for name in args.phases:
        run, key = phases[name]
        times[name], results[key] = _timed(run)
    np.savez(os.path.join(args.work, "torch.npz"), **results)
    return {"times": {k: [v] for k, v in times.items()}, "peak_rss_gb": peak_rss_gb()}


def greedy_circuit(ref, inputs, jax_side, graph, target: float) -> np.ndarray:
    """`[size, faithfulness]` of the fewest greedy edges reaching `target`: the package's
    `apply_greedy` and one `evaluate_graph` per size, on the sizes `find_circuit` evaluates (a
    geometric grid, then a finer one below the first size that reached). The greedy order is
    of jaxdepth's mean EAP-IG scores, so that both sides patch the same circuits."""
    import torch

    scores = jax_side["scores_mean"]
    f_clean, f_corrupt = jax_side["f"]
    total = int(graph.edge_mask.sum())
    order = ref.greedy(scores, total)

    def curve(sizes):
        complements = []
        for n in sizes:
            kept = np.zeros(graph.edge_mask.shape, bool)
            kept[order[:n, 0], order[:n, 1]] = True
            complements.append(graph.edge_mask & ~kept)
        with torch.no_grad():
            f = ref.patched(*inputs, complements)
        return (f.mean(axis=1) - f_corrupt) / (f_clean - f_corrupt)

    sizes = np.unique(np.round(np.geomspace(1, total, GRID)).astype(int))
    faithful = curve(sizes)
    first = int(np.flatnonzero(faithful >= target)[0])
    chosen, reached = int(sizes[first]), float(faithful[first])
    if first > 0:
        finer = np.unique(np.linspace(sizes[first - 1], chosen, GRID).astype(int))[1:-1]
        hits = np.flatnonzero(curve(finer) >= target) if len(finer) else []
        if len(hits):
            chosen = int(finer[hits[0]])
            reached = float(curve(finer[hits[0] : hits[0] + 1])[0])
    return np.array([chosen, reached])


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def agreement(work: str, phases) -> dict:
    """The largest difference of the two sides' results relative to the largest value."""
    a, b = np.load(os.path.join(work, "jax.npz")), np.load(os.path.join(work, "torch.npz"))
    rel = lambda x, y: float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-30))
    keys = {"patching": "effects"}  # the greedy phase compares the circuit's size and faithfulness
    return {phase: rel(a[keys.get(phase, phase)], b[keys.get(phase, phase)]) for phase in phases}


def report(args, jax_side: dict, torch_side: dict, agree: dict) -> dict:
    from benchmarking.machine import cpu_description

    rows = []
    for phase in args.phases:
        first, *compiled = jax_side["times"][phase]
        warm = compiled[-1] if compiled else None  # None: --compiled-calls 0
        ref = torch_side["times"][phase][0]
        rows.append({"phase": phase, "jax_first_s": first, "jax_s": warm, "torch_s": ref, "agreement": agree[phase]})
    total = {
        k: None if any(r[k] is None for r in rows) else sum(r[k] for r in rows)
        for k in ("jax_first_s", "jax_s", "torch_s")
    }
    names = {
        "eap": "EAP, every edge",
        "eap_ig": f"EAP-IG inputs, {args.steps} steps",
        "patching": f"exact patching, top {args.top} edges",
        "greedy": f"greedy circuit to {args.target:.0%} faithful",
        "neurons": "EAP-IG with neuron scores",
        "positions": "EAP-IG per position",
    }
    print(
        f"\nEdge attribution on {args.model}: {args.pairs} addition pairs of {jax_side['length']} tokens "
        f"(shared prefix {jax_side['prefix']}); CPU: {cpu_description()}, {os.cpu_count()} cores"
    )
    print(f"{'':34} {'jaxdepth (1st call)':>20} {'jaxdepth':>10} {'reference':>10} {'speed-up':>9} {'agreement':>10}")
    for r in rows + [dict(phase="total", **total, agreement=float("nan"))]:
        name = names.get(r["phase"], "total")
        compiled, speedup = (
            ("-", "-") if r["jax_s"] is None else (f"{r['jax_s']:.1f}s", f"{r['torch_s'] / r['jax_s']:.1f}x")
        )
        print(
            f"{name:34} {r['jax_first_s']:19.1f}s {compiled:>10} {r['torch_s']:9.1f}s "
            f"{speedup:>9} {r['agreement']:10.1e}"
        )
    first_calls = total["torch_s"] / total["jax_first_s"]
    print(f"speed-up of the whole workload, first calls (compilation included): {first_calls:.1f}x")
    print(
        f"peak memory (resident set, model included): jaxdepth {jax_side['peak_rss_gb']:.2f} GB, "
        f"reference {torch_side['peak_rss_gb']:.2f} GB"
    )
    return {"cpu": cpu_description(), "rows": rows, "total": total, "jax": jax_side, "torch": torch_side}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.impl:
        out = run_jax(args) if args.impl == "jax" else run_torch(args)
        print("RESULT " + json.dumps(out))
        return 0
    from benchmark import require_reference

    if require_reference() is None:
        return 2
    with tempfile.TemporaryDirectory() as work:
        sides = {}
        for impl in ("jax", "torch"):
            command = [sys.executable, os.path.abspath(__file__), "--impl", impl, "--work", work]
            command += [
                "--model",
                args.model,
                "--pairs",
                str(args.pairs),
                "--steps",
                str(args.steps),
                "--top",
                str(args.top),
                "--target",
                str(args.target),
                "--phases",
                *args.phases,
                "--compiled-calls",
                str(args.compiled_calls),
                "--torch-threads",
                str(args.torch_threads),
            ]
            print(f"running {impl} ...", flush=True)
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                print(done.stdout + done.stderr, file=sys.stderr)
                return done.returncode
            sides[impl] = json.loads(done.stdout.split("RESULT ", 1)[1])
        result = report(args, sides["jax"], sides["torch"], agreement(work, args.phases))
    if args.out:
        from jaxdepth.core.atomic import atomic_write

        with atomic_write(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
