"""Find a circuit, with the result on disk: `jaxdepth circuit`.

Scores every edge of the model on prompt pairs (`jaxdepth.analyses.edges.edge_attribution`),
checks the top edges one by one by exact patching, extracts a circuit (the top edges, or the
fewest reaching a faithfulness target) and draws it. Everything goes to
`OUT/<model>/circuit_<task>/<scoring>/`, one folder per way of scoring (`scoring_name`: `eap`,
`eap-ig-inputs-left-16`, ...), so that the results of two methods or settings never share a
file: `edge_scores.npz`, `edge_checks_top<K>.npz` (each of the top K edges' score and exact
effect), `circuit_<size N | target T>.npz`, `summary_top<K>_<size N | target T>.txt` and
`figures/` (`circuit_*` and `faithfulness_*` named as the circuit, `scores_vs_patching_top<K>`).
Each file is written atomically, and the command holds the folder (`folder_lock`) while it
writes; a rerun with the same model, pairs and settings reuses the scores and the checks (each a
step of `jaxdepth.lab.runs`, its identity beside it in `<file>.identity`), and a killed run
resumes from the last of them saved.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import warnings
from typing import Optional

import numpy as np

from jaxdepth.analyses.edges import (
    ABLATIONS,
    LEVELS,
    METHODS,
    Ablation,
    Circuit,
    CircuitSearch,
    EdgeScores,
    Patching,
    Scoring,
    circuit_figure,
    edge_attribution,
    edge_effects,
    faithfulness_figure,
    find_circuit,
    mean_ablation,
    position_figure,
    ranked_edges,
)
from jaxdepth.analyses.edges.ablations import as_ablation
from jaxdepth.analyses.edges.scores import RULELESS
from jaxdepth.analyses.edges.selection import SEARCHES
from jaxdepth.analyses.ig.rules import DEFAULT_TOLERANCE, RULES, rule_of
from jaxdepth.core.atomic import atomic_write
from jaxdepth.core.execution import Execution
from jaxdepth.core.saved_result import SavedResult
from jaxdepth.lab.circuit_tasks import TaskPairs, addition_pairs, read_pairs
from jaxdepth.lab.runs import Step, hold_folders, produce

__all__ = [
    "CIRCUIT_FORMAT",
    "POSITION_ROWS",
    "EdgeChecks",
    "circuit_folder",
    "scoring_name",
    "circuit_choice",
    "find_and_save",
    "task_ablation",
    "summarise",
    "scores_vs_patching_figure",
    "TASK_NAMING",
    "add_parser",
    "check_arguments",
    "check_size",
    "run_command",
]

CIRCUIT_FORMAT = 1  # part of the cache identity: bumped when the computation or the results change
POSITION_ROWS = 40  # at most this many of the circuit's edges in the figure over positions


@dataclasses.dataclass
class EdgeChecks(SavedResult):
    """The top edges by score (`edges [k, 2]`) with their mean `scores [k]` and their exact
    patching `effects [k, B]` (F(clean) - F(edge alone patched), per pair)."""

    edges: np.ndarray
    scores: np.ndarray
    effects: np.ndarray


def circuit_folder(out: str, model_key: str, task: str) -> str:
    """`OUT/<model key>/circuit_<task>`: the circuits of one task, one subfolder per way of
    scoring, under the model's results key (`jaxdepth.lab.study.source_results_key`)."""
    from jaxdepth.lab.study import slug

    return os.path.join(out, model_key, f"circuit_{slug(task)}")


def scoring_name(method: str, rule: str, steps: int, tolerance: Optional[float], ablation: str = "corrupt") -> str:
    """The folder of one way of scoring edges: the method and the settings it reads, `eap`,
    `eap-ig-inputs-left-16` or `eap-ig-inputs-adaptive-tol0.01-max16` (the adaptive rule's
    tolerance and its budget of evaluations), and an ablation other than the corrupt run's
    after them (`eap-zero`, `eap-ig-activations-left-16-mean`)."""
    if method in RULELESS:
        name = method
    elif rule == "adaptive":
        name = f"{method}-adaptive-tol{tolerance:g}-max{steps}"
    else:
        name = f"{method}-{rule}-{steps}"
    return name if ablation == "corrupt" else f"{name}-{ablation}"


