"""AtP* against exact node patching on the embedded model: how many of the nodes that matter each
estimate misses (`jaxdepth.analyses.edges.atp_star`), for AtP, AtP with the QK fix (AtP+QK) and
AtP* (the QK fix and GradDrop).

The workload: `--pairs` addition pairs (`jaxdepth.lab.circuit_tasks.addition_pairs`), logit
difference; every node of each kind at the positions after the pairs' shared prefix (before it
the clean and corrupt prompts agree, so every node there has an exact effect and estimate of 0),
each patched alone and exactly (`node_effects`, one vmapped call per chunk). A node's size is its
mean |effect| over the pairs (for an estimate, the mean |estimate|: GradDrop's are magnitudes
already). Reported per kind and method: the false-negative rate at k (`missed_nodes`: the share
of the k largest exact nodes not among the k largest estimated), and the largest exact effect
among the nodes missed at k = 10. The exact effects are saved (`--cache`) and reused by a rerun.

    python experiments/atp_star_false_negatives.py                          # ~25 min on 2 cores
    python experiments/atp_star_false_negatives.py --pairs 1 --kinds mlps   # a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

METHODS = ("AtP", "AtP+QK", "AtP*")  # of `atp_star`'s (`ATP_METHODS`), the ones compared
KS = (10, 50)


def parse_args(argv=None):
    from jaxdepth.analyses.edges.atp_star import NODE_KINDS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument(
        "--kinds", nargs="+", default=["queries", "keys", "values", "heads", "mlps"], choices=NODE_KINDS
    )
    parser.add_argument("--cache", default=None, help="an .npz of the exact effects: read if it is there, else written")
    parser.add_argument("--out", default=None, help="write the report as JSON here too")
    return parser.parse_args(argv)


def nodes_after(kind: str, config, seq_len: int, start: int) -> np.ndarray:
    """Every node of `kind` (`node_shape`'s index) whose position is `start` or later."""
    from jaxdepth.analyses.edges.atp_star import NODE_INDEX, node_shape

    shape = node_shape(kind, config, seq_len)
    nodes = np.stack(np.unravel_index(np.arange(int(np.prod(shape))), shape), axis=1)
    if "position" in NODE_INDEX[kind]:
        nodes = nodes[nodes[:, NODE_INDEX[kind].index("position")] >= start]
    return nodes


def exact_effects(model, pairs, kinds, cache) -> dict:
    """`{kind: (nodes [n, k], exact [n, B])}`, from `cache` where it holds them."""
    from jaxdepth.analyses.edges import logit_difference, node_effects
    from jaxdepth.core.atomic import atomic_write
    from jaxdepth.core.execution import Execution

    saved = dict(np.load(cache)) if cache and os.path.exists(cache) else {}
    out = {}
    for kind in kinds:
        nodes = nodes_after(kind, model.config, pairs.clean.shape[1], pairs.shared_prefix())
        if f"{kind}_effects" in saved and np.array_equal(saved[f"{kind}_nodes"], nodes):
            out[kind] = (nodes, saved[f"{kind}_effects"])
            continue
        start = time.perf_counter()
        execution = Execution(progress=True)
        effects = node_effects(model.params, pairs, model.config, logit_difference, kind, nodes, execution=execution)
        print(f"exact patching of {len(nodes)} {kind}: {time.perf_counter() - start:.1f} s", flush=True)
        out[kind] = (nodes, effects)
        if cache:
            arrays = {f"{k}_{name}": v for k, (n, e) in out.items() for name, v in (("nodes", n), ("effects", e))}
            with atomic_write(cache) as f:
                np.savez(f, **arrays)
    return out


def compare(estimates: dict, exact: dict) -> dict:
    """Per kind and method: the false-negative rate at each k, and the largest exact mean
    |effect| among the nodes missed at the first k."""
    from jaxdepth.analyses.edges.atp_star import missed_nodes

    report = {}
    for kind, (nodes, effects) in exact.items():
        size = np.mean(np.abs(effects), axis=1)  # [n]
        row = {"nodes": len(nodes), "largest_effect": float(size.max())}
        for method, scores in estimates.items():
            estimated = np.mean(np.abs(scores.of(kind)[(slice(None),) + tuple(nodes.T)]), axis=0)
            k0 = min(KS[0], len(nodes))
            found = set(np.argsort(-estimated, kind="stable")[:k0].tolist())
            missed = [i for i in np.argsort(-size, kind="stable")[:k0] if i not in found]
            row[method] = {
                **{f"missed_at_{k}": missed_nodes(estimated, size, min(k, len(nodes))) for k in KS},
                "largest_missed_effect": float(max((size[i] for i in missed), default=0.0)),
            }
        report[kind] = row
    return report


def main(argv=None) -> int:
    args = parse_args(argv)
    from jaxdepth.analyses.edges import atp_star, logit_difference
    from jaxdepth.lab.circuit_tasks import addition_pairs
    from jaxdepth.lab.sources import load

    model = load(args.model)
    pairs = addition_pairs(model.tokenizer, args.pairs).prompt_pairs()
    estimates, seconds = {}, {}
    for method in METHODS:
        start = time.perf_counter()
        estimates[method] = atp_star(
            model.params, pairs, model.config, logit_difference, kinds=args.kinds, method=method
        )
        seconds[method] = time.perf_counter() - start
    exact = exact_effects(model, pairs, args.kinds, args.cache)
    report = {"pairs": args.pairs, "length": int(pairs.clean.shape[1]), "from_position": pairs.shared_prefix()}
    report["seconds"] = seconds
    report["kinds"] = compare(estimates, exact)
    print(f"{args.pairs} pairs of {report['length']} tokens, nodes at positions {report['from_position']} on")
    print("| kind | nodes | method | missed at 10 | missed at 50 | largest missed effect (at 10) |")
    print("|---|---|---|---|---|---|")
    for kind, row in report["kinds"].items():
        for method in METHODS:
            r = row[method]
            print(
                f"| {kind} | {row['nodes']} | {method} | {r['missed_at_10']:.2f} | {r['missed_at_50']:.2f} | "
                f"{r['largest_missed_effect']:.4f} of {row['largest_effect']:.4f} |"
            )
    print("seconds per estimate (first call, compilation included):", {k: round(v, 1) for k, v in seconds.items()})
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
