"""Find a circuit, with the result on disk: `jaxdepth circuit`.

Scores every edge of the model on prompt pairs (`jaxdepth.analyses.edges.edge_attribution`),
checks the top edges one by one by exact patching, extracts a circuit (the top edges, or the
fewest reaching a faithfulness target) and draws it. Everything goes to
`OUT/<model>/circuit_<task>/`: `edge_scores.npz`, `edge_checks.npz` (each checked edge's score
and exact effect), `circuit.npz`, `summary.txt` and `figures/` (the circuit, the faithfulness
curve, scores against exact effects). Each file is written atomically; a rerun with the same
model, pairs and settings reuses the scores and the checks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time

import numpy as np

from jaxdepth.analyses.edges import (
    METHODS,
    Circuit,
    EdgeScores,
    circuit_figure,
    edge_attribution,
    edge_effects,
    faithfulness_figure,
    find_circuit,
    logit_difference,
    ranked_edges,
)
from jaxdepth.analyses.ig.rules import RULES
from jaxdepth.core.atomic import atomic_write
from jaxdepth.core.saved_result import SavedResult
from jaxdepth.lab.circuit_tasks import TaskPairs, addition_pairs, read_pairs

CIRCUIT_FORMAT = 1  # part of the cache identity: bumped when the computation or the results change


@dataclasses.dataclass
class EdgeChecks(SavedResult):
    """The top edges by score (`edges [k, 2]`) with their mean `scores [k]` and their exact
    patching `effects [k, B]` (F(clean) - F(edge alone patched), per pair)."""

    edges: np.ndarray
    scores: np.ndarray
    effects: np.ndarray


def circuit_folder(out: str, model_name: str, task: str) -> str:
    from jaxdepth.lab.study import slug

    return os.path.join(out, slug(model_name), f"circuit_{slug(task)}")


def _identity(model_name: str, task: TaskPairs, settings: dict) -> str:
    text = json.dumps(
        {"model": model_name, "clean": task.clean, "corrupt": task.corrupt, "labels": task.labels.tolist(), **settings},
        sort_keys=True,
    )
    return hashlib.sha256(f"{CIRCUIT_FORMAT}:{text}".encode()).hexdigest()[:16]


def _cached(path: str, identity: str, kind: type, compute):
    """The result at `path` when its identity file says `identity`, else `compute()` saved there."""
    marker = path + ".identity"
    if os.path.exists(path) and os.path.exists(marker) and open(marker).read() == identity:
        return kind.load(path), True
    result = compute()
    result.save(path)
    with atomic_write(marker, "w") as f:
        f.write(identity)
    return result, False


def find_and_save(model, task: TaskPairs, folder: str, args, *, model_name: str, figures: bool = True) -> dict:
    """The command's work: scores, checks, circuit and figures in `folder`; returns a summary."""
    pairs = task.prompt_pairs()
    p, c = model.params, model.config
    settings = dict(method=args.method, rule=args.rule, steps=args.steps, tolerance=args.tolerance)
    identity = _identity(model_name, task, settings)
    start = time.perf_counter()
    scores, reused = _cached(
        os.path.join(folder, "edge_scores.npz"),
        identity,
        EdgeScores,
        lambda: edge_attribution(p, pairs, c, logit_difference, **_score_options(settings), progress=True),
    )
    print(f"edge scores ({args.method}) {_took(start, reused)}")
    start = time.perf_counter()
    top = ranked_edges(scores.mean, scores.graph)[: args.check]

    def check():
        effects = edge_effects(p, pairs, c, logit_difference, top, progress=True)
        return EdgeChecks(edges=top, scores=scores.mean[top[:, 0], top[:, 1]], effects=effects)

    checks, reused = _cached(os.path.join(folder, "edge_checks.npz"), f"{identity}:{args.check}", EdgeChecks, check)
    print(f"exact patching of the top {len(top)} edges {_took(start, reused)}")
    start = time.perf_counter()
    circuit = find_circuit(p, pairs, c, logit_difference, scores, size=args.size, target=args.target)
    circuit.save(os.path.join(folder, "circuit.npz"))
    print(f"circuit of {len(circuit.edges)} edges in {time.perf_counter() - start:.1f} s")
    summary = summarise(scores, checks, circuit, model_name)
    with atomic_write(os.path.join(folder, "summary.txt"), "w") as f:
        f.write(summary["text"])
    if figures:
        from jaxdepth.lab.plots import save_figure

        figure_folder = os.path.join(folder, "figures")
        save_figure(circuit_figure(circuit, max_edges=args.draw), os.path.join(figure_folder, "circuit"))
        save_figure(faithfulness_figure(circuit), os.path.join(figure_folder, "faithfulness"))
        save_figure(scores_vs_patching_figure(checks, scores.method), os.path.join(figure_folder, "scores_vs_patching"))
    return summary


def _took(start: float, reused: bool) -> str:
    return "reused" if reused else f"in {time.perf_counter() - start:.1f} s"


def _score_options(settings: dict) -> dict:
    if settings["method"] == "eap":
        return {"method": "eap"}
    return {k: v for k, v in settings.items() if v is not None}