def circuit_choice(size: Optional[int], target: Optional[float], search: str = "top", level: str = "edge") -> str:
    """How the circuit was chosen, as its files name it: `size10` or `target0.8`, with
    `_greedy` after it for the greedy search, `_nodes` for a circuit of nodes and `_neurons` for
    one of heads and MLP units."""
    name = f"size{size}" if size is not None else f"target{target:g}"
    return name + ("" if search == "top" else f"_{search}") + {"edge": "", "node": "_nodes"}.get(level, f"_{level}s")


def _identity(model_name: str, fingerprint: str, task: TaskPairs, settings: dict) -> dict:
    """What the edge scores depend on: the model (its name and fingerprint), the pairs and the way
    of scoring."""
    pairs = {"clean": task.clean, "corrupt": task.corrupt, "labels": task.labels.tolist()}
    model = {"model": model_name, "model_fingerprint": fingerprint[:16]}
    if task.metric is not None:  # a task scored by its own metric (the default's files keep their identity)
        fn = task.metric.fn  # a `Metric` is named by its function
        pairs["metric"] = f"{fn.__module__}.{fn.__qualname__}"
    return {"format": CIRCUIT_FORMAT, **model, **pairs, **settings}


def find_and_save(
    model, task: TaskPairs, folder: str, args, *, model_name: str, fingerprint: str, figures: bool = True
) -> dict:
    """The command's work: scores, checks, circuit and figures in `folder` (one way of scoring's,
    `scoring_name`); returns a summary (`summarise`). `fingerprint`: the model's
    (`jaxdepth.lab.study.source_results_key`), part of every result's identity."""
    pairs, metric = task.prompt_pairs(), task.scored_by()
    p, c = model.params, model.config
    settings = dict(method=args.method, rule=args.rule, steps=args.steps, tolerance=args.tolerance)
    if args.ablation != "corrupt" or args.positions:  # files of earlier versions keep their identity
        settings.update(ablation=args.ablation, positions=args.positions)
    if args.level == "neuron":  # scores with the MLP units' own
        settings.update(neurons=True)
    identity = _identity(model_name, fingerprint, task, settings)
    ablation = task_ablation(model, task, args.ablation)
    patching = Patching(ablation)  # what every patched edge carries (no interventions: the model as it is)
    start = time.perf_counter()

    def score():
        detail = (["positions"] if args.positions else []) + (["neurons"] if args.level == "neuron" else [])
        scoring = _scoring(settings, detail)
        return edge_attribution(p, pairs, c, metric, scoring, patching=patching, execution=Execution(progress=True))

    scores = produce(Step(file="edge_scores.npz", result_type=EdgeScores, identity=identity, run=score), folder)
    print(f"edge scores ({args.method}) {_took(start, scores.reused)}", flush=True)
    scores = scores.result
    start = time.perf_counter()
    top = ranked_edges(scores.mean, scores.graph)[: args.check]

    def check():
        effects = edge_effects(p, pairs, c, metric, top, patching=patching, execution=Execution(progress=True))
        return EdgeChecks(edges=top, scores=scores.mean[top[:, 0], top[:, 1]], effects=effects)

    checked = f"top{args.check}"
    step = Step(
        file=f"edge_checks_{checked}.npz", result_type=EdgeChecks, identity={**identity, "check": args.check}, run=check
    )
    checks = produce(step, folder)
    print(f"exact patching of the top {len(top)} edges {_took(start, checks.reused)}", flush=True)
    checks = checks.result
    start = time.perf_counter()
    with warnings.catch_warnings():  # an unreached target is the command's own error line (run_command)
        warnings.filterwarnings("ignore", message="no circuit reaches faithfulness", category=RuntimeWarning)
        search = CircuitSearch(
            size=args.size, target=args.target, order=args.search, level=args.level, patching=patching
        )
        circuit = find_circuit(p, pairs, c, metric, scores, search)
    chosen = circuit_choice(args.size, args.target, args.search, args.level)
    circuit.save(os.path.join(folder, f"circuit_{chosen}.npz"))
    took = time.perf_counter() - start
    of_nodes = ""
    if args.level == "node":
        of_nodes = f"{len(circuit.nodes)} nodes, "
    elif args.level == "neuron":
        of_nodes = f"{len(circuit.nodes)} heads or input and {len(circuit.units)} MLP units, "
    print(f"circuit of {of_nodes}{len(circuit.edges)} edges ({circuit.num_live} live) in {took:.1f} s", flush=True)
    summary = summarise(scores, checks, circuit, model_name)
    with atomic_write(os.path.join(folder, f"summary_{checked}_{chosen}.txt"), "w") as f:
        f.write(summary["text"])
    if figures:
        from jaxdepth.lab.plots import save_figure

        figure_folder = os.path.join(folder, "figures")
        save_figure(circuit_figure(circuit, max_edges=args.draw), os.path.join(figure_folder, f"circuit_{chosen}"))
        save_figure(faithfulness_figure(circuit), os.path.join(figure_folder, f"faithfulness_{chosen}"))
        save_figure(
            scores_vs_patching_figure(checks, scores.method),
            os.path.join(figure_folder, f"scores_vs_patching_{checked}"),
        )
        if args.positions:
            labels = [model.tokenizer.decode([t]) for t in np.asarray(pairs.clean[0])]
            figure = position_figure(scores, edges=circuit, k=min(args.draw, POSITION_ROWS), labels=labels)
            save_figure(figure, os.path.join(figure_folder, f"positions_{chosen}"))
    return summary


