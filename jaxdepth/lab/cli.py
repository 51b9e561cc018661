"""The `jaxdepth` command: `convert` a checkpoint, `run` the analyses on a model, look at one prompt
closely (`case`), train and read a `tuned-lens`, `map` a smaller model's layers onto a larger
one's, find a `circuit` on clean/corrupt prompt pairs, and `table` saved results."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
import traceback
from functools import partial
from typing import NoReturn

from jaxdepth.lab.meshes import mesh_from_args
from jaxdepth.lab.optional import MissingDependencyError

__all__ = [
    "BASELINE_PROMPTS",
    "erasure_baseline_prompts",
    "analysis_options",
    "build_parser",
    "main",
    "interrupted_message",
]


def _convert(args) -> int:
    import numpy as np

    from conversion.checkpoint import save_converted
    from jaxdepth.lab.sources import convert_source

    dtype = {"float32": np.float32, "bfloat16": "bfloat16"}[args.dtype]
    if dtype == "bfloat16":
        import ml_dtypes

        dtype = ml_dtypes.bfloat16
    start = time.perf_counter()
    converted = convert_source(args.source, dtype=dtype)
    path = save_converted(converted, args.out_dir, overwrite=args.overwrite)
    c = converted.config
    print(
        f"converted {args.source} ({c.model_type}, {c.num_layers} layers, d={c.hidden_size}) "
        f"to {path} in {time.perf_counter() - start:.1f} s"
    )
    return 0


def _data_paths(specs, datasets) -> dict:
    """`--data` entries: `NAME=PATH`, or a bare PATH when exactly one dataset is run."""
    paths = {}
    for spec in specs or []:
        name, sep, path = spec.partition("=")
        if not sep:
            if len(datasets) != 1:
                raise ValueError("with several datasets, give --data as NAME=PATH")
            name, path = datasets[0], spec
        paths[name] = path
    return paths


BASELINE_PROMPTS = 10  # METHODS §4: the mean residual of the first 10 GSM8K test prompts


def erasure_baseline_prompts(baseline_data, datasets, paths) -> tuple:
    """The prompts whose mean residual is the erasure baseline, and a sentence saying which.

    The studies use the first 10 GSM8K test prompts. Without `--baseline-data`, take them from
    what this run can read without a network: the run's own GSM8K prompts (`--data gsm8k=...` or
    the hub), else the embedded default prompts (GSM8K rows, shipped with jaxdepth), else the
    hub; when none is readable, each dataset's own prompts (None), with a warning."""
    from jaxdepth.lab.prompts import DatasetError, load_prompts

    if baseline_data is not None:
        return load_prompts("gsm8k", baseline_data, BASELINE_PROMPTS), f"gsm8k[:10] from {baseline_data}"
    if "gsm8k" in datasets:
        source = paths.get("gsm8k")
        return (
            load_prompts("gsm8k", source, BASELINE_PROMPTS),
            f"gsm8k[:10] from {source or 'the hub'} (the run's own GSM8K prompts)",
        )
    if "default" in datasets:
        return (
            load_prompts("default", None, BASELINE_PROMPTS),
            "default[:10] (the embedded prompts, offline; the studies use GSM8K test[:10]: --baseline-data)",
        )
    try:
        return load_prompts("gsm8k", None, BASELINE_PROMPTS), "gsm8k[:10] from the hub"
    except DatasetError as e:
        print(f"warning: erasure baseline falls back to each dataset's own prompts: {e}", file=sys.stderr)
        return None, "each dataset's own first prompts (GSM8K unavailable offline; pass --baseline-data)"


def _load_model(args, mesh, start: float):
    """The model of `--model` in `--dtype`, and its name for result folders and the cache: bf16
    results are a different model for the cache, the folders and the table."""
    import jax

    from jaxdepth.core.compilation import cpu_multiplies_bf16_fast
    from jaxdepth.lab.sources import load
    from jaxdepth.lab.study import saved_model_name

    model = load(args.model, dtype=None if args.dtype == "float32" else args.dtype, mesh=mesh)
    if model.tokenizer is None:
        raise ValueError(f"the model from {args.model} has no tokenizer; prompts cannot be encoded")
    print(f"loaded {args.model} in {time.perf_counter() - start:.1f} s")
    if args.dtype == "float32" and jax.default_backend() == "cpu" and cpu_multiplies_bf16_fast():
        _hint_once(
            "amx",
            "this CPU has AMX: --dtype bf16-matmuls runs the matmuls 3-4x faster (docs/precision.md#bf16-matmuls; "
            "said once, the --help of run repeats it)",
        )
    return model, saved_model_name(args.model, args.dtype)


