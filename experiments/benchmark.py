"""Benchmark: jaxdepth against the reference approach (PyTorch + Hugging Face hooks, run the way
the published code runs each analysis: batch 1 and one forward pass per intervention, integrated
gradients in blocks of 16 steps; `experiments/reference_torch.py`) on the same model, the same
prompts and the same machine, in one run.

For every analysis it reports the jaxdepth wall time (the first call compiles and runs, the
next `--repeat` calls only run: their median), the reference wall time (median of `--repeat`), their ratio, the model
FLOPs of the workload and the FLOP/s jaxdepth achieves against a matmul peak measured in the
same run, and how far the two implementations' results are apart. Model loading is excluded
from every time.

The full workload of the studies (10 GSM8K prompts, erasure over every boundary and position,
IG at 256 steps over every layer) takes hours on a small CPU for either implementation, so the
expensive analyses have their own prompt counts and prompt-length caps; the printed workload
says exactly what ran. Example (the default workload, ~20 min on 2 CPU cores):

    JAXDEPTH_CACHE=/tmp/jdcache python experiments/benchmark.py

and a quick check that everything runs and agrees:

    python experiments/benchmark.py --prompts 2 --max-tokens 64 --ig-steps 8

What each analysis' case declares (how jaxdepth and the reference run it, its FLOP models, its
agreement check) is a module of `benchmarking/cases/`; the machine, the workloads and the report
are modules of `benchmarking/` beside them.
"""

from __future__ import annotations

from functools import partial
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from benchmarking.arguments import parse_args  # noqa: E402
from benchmarking.case import Bench  # noqa: E402
from benchmarking.cases import CASES, executed_flops, workload_flops  # noqa: E402
from benchmarking.cases.integrated_gradients import study_with_adaptive, time_adaptive  # noqa: E402
from benchmarking.machine import Clock, best_peak, cpu_description  # noqa: E402
from benchmarking.report import fmt_cores, log, print_tables, timing_row, totals, write_json_atomic  # noqa: E402
from benchmarking.study import full_study  # noqa: E402
from benchmarking.workload import build_workloads  # noqa: E402

IG = "integrated_gradients"