def task_ablation(model, task: TaskPairs, kind: str) -> Ablation:
    """The command's `--ablation`: the corrupt run's values, zero, or each writer's mean over
    the task's clean prompts (per token, or per position)."""
    if kind in ("mean", "mean-per-position"):
        per_position = kind == "mean-per-position"
        return mean_ablation(
            model.params, task.clean, model.config, per_position=per_position, execution=Execution(progress=True)
        )
    return as_ablation(kind)


def _took(start: float, reused: bool) -> str:
    return "reused" if reused else f"in {time.perf_counter() - start:.1f} s"


def _scoring(settings: dict, detail: list) -> Scoring:
    """`edge_attribution`'s `Scoring` from the command's settings (`rules.rule_of`: the adaptive
    rule's budget is `steps` evaluations) and the `detail` it resolves."""
    if settings["method"] in RULELESS:
        return Scoring(settings["method"], detail=detail)
    rule = rule_of(settings["rule"], settings["steps"], settings["tolerance"])
    return Scoring(settings["method"], rule, detail=detail)


def summarise(scores: EdgeScores, checks: EdgeChecks, circuit: Circuit, model_name: str) -> dict:
    """The numbers a reader wants first, as a dict with a `text` rendering; `reached`: whether
    the circuit reached its faithfulness target (`Circuit.reached`)."""
    effects = checks.effects.mean(axis=1)
    corr = float(np.corrcoef(checks.scores, effects)[0, 1]) if len(effects) > 1 else float("nan")
    reached = circuit.reached
    if circuit.target is None:
        goal = ""
    elif reached:
        goal = f" (target {circuit.target:g})"
    else:
        goal = f" (target {circuit.target:g} NOT reached by any circuit of the top edges: this is the whole graph)"
    lines = [
        f"model {model_name}: {len(scores.f_clean)} pairs, F(clean) {scores.f_clean.mean():.4g}, "
        f"F(corrupt) {scores.f_corrupt.mean():.4g} (means over pairs)",
        f"{scores.graph.num_edges} edges scored by {scores.method}"
        + ("" if scores.method == "eap" else f" ({scores.rule} rule, {scores.steps} steps)"),
        f"input-edge completeness gap (mean |.|): {np.abs(scores.completeness_gap()).mean():.3g}",
        f"top {len(effects)} edges: correlation of score and exact patching effect {corr:.3f}",
        f"circuit ({circuit.search}): {len(circuit.edges)} edges, {circuit.num_live} live, "
        f"faithfulness {circuit.faithfulness:.3f}{goal}",
        "top edges (mean score | exact effect):",
    ]
    lines += [
        f"  {scores.graph.edge_name(w, r):24} {s:+.4g} | {e:+.4g}"
        for (w, r), s, e in list(zip(checks.edges, checks.scores, effects))[:10]
    ]
    return {
        "text": "\n".join(lines) + "\n",
        "correlation": corr,
        "faithfulness": circuit.faithfulness,
        "reached": reached,
    }


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

