"""What the benchmark prints and writes: the timestamped log, the report's rows, the tables and
the JSON copy."""

from __future__ import annotations

import json
import time

import numpy as np


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------- rows


def timing_row(analysis: str, w, jax, ref, ref_passes, model_flops: float, executed: float, jax_peak: float) -> dict:
    """One analysis' row: its workload `w`, jaxdepth's compiled `Timing` `jax`, the reference's
    `Timing` `ref` and its (forwards, backwards) per call (None: not run), the FLOPs."""
    first, second, r = jax.first_s, jax.run_s, None if ref is None else ref.run_s
    forwards, backwards = (None, None) if ref_passes is None else ref_passes
    return dict(
        analysis=analysis,
        workload=w.describe(),
        prompts=len(w.lengths),
        lengths=w.lengths,
        jax_first_s=first,
        jax_run_s=second,
        jax_compile_s=max(first - second, 0.0),
        ref_s=r,
        ratio=None if r is None else r / second,
        model_flops=model_flops,
        jax_flops_per_s=model_flops / second,
        executed_flops=executed,
        executed_flops_per_s=executed / second,
        jax_fraction_of_peak=executed / second / jax_peak,
        ref_flops_per_s=None if r is None else model_flops / r,
        ref_forwards=forwards,
        ref_backwards=backwards,
        others_cores_jax=jax.others_all,
        others_cores_ref=None if ref is None else ref.others,
    )


def totals(rows: list) -> dict:
    tot = lambda k: sum(r[k] for r in rows) if all(r[k] is not None for r in rows) else None  # noqa: E731
    out = dict(
        jax_first_s=tot("jax_first_s"),
        jax_run_s=tot("jax_run_s"),
        jax_compile_s=tot("jax_compile_s"),
        ref_s=tot("ref_s"),
        model_flops=tot("model_flops"),
    )
    out["ratio"] = None if out["ref_s"] is None else out["ref_s"] / out["jax_run_s"]
    return out


def study_total(rows: list) -> dict:
    """The TOTAL row of a full-study extrapolation (None where a row has no value)."""
    return dict(
        analysis="TOTAL",
        **{
            k: None if any(r[k] is None for r in rows) else sum(r[k] for r in rows)
            for k in ("model_flops", "executed_flops", "jax_s", "ref_s")
        },
    )


# ----------------------------------------------------------------------------- tables


def fmt_s(x):
    return "-" if x is None else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def fmt_flops(x):
    return "-" if x is None else f"{x / 1e9:.1f}G"


CONTENDED_CORES = 0.25


def fmt_cores(x) -> str:
    return "?" if x is None else f"{x:.2f}"


def _contended(row, cores=None) -> bool:
    """True when other processes took a noticeable share of the CPU during this row's timings."""
    return any(x is not None and x > CONTENDED_CORES for x in (row["others_cores_jax"], row["others_cores_ref"]))


