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
"""

from __future__ import annotations

import argparse
import dataclasses
from functools import partial
import json
import os
import platform
import sys
import time
from typing import Callable, Optional

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
IG_BLOCK = 16  # reference_torch.IG_BLOCK (not imported here: that module needs torch)

ALIASES = {"contrib": "contributions", "cosine": "contributions", "lens": "logit_lens", "skip": "layer_skip",
           "ig": "integrated_gradients"}
# The shared data samples live beside the checkout (`../shared/data/`, see DESIGN.md).
DEFAULT_DATA = os.path.normpath(os.path.join(HERE, "..", "..", "shared", "data", "gsm8k_test_sample.jsonl"))


# ----------------------------------------------------------------------------- arguments

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2",
                   help="an embedded jaxdepth model name or a .gguf file: jaxdepth converts it, transformers "
                        "reads the same file with its GGUF loader")
    p.add_argument("--data", default=DEFAULT_DATA, help="GSM8K JSONL file")
    from jaxdepth.lab.registry import ANALYSES

    p.add_argument("--analyses", default=",".join(ANALYSES),
                   help="comma-separated subset of " + ", ".join(ANALYSES))
    p.add_argument("--prompts", type=int, default=10, help="prompts for contributions and logit lens")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="truncate every prompt to this many tokens (default: full length); the "
                        "per-analysis caps below apply on top of it")
    p.add_argument("--skip-prompts", type=int, default=2, help="prompts for layer skip")
    p.add_argument("--skip-max-tokens", type=int, default=64, help="token cap for layer skip")
    p.add_argument("--erasure-prompts", type=int, default=1,
                   help="prompts for residual erasure and attribution patching")
    p.add_argument("--erasure-max-tokens", type=int, default=32,
                   help="token cap for residual erasure and attribution patching")
    p.add_argument("--ig-prompts", type=int, default=1, help="prompts for integrated gradients")
    p.add_argument("--ig-max-tokens", type=int, default=16, help="token cap for integrated gradients")
    p.add_argument("--ig-steps", type=int, default=16,
                   help="integrated-gradients steps (left Riemann). The studies use 256; at 30 layers "
                        "that is 7,680 forward+backward passes per prompt, about an hour on 2 CPU cores "
                        "for jaxdepth alone, so the default runs 16 and the full-workload table "
                        "extrapolates (both implementations cost exactly linear in steps)")
    p.add_argument("--ig-tolerance", type=float, default=0.01,
                   help="the adaptive integrated-gradients preset: it also runs on the IG workload, and the full-study "
                        "extrapolation is given a second time with it in place of the published 256-step rule "
                        "(0 = leave it out)")
    p.add_argument("--baseline-prompts", type=int, default=10,
                   help="erasure baseline: mean residuals over the first N prompts of --data (full length)")
    p.add_argument("--seed", type=int, default=123, help="split-position seed (layer skip)")
    p.add_argument("--torch-threads", type=int, default=os.cpu_count(),
                   help="torch intra-op threads for the reference (default: every core, as jax uses)")
    p.add_argument("--wait-quiet", type=float, default=0.0,
                   help="before each timed call, wait up to this many seconds for other processes to "
                        "leave the CPU (under 0.2 cores busy over 3 s); 0 = do not wait. The CPU time "
                        "other processes take during each timing is reported either way")
    p.add_argument("--repeat", type=int, default=1,
                   help="timed calls per analysis and side; the tables report their median (jaxdepth's first, "
                        "compiling call is timed apart)")
    p.add_argument("--no-reference", action="store_true", help="time jaxdepth only (no agreement check)")
    p.add_argument("--out", default="results/benchmark.json", help="JSON copy of the tables")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    names = [ALIASES.get(a.strip(), a.strip()) for a in args.analyses.replace(" ", ",").split(",") if a.strip()]
    unknown = sorted(set(names) - set(ANALYSES))
    if unknown:
        p.error(f"unknown analyses {unknown}; known: {', '.join(ANALYSES)}")
    missing = sorted(set(names) - set(CASES))
    if missing:
        p.error(f"no benchmark case for {missing} (a registered analysis needs one in CASES)")
    args.analyses = [a for a in ANALYSES if a in names]
    return args


# ----------------------------------------------------------------------------- workload

@dataclasses.dataclass
class Workload:
    """One analysis' prompts: the jaxdepth batch and the same prompts as plain token lists."""

    name: str
    batch: object  # jaxdepth PromptBatch
    token_lists: list
    answer_starts: list
    answer_replaced: int  # prompts whose answer was cut off by the cap (see `truncate`)
    cap: Optional[int]

    @property
    def lengths(self):
        return [len(t) for t in self.token_lists]

    def describe(self) -> str:
        s = f"{len(self.token_lists)} prompt(s), lengths {self.lengths}"
        if self.cap:
            s += f" (cap {self.cap} tokens)"
        if self.answer_replaced:
            s += (f"; {self.answer_replaced} answer(s) cut off by the cap: their last quarter of tokens "
                  "stands in as the answer")
        return s