TASK_NAMING = (
    "The task is named after the pairs file (its name without the extension: PAIRS.jsonl is the task "
    "PAIRS), or addition<N> for the addition task of --num-pairs N. Results go to "
    "OUT/<model>/circuit_<task>/<scoring>/, <scoring> naming the method and its settings (eap, "
    "eap-ig-inputs-left-16, eap-ig-inputs-adaptive-tol0.01-max16), each file named after the settings "
    "it depends on (edge_checks_top<K>.npz, circuit_target<T>.npz or circuit_size<N>.npz, summary_..., "
    "figures/...); a rerun with the same settings reuses the scores and the checks."
)


class _HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's help with each option's default, except where its help says the default in
    words already (an option whose default is None, or a flag)."""

    def _get_help_string(self, action):
        if "default" in (action.help or "").lower():
            return action.help
        return super()._get_help_string(action)


def add_parser(subparsers) -> None:
    """Add the `circuit` subcommand to the `jaxdepth` command's subparsers."""
    p = subparsers.add_parser(
        "circuit",
        help="score every edge on clean/corrupt prompt pairs (EAP, EAP-IG), check the top edges by exact "
        "patching, and extract and draw a circuit",
        description="Score every edge of a model on clean/corrupt prompt pairs (EAP, EAP-IG), check the top "
        "edges one by one by exact patching, and extract and draw a circuit. " + TASK_NAMING,
        formatter_class=_HelpWithDefaults,
    )
    p.add_argument("--model", default="smollm2", help="anything jaxdepth.load accepts")
    p.add_argument(
        "--pairs",
        metavar="PATH",
        help="JSON Lines of pairs, one object per line: clean, corrupt, right, wrong (texts; the answers' "
        "first tokens are compared by logit difference); names the task after its stem. Default: the "
        "addition task (the task addition<N>)",
    )
    p.add_argument("--num-pairs", type=int, default=20, help="pairs of the addition task")
    p.add_argument("--method", choices=METHODS, default="eap-ig-inputs", help="how edges are scored")
    p.add_argument("--rule", choices=RULES, default="left", help="EAP-IG's quadrature rule")
    p.add_argument("--steps", type=int, default=16, help="EAP-IG steps (with --rule adaptive: its budget)")
    p.add_argument(
        "--tolerance",
        type=float,
        help=f"with --rule adaptive: the completeness tolerance (default {DEFAULT_TOLERANCE:g} there; "
        "no other rule takes one)",
    )
    p.add_argument("--check", type=int, default=100, help="edges checked one by one by exact patching")
    group = p.add_mutually_exclusive_group()
    group.add_argument(
        "--size", type=int, help="the circuit's size: its top edges (default: none, the size --target asks for)"
    )
    group.add_argument(
        "--target",
        type=float,
        help="the fewest top edges reaching this faithfulness, in (0, 1] (default 0.8 without --size); when no "
        "circuit reaches it, the command says so and ends with exit status 1",
    )
    p.add_argument(
        "--search",
        choices=SEARCHES,
        default="top",
        help="the circuits' edges: the top ones by score anywhere (default), or grown greedily from the logits "
        "(the EAP-IG package's apply_greedy)",
    )
    p.add_argument(
        "--ablation",
        choices=ABLATIONS,
        default="corrupt",
        help="what a patched edge carries: the corrupt prompt's values, zero, or each writer's mean over the "
        "task's clean prompts (per token or per position); --method eap-ig-inputs and clean-corrupted take "
        "the corrupt one only",
    )
    p.add_argument(
        "--positions",
        action="store_true",
        help="also score each edge at each position, and draw the circuit's edges over the first pair's tokens",
    )
    p.add_argument(
        "--level",
        choices=LEVELS,
        default="edge",
        help="what the circuit is made of: edges (default), nodes (heads, MLPs, the input) by their node "
        "scores, each with all its out-edges, or neurons (heads, the input and MLP hidden units ranked "
        "together); --size then counts nodes, or heads, input and units",
    )
    p.add_argument("--draw", type=int, default=60, help="edges drawn in the live circuit figure (the best)")
    p.add_argument("--out", default="results", help="results under OUT/<model>/circuit_<task>/<scoring>/")
    p.add_argument("--no-figures", action="store_true", help="save results only (default: draw the figures)")
    p.set_defaults(func=run_command)


