"""Table 1 of the second study from saved results: effective depth and ratio by method x
dataset x model. Nothing is recomputed: the curves are read from the result files."""

from __future__ import annotations

import csv
import io
import os
from typing import Iterable

from jaxdepth import effective_depth as ed
from jaxdepth.atomic import atomic_write
from jaxdepth.results import load_result

METHODS = ("cosine", "kl", "overlap")


def collect(roots: Iterable[str]) -> list[dict]:
    """One row per (model, dataset, method) for every `<model>/<dataset>/` folder under `roots`
    (a root may also be a model folder or a dataset folder itself)."""
    rows = []
    for root in roots:
        if not os.path.isdir(root):
            raise FileNotFoundError(f"no results folder {root}")
        found = False
        for folder, _, files in sorted(os.walk(root)):
            if "contributions.npz" not in files and "logit_lens.npz" not in files:
                continue
            found = True
            rows.extend(_rows_for(folder, files))
        if not found:
            raise FileNotFoundError(f"no contributions.npz or logit_lens.npz under {root}")
    return rows


def _rows_for(folder: str, files) -> list[dict]:
    depths, identity = {}, {}
    if "contributions.npz" in files:
        r = load_result(os.path.join(folder, "contributions.npz"))
        depths["cosine"] = ed.cosine_effective_depth(r.mean_cosine)
        identity = r.settings.get("identity", {})
    if "logit_lens.npz" in files:
        r = load_result(os.path.join(folder, "logit_lens.npz"))
        depths["kl"] = ed.kl_effective_depth(r.kl)
        depths["overlap"] = ed.overlap_effective_depth(r.overlap)
        identity = identity or r.settings.get("identity", {})
    model = identity.get("model", os.path.basename(os.path.dirname(folder)))
    dataset = identity.get("dataset", os.path.basename(folder))
    return [{"model": model, "dataset": dataset, "method": m, "layers": d.num_layers,
             "ed": d.layer, "ratio": None if d.ratio is None else round(d.ratio, 4)}
            for m, d in depths.items()]


def to_csv(rows: list[dict]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=["model", "dataset", "method", "layers", "ed", "ratio"])
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("none" if v is None else v) for k, v in row.items()})
    return out.getvalue()


def to_markdown(rows: list[dict]) -> str:
    """Rows (model, dataset), columns 'ED (ratio)' per method; 'none' where nothing crosses."""
    cells = {(r["model"], r["dataset"], r["method"]): r for r in rows}
    keys = sorted({(r["model"], r["dataset"]) for r in rows})
    lines = ["| model | dataset | L | cosine ED (ratio) | KL ED (ratio) | overlap ED (ratio) |",
             "|---|---|---|---|---|---|"]
    for model, dataset in keys:
        layers = next(r["layers"] for r in rows if (r["model"], r["dataset"]) == (model, dataset))
        entries = []
        for method in METHODS:
            r = cells.get((model, dataset, method))
            entries.append("-" if r is None else "none" if r["ed"] is None else f"{r['ed']} ({r['ratio']:.2f})")
        lines.append(f"| {model} | {dataset} | {layers} | " + " | ".join(entries) + " |")
    return "\n".join(lines) + "\n"


def write_table(rows: list[dict], out_prefix: str) -> tuple[str, str]:
    """Write `<out_prefix>.md` and `<out_prefix>.csv` atomically; return their paths."""
    paths = []
    for ext, text in ((".md", to_markdown(rows)), (".csv", to_csv(rows))):
        path = out_prefix + ext
        with atomic_write(path, "w") as f:
            f.write(text)
        paths.append(path)
    return paths[0], paths[1]