def truncate(full, indices, cap: Optional[int], pad_id: int, name: str) -> Workload:
    """Prompts `indices` of `full`, cut to their first `cap` tokens. A cut that removes every
    answer-predicting position (the answer starts at token >= cap - 1) would leave erasure and IG
    nothing to measure: the last quarter of the cut prompt then stands in as its answer. Both
    implementations receive exactly the same tokens and answer starts."""
    from jaxdepth.core.batch import make_batch

    token_lists, starts, replaced = [], [], 0
    for i in indices:
        n = int(full.lengths[i])
        tokens = [int(t) for t in full.tokens[i, :n]]
        start = int(full.answer_start[i])
        if cap is not None and n > cap:
            tokens, n = tokens[:cap], cap
        if start > n - 1:
            start = n - max(1, n // 4)
            replaced += 1
        token_lists.append(tokens)
        starts.append(start)
    batch = make_batch(token_lists, starts, pad_to_multiple=16, pad_id=pad_id)
    return Workload(name, batch, token_lists, starts, replaced, cap)


def combine_caps(*caps):
    caps = [c for c in caps if c]
    return min(caps) if caps else None


# ----------------------------------------------------------------------------- FLOPs

def layer_flops(c, queries: int, keys: int, layers: int) -> float:
    """Matmul FLOPs of `layers` decoder layers over `queries` positions attending to `keys`."""
    layer_params = (c.hidden_size * c.num_heads * c.head_dim + 2 * c.hidden_size * c.num_kv_heads * c.head_dim
                    + c.num_heads * c.head_dim * c.hidden_size + 3 * c.hidden_size * c.intermediate_size)
    return layers * (2.0 * queries * layer_params + 4.0 * queries * keys * c.num_heads * c.head_dim)


def forward_flops(c, T: int, lm_head: bool = True) -> float:
    """Matmul FLOPs of one forward pass over T tokens: 2 x matmul params per token (q, k, v, o,
    gate, up, down; the LM head if asked) plus attention scores and values (4 T^2 H Dh per
    layer, the full square as both implementations compute it)."""
    return layer_flops(c, T, T, c.num_layers) + (lm_head_flops(c, T) if lm_head else 0.0)


def lm_head_flops(c, T: int) -> float:
    return 2.0 * T * c.hidden_size * c.vocab_size


# ----------------------------------------------------------------------------- peak

def matmul_peak(config=None, repeats: int = 7):
    """Best float32 matmul FLOP/s of jnp.dot (and of torch.mm, for the reference) on this machine:
    square 2048 and 4096 matmuls, and the model's own MLP shape at 8192 tokens
    ([8192, D] x [D, F], what a sweep of many members multiplies)."""
    import jax
    import jax.numpy as jnp

    shapes = {"2048": (2048, 2048, 2048), "4096": (4096, 4096, 4096)}
    if config is not None:
        shapes["mlp"] = (8192, config.hidden_size, config.intermediate_size)
    out = {}
    dot = jax.jit(jnp.dot)
    for name, (m, k, n) in shapes.items():
        a = jax.random.normal(jax.random.PRNGKey(0), (m, k), jnp.float32)
        b = jax.random.normal(jax.random.PRNGKey(1), (k, n), jnp.float32)
        dot(a, b).block_until_ready()
        best = min(_timed(lambda: dot(a, b).block_until_ready()) for _ in range(repeats))
        out[f"jax_{name}"] = 2 * m * k * n / best
    try:
        import torch

        for name, (m, k, n) in shapes.items():
            a, b = torch.randn(m, k), torch.randn(k, n)
            torch.mm(a, b)
            best = min(_timed(lambda: torch.mm(a, b)) for _ in range(repeats))
            out[f"torch_{name}"] = 2 * m * k * n / best
    except ImportError:
        pass
    return out


class CpuMeter:
    """CPU time used by *other* processes while a timing runs: the machine's busy time
    (/proc/stat) minus this process' own (os.times), in cores (CPU-seconds per wall second).
    A contended timing is not a measurement of either implementation."""

    HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    @staticmethod
    def _busy():
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:9]]
        except OSError:
            return None
        return (sum(v) - v[3] - v[4]) / CpuMeter.HZ  # all but idle and iowait

    def __enter__(self):
        self.busy0, t = self._busy(), os.times()
        self.own0, self.wall0 = t.user + t.system, time.perf_counter()
        return self

    def __exit__(self, *exc):
        busy1, t = self._busy(), os.times()
        self.wall = time.perf_counter() - self.wall0
        own = t.user + t.system - self.own0
        self.others = None if busy1 is None else max(busy1 - self.busy0 - own, 0.0) / max(self.wall, 1e-9)
        return False


def wait_quiet(timeout: float, threshold: float = 0.2, window: float = 3.0) -> Optional[float]:
    """Wait (up to `timeout` s) until other processes use under `threshold` cores over `window` s;
    returns the seconds waited, or None when it timed out."""
    start = time.perf_counter()
    while True:
        with CpuMeter() as m:
            time.sleep(window)
        if m.others is None or m.others < threshold:
            return time.perf_counter() - start
        if time.perf_counter() - start > timeout:
            return None


VECTOR_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


def cpu_description() -> str:
    """The CPU model and the vector extensions that matter for matmuls, e.g. 'AMD EPYC (avx2,
    fma, avx512f)': speed ratios differ between CPUs, so every report names it."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model in ("", platform.machine(), platform.processor()):
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    return f"{model} ({', '.join(f for f in VECTOR_FLAGS if f in flags) or 'vector extensions unknown'})"


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# ----------------------------------------------------------------------------- agreement

def _diff_row(analysis, quantity, ours, theirs, tol_rel=1e-3, exact=False):
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    if ours.shape != theirs.shape:
        return dict(analysis=analysis, quantity=quantity, max_abs_diff=None, scale=None, ok=False,
                    note=f"shape mismatch {ours.shape} vs {theirs.shape}")
    diff = float(np.max(np.abs(ours - theirs))) if ours.size else 0.0
    scale = float(np.max(np.abs(theirs))) if theirs.size else 0.0
    ok = diff == 0 if exact else diff <= tol_rel * max(scale, 1e-12) + 1e-7
    return dict(analysis=analysis, quantity=quantity, max_abs_diff=diff, scale=scale, ok=bool(ok),
                note="must be equal" if exact else f"tol {tol_rel:g} x scale")


def _value_row(analysis, quantity, ours, theirs, ok=None, note=""):
    ok = bool(ours == theirs) if ok is None else bool(ok)
    return dict(analysis=analysis, quantity=quantity, jaxdepth=ours, reference=theirs, ok=ok, note=note)


def _ed_row(analysis, quantity, ours, theirs, our_curve, their_curve):
    """Effective depth read by jaxdepth's rule on its curve and by the reference rule on the
    reference curve (-1 = no layer qualifies); on a mismatch, the curves at the layers involved."""
    ours = -1 if ours is None else int(ours)
    note = ""
    if ours != theirs:
        at = sorted({l for l in (ours, theirs) if l >= 0})
        note = "curves there: " + ", ".join(
            f"l={l}: jax {float(np.asarray(our_curve)[l]):.9g} ({np.asarray(our_curve).dtype}), "
            f"ref {float(np.asarray(their_curve)[l]):.9g} ({np.asarray(their_curve).dtype})" for l in at)
    return _value_row(analysis, quantity, ours, theirs, note=note)


# ----------------------------------------------------------------------------- cases

@dataclasses.dataclass
class Bench:
    """What every case reads: the loaded jaxdepth model, the arguments, the layer-skip split
    positions per prompt and the erasure baseline (both computed once, shared by both sides)."""

    model: object
    args: argparse.Namespace
    splits: list = dataclasses.field(default_factory=list)
    baseline: object = None
    excluded_s: dict = dataclasses.field(default_factory=dict)  # untimed preparation, by what it was

    @property
    def config(self):
        return self.model.config


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    """How the benchmark runs, counts and checks one registered analysis.

    prompts, cap: args -> its prompt count and token cap.
    jaxdepth: (bench, workload) -> jaxdepth's result.
    reference: (reference, bench, workload) -> the reference's result.
    model_flops: (config, T, splits of the prompt, steps) -> the work of one prompt of length T
        as the reference formulation defines it (one pass per intervention).
    executed_flops: (config, one-prompt batch, splits of the prompt, steps) -> the matmul FLOPs
        jaxdepth executes for it.
    agreement: (jaxdepth result, reference result, workload, config) -> agreement rows.
    passes: (bench, workload) -> what the workload line adds about the passes it runs.
    prepare: (bench, workload, every encoded prompt) -> None; computes, untimed, what both
        sides share (the layer-skip split positions, the erasure baseline) into `bench`.
    """

    prompts: Callable
    cap: Callable
    jaxdepth: Callable
    reference: Callable
    model_flops: Callable
    executed_flops: Callable
    agreement: Callable
    passes: Callable = lambda bench, w: ""
    prepare: Callable = lambda bench, w, full: None


def _settings(bench: Bench):
    from jaxdepth.lab.study import StudySettings

    return StudySettings(seed=bench.args.seed, skip_sublayers=("layer",), ig_steps=bench.args.ig_steps)


def _via_registry(name: str):
    """jaxdepth's side of a case: the registered analysis, run as `jaxdepth run` runs it."""
    def run(bench: Bench, w: Workload):
        from jaxdepth.lab.registry import RunInputs, analysis

        return analysis(name).run(RunInputs(model=bench.model, batch=w.batch, settings=_settings(bench),
                                            progress=False))
    return run


