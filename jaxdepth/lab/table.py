"""Table 1 of the second study from saved results: effective depth and ratio by method x
dataset x model, with a bootstrap interval over prompts where the results carry per-prompt
curves. Nothing is recomputed on the model: the curves are read from the result files, each
through what its analysis declares (`feeds_table` and its `depth` reading: the residual
cosine's and the logit lens's effective depths, or a plugin's)."""

from __future__ import annotations

import csv
import io
import os
from typing import Iterable

from jaxdepth.analyses import uncertainty
from jaxdepth.core.atomic import atomic_write
from jaxdepth.lab.results import load_result

__all__ = [
    "collect",
    "result_identity",
    "with_model_labels",
    "per_prompt_rows",
    "to_csv",
    "per_prompt_csv",
    "to_markdown",
    "write_table",
    "METHODS",
    "COLUMNS",
    "PER_PROMPT_COLUMNS",
    "PER_PROMPT_SUFFIX",
    "LEVEL",
]


METHODS = ("cosine", "kl", "overlap")
COLUMNS = ("model", "dataset", "method", "layers", "ed", "ratio", "ed_low", "ed_high")
PER_PROMPT_COLUMNS = ("model", "dataset", "method", "prompt", "ed")
PER_PROMPT_SUFFIX = "_per_prompt.csv"  # `write_table` writes `<out_prefix>_per_prompt.csv`
LEVEL = uncertainty.DEFAULT_LEVEL


def collect(
    roots: Iterable[str], *, resamples: int = uncertainty.DEFAULT_RESAMPLES, seed: int = uncertainty.DEFAULT_SEED
) -> list[dict]:
    """One row per (model, dataset, method) for every `<model>/<dataset>/` folder under `roots`
    (a root may also be a model folder or a dataset folder itself).

    Where a result carries per-prompt curves and `resamples > 0`, the row also holds the 95%
    bootstrap interval over prompts (`ed_low`, `ed_high`; `resamples` and `seed` as in
    `uncertainty.effective_depth_intervals`); `resamples=0`, or a result saved without
    per-prompt curves, leaves the row without one (`resamples` 0). `per_prompt` holds each
    prompt's own effective depth where the curves allow (else None)."""
    if resamples < 0:
        raise ValueError(f"resamples must be >= 0 (0: no bootstrap), got {resamples}")
    rows, tables = [], _table_analyses()
    for root in roots:
        if not os.path.isdir(root):
            raise FileNotFoundError(f"no results folder {root}")
        found = False
        for folder, _, files in sorted(os.walk(root)):
            for entry in tables:
                if f"{entry.name}.npz" in files:
                    found = True
                    rows.extend(_rows_for(folder, entry, resamples, seed))
        if not found:
            raise FileNotFoundError(f"no {' or '.join(f'{e.name}.npz' for e in tables)} under {root}")
    return with_model_labels(rows)


def result_identity(result, folder: str) -> dict:
    """`model`, `fingerprint` and `dataset` of a result saved in `folder`: as its identity records
    them, else (results saved before they were recorded) the folders' names and no fingerprint."""
    identity = result.settings.get("identity", {})
    return {
        "model": identity.get("model", os.path.basename(os.path.dirname(folder))),
        "fingerprint": identity.get("model_fingerprint"),
        "dataset": identity.get("dataset", os.path.basename(folder)),
    }


def with_model_labels(items: list, get=lambda item: item, put=None) -> list:
    """`items` (rows, or anything `get` reads a dict of `model` and `fingerprint` from) with each
    model named so that two models never read as one: the name as recorded, and where two
    different models (fingerprints) share it, the first 8 digits of each one's fingerprint after
    it (`tiny [1f3a9c20]`). `put(item, label)` returns the item renamed (default: a dict's
    `model` replaced)."""
    put = put or (lambda item, label: {**item, "model": label})
    prints: dict = {}
    for item in items:
        prints.setdefault(get(item)["model"], set()).add(get(item)["fingerprint"])
    renamed = []
    for item in items:
        model, fingerprint = get(item)["model"], get(item)["fingerprint"]
        shared = len(prints[model]) > 1
        renamed.append(put(item, f"{model} [{(fingerprint or 'unrecorded')[:8]}]") if shared else item)
    return renamed


def _table_analyses() -> list:
    """The registered analyses whose results feed the table (`Analysis.feeds_table`), each read
    through its declared `depth` reading."""
    from jaxdepth.lab.registry import ANALYSES

    return [entry for entry in ANALYSES.values() if entry.feeds_table]


