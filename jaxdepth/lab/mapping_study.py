"""Map a smaller model's residual stream onto a larger one's (first study, Analysis 5), with the
result on disk: `jaxdepth map SMALL LARGE`.

Both models read the same prompts (their tokenizers must agree token for token). The first
`train_prompts` prompts fit a ridge map for every (small boundary, large boundary) pair, the
rest measure its held-out relative error (`jaxdepth.analyses.layer_mapping`). The result is
written atomically to `OUT/<small>__<large>/<dataset>/layer_mapping.npz` with a heatmap beside
it, the command holding the folder meanwhile (`folder_lock`); a rerun with the same models,
prompts and settings reuses it (a step of `jaxdepth.lab.runs`, the one way every command caches).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np

from jaxdepth.analyses.layer_mapping import PAD_TO, LayerMappingResult, MappingSettings, compute_mapping
from jaxdepth.core.batch import PromptBatch
from jaxdepth.core.execution import Execution, refuse_moved, refuse_unknown
from jaxdepth.core.progress import ProgressLike
from jaxdepth.core.sharding import is_writer
from jaxdepth.lab.loaded_model import Model
from jaxdepth.lab.runs import Step, batch_digest, hold_folders, produce

__all__ = [
    "MappingSettings",  # where the mapping's settings were first offered
    "RESULT_NAME",
    "MAPPING_FORMAT",
    "check_same_tokenizer",
    "mapping_folder",
    "encode_both",
    "MappingPrompts",
    "MappingRun",
    "map_models",
    "mapping_figure",
    "summary",
    "add_parser",
]

RESULT_NAME = "layer_mapping"
MAPPING_FORMAT = 1  # part of the cache identity: bumped when the computation or the result changes
# ----------------------------------------------------------------------------- tokenizers


def check_same_tokenizer(small: Model, large: Model, small_batch: PromptBatch, large_batch: PromptBatch) -> None:
    """Raise a ValueError unless both models have a tokenizer with the same vocabulary and the
    prompts encode to the same token ids (only then is token t the same input to both)."""
    for model in (small, large):
        if model.tokenizer is None:
            raise ValueError(f"the model from {model.source} has no tokenizer; its prompts cannot be encoded")
    vocab_s, vocab_l = _vocabulary(small.tokenizer), _vocabulary(large.tokenizer)
    if vocab_s is not None and vocab_l is not None and vocab_s != vocab_l:
        differing = sorted(set(vocab_s.items()) ^ set(vocab_l.items()), key=lambda kv: kv[1])[:3]
        raise ValueError(
            f"the models' tokenizers differ ({small.source}: {len(vocab_s)} tokens, {large.source}: {len(vocab_l)} "
            f"tokens; e.g. {differing}): a layer mapping needs two models that read the same tokens"
        )
    same = (
        small_batch.valid.shape == large_batch.valid.shape
        and np.array_equal(small_batch.valid, large_batch.valid)
        and np.array_equal(small_batch.tokens[small_batch.valid], large_batch.tokens[large_batch.valid])
    )
    if not same:
        raise ValueError(
            f"the prompts encode to different token ids with the tokenizers of {small.source} and "
            f"{large.source}: a layer mapping needs two models that read the same tokens"
        )
    ids = small_batch.tokens[small_batch.valid]
    for model in (small, large):
        if ids.size and ids.max() >= model.config.vocab_size:
            raise ValueError(
                f"token id {ids.max()} is outside the embedding of {model.source} "
                f"(vocab_size {model.config.vocab_size})"
            )


def _vocabulary(tokenizer) -> Optional[dict]:
    get = getattr(tokenizer, "get_vocab", None)
    return None if get is None else dict(get())


# ----------------------------------------------------------------------------- on disk


def mapping_folder(out_dir: str, small_key: str, large_key: str, dataset: str) -> str:
    """`OUT/<small key>__<large key>/<dataset>`: where a mapping's result and figure go, the
    models named by their results keys (`jaxdepth.lab.study.model_results_key`)."""
    from jaxdepth.lab.study import slug

    return os.path.join(out_dir, f"{small_key}__{large_key}", slug(dataset))


def encode_both(
    small: Model, large: Model, prompts, *, max_tokens: Optional[int] = None, limit: Optional[int] = None
) -> PromptBatch:
    """Encode `prompts` with both tokenizers, check they agree (`check_same_tokenizer`) and
    return the batch; prompts longer than either model's context are an error."""
    from jaxdepth.lab.prompts import encode

    for model in (small, large):
        if model.tokenizer is None:
            raise ValueError(f"the model from {model.source} has no tokenizer; its prompts cannot be encoded")
    context = min(small.config.max_position_embeddings, large.config.max_position_embeddings)
    batches = [
        encode(m.tokenizer, prompts, max_tokens=max_tokens, context=context, limit=limit, buckets=PAD_TO)
        for m in (small, large)
    ]
    check_same_tokenizer(small, large, *batches)
    return batches[0]