def main(argv=None) -> int:
    args = parse_args(argv, description=__doc__.split("\n\n")[0])
    wall_start = time.perf_counter()
    load_before = os.getloadavg()
    torch = require_reference()
    if torch is None:
        return 2
    torch.set_num_threads(args.torch_threads)
    import jax

    import jaxdepth

    log(
        f"jax {jax.__version__} on {jax.devices()}, torch {torch.__version__} with {torch.get_num_threads()} "
        f"threads, {os.cpu_count()} cores; load average before: {load_before[0]:.2f}"
    )
    if load_before[0] > 0.5 * os.cpu_count():
        log(
            "WARNING: the machine is busy (load average above half the cores): other processes compete "
            "for the CPU and every time below is inflated by them"
        )

    start = time.perf_counter()
    model = jaxdepth.load(args.model)
    c = model.config
    jax_load_s = time.perf_counter() - start
    log(
        f"jaxdepth loaded {args.model} in {jax_load_s:.1f} s (excluded): L={c.num_layers}, D={c.hidden_size}, "
        f"H={c.num_heads}/{c.num_kv_heads}, F={c.intermediate_size}, V={c.vocab_size}"
    )

    # ---- prompts: one encoding, then each case's prompts and cap, and what both sides share
    cases = {a: CASES[a] for a in args.analyses}
    full, workloads = build_workloads(model, args, cases)
    bench = Bench(model, args)
    for a, case in cases.items():
        case.prepare(bench, workloads[a], full)

    print("\nWORKLOAD (GSM8K test prompts from " + args.data + ")")
    flops, executed = {}, {}
    for a, w in workloads.items():
        flops[a] = workload_flops(a, c, w.lengths, splits=bench.splits, steps=args.ig_steps)
        executed[a] = executed_flops(a, c, w.batch, splits=bench.splits, steps=args.ig_steps)
        print(
            f"  {a:<22}{w.describe()}{cases[a].passes(bench, w)}; {flops[a] / 1e12:.2f} TFLOP as the reference "
            f"runs it, {executed[a] / 1e12:.2f} TFLOP executed by jaxdepth"
        )
    sys.stdout.flush()

    # ---- matmul peak (again at the end: the best of both counts)
    clock = Clock(args.wait_quiet, args.repeat, args.peak_sizes)
    peaks_before = clock.matmul_peak(c)

    # ---- jaxdepth: every analysis once to compile, then `--repeat` timed calls
    jax_runs = {}
    for a, case in cases.items():
        jax_runs[a] = t = clock.compiled(f"jaxdepth {a}", partial(case.jaxdepth, bench, workloads[a]))
        log(
            f"jaxdepth {a}: first call {t.first_s:.2f} s, then {t.run_s:.2f} s (median of {args.repeat}; "
            f"{executed[a] / t.run_s / 1e9:.1f} GFLOP/s executed); other processes used {fmt_cores(t.first_others)} / "
            f"{fmt_cores(t.others)} cores meanwhile"
        )
    # the adaptive IG preset on the IG workload (no reference: the published code has no such rule)
    adaptive = None
    if IG in cases and args.ig_tolerance > 0:
        adaptive = time_adaptive(clock, bench, workloads[IG], jax_runs[IG].run_s)

    # ---- reference
    ref_runs, ref_passes, ref_load_s = {}, {}, None
    if not args.no_reference:
        ref, ref_load_s = load_reference(args.model)
        for a, case in cases.items():
            f0, b0 = ref.forwards, ref.backwards
            ref_runs[a] = t = clock.timed(f"reference {a}", partial(case.reference, ref, bench, workloads[a]))
            ref_passes[a] = ((ref.forwards - f0) // args.repeat, (ref.backwards - b0) // args.repeat)
            log(
                f"reference {a}: {t.run_s:.2f} s (median of {args.repeat}), {ref_passes[a][0]} forwards, "
                f"{ref_passes[a][1]} backwards ({flops[a] / t.run_s / 1e9:.1f} GFLOP/s); other processes used "
                f"{fmt_cores(t.others)} cores meanwhile"
            )

    peak = best_peak(peaks_before, clock.matmul_peak(c, again=True))

    # ---- report
    rows = [
        timing_row(a, workloads[a], jax_runs[a], ref_runs.get(a), ref_passes.get(a), flops[a], executed[a], peak["jax"])
        for a in cases
    ]
    agree = [
        row for a in ref_runs for row in cases[a].agreement(jax_runs[a].result, ref_runs[a].result, workloads[a], c)
    ]
    study = full_study(rows, full, c, args.seed)
    study_adaptive = study_with_adaptive(study["rows"], rows, adaptive, args.ig_steps)
    load_after = os.getloadavg()
    report = dict(
        command=" ".join([os.path.basename(sys.executable)] + sys.argv),
        args=vars(args),
        machine=dict(
            cpu=cpu_description(),
            cores=os.cpu_count(),
            load_average_before=load_before,
            load_average_after=load_after,
            jax=jax.__version__,
            torch=torch.__version__,
            jax_devices=[str(d) for d in jax.devices()],
            torch_threads=torch.get_num_threads(),
        ),
        model=dict(source=args.model, config=c.to_dict()),
        split_positions=bench.splits,
        excluded_s=dict(jax_load=jax_load_s, ref_load=ref_load_s, **bench.excluded_s),
        peak_flops=peak,
        rows=rows,
        totals=totals(rows),
        agreement=agree,
        study_workload_estimate=study,
        adaptive_ig=adaptive,
        study_workload_estimate_adaptive_ig=study_adaptive,
        all_agree=all(a["ok"] for a in agree) if agree else None,
        benchmark_wall_s=time.perf_counter() - wall_start,
    )
    print_tables(report)
    print(
        f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}; benchmark wall time "
        f"{report['benchmark_wall_s']:.0f} s (incl. loading)"
    )
    if agree and not report["all_agree"]:
        print(
            "WARNING: the implementations DISAGREE on: "
            + "; ".join(f"{a['analysis']} {a['quantity']}" for a in agree if not a["ok"])
        )
    write_json_atomic(args.out, report)
    print(f"wrote {args.out}")
    return 0 if (not agree or report["all_agree"]) else 1


def require_reference():
    """torch (with its thread count still to set) when the reference can run, else None after
    saying what to install."""
    from jaxdepth.lab.optional import MissingDependencyError, require

    try:
        torch = require(
            "torch",
            purpose="the benchmark's PyTorch reference",
            install="pip install torch==2.13.0 accelerate (the CPU build; or the README's test set-up)",
        )
        require(
            "accelerate",
            purpose="transformers' GGUF loader (the reference model)",
            install="pip install torch==2.13.0 accelerate",
        )
    except MissingDependencyError as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    return torch


def load_reference(model: str):
    """The reference on transformers' reading of the same GGUF file, and the seconds loading took."""
    from jaxdepth.lab.sources import embedded_gguf_path
    from reference_torch import Reference, load_hf_model

    start = time.perf_counter()
    hf = load_hf_model(embedded_gguf_path(model) if not model.endswith(".gguf") else model)
    seconds = time.perf_counter() - start
    log(
        f"reference: transformers loaded the GGUF in {seconds:.1f} s (excluded), "
        f"attention {hf.config._attn_implementation}"
    )
    return Reference(hf), seconds


if __name__ == "__main__":
    sys.exit(main())