def _rows_for(folder: str, entry, resamples: int, seed: int) -> list[dict]:
    """The rows of one result of `folder`: each effective depth its analysis's reading declares,
    under the identity of the file it comes from (two files of one folder from two models, as
    older versions could write, are two rows)."""
    r = load_result(os.path.join(folder, f"{entry.name}.npz"))
    reading = entry.depth(r)
    per_prompt, intervals = {}, {}
    if reading.per_prompt:
        per_prompt = uncertainty.per_prompt_depths(r)
        if resamples > 0:
            intervals = uncertainty.effective_depth_intervals(r, resamples=resamples, seed=seed, level=LEVEL)
    identity = result_identity(r, folder)
    rows = []
    for m, d in reading.effective_depths.items():
        interval = intervals.get(m)
        rows.append(
            {
                **identity,
                "method": m,
                "layers": d.num_layers,
                "ed": d.layer,
                "ratio": None if d.ratio is None else round(d.ratio, 4),
                "ed_low": None if interval is None else interval.low,
                "ed_high": None if interval is None else interval.high,
                "resamples": 0 if interval is None else interval.resamples,
                "per_prompt": None if m not in per_prompt else [p.layer for p in per_prompt[m]],
            }
        )
    return rows


def per_prompt_rows(roots: Iterable[str]) -> list[dict]:
    """One row per (model, dataset, method, prompt): each prompt's own effective depth (None
    where its curve does not cross), for results that carry per-prompt curves."""
    return _per_prompt_rows(collect(roots, resamples=0))


def _per_prompt_rows(rows: list[dict]) -> list[dict]:
    return [
        {"model": r["model"], "dataset": r["dataset"], "method": r["method"], "prompt": i, "ed": layer}
        for r in rows
        if r.get("per_prompt") is not None
        for i, layer in enumerate(r["per_prompt"])
    ]


def _csv(rows: list[dict], columns) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(columns), extrasaction="ignore")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("none" if v is None else v) for k, v in row.items()})
    return out.getvalue()


def to_csv(rows: list[dict]) -> str:
    """The rows as CSV; `ed_low` and `ed_high` are empty where no interval was computed and
    'none' where a bound falls on resamples with no crossing."""
    bare = lambda r: not r.get("resamples")
    return _csv([{**r, "ed_low": "", "ed_high": ""} if bare(r) else r for r in rows], COLUMNS)


def per_prompt_csv(rows: list[dict]) -> str:
    """Rows of `per_prompt_rows` as CSV ('none' where a prompt's curve does not cross)."""
    return _csv(rows, PER_PROMPT_COLUMNS)


def _cell(r) -> str:
    if r is None:
        return "-"
    text = "none" if r["ed"] is None else str(r["ed"])
    if r.get("resamples"):
        bound = lambda b: "none" if b is None else str(b)
        text += f" [{bound(r['ed_low'])}, {bound(r['ed_high'])}]"
    return text if r["ed"] is None else f"{text} ({r['ratio']:.2f})"


def to_markdown(rows: list[dict]) -> str:
    """Rows (model, dataset), columns 'ED (ratio)' per method; 'none' where nothing crosses.
    Rows with a bootstrap interval read 'ED [low, high] (ratio)', the interval at 95% over
    prompts, and a note below the table says how it was drawn."""
    cells = {(r["model"], r["dataset"], r["method"]): r for r in rows}  # models named apart by `collect`
    keys = sorted({(r["model"], r["dataset"]) for r in rows})
    resamples = max((r.get("resamples", 0) for r in rows), default=0)
    what = f"ED [{LEVEL:.0%}] (ratio)" if resamples else "ED (ratio)"
    lines = [f"| model | dataset | L | cosine {what} | KL {what} | overlap {what} |", "|---|---|---|---|---|---|"]
    for model, dataset in keys:
        layers = next(r["layers"] for r in rows if (r["model"], r["dataset"]) == (model, dataset))
        entries = [_cell(cells.get((model, dataset, method))) for method in METHODS]
        lines.append(f"| {model} | {dataset} | {layers} | " + " | ".join(entries) + " |")
    if resamples:
        lines += [
            "",
            f"[low, high]: {LEVEL:.0%} percentile interval of the effective depth over "
            f"{resamples} bootstrap resamples of the prompts; 'none': no layer qualifies.",
        ]
    return "\n".join(lines) + "\n"


def write_table(rows: list[dict], out_prefix: str) -> tuple[str, str]:
    """Write `<out_prefix>.md` and `<out_prefix>.csv` atomically and return their paths; where
    the rows carry per-prompt effective depths, also `<out_prefix>_per_prompt.csv`
    (`PER_PROMPT_SUFFIX`)."""
    files = [(out_prefix + ".md", to_markdown(rows)), (out_prefix + ".csv", to_csv(rows))]
    if any(r.get("per_prompt") is not None for r in rows):
        files.append((out_prefix + PER_PROMPT_SUFFIX, per_prompt_csv(_per_prompt_rows(rows))))
    for path, text in files:
        with atomic_write(path, "w") as f:
            f.write(text)
    return files[0][0], files[1][0]