def _hint_once(name: str, text: str) -> None:
    """Print `text` unless it was printed before for this user on this machine: a marker file
    `hints/<name>` in the jaxdepth cache folder (`cache_dir`) remembers it. A hint every run
    repeats is noise in every log; where the marker cannot be written, the hint is printed."""
    from jaxdepth.core.atomic import atomic_write
    from jaxdepth.lab.sources import cache_dir

    marker = os.path.join(cache_dir(), "hints", name)
    if os.path.exists(marker):
        return
    print(text)
    with contextlib.suppress(OSError):
        with atomic_write(marker, "w") as f:
            f.write(f"{text}\n")


def _study_settings(args, entries, **common):
    """`StudySettings` of a run of `entries` (`Analysis` declarations): the analyses' options as
    parsed (`analysis_options`) and the `common` settings, each analysis's own settings checked
    now (a bad combination fails before the model loads) and their warnings printed."""
    from jaxdepth.lab.registry import declared_options
    from jaxdepth.lab.study import StudySettings

    options = {name: getattr(args, name) for name in declared_options(entries) if hasattr(args, name)}
    settings = StudySettings(seed=args.seed, options=options, **common)
    warnings = dict.fromkeys(w for own in settings.check(entries) for w in own.warnings())
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    return settings


def _run(args) -> int:
    from jaxdepth.core.sharding import is_writer
    from jaxdepth.lab.plugins import owners
    from jaxdepth.lab.prompts import DATASETS, load_prompts
    from jaxdepth.lab.registry import ANALYSES, default_analyses
    from jaxdepth.lab.runs import hold_folders
    from jaxdepth.lab.study import Failures, result_folder, source_results_key

    start = time.perf_counter()
    plugins = _named_plugins(args)
    if plugins is None:
        return 2
    plugin_of = owners(plugins)
    failures = Failures(isolated=plugin_of)  # a plugin's analysis may fail; the others' results are kept
    analyses = args.analyses.split(",") if args.analyses else default_analyses()
    unknown = set(analyses) - set(ANALYSES)
    if unknown:
        raise ValueError(f"unknown analyses {sorted(unknown)}; known: {', '.join(ANALYSES)}")
    settings = _study_settings(
        args, [ANALYSES[a] for a in analyses], num_prompts=args.prompts, detail_prompts=args.detail_prompts
    )
    paths = _data_paths(args.data, args.dataset)
    # Read every prompt set before the model: a bad file should fail in a second, not after a load.
    texts = {
        name: load_prompts(name, paths.get(name), limit=None if DATASETS[name].max_tokens else args.prompts)
        for name in args.dataset
    }
    baseline_texts, baseline_name = (
        erasure_baseline_prompts(args.baseline_data, args.dataset, paths)
        if any(ANALYSES[a].uses_baseline for a in analyses)
        else (None, None)
    )
    mesh = mesh_from_args(args)
    # Held from before the load to the last figure: a second run on any of these folders is
    # refused at once, and nothing else writes them meanwhile.
    # The folders are the model's (its name and fingerprint), known before it loads.
    model_key = source_results_key(args.model, args.dtype)
    folders = [result_folder(args.out, model_key[0], name) for name in args.dataset]
    with hold_folders(folders):
        model, model_name = _load_model(args, mesh, start)
        summary = _study_datasets(
            args,
            model,
            (model_name, model_key),
            texts,
            baseline_texts,
            analyses=analyses,
            settings=settings,
            mesh=mesh,
            baseline_name=baseline_name,
            failures=failures,
        )
    if baseline_name is not None:
        print(f"erasure baseline: {baseline_name}")
    print("\n".join(summary))
    if any(ANALYSES[a].feeds_table for a in analyses) and is_writer():
        from jaxdepth.lab.table import collect, to_markdown, write_table

        rows = collect([args.out], resamples=args.bootstrap)
        print(to_markdown(rows), end="")
        if _can_write(args.out, "the effective-depth table"):
            write_table(rows, os.path.join(args.out, "effective_depth_table"))
    print(f"total {time.perf_counter() - start:.1f} s; results in {args.out}")
    failed = [(plugin_of[f.name], f"(analysis {f.name!r}) raised while {f.stage}", f.error) for f in failures.records]
    _report_plugin_failures(failed)
    return 1 if failed else 0