@dataclasses.dataclass(frozen=True)
class MappingPrompts:
    """The prompts of a mapping: what is measured on.

    dataset: their name (the result folder's, `mapping_folder`, and the result's identity).
    prompts: `jaxdepth.lab.prompts.Prompt`s, encoded with both tokenizers (`encode_both`).
    max_tokens: longer prompts are skipped (the AIME rule; None: none skipped).
    limit: at most this many are encoded (None: all)."""

    dataset: str
    prompts: Sequence
    max_tokens: Optional[int] = None
    limit: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class MappingRun:
    """How a mapping runs and reports; nothing here changes the result.

    progress: progress bars of the fit and the held-out pass (`jaxdepth.core.progress`).
    log: called with a line on the result (reused or computed) and each figure written.
    mesh: a device mesh the larger model's cross-products are split over (None: one device).
    figures: draw the heatmap beside the result."""

    progress: ProgressLike = True
    log: Callable[[str], None] = print
    mesh: Any = None
    figures: bool = True


# Where each keyword `map_models` once took on its own now lives.
_MAPPING_KEYWORDS = {
    "dataset": "prompts=MappingPrompts(dataset, prompts)",
    "max_tokens": "prompts=MappingPrompts(dataset, prompts, max_tokens=...)",
    "limit": "prompts=MappingPrompts(dataset, prompts, limit=...)",
    "mesh": "run=MappingRun(mesh=...)",
    "figures": "run=MappingRun(figures=...)",
    "progress": "run=MappingRun(progress=...)",
    "log": "run=MappingRun(log=...)",
}


def _refuse_mapping_keywords(options: dict) -> None:
    """A `TypeError` for a keyword `map_models` once took, showing the value that holds it now."""
    refuse_moved("map_models", options, _MAPPING_KEYWORDS, "jaxdepth.lab.mapping_study.MappingPrompts, MappingRun")
    refuse_unknown("map_models", options)


def map_models(
    small: Model,
    large: Model,
    prompts: MappingPrompts,
    out_dir: str,
    *,
    small_name: str,
    large_name: str,
    settings: MappingSettings = MappingSettings(),
    run: MappingRun = MappingRun(),
    **loose,
) -> LayerMappingResult:
    """Map every boundary of `small` onto every boundary of `large` on `prompts` (a
    `MappingPrompts`: the dataset's name and its `jaxdepth.lab.prompts.Prompt`s, encoded with
    both tokenizers, which must agree: ValueError otherwise), the first
    `settings.train_prompts` fitting and the rest held out; returns the result, its errors
    `[L_small + 1, L_large + 1]`.

    Writes `layer_mapping.npz` and the heatmap (`layer_mapping.png`, `.pdf`; unless
    `run.figures` is False) under `mapping_folder(out_dir, small key, large key, dataset)`
    (each model's `jaxdepth.lab.study.model_results_key`: its name and fingerprint),
    atomically, from the writer process only; a saved result with the same models, prompts and
    settings is reused. `prompts.max_tokens` skips longer prompts (the AIME rule),
    `prompts.limit` caps the number encoded; `run` (a `MappingRun`) holds the mesh, the
    progress and the log. The keywords this function once took on their own (`dataset=`,
    `max_tokens=`, `limit=`, `mesh=`, `figures=`, `progress=`, `log=`) are refused with the
    value that holds them now."""
    _refuse_mapping_keywords(loose)
    if not isinstance(prompts, MappingPrompts):
        raise TypeError(
            "map_models(small, large, prompts, out_dir, ...) takes the prompts as one value: "
            f"MappingPrompts(dataset, prompts), got {type(prompts).__name__}"
        )
    dataset, mesh, log = prompts.dataset, run.mesh, run.log
    batch = encode_both(small, large, prompts.prompts, max_tokens=prompts.max_tokens, limit=prompts.limit)
    k = settings.train_prompts
    if not 0 < k < len(batch):
        raise ValueError(
            f"train_prompts={k} must leave prompts on both sides of the split: {len(batch)} prompt(s) "
            "were encoded (the rest are held out)"
        )
    train, held_out = batch.select(slice(0, k)), batch.select(slice(k, None))
    from jaxdepth.lab.study import model_results_key

    (small_key, small_fingerprint), (large_key, large_fingerprint) = (
        model_results_key(small, small_name),
        model_results_key(large, large_name),
    )
    folder = mapping_folder(out_dir, small_key, large_key, dataset)
    path = os.path.join(folder, f"{RESULT_NAME}.npz")
    identity = {
        "small": small_name,
        "large": large_name,
        "small_fingerprint": small_fingerprint[:16],
        "large_fingerprint": large_fingerprint[:16],
        "dataset": dataset,
        "format": MAPPING_FORMAT,
        "settings": dataclasses.asdict(settings),
        "train_tokens_sha": batch_digest(train),
        "heldout_tokens_sha": batch_digest(held_out),
        "small_config": small.config.to_dict(),
        "large_config": large.config.to_dict(),
    }

    execution = Execution(progress=run.progress)

    def compute():
        with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
            names = (small_name, large_name, dataset)
            return compute_mapping(small, large, train, held_out, settings, mesh=mesh, execution=execution, names=names)

    produced = produce(
        Step(file=f"{RESULT_NAME}.npz", result_type=LayerMappingResult, identity=identity, run=compute), folder
    )
    result = produced.result
    if produced.reused:
        log(f"layer mapping: reusing {path}")
    else:
        log(f"layer mapping: {produced.seconds:.1f} s -> {path}")
    if run.figures and is_writer() and result is not None:
        from jaxdepth.lab.plots import save_figure

        for written in save_figure(mapping_figure(result), os.path.join(folder, RESULT_NAME)):
            log(f"wrote {written}")
    return result