def _sample_splits(bench: Bench, w: Workload, full):
    from jaxdepth.analyses.layer_skip import sample_split_positions

    bench.splits = sample_split_positions(w.lengths, seed=bench.args.seed)


def _erasure_baseline(bench: Bench, w: Workload, full):
    from jaxdepth.analyses.erasure import mean_residuals

    if bench.baseline is not None:  # erasure and attribution patching share it
        return
    start = time.perf_counter()
    first = full.select(slice(0, bench.args.baseline_prompts))
    bench.baseline = mean_residuals(bench.model.params, first, bench.config)
    bench.excluded_s["erasure_baseline"] = seconds = time.perf_counter() - start
    log(f"erasure baseline: mean residuals over the first {min(bench.args.baseline_prompts, len(full))} prompts "
        f"(full length) by jaxdepth.analyses.erasure.mean_residuals in {seconds:.1f} s (excluded; both use it)")


def _erasure_jaxdepth(bench: Bench, w: Workload):
    # Not through the registry: its run computes the baseline's mean residuals first, which the
    # benchmark computes once outside the timings and hands to both sides.
    from jaxdepth.analyses.erasure import residual_erasure

    return residual_erasure(bench.model.params, w.batch, bench.config, bench.baseline, progress=False)


def _attribution_jaxdepth(bench: Bench, w: Workload):
    # Not through the registry, for the same reason as erasure: the baseline is shared, untimed.
    from jaxdepth.analyses.attribution import attribution_patching

    return attribution_patching(bench.model.params, w.batch, bench.config, bench.baseline, progress=False)


def _attribution_executed(c, one, splits, steps):
    # forward, then a backward that pulls back through the stored activations (or, where
    # site_gradients would, recomputes each layer first); the LM head only at the answer positions
    from jaxdepth.analyses.attribution import recomputes_layers

    L, T, A = c.num_layers, one.tokens.shape[1], _answers(one)
    passes = 3 if recomputes_layers(c, T) else 2
    return passes * layer_flops(c, T, T, L) + 2 * lm_head_flops(c, A)


def _ig_model_flops(c, T, splits, steps):
    # As the published code runs it: one clean forward; per layer l, F(b) and `steps` forward and
    # backward passes of the layers after l and the head, in blocks of 16 steps. Weights need no
    # gradient, so a backward costs about one forward of the layers it crosses.
    suffix = lambda l: layer_flops(c, T, T, c.num_layers - l - 1) + lm_head_flops(c, T)  # noqa: E731
    return forward_flops(c, T) + sum((2 * steps + 1) * suffix(l) for l in range(c.num_layers))


def _answers(one) -> int:
    return len(one.answer_positions(0)[0])


def _erasure_executed(c, one, splits, steps):
    from jaxdepth.analyses.erasure import position_blocks

    L, T, A = c.num_layers, one.tokens.shape[1], _answers(one)
    kv = 2 * T * L * 2 * c.hidden_size * c.num_kv_heads * c.head_dim
    total = layer_flops(c, T, T, L) + kv + lm_head_flops(c, A)
    for first, stop in position_blocks(T):
        total += (stop - first) * sum(layer_flops(c, T - first, T, L - l) + lm_head_flops(c, A)
                                      for l in range(L + 1))
    return total


def _ig_executed(c, one, splits, steps):
    L, T, A = c.num_layers, one.tokens.shape[1], _answers(one)
    total = layer_flops(c, T, T, L) + lm_head_flops(c, A)
    for l in range(L):
        # forward, then a backward that recomputes each layer (remat) before pulling back
        rest = layer_flops(c, T, T, L - l - 1)
        total += steps * (3 * rest + 2 * lm_head_flops(c, A)) + rest + lm_head_flops(c, A)
    return total


def _layer_skip_executed(c, one, splits, steps):
    from jaxdepth.analyses.layer_skip import measured_rows, member_masks

    L, T = c.num_layers, one.tokens.shape[1]
    if not splits:  # a prompt without split positions is not run; the others run 4 (padded)
        return 0.0
    # the LM head runs on each split's measured positions only, the rows `output_shifts` gets
    padded = list(splits) + [splits[0]] * (4 - len(splits))
    _, measure = member_masks(int(one.lengths[0]), T, padded, "future")
    rows = len(measured_rows(np.stack(measure), one.valid[0])[0])
    return layer_flops(c, T, T, L) + (L + 1) * lm_head_flops(c, rows) + 4 * sum(
        layer_flops(c, T, T, L - s) for s in range(L))