def _study_datasets(
    args, model, names, texts, baseline_texts, *, analyses, settings, mesh, baseline_name, failures
) -> list[str]:
    """`jaxdepth run`'s studies, one per dataset of `texts` (name -> prompts): results, figures,
    and the summary lines it prints (process 0's; the other processes' are empty). `names`:
    the model's name and its `(key, fingerprint)` (`jaxdepth.lab.study.source_results_key`)."""
    model_name, model_key = names
    import jax

    from jaxdepth.core.sharding import is_writer
    from jaxdepth.lab.prompts import DATASETS, encode
    from jaxdepth.lab.registry import ANALYSES
    from jaxdepth.lab.study import StudyPrompts, StudyRun, result_folder, run_study, write_figures

    def encoded(name, prompts, limit):
        return encode(
            model.tokenizer,
            prompts,
            max_tokens=DATASETS[name].max_tokens,
            context=model.config.max_position_embeddings,
            limit=limit,
            buckets=args.length_buckets,
        )

    baseline = None if baseline_texts is None else encoded("gsm8k", baseline_texts, BASELINE_PROMPTS)
    summary = []
    for name in args.dataset:
        batch = encoded(name, texts[name], args.prompts)
        print(f"{name}: {len(batch)} prompts, {int(batch.valid.sum())} tokens")
        with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
            results = run_study(
                model,
                model_name,
                StudyPrompts(name, batch, baseline, baseline_name),
                args.out,
                analyses=analyses,
                settings=settings,
                model_key=model_key,
                run=StudyRun(failures=failures),
            )
        if not is_writer():  # multi-host: process 0 alone writes figures, the summary and the table
            continue
        folder = result_folder(args.out, model_key[0], name)
        if not args.no_figures and _can_write(folder, "figures"):
            if write_figures(results, folder, model.tokenizer, failures=failures):
                print(f"  figures in {os.path.join(folder, 'figures')}")
        line = [name]
        for a, result in results.items():
            with failures.guard(a, "summing up its result"):
                line.extend(ANALYSES[a].summary(result))
        summary.append("  " + "; ".join(line))
    return summary


def _can_write(folder: str, what: str) -> bool:
    """Whether `folder` can be written; where not (a read-only results folder, read by a rerun
    whose results all exist), says that `what` is not written there."""
    from jaxdepth.core.atomic import writable

    if writable(folder):
        return True
    print(f"{what} not written: {folder} is read-only", file=sys.stderr)
    return False


def _report_plugin_failures(failed) -> None:
    """Print each (plugin label, what went wrong, error): the tracebacks first, for the plugin's
    author, then one line each, last, for the user."""
    for label, what, error in failed:
        traceback.print_exception(error, file=sys.stderr)
    for label, what, error in failed:
        print(f"error: plugin {label} {what}: {type(error).__name__}: {error}", file=sys.stderr)


def _named_plugins(args):
    """The plugins the command names (`--plugin`) and the installed ones, loaded; None, after
    saying which, when one fails to load: a misspelt plugin should cost a second, not a run."""
    from jaxdepth.lab.plugins import load_plugins

    plugins = load_plugins(args.plugin or ())
    not_loaded = [p for p in plugins if p.error is not None]
    if not_loaded:
        _report_plugin_failures([(p.label, "failed to load", p.error) for p in not_loaded])
        print(
            f"error: nothing was run; plugins that failed to load: {', '.join(p.label for p in not_loaded)} "
            "(correct the --plugin MODULE:OBJECT, or fix or uninstall the distribution of an entry point)",
            file=sys.stderr,
        )
        return None
    return plugins


def _case(args) -> int:
    from jaxdepth.lab.case_study import case_prompt, check_analyses, check_answer_tokens, write_case_figures
    from jaxdepth.lab.prompts import encode
    from jaxdepth.lab.registry import ANALYSES
    from jaxdepth.lab.runs import hold_folders
    from jaxdepth.lab.study import StudyPrompts, result_folder, run_study, source_results_key

    start = time.perf_counter()
    if _named_plugins(args) is None:
        return 2
    if args.source and args.model and args.source != args.model:
        raise ValueError(f"two models given: {args.source} and --model {args.model}")
    args.model = args.model or args.source or "smollm2"
    analyses = check_analyses(args.analyses.split(","))
    settings = _study_settings(args, [ANALYSES[a] for a in analyses], num_prompts=1)
    prompt, name = case_prompt(
        question=args.prompt, answer=args.answer, dataset=args.dataset, row=args.row, data_path=args.data
    )
    datasets = [args.dataset or "default"]
    baseline_texts, baseline_name = (
        erasure_baseline_prompts(args.baseline_data, datasets, {args.dataset: args.data})
        if any(ANALYSES[a].uses_baseline for a in analyses)
        else (None, None)
    )
    model_key = source_results_key(args.model, args.dtype)
    folder = result_folder(args.out, model_key[0], name)
    with hold_folders([folder]):  # from before the load to the last figure; a second run is refused at once
        model, model_name = _load_model(args, None, start)
        context = model.config.max_position_embeddings
        batch = encode(model.tokenizer, [prompt], context=context, buckets=args.length_buckets)
        baseline = (
            None
            if baseline_texts is None
            else encode(
                model.tokenizer, baseline_texts, context=context, buckets=args.length_buckets, limit=BASELINE_PROMPTS
            )
        )
        answer_tokens = check_answer_tokens(batch, prompt)
        print(f"{name}: {int(batch.lengths[0])} tokens, the last {answer_tokens} of them the answer {prompt.answer!r}")
        results = run_study(
            model,
            model_name,
            StudyPrompts(name, batch, baseline, baseline_name),
            args.out,
            analyses=analyses,
            settings=settings,
            model_key=model_key,
        )
        if baseline_name is not None:
            print(f"erasure baseline: {baseline_name}")
        for analysis_name, result in results.items():
            print("  " + "; ".join(ANALYSES[analysis_name].summary(result)))
        if not args.no_figures and _can_write(folder, "figures"):
            paths = write_case_figures(results, folder, model.tokenizer)
            print(f"figures in {os.path.dirname(paths[0])}" if paths else "no figures")
    print(f"total {time.perf_counter() - start:.1f} s; results in {folder}")
    return 0