def summarise(scores: EdgeScores, checks: EdgeChecks, circuit: Circuit, model_name: str) -> dict:
    """The numbers a reader wants first, as a dict with a `text` rendering."""
    effects = checks.effects.mean(axis=1)
    corr = float(np.corrcoef(checks.scores, effects)[0, 1]) if len(effects) > 1 else float("nan")
    lines = [
        f"model {model_name}: {len(scores.f_clean)} pairs, F(clean) {scores.f_clean.mean():.4g}, "
        f"F(corrupt) {scores.f_corrupt.mean():.4g} (means over pairs)",
        f"{scores.graph.num_edges} edges scored by {scores.method}"
        + ("" if scores.method == "eap" else f" ({scores.rule} rule, {scores.steps} steps)"),
        f"input-edge completeness gap (mean |.|): {np.abs(scores.completeness_gap()).mean():.3g}",
        f"top {len(effects)} edges: correlation of score and exact patching effect {corr:.3f}",
        f"circuit: {len(circuit.edges)} edges, faithfulness {circuit.faithfulness:.3f}"
        + ("" if circuit.target is None else f" (target {circuit.target:g})"),
        "top edges (mean score | exact effect):",
    ]
    lines += [
        f"  {scores.graph.edge_name(w, r):24} {s:+.4g} | {e:+.4g}"
        for (w, r), s, e in list(zip(checks.edges, checks.scores, effects))[:10]
    ]
    return {"text": "\n".join(lines) + "\n", "correlation": corr, "faithfulness": circuit.faithfulness}


def scores_vs_patching_figure(checks: EdgeChecks, method: str):
    """Each checked edge's mean score against its exact patching effect (the diagonal: a score
    that is exact)."""
    from jaxdepth.analyses import drawing as d

    fig = d.new_figure(5, 5)
    ax = fig.add_subplot()
    effects = checks.effects.mean(axis=1)
    ax.scatter(effects, checks.scores, s=12)
    limit = float(max(np.abs(effects).max(), np.abs(checks.scores).max(), 1e-12)) * 1.05
    ax.plot([-limit, limit], [-limit, limit], color="gray", linestyle="--", linewidth=0.8)
    ax.set_xlabel("exact patching: F(clean) - F(edge patched)")
    ax.set_ylabel(f"{method} score")
    ax.set_title(f"Top {len(effects)} edges: score against exact patching")
    return fig


# ----------------------------------------------------------------------------- command line


def add_parser(subparsers) -> None:
    """Add the `circuit` subcommand to the `jaxdepth` command's subparsers."""
    p = subparsers.add_parser(
        "circuit",
        help="score every edge on clean/corrupt prompt pairs (EAP, EAP-IG), check the top edges by exact "
        "patching, and extract and draw a circuit",
    )
    p.add_argument("--model", default="smollm2", help="anything jaxdepth.load accepts (default: smollm2)")
    p.add_argument(
        "--pairs",
        metavar="PATH",
        help="JSON Lines of pairs, one object per line: clean, corrupt, right, wrong (texts; the answers' "
        "first tokens are compared by logit difference). Default: the addition task",
    )
    p.add_argument("--num-pairs", type=int, default=20, help="pairs of the addition task (default 20)")
    p.add_argument("--method", choices=METHODS, default="eap-ig-inputs")
    p.add_argument("--rule", choices=RULES, default="left", help="EAP-IG's quadrature rule (default left)")
    p.add_argument("--steps", type=int, default=16, help="EAP-IG steps (default 16)")
    p.add_argument("--tolerance", type=float, help="with --rule adaptive: the completeness tolerance")
    p.add_argument("--check", type=int, default=100, help="edges checked one by one by exact patching (default 100)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--size", type=int, help="the circuit's size: its top edges")
    group.add_argument(
        "--target", type=float, help="the fewest top edges reaching this faithfulness (default 0.8 without --size)"
    )
    p.add_argument("--draw", type=int, default=60, help="edges drawn in the circuit figure (the best; default 60)")
    p.add_argument("--out", default="results", help="results under OUT/<model>/circuit_<task>/")
    p.add_argument("--no-figures", action="store_true")
    p.set_defaults(func=run_command)


def run_command(args) -> int:
    from jaxdepth.lab.sources import load

    if args.size is None and args.target is None:
        args.target = 0.8
    if args.method == "eap" and (args.rule, args.steps, args.tolerance) != ("left", 16, None):
        raise ValueError("--rule, --steps and --tolerance are EAP-IG's; --method eap takes none")
    if args.pairs is not None and not os.path.isfile(args.pairs):
        raise ValueError(f"--pairs {args.pairs}: no such file")
    start = time.perf_counter()
    model = load(args.model)
    print(f"loaded {args.model} in {time.perf_counter() - start:.1f} s")
    if model.tokenizer is None:
        raise ValueError(f"the model from {args.model} has no tokenizer: its pairs cannot be encoded")
    if args.pairs:
        task, task_name = read_pairs(args.pairs, model.tokenizer), os.path.splitext(os.path.basename(args.pairs))[0]
    else:
        task, task_name = addition_pairs(model.tokenizer, args.num_pairs), f"addition{args.num_pairs}"
    folder = circuit_folder(args.out, args.model, task_name)
    summary = find_and_save(model, task, folder, args, model_name=args.model, figures=not args.no_figures)
    print(summary["text"], end="")
    print(f"written to {folder}")
    return 0