def _contributions_agreement(jres, rres, w, c):
    from jaxdepth.analyses import effective_depth as ed

    import reference_torch as rt

    name = "contributions"
    rows = [_diff_row(name, f"curve {stat} [L]", getattr(jres, stat), rres["curves"][stat])
            for stat in ("norm_attn", "norm_mlp", "norm_layer", "cos_attn", "cos_mlp", "cos_layer")]
    mean_cos = sum(rres["curves"][k] for k in ("cos_attn", "cos_mlp", "cos_layer")) / 3
    ours = ed.cosine_effective_depth(jres.mean_cosine).layer
    rows.append(_ed_row(name, "cosine ED", ours, rt.ed_cosine(mean_cos), jres.mean_cosine, mean_cos))
    return rows


def _logit_lens_agreement(jres, rres, w, c):
    from jaxdepth.analyses import effective_depth as ed

    import reference_torch as rt

    name = "logit_lens"
    kl_ed, ov_ed = ed.kl_effective_depth(jres.kl).layer, ed.overlap_effective_depth(jres.overlap).layer
    return [_diff_row(name, "KL(P_l||P) [L]", jres.kl, rres["kl"]),
            _diff_row(name, "top-5 overlap [L]", jres.overlap, rres["overlap"]),
            _ed_row(name, "KL ED", kl_ed, rt.ed_kl(rres["kl"]), jres.kl, rres["kl"]),
            _ed_row(name, "overlap ED", ov_ed, rt.ed_overlap(rres["overlap"]), jres.overlap, rres["overlap"])]


def _layer_skip_agreement(jres, rres, w, c):
    from jaxdepth.analyses import effective_depth as ed

    import reference_torch as rt

    name, jres, L = "layer_skip", jres.part("layer"), c.num_layers
    low = np.tril(np.ones((L, L), bool))
    ours, theirs = ed.depth_score(jres.later), rt.depth_score(rres["later"])
    return [_diff_row(name, "D[s,j] later [L,L]", jres.later, rres["later"]),
            _diff_row(name, "output L2 [L]", jres.output, rres["output"]),
            _diff_row(name, "D per prompt [P,L,L]", jres.later_per_prompt, rres["later_per_prompt"]),
            _diff_row(name, "D[s,j<=s] (both exact 0)", np.asarray(jres.later)[low], np.asarray(rres["later"])[low],
                      exact=True),
            _value_row(name, "depth score", round(ours, 4), round(theirs, 4), ok=abs(ours - theirs) < 1e-3)]


def _erasure_agreement(jres, rres, w, c):
    name = "erasure"
    ours = [np.asarray(jres.effects)[i, :, :n] for i, n in enumerate(w.lengths)]
    rows = [_diff_row(name, "effects [P,L+1,T]", np.concatenate(ours, axis=1), np.concatenate(rres, axis=1))]
    for i, n in enumerate(w.lengths):  # positions after the last answer prediction: exactly 0
        tail = slice(n - 1, n)
        rows.append(_diff_row(name, f"prompt {i}: erasing t=T-1 (both exact 0)", ours[i][:, tail], rres[i][:, tail],
                              exact=True))
    return rows


def _ig_agreement(jres, rres, w, c):
    name = "integrated_gradients"
    ours = np.concatenate([np.asarray(jres.attributions)[i, :, :n] for i, n in enumerate(w.lengths)], axis=1)
    return [_diff_row(name, "attributions [P,L,T]", ours, np.concatenate(rres["attributions"], axis=1), tol_rel=3e-3),
            _diff_row(name, "F(x) [P]", jres.f_input, rres["f_input"]),
            _diff_row(name, "F(b) [P,L]", jres.f_baseline, np.stack(rres["f_baseline"])),
            _diff_row(name, "completeness gap [P,L]", jres.gap, np.stack(rres["gap"]), tol_rel=3e-2)]


def _attribution_agreement(jres, rres, w, c, name="attribution_patching"):
    cut = lambda x: np.concatenate([np.asarray(x)[i, :, :n] for i, n in enumerate(w.lengths)], axis=1)  # noqa: E731
    return [_diff_row(name, "estimate [P,L+1,T]", cut(jres.patching), np.concatenate(rres["patching"], axis=1)),
            _diff_row(name, "grad x act [P,L+1,T]", cut(jres.grad_x_act), np.concatenate(rres["grad_x_act"], axis=1)),
            _diff_row(name, "F(x) [P]", jres.f_input, rres["f_input"])]


_ATTRIBUTION = Case(
    prompts=lambda a: a.erasure_prompts, cap=lambda a: combine_caps(a.max_tokens, a.erasure_max_tokens),
    jaxdepth=_attribution_jaxdepth,
    reference=lambda ref, bench, w: ref.attribution_patching(w.token_lists, w.answer_starts, bench.baseline),
    # one forward, one backward to the activations (about one forward again)
    model_flops=lambda c, T, splits, steps: 2 * forward_flops(c, T),
    executed_flops=_attribution_executed, agreement=_attribution_agreement, prepare=_erasure_baseline,
    passes=lambda bench, w: f"; {len(w.lengths)} forward+backward pass(es), the erasure's prompts")