# ----------------------------------------------------------------------------- figure and summary


def mapping_figure(result: LayerMappingResult, *, title: Optional[str] = None):
    """Heatmap of the held-out relative error (small boundary m up, large boundary l across),
    each row's best match marked, and the diagonal of equal relative depth l = m L_l / L_s."""
    from matplotlib import patheffects
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    from jaxdepth.lab.study import slug

    Ls, Ll = result.small_layers, result.large_layers
    small, large = slug(result.small_model), slug(result.large_model)  # a folder path would fill the axis
    fig = Figure(figsize=(max(5.5, 3 + 0.12 * Ll), max(4.5, 1.5 + 0.12 * Ls)), layout="constrained")
    FigureCanvasAgg(fig)  # Agg whatever backend pyplot may use elsewhere (as jaxdepth.lab.plots does)
    ax = fig.add_subplot()
    image = ax.imshow(result.errors, origin="lower", aspect="auto", cmap="viridis", interpolation="nearest")
    fig.colorbar(image, ax=ax, label=r"held-out $\|h_l - f(h_m)\| \,/\, \|h_l\|$")
    # white with a dark outline: visible on the dark cells of the map and in the legend outside it
    ax.plot(
        [0, Ll],
        [0, Ls],
        color="white",
        linestyle="--",
        linewidth=1.2,
        label="equal relative depth",
        path_effects=[patheffects.withStroke(linewidth=2.4, foreground="0.2")],
    )
    ax.scatter(
        result.best_match,
        np.arange(Ls + 1),
        marker="x",
        color="red",
        s=28,
        linewidths=1.5,
        zorder=3,
        label="best match of each row",
    )
    ax.set(
        xlabel=f"{large} boundary l (0 = embeddings)",
        ylabel=f"{small} boundary m",
        xlim=(-0.5, Ll + 0.5),
        ylim=(-0.5, Ls + 0.5),
    )
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(MaxNLocator(integer=True))
    fig.legend(loc="outside lower center", ncols=2, fontsize=8)  # outside: no cell of the map hidden
    fig.suptitle(
        title
        or f"Linear maps {small} ({Ls} layers) -> {large} ({Ll} layers), {result.dataset}\n"
        f"{result.train_tokens} training / {result.heldout_tokens} held-out tokens",
        fontsize=10,
    )
    return fig


def summary(result: LayerMappingResult) -> str:
    """A few lines: the best match of every small boundary, its error, and how far the best
    matches lie from the diagonal of equal relative depth."""
    rows = np.arange(len(result.best_match))
    best = result.errors[rows, result.best_match]
    offset = result.diagonal_offset()
    return "\n".join(
        [
            f"{result.small_model} -> {result.large_model} on {result.dataset}: {result.train_tokens} training tokens "
            f"({result.train_prompts} prompts), {result.heldout_tokens} held-out tokens "
            f"({result.heldout_prompts} prompts)",
            "best large boundary per small boundary m: "
            + " ".join(f"{m}:{l}" for m, l in zip(rows, result.best_match)),
            f"error at the best match: min {best.min():.4f}, median {np.median(best):.4f}, max {best.max():.4f}",
            f"best match - equal relative depth: mean |offset| {np.abs(offset).mean():.2f} layers, "
            f"max {np.abs(offset).max():.2f}",
        ]
    )