def _table(args) -> int:
    from jaxdepth.lab.table import collect, to_markdown, write_table

    rows = collect(args.results, resamples=args.bootstrap)
    print(to_markdown(rows), end="")
    md, csv_path = write_table(rows, args.out)
    print(f"wrote {md} and {csv_path}")
    return 0


def _compare(args) -> int:
    from jaxdepth.core.atomic import atomic_write
    from jaxdepth.lab.depth_comparison import depth_comparison_figure, depth_profiles, profiles_markdown
    from jaxdepth.lab.kind_comparison import kind_comparisons, kind_figure, kinds_markdown
    from jaxdepth.lab.plots import save_figure
    from jaxdepth.lab.study import slug

    profiles = depth_profiles(args.results)
    by_kind, notes = kind_comparisons(profiles, args.split)  # refused before anything is written
    table = profiles_markdown(profiles)
    print(table, end="")
    png, pdf = save_figure(depth_comparison_figure(profiles), args.out)
    with atomic_write(f"{args.out}.md", "w") as f:
        f.write(table)
    print(f"wrote {png}, {pdf} and {args.out}.md")
    for note in notes:
        print(note, file=sys.stderr)
    if by_kind:
        kinds_table = kinds_markdown(by_kind)
        print(kinds_table, end="")
        written = []
        for c in by_kind:
            written.extend(save_figure(kind_figure(c), f"{args.out}_kinds_{slug(c.model)}_{slug(c.dataset)}"))
        with atomic_write(f"{args.out}_kinds.md", "w") as f:
            f.write(kinds_table)
        print(f"wrote {', '.join(written)} and {args.out}_kinds.md")
    return 0


def _tuned_lens(args) -> int:
    from jaxdepth.analyses.tuned_lens import LensTrainingSettings
    from jaxdepth.lab.lens_study import compare_lenses, comparison_markdown, parse_rows, save_comparison
    from jaxdepth.lab.sources import load
    from jaxdepth.lab.prompts import encode, load_prompts
    from jaxdepth.lab.runs import hold_folders
    from jaxdepth.lab.study import result_folder, source_results_key

    train_rows, eval_rows = parse_rows(args.train_rows), parse_rows(args.eval_rows)
    prompts = load_prompts(args.dataset, args.data)
    train, held_out = prompts[train_rows], prompts[eval_rows]
    if not train or not held_out:
        raise ValueError(
            f"{args.dataset} has {len(prompts)} rows: rows {args.train_rows} (training) and "
            f"{args.eval_rows} (evaluation) must both select some"
        )
    rows = lambda s: set(range(*s.indices(len(prompts))))  # noqa: E731
    if rows(train_rows) & rows(eval_rows):
        raise ValueError("the training and evaluation rows overlap: a lens must be read on prompts it never saw")
    settings = LensTrainingSettings(
        steps=args.steps, tokens_per_step=args.tokens_per_step, learning_rate=args.learning_rate, seed=args.seed
    )
    out = result_folder(args.out, source_results_key(args.model)[0], args.dataset)
    with hold_folders([out]):  # the folder `run` holds for this model and dataset: one writer at a time
        model = load(args.model)
        context = model.config.max_position_embeddings
        print(
            f"training a tuned lens on {args.dataset} rows {args.train_rows} ({len(train)} prompts), "
            f"reading rows {args.eval_rows} ({len(held_out)} prompts); lens in {os.path.join(out, 'lens')}"
        )
        comparison = compare_lenses(
            model,
            encode(model.tokenizer, train, context=context, buckets=args.length_buckets),
            encode(model.tokenizer, held_out, context=context, buckets=args.length_buckets),
            settings,
            os.path.join(out, "lens"),
            weighting=args.weighting,
        )
        for path in save_comparison(comparison, out, figures=not args.no_figures, resamples=args.bootstrap):
            print(f"wrote {path}")
    print(comparison_markdown(comparison.results, resamples=args.bootstrap), end="")
    print("seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in comparison.seconds.items()))
    return 0


def _analysis_names() -> list[str]:
    return [entry.name for entry in _registered()]


def _registered() -> list:
    """The registered analyses (`jaxdepth.lab.registry.ANALYSES`), built-in and plugins'."""
    from jaxdepth.lab.registry import ANALYSES

    return list(ANALYSES.values())


def _dataset_names() -> list[str]:
    from jaxdepth.lab.prompts import DATASETS

    return list(DATASETS)


def analysis_options(parser, entries) -> None:
    """Add the options the settings of `entries` declare (`jaxdepth.analyses.suite.option`):
    `--name-with-dashes`, the field's default, choices and help, its text parsed as the field
    says."""
    from jaxdepth.analyses.suite import option_flag
    from jaxdepth.lab.registry import declared_options

    for name, field in declared_options(entries).items():
        spec = field.metadata["option"]
        default = field.default
        shown = ",".join(default) if isinstance(default, tuple) else default
        parser.add_argument(
            option_flag(name),
            dest=name,
            default=default,
            type=partial(_parsed, field),
            choices=spec["choices"],
            metavar=spec["metavar"] or (None if spec["choices"] else name.upper()),
            help=spec["help"] + ("" if default is None or "default" in spec["help"] else f" (default: {shown})"),
        )


def _parsed(field, text: str):
    from jaxdepth.analyses.suite import parse_option

    try:
        return parse_option(field, text)
    except ValueError as e:  # argparse shows the message of an ArgumentTypeError only
        raise argparse.ArgumentTypeError(str(e)) from None


def _dtype_argument(parser):
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "bf16-matmuls"],
        default="float32",
        help="bfloat16: weights and activations in bf16, statistics in float32; bf16-matmuls: float32 "
        "activations, the layers' weight matrices in bf16, products accumulated in float32 (3-4x faster "
        "matmuls on CPUs with AMX; docs/precision.md)",
    )