# One case per registered analysis (`jaxdepth.lab.registry.ANALYSES`); a test checks they match.
CASES = {
    "contributions": Case(
        prompts=lambda a: a.prompts, cap=lambda a: a.max_tokens,
        jaxdepth=_via_registry("contributions"),
        reference=lambda ref, bench, w: ref.contributions(w.token_lists),
        model_flops=lambda c, T, splits, steps: forward_flops(c, T, lm_head=False),  # no LM head needed
        executed_flops=lambda c, one, splits, steps: layer_flops(c, one.tokens.shape[1], one.tokens.shape[1],
                                                                 c.num_layers),
        agreement=_contributions_agreement),
    "logit_lens": Case(
        prompts=lambda a: a.prompts, cap=lambda a: a.max_tokens,
        jaxdepth=_via_registry("logit_lens"),
        reference=lambda ref, bench, w: ref.logit_lens(w.token_lists),
        model_flops=lambda c, T, splits, steps: forward_flops(c, T) + c.num_layers * lm_head_flops(c, T),
        executed_flops=lambda c, one, splits, steps: (
            layer_flops(c, one.tokens.shape[1], one.tokens.shape[1], c.num_layers)
            + (c.num_layers + 1) * lm_head_flops(c, one.tokens.shape[1])),
        agreement=_logit_lens_agreement),
    "layer_skip": Case(
        prompts=lambda a: a.skip_prompts, cap=lambda a: combine_caps(a.max_tokens, a.skip_max_tokens),
        jaxdepth=_via_registry("layer_skip"),
        reference=lambda ref, bench, w: ref.layer_skip(w.token_lists, bench.splits),
        model_flops=lambda c, T, splits, steps: (1 + c.num_layers * len(splits)) * forward_flops(c, T),
        executed_flops=_layer_skip_executed, agreement=_layer_skip_agreement, prepare=_sample_splits,
        passes=lambda bench, w: (f"; split positions {bench.splits}; "
                                 f"{sum(len(s) for s in bench.splits) * bench.config.num_layers} skip passes + "
                                 f"{len(bench.splits)} clean")),
    "erasure": Case(
        prompts=lambda a: a.erasure_prompts, cap=lambda a: combine_caps(a.max_tokens, a.erasure_max_tokens),
        jaxdepth=_erasure_jaxdepth,
        reference=lambda ref, bench, w: ref.erasure(w.token_lists, w.answer_starts, bench.baseline),
        model_flops=lambda c, T, splits, steps: (1 + (c.num_layers + 1) * T) * forward_flops(c, T),
        executed_flops=_erasure_executed, agreement=_erasure_agreement, prepare=_erasure_baseline,
        passes=lambda bench, w: (f"; {(bench.config.num_layers + 1) * sum(w.lengths)} erasure passes "
                                 "(every boundary 0..L x position)")),
    "integrated_gradients": Case(
        prompts=lambda a: a.ig_prompts, cap=lambda a: combine_caps(a.max_tokens, a.ig_max_tokens),
        jaxdepth=_via_registry("integrated_gradients"),
        reference=lambda ref, bench, w: ref.integrated_gradients(w.token_lists, w.answer_starts, bench.args.ig_steps),
        model_flops=_ig_model_flops, executed_flops=_ig_executed, agreement=_ig_agreement,
        passes=lambda bench, w: (f"; {bench.args.ig_steps} steps x {bench.config.num_layers} layers; the reference "
                                 f"runs them in blocks of {IG_BLOCK} steps, "
                                 f"{-(-bench.args.ig_steps // IG_BLOCK) * bench.config.num_layers * len(w.lengths)} "
                                 "forward+backward passes")),
    "attribution_patching": _ATTRIBUTION,
    # the same pass, registered as its own analysis
    "grad_x_act": dataclasses.replace(_ATTRIBUTION, agreement=partial(_attribution_agreement, name="grad_x_act")),
}


def _adaptive_jaxdepth(bench: Bench, w: Workload):
    from jaxdepth.analyses.adaptive_ig import adaptive_integrated_gradients

    return adaptive_integrated_gradients(bench.model.params, w.batch, bench.config, tolerance=bench.args.ig_tolerance,
                                         progress=False)


def _study_with_adaptive(study: list, rows: list, adaptive: Optional[dict], steps: int) -> Optional[dict]:
    """The full-study extrapolation with the adaptive IG preset in place of the published rule:
    jaxdepth's IG time scaled by the measured adaptive time over the measured fixed-rule time
    scaled to 256 steps (both on the IG workload); the reference keeps the published rule."""
    if adaptive is None:
        return None
    fixed = next(r for r in rows if r["analysis"] == "integrated_gradients")
    share = adaptive["jax_run_s"] / (fixed["jax_run_s"] * 256 / steps)
    out = [dict(r, jax_s=r["jax_s"] * share) if r["analysis"] == "integrated_gradients" else dict(r) for r in study]
    return dict(share_of_published_ig_time=share, rows=out, total=_study_total(out))


def _study_total(rows: list) -> dict:
    """The TOTAL row of a full-study extrapolation (None where a row has no value)."""
    return dict(analysis="TOTAL", **{k: None if any(r[k] is None for r in rows) else sum(r[k] for r in rows)
                                     for k in ("model_flops", "executed_flops", "jax_s", "ref_s")})


def workload_flops(name: str, c, lengths, *, splits=None, steps: int = 0) -> float:
    """Model FLOPs of an analysis' workload as the reference approach runs it (one pass per
    intervention, each prompt at its own length; matmul FLOPs only)."""
    return sum(CASES[name].model_flops(c, T, splits[i] if splits else [], steps) for i, T in enumerate(lengths))


def executed_flops(name: str, c, batch, *, splits=None, steps: int = 0) -> float:
    """Matmul FLOPs jaxdepth actually executes for an analysis: each prompt at its padded length,
    interventions starting at their boundary, erasures on their position block's suffix, the LM
    head only where it is read, and IG's backward recomputing each layer (3 layer passes per
    gradient: forward, recomputation, pull-back to the input; weights take no gradient). What
    `% peak` is computed from; `workload_flops` is the work as the reference formulation
    defines it, which makes the ratios comparable."""
    from jaxdepth.analyses import integrated_gradients

    pad = integrated_gradients.PAD_TO if name == "integrated_gradients" else 16  # as each analysis pads them
    return sum(CASES[name].executed_flops(c, batch.single(i, pad), splits[i] if splits else [], steps)
               for i in range(len(batch)))


# ----------------------------------------------------------------------------- tables

def fmt_s(x):
    return "-" if x is None else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def fmt_flops(x):
    return "-" if x is None else f"{x / 1e9:.1f}G"


CONTENDED_CORES = 0.25


def _fmt_cores(x) -> str:
    return "?" if x is None else f"{x:.2f}"


def _contended(row, cores=None) -> bool:
    """True when other processes took a noticeable share of the CPU during this row's timings."""
    return any(x is not None and x > CONTENDED_CORES for x in (row["others_cores_jax"], row["others_cores_ref"]))