def check_arguments(args) -> None:
    """Refuse what the command line gets wrong before anything is loaded or computed (the
    circuit's size against the graph: `check_size`, once the model's config is known)."""
    for flag, value in (("--num-pairs", args.num_pairs), ("--steps", args.steps), ("--check", args.check)):
        if value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    if args.draw < 0:
        raise ValueError(f"--draw must be at least 0, got {args.draw}")
    if args.target is not None and not 0 < args.target <= 1:
        raise ValueError(f"--target is a faithfulness, in (0, 1]; got {args.target:g}")
    if args.method in RULELESS and (args.rule, args.steps, args.tolerance) != ("left", 16, None):
        raise ValueError(f"--rule, --steps and --tolerance are EAP-IG's; --method {args.method} takes none")
    if args.ablation != "corrupt" and args.method in ("eap-ig-inputs", "clean-corrupted"):
        raise ValueError(
            f"--method {args.method} takes gradients between the corrupt and the clean prompt: --ablation "
            f"{args.ablation} needs --method eap or eap-ig-activations"
        )
    if args.level != "edge" and args.search != "top":
        raise ValueError(f"--level {args.level} takes its members by their scores: --search greedy grows edges")
    if args.rule == "adaptive" and args.method != "eap-ig-inputs":
        raise ValueError("--rule adaptive certifies the input path's completeness: use it with --method eap-ig-inputs")
    if args.tolerance is not None and (args.rule != "adaptive" or not args.tolerance > 0):
        raise ValueError(f"--tolerance takes a number > 0, with --rule adaptive only; got {args.tolerance:g}")
    if args.pairs is not None and not os.path.isfile(args.pairs):
        raise ValueError(f"--pairs {args.pairs}: no such file")


def check_size(size: Optional[int], config, level: str = "edge") -> None:
    """Refuse a circuit size the model's graph cannot have (known from its config, before any
    scoring): its edges, its nodes (writers) at `level` 'node', its heads, input and MLP units at
    'neuron'."""
    from jaxdepth.analyses.edges.graph import EdgeGraph

    graph = EdgeGraph.of(config)
    members = graph.num_writers - config.num_layers + config.num_layers * config.intermediate_size
    total, unit = {
        "node": (graph.num_writers, "nodes"),
        "neuron": (members, "heads, input and MLP units"),
    }.get(level, (graph.num_edges, "edges"))
    if size is not None and not 1 <= size <= total:
        raise ValueError(f"--size must be in 1..{total} (the {unit} of this model's graph), got {size}")


def run_command(args) -> int:
    """`jaxdepth circuit`: check the arguments, hold the results folder, load the model, read the
    pairs (`read_pairs` refuses a bad pair: prompts of other lengths or the same tokens, answers
    beginning with one token), then score, check, find and draw (`find_and_save`). Exit status
    1 when no circuit reached the faithfulness target (what was computed is saved all the same)."""
    from jaxdepth.lab.sources import load
    from jaxdepth.lab.study import source_results_key

    if args.size is None and args.target is None:
        args.target = 0.8
    if args.rule == "adaptive" and args.tolerance is None:
        args.tolerance = DEFAULT_TOLERANCE  # named in the folder: the default and 0.01 are one setting
    check_arguments(args)
    task_name = os.path.splitext(os.path.basename(args.pairs))[0] if args.pairs else f"addition{args.num_pairs}"
    scoring = scoring_name(args.method, args.rule, args.steps, args.tolerance, args.ablation)
    model_key, fingerprint = source_results_key(args.model)
    folder = os.path.join(circuit_folder(args.out, model_key, task_name), scoring)
    with hold_folders([folder]):
        start = time.perf_counter()
        model = load(args.model)
        print(f"loaded {args.model} in {time.perf_counter() - start:.1f} s", flush=True)
        if model.tokenizer is None:
            raise ValueError(f"the model from {args.model} has no tokenizer: its pairs cannot be encoded")
        check_size(args.size, model.config, args.level)
        tokenizer = model.tokenizer
        task = read_pairs(args.pairs, tokenizer) if args.pairs else addition_pairs(tokenizer, args.num_pairs)
        summary = find_and_save(
            model, task, folder, args, model_name=args.model, fingerprint=fingerprint, figures=not args.no_figures
        )
    print(summary["text"], end="")
    print(f"written to {folder}")
    if not summary["reached"]:
        print(
            f"error: no circuit reaches faithfulness {args.target:g} (the circuit saved is the whole graph, "
            f"faithfulness {summary['faithfulness']:.3f}); the results are saved all the same",
            file=sys.stderr,
        )
        return 1
    return 0