def _compiling_arguments(parser):
    """Options of the commands that compile: the persistent compilation cache and the length
    buckets prompts are padded to."""
    parser.add_argument(
        "--no-compilation-cache",
        dest="compilation_cache",
        action="store_false",
        help="compile everything anew, keeping nothing (default: compiled programs are kept in "
        "$JAXDEPTH_CACHE/xla and reused by any later run of the same shapes)",
    )
    parser.add_argument(
        "--length-buckets",
        type=_length_buckets,
        default="geometric",
        metavar="POLICY",
        help="the lengths prompts are padded to, so that prompts of many lengths share a few "
        "compiled sweeps: 'geometric' (default: 16, 24, 32, 48, 64, 96, ..., padding a prompt "
        "by a fifth on average, at most a half), 'geometric:N' (the same ladder from N) or "
        "'multiple:N' (every multiple of N: the least padding, the most compilations). "
        "Results do not depend on it",
    )


def _length_buckets(text: str):
    """--length-buckets: a `jaxdepth.core.batch.LengthBuckets` (argparse converts the default too)."""
    from jaxdepth.core.batch import LengthBuckets

    try:
        return LengthBuckets.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _bootstrap_argument(parser):
    parser.add_argument(
        "--bootstrap",
        type=int,
        default=1000,
        metavar="N",
        help="bootstrap resamples of the prompts for the effective depths' 95%% intervals in the "
        "table (seeded; default 1000; 0: bare integers, no intervals)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The `jaxdepth` command line: every command's parser, with the suite's options."""
    from jaxdepth.lab.case_study import CASE_ANALYSES

    parser = argparse.ArgumentParser(prog="jaxdepth", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    convert = sub.add_parser("convert", help="convert a model to a jaxdepth checkpoint folder")
    convert.add_argument("source", help="HF folder, hub id, .gguf file, converted folder, or 'smollm2'")
    convert.add_argument("out_dir")
    convert.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    convert.add_argument("--overwrite", action="store_true")
    convert.set_defaults(func=_convert)

    run = sub.add_parser("run", help="run the analyses on a model and prompt set")
    run.add_argument("--model", default="smollm2", help="anything jaxdepth.load accepts (default: smollm2)")
    run.add_argument(
        "--dataset",
        nargs="+",
        default=["default"],
        choices=_dataset_names(),
        help="default: short arithmetic prompts shipped with jaxdepth (no network needed)",
    )
    run.add_argument(
        "--data",
        action="append",
        metavar="[NAME=]PATH",
        help="local JSONL file for a dataset (default: the hub via `datasets`)",
    )
    run.add_argument("--prompts", type=int, default=10)
    run.add_argument(
        "--detail-prompts",
        type=int,
        help="prompts for erasure and integrated gradients, the per-position sweeps (default: all)",
    )
    run.add_argument(
        "--baseline-data",
        help="GSM8K JSONL for the erasure baseline (its first 10 prompts); "
        "default: the run's GSM8K prompts, else the embedded prompts (offline), else the hub",
    )
    run.add_argument(
        "--analyses",
        help="comma-separated subset of the registered analyses: "
        f"{','.join(_analysis_names())} and the plugins' (default: all). attribution_patching and "
        "grad_x_act are first-order screening estimates (one backward pass per prompt): confirm what "
        "they find with the exact erasure",
    )
    run.add_argument(
        "--plugin",
        action="append",
        metavar="MODULE:OBJECT",
        help="add the analysis of a plugin (repeatable): OBJECT, an attribute of the importable "
        "MODULE, must be a jaxdepth.lab.registry.Analysis; it is registered and runs, caches, "
        "resumes, draws and sums up like a built-in one. The entry points of the group "
        "'jaxdepth.analyses' of installed distributions (NAME = MODULE:OBJECT) are loaded too. "
        "A name taken by a built-in or another plugin, or a plugin that fails to load, stops the "
        "run before any analysis runs (exit status 2); a plugin whose analysis raises is "
        "reported and the others' results are kept, with exit status 1",
    )
    run.add_argument("--seed", type=int, default=123)
    analysis_options(run, _registered())
    run.add_argument("--out", default="results")
    _bootstrap_argument(run)
    run.add_argument("--no-figures", action="store_true", help="save results only")
    run.add_argument("--mesh", metavar="DATAxMODEL", help="device mesh, e.g. 8x1 or 2x4 (default: one device)")
    run.add_argument(
        "--distributed",
        action="store_true",
        help="multi-host: call jax.distributed.initialize() first (TPU pods, multi-node GPU); every "
        "process runs the same command, process 0 alone writes",
    )
    run.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        help="with --distributed, where cluster auto-detection does not apply: process 0's address",
    )
    run.add_argument("--num-processes", type=int, help="with --coordinator: how many processes take part")
    run.add_argument("--process-id", type=int, help="with --coordinator: this process's index, 0 .. N-1")
    _dtype_argument(run)
    _compiling_arguments(run)
    run.set_defaults(func=_run)

    case = sub.add_parser(
        "case",
        help="one prompt looked at closely: residual erasure and integrated gradients of "
        "a question and its answer, with figures",
    )
    case.add_argument("source", nargs="?", metavar="MODEL", help="anything jaxdepth.load accepts (default: smollm2)")
    case.add_argument("--model", help="the model, as `run` takes it (instead of the positional MODEL)")
    case.add_argument(
        "--prompt", help="the question text, exactly as the model reads it (e.g. '5 + 7 + 5 + 3 + 1 + 7 = ')"
    )
    case.add_argument("--answer", help="the answer that follows it, teacher-forced and attributed (e.g. 28)")
    case.add_argument(
        "--dataset",
        choices=_dataset_names(),
        help="instead of --prompt: a row of a dataset, formatted as the studies do",
    )
    case.add_argument("--row", type=int, help="with --dataset: the row, 0-based")
    case.add_argument("--data", metavar="PATH", help="with --dataset: a local JSONL file (default: the hub)")
    case.add_argument(
        "--analyses",
        default=",".join(CASE_ANALYSES),
        help="per-prompt analyses to run (default: erasure,integrated_gradients; also "
        "attribution_patching, grad_x_act)",
    )
    case.add_argument(
        "--baseline-data",
        help="GSM8K JSONL for the erasure baseline (its first 10 prompts); "
        "default: as `run` (the dataset's GSM8K prompts, else the embedded prompts)",
    )
    case.add_argument("--seed", type=int, default=123)
    case.add_argument(
        "--plugin",
        action="append",
        metavar="MODULE:OBJECT",
        help="add the analysis of a plugin (repeatable), as `run` takes it; a case runs it where it is per-prompt "
        "or has a per-token view",
    )
    from jaxdepth.lab.case_study import case_analysis

    analysis_options(case, [entry for entry in _registered() if case_analysis(entry)])
    _dtype_argument(case)
    case.add_argument(
        "--out",
        default="results",
        help="results under OUT/<model>/case_<prompt>/, figures in its "
        "figures/ (case.png: erasure above IG); a rerun reuses them",
    )
    case.add_argument("--no-figures", action="store_true", help="save results only")
    _compiling_arguments(case)
    case.set_defaults(func=_case)

    lens = sub.add_parser(
        "tuned-lens", help="train a tuned lens and read held-out prompts through it and the logit lens"
    )
    lens.add_argument("--model", default="smollm2", help="anything jaxdepth.load accepts (default: smollm2)")
    lens.add_argument("--dataset", default="gsm8k", choices=_dataset_names())
    lens.add_argument("--data", metavar="PATH", help="local JSONL file of the dataset (default: the hub)")
    lens.add_argument("--train-rows", default="10:250", help="rows to train on, START:STOP (default 10:250)")
    lens.add_argument("--eval-rows", default="0:10", help="held-out rows to read, START:STOP (default 0:10)")
    lens.add_argument("--steps", type=int, default=200, help="optimizer steps (default 200)")
    lens.add_argument(
        "--tokens-per-step", type=int, default=64, help="tokens drawn per step, all layers of each (default 64)"
    )
    lens.add_argument("--learning-rate", type=float, default=1e-3, help="Adam peak learning rate (default 1e-3)")
    lens.add_argument("--seed", type=int, default=0, help="token-draw seed (default 0)")
    lens.add_argument(
        "--weighting",
        choices=["prompt", "token"],
        default="prompt",
        help="how the held-out curves average over prompts (as `run`)",
    )
    lens.add_argument(
        "--out",
        default="results",
        help="the lens, both results, table and figure go under "
        "OUT/<model>/<dataset>/; a rerun resumes the training from its last checkpoint",
    )
    _bootstrap_argument(lens)
    lens.add_argument("--no-figures", action="store_true")
    _compiling_arguments(lens)
    lens.set_defaults(func=_tuned_lens)

    from jaxdepth.lab.mapping_study import add_parser as add_map_parser

    add_map_parser(sub)

    from jaxdepth.lab.circuit_study import add_parser as add_circuit_parser

    add_circuit_parser(sub)

    table = sub.add_parser("table", help="effective-depth table (Markdown and CSV) from saved results")
    table.add_argument("results", nargs="+", help="results folders written by `jaxdepth run`")
    table.add_argument("--out", default="effective_depth_table", help="output prefix for .md and .csv")
    _bootstrap_argument(table)
    table.set_defaults(func=_table)

    compare = sub.add_parser(
        "compare", help="every depth measure of saved results on one relative-depth axis (a figure and a table)"
    )
    compare.add_argument("results", nargs="+", help="results folders written by `jaxdepth run`")
    compare.add_argument(
        "--out",
        default="depth_comparison",
        help="output prefix for .png, .pdf and .md; a model whose layers come in kinds (linear and full attention, "
        "dense and sparse MLPs, sliding and full attention, layers without positions) adds its measures by kind: "
        "OUT_kinds_<model>_<dataset>.png and .pdf, and OUT_kinds.md",
    )
    from jaxdepth.lab.kind_comparison import SPLITS

    compare.add_argument(
        "--split",
        choices=list(SPLITS),
        help="how to split the layers into kinds where a model's split more than one way (a hybrid mixture of "
        "experts: mixer or mlp); default: the one way a model's layers split",
    )
    compare.set_defaults(func=_compare)
    return parser


def _keep_compiled_programs(keep: bool) -> None:
    """Compiled programs go to `$JAXDEPTH_CACHE/xla` (unless a JAX compilation cache is set):
    a rerun with other settings, or a resumed study, compiles only what is new. `keep` False
    (`--no-compilation-cache`): no persistent cache at all, a configured one included."""
    import jax

    from jaxdepth.core.compilation import use_compilation_cache
    from jaxdepth.lab.sources import cache_dir

    if not keep:
        jax.config.update("jax_enable_compilation_cache", False)
        return
    use_compilation_cache(os.path.join(cache_dir(), "xla"))


def _load_plugins_named_in(argv) -> None:
    """For `jaxdepth run` and `case`: load (and register) the plugins its arguments name and the
    installed ones, so that the parser offers their options; a plugin that fails to load is
    reported by the command itself, which loads the same plugins again (each is loaded once)."""
    if not argv or argv[0] not in ("run", "case"):
        return
    from jaxdepth.lab.plugins import load_plugins

    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("--plugin", action="append", default=[])
    load_plugins(early.parse_known_args(argv[1:])[0].plugin)


def main(argv=None) -> int:
    """The `jaxdepth` command; returns its exit status: 0, 1 (a command's own failure, said on its
    last line), 2 (an error: bad input, a missing file or dependency, a busy results folder) or
    130 (interrupted, Ctrl-C: one line says what is saved, and a rerun resumes from it).

    Called without `argv`, as the installed command and `python -m jaxdepth.lab.cli` call it, it
    takes Ctrl-C itself (`_CtrlC`): an interrupt ends the process with status 130, whenever it
    lands, once every block it interrupted has cleaned up; called with `argv` (from Python), an
    interrupt returns 130."""
    from jaxdepth.core.atomic import locked_folders

    # jaxdepth never needs torch: transformers' advice that it is missing is noise here.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    as_command = argv is None
    argv = sys.argv[1:] if argv is None else list(argv)
    # Every command that writes results holds their folders (`folder_lock`): those it held are
    # where the work finished before an interrupt is.
    with locked_folders() as written:
        ctrl_c = _CtrlC.take(written) if as_command else None
        interrupted = False
        try:
            status = _command(argv)
        except KeyboardInterrupt:
            interrupted = True
        except BaseException:
            if ctrl_c is None or not ctrl_c.noticed:
                raise
            interrupted = True  # the interrupt's KeyboardInterrupt became another error on its way out
    if ctrl_c is not None and ctrl_c.noticed:
        # every block the interrupt unwound has ended (atomic writes removed their temporaries,
        # folder locks let go); an interrupt that a swallowing callback delayed past the command's
        # end still ends it with 130
        ctrl_c.end()
    if interrupted:
        _say_interrupted(written)
        return 130
    if ctrl_c is not None:
        ctrl_c.give_back()
    return status


def _say_interrupted(folders) -> None:
    # on a line of its own: the terminal's ^C, or a progress bar, may end the current one
    print("\n" + interrupted_message(folders), file=sys.stderr, flush=True)


class _CtrlC:
    """How the `jaxdepth` command takes Ctrl-C (SIGINT): the first one raises KeyboardInterrupt in
    the main thread, as Python's own handler does, so that every `with` and `finally` on the way
    out runs (atomic writes remove their temporaries, folder locks let go); `main` then says the
    one line and `end`s the process.

    Why the process ends with `os._exit` rather than Python's exit: XLA compiles on threads of its
    own, and an interrupt that lands while the main thread waits for a compilation leaves that
    compilation running. Python's exit then collects the JAX client, whose destructor tears down
    the client's devices before it joins its compile threads; the compilation, finishing, builds
    its executable's shardings on a device already destroyed (`SingleDeviceSharding::Create`,
    called from `PjRtLoadedExecutable::Create`) and the process dies of a segmentation fault in
    libjax_common.so (exit 139), after the line was printed. `os._exit` skips that teardown: the
    kernel frees what the process held (its file locks included).

    Why an interrupt is raised again: Python delivers a signal at the next bytecode the main
    thread runs, and while it waits in XLA's C++ that bytecode is often a garbage-collection
    callback's (jax's `_xla_gc_callback`), a destructor's or a weakref callback's, where an
    exception cannot propagate: Python reports it as "Exception ignored" with a traceback and the
    command ran on to the end (exit 0). Such a swallowed KeyboardInterrupt is taken from
    `sys.unraisablehook`, silently, and raised again a moment later in ordinary code.

    A second Ctrl-C while the first one unwinds ends the process at once (the same line, status
    130), leaving what a kill leaves: a temporary or a lock file that the next run tidies away."""

    REDELIVERY_S = 0.05  # after a swallowed interrupt: soon, and outside the callback that swallowed it

    def __init__(self, written: list[str]):
        self.written = written  # the folders held so far (`locked_folders`), for the line
        self.noticed = False  # a Ctrl-C came
        self.in_flight = False  # its KeyboardInterrupt is on its way out to `main`
        self._previous_hook = sys.unraisablehook

    @classmethod
    def take(cls, written: list[str]) -> "_CtrlC | None":
        """Take SIGINT for this process; None where it is not Python's default handler (a
        background job's ignored SIGINT, a caller's own handler) or not in the main thread."""
        import threading

        if threading.current_thread() is not threading.main_thread():
            return None
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return None
        ctrl_c = cls(written)
        signal.signal(signal.SIGINT, ctrl_c._on_sigint)
        sys.unraisablehook = ctrl_c._on_unraisable
        return ctrl_c

    def give_back(self) -> None:
        """Python's own handling again (the command finished uninterrupted)."""
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.unraisablehook = self._previous_hook

    def _on_sigint(self, signum, frame):
        if self.in_flight:
            self.end()
        self.noticed = self.in_flight = True
        raise KeyboardInterrupt

    def _on_unraisable(self, unraisable) -> None:
        if self.in_flight and issubclass(unraisable.exc_type, KeyboardInterrupt):
            import threading

            self.in_flight = False
            # not from here: the main thread would take it inside this hook, swallowed again
            timer = threading.Timer(self.REDELIVERY_S, self._raise_again)
            timer.daemon = True
            timer.start()
            return
        self._previous_hook(unraisable)

    def _raise_again(self) -> None:
        import _thread

        if not self.in_flight:
            _thread.interrupt_main(signal.SIGINT)

    def end(self) -> NoReturn:
        """Say the one line, flush what is printed, and end the process with status 130."""
        with contextlib.suppress(OSError, ValueError):  # a closed pipe or stream has nobody to tell
            _say_interrupted(self.written)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError, AttributeError):
                stream.flush()
        os._exit(130)


def interrupted_message(folders) -> str:
    """The one line an interrupted command ends on: what is saved, and that a rerun resumes. A
    folder that was held and is gone again held nothing (`folder_lock` removes the folders it
    made where nothing was written): it is not named."""
    folders = [f for f in folders if os.path.isdir(f)]
    if not folders:
        return "interrupted before any results were written: nothing is saved"
    return f"interrupted: what was finished is saved in {', '.join(folders)}; the same command again resumes from there"


def _command(argv) -> int:
    try:
        _load_plugins_named_in(argv)  # before the parser: a plugin's analysis brings its options
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    try:
        if args.func is not _table:  # the others compile
            _keep_compiled_programs(getattr(args, "compilation_cache", True))
        return args.func(args)
    except (ValueError, OSError, MissingDependencyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