def print_tables(report):
    peak = report["peak_flops"]
    print("\n" + "=" * 112)
    torch_peak = f", torch {peak['torch'] / 1e9:.1f} GFLOP/s" if peak.get("torch") else ""
    print(f"jaxdepth vs reference (PyTorch + HF hooks, as published)  |  {report['machine']['cpu']}, "
          f"{report['machine']['cores']} cores  |  matmul peak: jax {peak['jax'] / 1e9:.1f} GFLOP/s{torch_peak}")
    print("-" * 112)
    head = (f"{'analysis':<22}{'jax 1st':>9}{'jax run':>9}{'compile':>9}{'ref':>9}{'ref/jax':>9}"
            f"{'model FLOPs':>13}{'executed':>10}{'exec FLOP/s':>12}{'% peak':>8}{'others j/r':>12}")
    print(head)
    for r in report["rows"]:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.1f}x"
        pct = f"{100 * r['jax_fraction_of_peak']:.1f}"
        print(f"{r['analysis']:<22}{fmt_s(r['jax_first_s']):>9}{fmt_s(r['jax_run_s']):>9}"
              f"{fmt_s(r['jax_compile_s']):>9}{fmt_s(r['ref_s']):>9}{ratio:>9}"
              f"{r['model_flops'] / 1e12:>12.2f}T{r['executed_flops'] / 1e12:>9.2f}T"
              f"{fmt_flops(r['executed_flops_per_s']):>12}{pct:>8}"
              f"{_fmt_cores(r['others_cores_jax']):>7}/{'-' if r['ref_s'] is None else _fmt_cores(r['others_cores_ref']):<4}"
              f"{'  *' if _contended(r, report['machine']['cores']) else ''}")
    t = report["totals"]
    ratio = "-" if t["ratio"] is None else f"{t['ratio']:.1f}x"
    print(f"{'TOTAL':<22}{fmt_s(t['jax_first_s']):>9}{fmt_s(t['jax_run_s']):>9}{fmt_s(t['jax_compile_s']):>9}"
          f"{fmt_s(t['ref_s']):>9}{ratio:>9}{t['model_flops'] / 1e12:>12.2f}T")
    print("jax 1st = first call (compile + run); jax run = later calls (median of --repeat); compile = 1st - run; "
          "ref = reference (median of --repeat);\nmodel FLOPs = the work as the reference formulation runs it; "
          "executed = the matmul FLOPs jaxdepth runs (it skips the rest);\nexec FLOP/s = executed / run time, "
          "% peak of the jax matmul peak; others j/r = CPU cores other processes used during the\njaxdepth / "
          f"reference timing (of {report['machine']['cores']}; the worst call)")
    if any(_contended(r, report["machine"]["cores"]) for r in report["rows"]):
        print(f"  * = timed while other processes took > {CONTENDED_CORES} cores: those times are "
              "inflated, the reference's\n    multi-threaded torch most (its OpenMP barriers stall when a "
              "thread is descheduled); rerun on a quiet machine")
    if report["agreement"]:
        print("-" * 112)
        print(f"{'agreement':<22}{'quantity':<38}{'max |diff|':>14}{'scale':>12}  result")
        for a in report["agreement"]:
            if "max_abs_diff" in a:
                d = "-" if a["max_abs_diff"] is None else f"{a['max_abs_diff']:.3e}"
                s = "-" if a["scale"] is None else f"{a['scale']:.3g}"
                print(f"{a['analysis']:<22}{a['quantity']:<38}{d:>14}{s:>12}  "
                      f"{'ok' if a['ok'] else 'DISAGREE'} ({a['note']})")
            else:
                print(f"{a['analysis']:<22}{a['quantity']:<38}{'jax ' + str(a['jaxdepth']):>14}"
                      f"{'ref ' + str(a['reference']):>12}  {'ok' if a['ok'] else 'DISAGREE'} {a['note']}")
    est = report["study_workload_estimate"]
    print("-" * 112)
    print("FULL STUDY WORKLOAD, extrapolated (jaxdepth: executed FLOPs / its executed FLOP/s above; reference: "
          "model FLOPs / its FLOP/s above;\nrough: efficiency changes with prompt length):")
    print("  " + est["description"])
    _print_study_rows(est)
    adaptive, est = report.get("adaptive_ig"), report.get("study_workload_estimate_adaptive_ig")
    if adaptive is not None:
        print("-" * 112)
        print(f"ADAPTIVE IG PRESET (tolerance {adaptive['tolerance']}) on the IG workload: "
              f"{fmt_s(adaptive['jax_run_s'])} s ({fmt_s(adaptive['jax_first_s'])} s first call), "
              f"{adaptive['evaluations']:,} gradient evaluations against {adaptive['fixed_evaluations']:,} of the "
              f"fixed rule above,\n  {adaptive['ms_per_evaluation']:.1f} ms per gradient evaluation against the fixed "
              f"rule's {adaptive['fixed_ms_per_evaluation']:.1f} ms; {adaptive['converged']}/{adaptive['layers']} layers converged, largest |gap| "
              f"{100 * adaptive['max_relative_gap']:.2f}% of |F(x) - F(b)| (certified). FULL STUDY again with it in "
              f"place of IG at 256 steps (jaxdepth's IG time x {est['share_of_published_ig_time']:.3f}: the measured "
              "adaptive time over the fixed rule's\n  scaled to 256 steps; the reference keeps the published rule, "
              "which does not converge on early layers: see experiments/ig_accuracy.py):")
        _print_study_rows(est)
    print("=" * 112)


def _print_study_rows(est):
    print(f"{'analysis':<22}{'model FLOPs':>13}{'executed':>10}{'jaxdepth':>12}{'reference':>12}{'ref/jax':>9}")
    for r in est["rows"] + [est["total"]]:
        ref = "-" if r["ref_s"] is None else f"{r['ref_s'] / 3600:.2f} h"
        ratio = "-" if r["ref_s"] is None else f"{r['ref_s'] / r['jax_s']:.1f}x"
        print(f"{r['analysis']:<22}{r['model_flops'] / 1e12:>12.1f}T{r['executed_flops'] / 1e12:>9.1f}T"
              f"{r['jax_s'] / 3600:>10.2f} h{ref:>12}{ratio:>9}")


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


# ----------------------------------------------------------------------------- main