def print_tables(report):
    peak = report["peak_flops"]
    print("\n" + "=" * 112)
    torch_peak = f", torch {peak['torch'] / 1e9:.1f} GFLOP/s" if peak.get("torch") else ""
    print(
        f"jaxdepth vs reference (PyTorch + HF hooks, as published)  |  {report['machine']['cpu']}, "
        f"{report['machine']['cores']} cores  |  matmul peak: jax {peak['jax'] / 1e9:.1f} GFLOP/s{torch_peak}"
    )
    print("-" * 112)
    head = (
        f"{'analysis':<22}{'jax 1st':>9}{'jax run':>9}{'compile':>9}{'ref':>9}{'ref/jax':>9}"
        f"{'model FLOPs':>13}{'executed':>10}{'exec FLOP/s':>12}{'% peak':>8}{'others j/r':>12}"
    )
    print(head)
    for r in report["rows"]:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.1f}x"
        pct = f"{100 * r['jax_fraction_of_peak']:.1f}"
        print(
            f"{r['analysis']:<22}{fmt_s(r['jax_first_s']):>9}{fmt_s(r['jax_run_s']):>9}"
            f"{fmt_s(r['jax_compile_s']):>9}{fmt_s(r['ref_s']):>9}{ratio:>9}"
            f"{r['model_flops'] / 1e12:>12.2f}T{r['executed_flops'] / 1e12:>9.2f}T"
            f"{fmt_flops(r['executed_flops_per_s']):>12}{pct:>8}"
            f"{fmt_cores(r['others_cores_jax']):>7}/"
            f"{'-' if r['ref_s'] is None else fmt_cores(r['others_cores_ref']):<4}"
            f"{'  *' if _contended(r, report['machine']['cores']) else ''}"
        )
    t = report["totals"]
    ratio = "-" if t["ratio"] is None else f"{t['ratio']:.1f}x"
    print(
        f"{'TOTAL':<22}{fmt_s(t['jax_first_s']):>9}{fmt_s(t['jax_run_s']):>9}{fmt_s(t['jax_compile_s']):>9}"
        f"{fmt_s(t['ref_s']):>9}{ratio:>9}{t['model_flops'] / 1e12:>12.2f}T"
    )
    print(
        "jax 1st = first call (compile + run); jax run = later calls (median of --repeat); compile = 1st - run; "
        "ref = reference (median of --repeat);\nmodel FLOPs = the work as the reference formulation runs it; "
        "executed = the matmul FLOPs jaxdepth runs (it skips the rest);\nexec FLOP/s = executed / run time, "
        "% peak of the jax matmul peak; others j/r = CPU cores other processes used during the\njaxdepth / "
        f"reference timing (of {report['machine']['cores']}; the worst call)"
    )
    if any(_contended(r, report["machine"]["cores"]) for r in report["rows"]):
        print(
            f"  * = timed while other processes took > {CONTENDED_CORES} cores: those times are "
            "inflated, the reference's\n    multi-threaded torch most (its OpenMP barriers stall when a "
            "thread is descheduled); rerun on a quiet machine"
        )
    if report["agreement"]:
        print("-" * 112)
        print(f"{'agreement':<22}{'quantity':<38}{'max |diff|':>14}{'scale':>12}  result")
        for a in report["agreement"]:
            if "max_abs_diff" in a:
                d = "-" if a["max_abs_diff"] is None else f"{a['max_abs_diff']:.3e}"
                s = "-" if a["scale"] is None else f"{a['scale']:.3g}"
                print(
                    f"{a['analysis']:<22}{a['quantity']:<38}{d:>14}{s:>12}  "
                    f"{'ok' if a['ok'] else 'DISAGREE'} ({a['note']})"
                )
            else:
                print(
                    f"{a['analysis']:<22}{a['quantity']:<38}{'jax ' + str(a['jaxdepth']):>14}"
                    f"{'ref ' + str(a['reference']):>12}  {'ok' if a['ok'] else 'DISAGREE'} {a['note']}"
                )
    est = report["study_workload_estimate"]
    print("-" * 112)
    print(
        "FULL STUDY WORKLOAD, extrapolated (jaxdepth: executed FLOPs / its executed FLOP/s above; reference: "
        "model FLOPs / its FLOP/s above;\nrough: efficiency changes with prompt length):"
    )
    print("  " + est["description"])
    _print_study_rows(est)
    adaptive, est = report.get("adaptive_ig"), report.get("study_workload_estimate_adaptive_ig")
    if adaptive is not None:
        print("-" * 112)
        print(
            f"ADAPTIVE IG PRESET (tolerance {adaptive['tolerance']}) on the IG workload: "
            f"{fmt_s(adaptive['jax_run_s'])} s ({fmt_s(adaptive['jax_first_s'])} s first call), "
            f"{adaptive['evaluations']:,} gradient evaluations against {adaptive['fixed_evaluations']:,} of the "
            f"fixed rule above,\n  {adaptive['ms_per_evaluation']:.1f} ms per gradient evaluation against the fixed "
            f"rule's {adaptive['fixed_ms_per_evaluation']:.1f} ms ({adaptive['gflops_per_s']:.0f} GFLOP/s of "
            f"gradient work against {adaptive['fixed_gflops_per_s']:.0f}: its evaluations are mostly of early "
            f"layers, which cross more "
            f"layers);\n  {adaptive['converged']}/{adaptive['layers']} layers converged, largest |gap| "
            f"{100 * adaptive['max_relative_gap']:.2f}% of |F(x) - F(b)| (certified). FULL STUDY again with it in "
            f"place of IG at 256 steps (jaxdepth's IG time x {est['share_of_published_ig_time']:.3f}: the measured "
            "adaptive time over the fixed rule's\n  scaled to 256 steps; the reference keeps the published rule, "
            "which does not converge on early layers: see experiments/ig_accuracy.py):"
        )
        _print_study_rows(est)
    print("=" * 112)


def _print_study_rows(est):
    print(f"{'analysis':<22}{'model FLOPs':>13}{'executed':>10}{'jaxdepth':>12}{'reference':>12}{'ref/jax':>9}")
    for r in est["rows"] + [est["total"]]:
        ref = "-" if r["ref_s"] is None else f"{r['ref_s'] / 3600:.2f} h"
        ratio = "-" if r["ref_s"] is None else f"{r['ref_s'] / r['jax_s']:.1f}x"
        print(
            f"{r['analysis']:<22}{r['model_flops'] / 1e12:>12.1f}T{r['executed_flops'] / 1e12:>9.1f}T"
            f"{r['jax_s'] / 3600:>10.2f} h{ref:>12}{ratio:>9}"
        )


def write_json_atomic(path, obj):
    from jaxdepth.core.atomic import atomic_write

    with atomic_write(path, "w") as f:
        json.dump(obj, f, indent=2, default=_json_default)


def _json_default(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.bool_):
        return bool(x)
    raise TypeError(type(x))