# ----------------------------------------------------------------------------- command line


def _map(args) -> int:
    from jaxdepth.lab.meshes import mesh_from_args
    from jaxdepth.lab.sources import load
    from jaxdepth.lab.prompts import DATASETS, load_prompts
    from jaxdepth.lab.study import saved_model_name, source_results_key

    if not 0 < args.train_prompts < args.prompts:
        raise ValueError(
            f"--train-prompts ({args.train_prompts}) must lie between 0 and --prompts ({args.prompts}): "
            "the prompts after the training ones are held out"
        )
    max_tokens = DATASETS[args.dataset].max_tokens
    # Read the prompts before the models: a bad file should fail in a second, not after a load.
    prompts = load_prompts(args.dataset, args.data, limit=None if max_tokens else args.prompts)
    settings = MappingSettings(train_prompts=args.train_prompts, ridge=args.ridge, first_position=args.first_position)
    mesh = mesh_from_args(args)
    names = {
        "small_name": saved_model_name(args.small, args.dtype),
        "large_name": saved_model_name(args.large, args.dtype),
    }
    # Held from before the loads to the figure: a second run on the folder is refused at once.
    keys = [source_results_key(source, args.dtype)[0] for source in (args.small, args.large)]
    with hold_folders([mapping_folder(args.out, *keys, args.dataset)]):
        dtype = None if args.dtype == "float32" else args.dtype
        start = time.perf_counter()
        small, large = (load(source, dtype=dtype, mesh=mesh) for source in (args.small, args.large))
        print(f"loaded {args.small} and {args.large} in {time.perf_counter() - start:.1f} s")
        result = map_models(
            small,
            large,
            MappingPrompts(args.dataset, prompts, max_tokens=max_tokens, limit=args.prompts),
            args.out,
            **names,
            settings=settings,
            run=MappingRun(mesh=mesh, figures=not args.no_figures),
        )
    if is_writer():
        print(summary(result))
    return 0


def add_parser(subparsers) -> None:
    """Add the `map` subcommand to the `jaxdepth` command's subparsers."""
    from jaxdepth.lab.prompts import DATASETS

    p = subparsers.add_parser(
        "map",
        help="fit linear maps from every layer of a smaller model to every layer of a larger one (same "
        "tokenizer) and report their held-out relative errors",
    )
    p.add_argument("small", help="the smaller model: anything jaxdepth.load accepts")
    p.add_argument("large", help="the larger model; its tokenizer must equal the smaller one's")
    p.add_argument("--dataset", default="gsm8k", choices=list(DATASETS))
    p.add_argument("--data", metavar="PATH", help="local JSONL file of the dataset (default: the hub)")
    p.add_argument("--prompts", type=int, default=100, help="prompts in all, training and held out (default 100)")
    p.add_argument(
        "--train-prompts",
        type=int,
        default=MappingSettings.train_prompts,
        help=f"the first K prompts fit the maps, the rest measure them (default {MappingSettings.train_prompts})",
    )
    p.add_argument(
        "--ridge",
        type=float,
        default=MappingSettings.ridge,
        help="ridge relative to the mean eigenvalue of each Gram matrix (default %(default)g)",
    )
    p.add_argument(
        "--first-position",
        type=int,
        default=MappingSettings.first_position,
        help="positions before this one are left out (default 1: position 0, an attention sink with a "
        "huge residual norm, is excluded)",
    )
    p.add_argument(
        "--out", default="results", help="the result and its heatmap go under OUT/<small>__<large>/<dataset>/"
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="both models' weights and activations; the statistics are float32 either way",
    )
    p.add_argument("--no-figures", action="store_true", help="save the result only")
    p.add_argument("--mesh", metavar="DATAxMODEL", help="device mesh, e.g. 8x1 or 1x8 (default: one device)")
    p.add_argument(
        "--distributed",
        action="store_true",
        help="multi-host: call jax.distributed.initialize() first; process 0 alone writes",
    )
    p.add_argument("--coordinator", metavar="HOST:PORT", help="with --distributed: process 0's address")
    p.add_argument("--num-processes", type=int, help="with --coordinator: how many processes take part")
    p.add_argument("--process-id", type=int, help="with --coordinator: this process's index, 0 .. N-1")
    p.set_defaults(func=_map)