def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    wall_start = time.perf_counter()
    load_before = os.getloadavg()

    from jaxdepth.lab.optional import MissingDependencyError, require

    try:
        torch = require("torch", purpose="the benchmark's PyTorch reference",
                        install="pip install torch==2.13.0 accelerate (the CPU build; or the README's test set-up)")
        require("accelerate", purpose="transformers' GGUF loader (the reference model)",
                install="pip install torch==2.13.0 accelerate")
    except MissingDependencyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    torch.set_num_threads(args.torch_threads)
    import jax

    import jaxdepth
    from jaxdepth.analyses.layer_skip import sample_split_positions
    from jaxdepth.lab.sources import embedded_gguf_path
    from jaxdepth.lab.prompts import encode, load_prompts

    log(f"jax {jax.__version__} on {jax.devices()}, torch {torch.__version__} with {torch.get_num_threads()} "
        f"threads, {os.cpu_count()} cores; load average before: {load_before[0]:.2f}")
    if load_before[0] > 0.5 * os.cpu_count():
        log("WARNING: the machine is busy (load average above half the cores): other processes compete "
            "for the CPU and every time below is inflated by them")

    start = time.perf_counter()
    model = jaxdepth.load(args.model)
    c = model.config
    jax_load_s = time.perf_counter() - start
    log(f"jaxdepth loaded {args.model} in {jax_load_s:.1f} s (excluded): L={c.num_layers}, D={c.hidden_size}, "
        f"H={c.num_heads}/{c.num_kv_heads}, F={c.intermediate_size}, V={c.vocab_size}")

    # ---- prompts: one encoding, then per-analysis subsets and caps
    cases = {a: CASES[a] for a in args.analyses}
    counts = {a: case.prompts(args) for a, case in cases.items()}
    need = max(list(counts.values()) + [10, args.baseline_prompts])
    prompts = load_prompts("gsm8k", args.data, limit=need)
    full = encode(model.tokenizer, prompts)
    pad_id = model.tokenizer.pad_token_id if model.tokenizer.pad_token_id is not None else 0
    workloads = {a: truncate(full, range(min(counts[a], len(full))), case.cap(args), pad_id, a)
                 for a, case in cases.items()}
    bench = Bench(model, args)
    for a, case in cases.items():
        case.prepare(bench, workloads[a], full)

    print("\nWORKLOAD (GSM8K test prompts from " + args.data + ")")
    flops, executed = {}, {}
    for a, w in workloads.items():
        flops[a] = workload_flops(a, c, w.lengths, splits=bench.splits, steps=args.ig_steps)
        executed[a] = executed_flops(a, c, w.batch, splits=bench.splits, steps=args.ig_steps)
        print(f"  {a:<22}{w.describe()}{cases[a].passes(bench, w)}; {flops[a] / 1e12:.2f} TFLOP as the reference "
              f"runs it, {executed[a] / 1e12:.2f} TFLOP executed by jaxdepth")
    sys.stdout.flush()

    def gate(what):
        if args.wait_quiet > 0:
            waited = wait_quiet(args.wait_quiet)
            if waited is None:
                log(f"  the CPU did not become quiet within {args.wait_quiet:.0f} s; timing {what} anyway")
            elif waited > 5:
                log(f"  waited {waited:.0f} s for other processes to leave the CPU before {what}")

    # ---- matmul peak (again at the end: the best of both counts)
    gate("the matmul peak")
    peaks_before = matmul_peak(c)
    log("matmul peak (best of 7, float32): " + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in peaks_before.items()))

    def timed(what, fn):
        """(result, median wall time, the most other processes used) of `args.repeat` calls."""
        walls, busy, result = [], [], None
        for _ in range(args.repeat):
            gate(what)
            with CpuMeter() as m:
                result = fn()
            walls.append(m.wall)
            busy.append(m.others)
        return result, float(np.median(walls)), None if None in busy else max(busy)

    # ---- jaxdepth: every analysis once to compile, then `--repeat` timed calls
    jax_times, jax_results, others = {}, {}, {}
    for a in args.analyses:
        gate(f"jaxdepth {a} (first call)")
        with CpuMeter() as m1:
            cases[a].jaxdepth(bench, workloads[a])
        jax_results[a], second, busy = timed(f"jaxdepth {a}", lambda: cases[a].jaxdepth(bench, workloads[a]))
        first = m1.wall
        jax_times[a] = (first, second)
        others[("jax", a)] = None if busy is None or m1.others is None else max(m1.others, busy)
        log(f"jaxdepth {a}: first call {first:.2f} s, then {second:.2f} s (median of {args.repeat}; "
            f"{executed[a] / second / 1e9:.1f} GFLOP/s executed); other processes used {_fmt_cores(m1.others)} / "
            f"{_fmt_cores(busy)} cores meanwhile")

    # ---- jaxdepth: the adaptive IG preset on the IG workload (no reference: the published code has no such rule)
    adaptive = None
    if "integrated_gradients" in args.analyses and args.ig_tolerance > 0:
        w = workloads["integrated_gradients"]
        gate("jaxdepth adaptive IG (first call)")
        with CpuMeter() as m1:
            _adaptive_jaxdepth(bench, w)
        result, second, busy = timed("jaxdepth adaptive IG", lambda: _adaptive_jaxdepth(bench, w))
        fixed_evaluations = args.ig_steps * c.num_layers * len(w.lengths)
        evaluations = int(result.evaluations.sum())
        # Milliseconds per gradient evaluation, each rule on the same prompts, layers and machine.
        fixed_ms = 1e3 * jax_times["integrated_gradients"][1] / fixed_evaluations
        adaptive = dict(tolerance=args.ig_tolerance, jax_first_s=m1.wall, jax_run_s=second,
                        evaluations=evaluations, fixed_evaluations=fixed_evaluations,
                        ms_per_evaluation=1e3 * second / evaluations, fixed_ms_per_evaluation=fixed_ms,
                        converged=int(result.converged.sum()), layers=int(result.converged.size),
                        max_relative_gap=float(np.nanmax(np.abs(result.relative_gap))),
                        others_cores=None if busy is None or m1.others is None else max(m1.others, busy))
        log(f"jaxdepth adaptive IG at tolerance {args.ig_tolerance}: first call {m1.wall:.2f} s, then {second:.2f} s; "
            f"{adaptive['evaluations']} gradient evaluations ({adaptive['converged']}/{adaptive['layers']} layers "
            f"converged, largest |gap| {100 * adaptive['max_relative_gap']:.2f}% of |F(x) - F(b)|); "
            f"{adaptive['ms_per_evaluation']:.1f} ms per gradient evaluation against the fixed rule's {fixed_ms:.1f} ms")

    # ---- reference
    ref_times, ref_results, ref_load_s, ref_passes = {}, {}, None, {}
    if not args.no_reference:
        from reference_torch import Reference, load_hf_model

        start = time.perf_counter()
        hf = load_hf_model(embedded_gguf_path(args.model) if not args.model.endswith(".gguf") else args.model)
        ref_load_s = time.perf_counter() - start
        log(f"reference: transformers loaded the GGUF in {ref_load_s:.1f} s (excluded), "
            f"attention {hf.config._attn_implementation}")
        ref = Reference(hf)
        for a in args.analyses:
            f0, b0 = ref.forwards, ref.backwards
            ref_results[a], ref_times[a], others[("ref", a)] = timed(
                f"reference {a}", lambda: cases[a].reference(ref, bench, workloads[a]))
            ref_passes[a] = ((ref.forwards - f0) // args.repeat, (ref.backwards - b0) // args.repeat)
            log(f"reference {a}: {ref_times[a]:.2f} s (median of {args.repeat}), {ref_passes[a][0]} forwards, "
                f"{ref_passes[a][1]} backwards ({flops[a] / ref_times[a] / 1e9:.1f} GFLOP/s); other processes used "
                f"{_fmt_cores(others[('ref', a)])} cores meanwhile")

    gate("the matmul peak")
    peaks_after = matmul_peak(c)
    log("matmul peak again (best of 7, float32): " + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in peaks_after.items()))
    peaks = {k: max(peaks_before[k], peaks_after.get(k, 0)) for k in peaks_before}
    peak = {"jax": max(v for k, v in peaks.items() if k.startswith("jax")),
            "torch": max((v for k, v in peaks.items() if k.startswith("torch")), default=None),
            "before": peaks_before, "after": peaks_after}

    # ---- report
    rows, agree = [], []
    for a in args.analyses:
        first, second = jax_times[a]
        r = ref_times.get(a)
        rows.append(dict(analysis=a, workload=workloads[a].describe(), prompts=len(workloads[a].lengths),
                         lengths=workloads[a].lengths, jax_first_s=first, jax_run_s=second,
                         jax_compile_s=max(first - second, 0.0), ref_s=r,
                         ratio=None if r is None else r / second, model_flops=flops[a],
                         jax_flops_per_s=flops[a] / second, executed_flops=executed[a],
                         executed_flops_per_s=executed[a] / second,
                         jax_fraction_of_peak=executed[a] / second / peak["jax"],
                         ref_flops_per_s=None if r is None else flops[a] / r,
                         ref_forwards=ref_passes.get(a, (None, None))[0],
                         ref_backwards=ref_passes.get(a, (None, None))[1],
                         others_cores_jax=others[("jax", a)], others_cores_ref=others.get(("ref", a))))
        if a in ref_results:
            agree.extend(cases[a].agreement(jax_results[a], ref_results[a], workloads[a], c))
    tot = lambda k: sum(r[k] for r in rows) if all(r[k] is not None for r in rows) else None  # noqa: E731
    totals = dict(jax_first_s=tot("jax_first_s"), jax_run_s=tot("jax_run_s"), jax_compile_s=tot("jax_compile_s"),
                  ref_s=tot("ref_s"), model_flops=tot("model_flops"))
    totals["ratio"] = None if totals["ref_s"] is None else totals["ref_s"] / totals["jax_run_s"]
    # The full study workload, extrapolated: jaxdepth from the FLOPs it would execute at its measured
    # executed rate (its savings grow with prompt length), the reference from its model FLOPs at
    # its measured rate.
    study_batch = full.select(slice(0, 10))  # the studies: 10 prompts, full length
    study_lengths = [int(n) for n in study_batch.lengths]
    study_splits = sample_split_positions(study_lengths, seed=args.seed)
    study = []
    for r in rows:
        a = r["analysis"]
        f = workload_flops(a, c, study_lengths, splits=study_splits, steps=256)
        e = executed_flops(a, c, study_batch, splits=study_splits, steps=256)
        study.append(dict(analysis=a, model_flops=f, executed_flops=e, jax_s=e / r["executed_flops_per_s"],
                          ref_s=None if r["ref_flops_per_s"] is None else f / r["ref_flops_per_s"]))
    study_adaptive = _study_with_adaptive(study, rows, adaptive, args.ig_steps)
    load_after = os.getloadavg()
    report = dict(
        command=" ".join([os.path.basename(sys.executable)] + sys.argv), args=vars(args),
        machine=dict(cpu=cpu_description(), cores=os.cpu_count(),
                     load_average_before=load_before, load_average_after=load_after,
                     jax=jax.__version__, torch=torch.__version__, jax_devices=[str(d) for d in jax.devices()],
                     torch_threads=torch.get_num_threads()),
        model=dict(source=args.model, config=c.to_dict()), split_positions=bench.splits,
        excluded_s=dict(jax_load=jax_load_s, ref_load=ref_load_s, **bench.excluded_s),
        peak_flops=peak, rows=rows, totals=totals, agreement=agree, study_workload_estimate=dict(
            description=f"{len(study_lengths)} prompts at full length (lengths {study_lengths}), layer skip with "
                        "4 split positions each, erasure at every boundary x position, IG 256 steps x every layer",
            rows=study, total=_study_total(study)),
        adaptive_ig=adaptive, study_workload_estimate_adaptive_ig=study_adaptive,
        all_agree=all(a["ok"] for a in agree) if agree else None,
        benchmark_wall_s=time.perf_counter() - wall_start)
    print_tables(report)
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}; benchmark wall time "
          f"{report['benchmark_wall_s']:.0f} s (incl. loading)")
    if agree and not report["all_agree"]:
        print("WARNING: the implementations DISAGREE on: " +
              "; ".join(f"{a['analysis']} {a['quantity']}" for a in agree if not a["ok"]))
    write_json_atomic(args.out, report)
    print(f"wrote {args.out}")
    return 0 if (not agree or report["all_agree"]) else 1


if __name__ == "__main__":
    sys.exit(main())
