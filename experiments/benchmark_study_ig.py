"""The study's integrated gradients measured, not modelled: one full-length GSM8K prompt, 256
left-Riemann steps over every layer, timed end to end on both sides on the same machine.

`experiments/benchmark.py` times IG on a short prompt and extrapolates to the study's workload
(10 full-length prompts) from FLOP counts. This script runs one of those prompts for real: the
reference (`experiments/reference_torch.py`, the published formulation: the layers before l
once, blocks of 16 steps forward and backward) and jaxdepth (`jaxdepth.integrated_gradients` at
each layer's output, the studies' F, as a user calls it, compilation included). Each side is
timed layer by layer and every finished layer is written to `--state` at once (atomically), so
an interrupted run resumes where it stopped; the totals are the sums over layers. A run of both
sides takes about two hours on 2 CPU cores (SmolLM2-135M, a ~200-token prompt):

    python experiments/benchmark_study_ig.py --state experiments/results/study_ig

`--dtype bf16-matmuls` runs jaxdepth's side with the layers' weight matrices in bf16 beside
float32 activations (`docs/precision.md`), kept apart in the state as side `jaxdepth-bf16-matmuls`
against the same reference. A quick check that it runs and agrees:

    python experiments/benchmark_study_ig.py --state /tmp/study_ig --max-tokens 24 --steps 16 --layers 28,29
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from benchmarking.arguments import DEFAULT_DATA  # noqa: E402
from benchmarking.machine import cpu_description  # noqa: E402
from benchmarking.report import log  # noqa: E402

SIDES = ("jaxdepth", "reference")
STUDY_ROWS = 10  # the studies' prompts: GSM8K test rows 0-9


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="an embedded model name or a .gguf file")
    p.add_argument("--data", default=DEFAULT_DATA, help="GSM8K JSONL file")
    p.add_argument("--row", type=int, default=None, help="the GSM8K row (default: the median-length one of rows 0-9)")
    p.add_argument("--steps", type=int, default=256, help="left-Riemann steps (the studies': 256)")
    p.add_argument("--max-tokens", type=int, default=None, help="cut the prompt (default: full length)")
    p.add_argument("--layers", default=None, help="comma-separated layers (default: every layer)")
    p.add_argument("--sides", default=",".join(SIDES), help="comma-separated subset of " + ", ".join(SIDES))
    p.add_argument("--state", required=True, help="folder of the per-layer results (a rerun resumes from it)")
    p.add_argument(
        "--dtype",
        choices=["float32", "bf16-matmuls"],
        default="float32",
        help="jaxdepth's precision (bf16-matmuls: bf16 weight matrices, float32 activations)",
    )
    p.add_argument("--torch-threads", type=int, default=os.cpu_count(), help="the reference's threads")
    return p.parse_args(argv)


def study_prompt(model, args):
    """(row, token ids, answer start) of the prompt to run: `--row`, or the median-length one of
    the study's rows, cut to `--max-tokens` (then its last quarter stands in as the answer)."""
    from jaxdepth.lab.prompts import encode, load_prompts

    batch = encode(model.tokenizer, load_prompts("gsm8k", args.data, limit=STUDY_ROWS))
    lengths = batch.lengths
    row = int(np.argsort(lengths, kind="stable")[len(lengths) // 2]) if args.row is None else args.row
    n, start = int(lengths[row]), int(batch.answer_start[row])
    tokens = [int(t) for t in batch.tokens[row, :n]]
    if args.max_tokens is not None and n > args.max_tokens:
        tokens, n = tokens[: args.max_tokens], args.max_tokens
        start = min(start, n - max(1, n // 4))
    return row, tokens, start


def answer_prompt(tokens, start):
    """The prompt with its answer span, as the studies' F reads it: the summed probability of
    the answer tokens (`jaxdepth.metrics.answer_probability`), read at the positions that
    predict them (the LM head runs there alone)."""
    import jax.numpy as jnp

    from jaxdepth.core.batch import PromptArrays

    ids = jnp.asarray([tokens], jnp.int32)
    predicting = jnp.arange(start - 1, len(tokens) - 1, dtype=jnp.int32)
    return PromptArrays(ids, jnp.ones(ids.shape, bool), predicting, jnp.ones(predicting.shape, bool))


class State:
    """One side's finished layers, in `folder/<side>.json`, rewritten atomically after each."""

    def __init__(self, folder: str, side: str, identity: dict):
        from jaxdepth.core.atomic import atomic_write

        self._write = atomic_write
        self.path = os.path.join(folder, f"{side}.json")
        self.identity = identity
        self.layers: dict[int, dict] = {}
        if os.path.exists(self.path):
            with open(self.path) as f:
                saved = json.load(f)
            if saved["identity"] != identity:
                raise SystemExit(f"{self.path} holds another run ({saved['identity']}); give another --state")
            self.layers = {int(k): v for k, v in saved["layers"].items()}

    def add(self, layer: int, record: dict) -> None:
        self.layers[layer] = record
        with self._write(self.path, "w") as f:
            json.dump({"identity": self.identity, "layers": self.layers}, f)


def run_jaxdepth(model, tokens, start, layers, steps, state: State) -> None:
    import jaxdepth
    from jaxdepth.analyses.ig import Attribution, FixedRule

    prompt = answer_prompt(tokens, start)
    for layer in layers:
        if layer in state.layers:
            continue
        t0 = time.perf_counter()
        r = jaxdepth.integrated_gradients(
            model.params,
            prompt,
            model.config,
            Attribution(jaxdepth.metrics.answer_probability, site="resid_post", layers=[layer], per_channel=False),
            rule=FixedRule("left", steps),
        )
        seconds = time.perf_counter() - t0
        state.add(layer, _record(seconds, r.per_position[0, 0], r.f_input[0], r.f_baseline[0, 0]))
        log(f"jaxdepth layer {layer}: {seconds:.1f} s")


def run_reference(model_name, tokens, start, layers, steps, state: State, threads: int) -> None:
    import torch

    from benchmark import load_reference

    torch.set_num_threads(threads)
    ref, _ = load_reference(model_name)
    for layer in layers:
        if layer in state.layers:
            continue
        t0 = time.perf_counter()
        r = ref.integrated_gradients([tokens], [start], steps, layers=[layer])
        seconds = time.perf_counter() - t0
        state.add(layer, _record(seconds, r["attributions"][0][layer], r["f_input"][0], r["f_baseline"][0][layer]))
        log(f"reference layer {layer}: {seconds:.1f} s")


def _record(seconds, attributions, f_input, f_baseline) -> dict:
    return dict(
        seconds=float(seconds),
        attributions=np.asarray(attributions, np.float64).tolist(),
        f_input=float(f_input),
        f_baseline=float(f_baseline),
    )


def jaxdepth_side(dtype: str) -> str:
    """The state's name for jaxdepth's side in `dtype`: 'jaxdepth' in float32."""
    return "jaxdepth" if dtype == "float32" else f"jaxdepth-{dtype}"


def report(states: dict, layers: list, identity: dict, ours: str = "jaxdepth") -> dict:
    """Per side: the layers done and their summed seconds; with both complete, the ratio and how
    far the attributions are apart (max |difference| relative to max |attribution|, per layer)."""
    out = {"identity": identity, "cpu": cpu_description(), "cores": os.cpu_count()}
    for side, s in states.items():
        done = [l for l in layers if l in s.layers]
        out[side] = dict(layers_done=len(done), seconds=sum(s.layers[l]["seconds"] for l in done))
    if all(out.get(side, {}).get("layers_done") == len(layers) for side in (ours, "reference")):
        j, r = states[ours].layers, states["reference"].layers
        out["speedup"] = out["reference"]["seconds"] / out[ours]["seconds"]
        out["max_relative_difference"] = max(
            float(np.max(np.abs(np.subtract(j[l]["attributions"], r[l]["attributions"]))))
            / max(float(np.max(np.abs(r[l]["attributions"]))), 1e-30)
            for l in layers
        )
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    import jaxdepth

    sides = args.sides.split(",")
    if not set(sides) <= set(SIDES):
        raise SystemExit(f"--sides must be a subset of {SIDES}, got {args.sides!r}")
    model = jaxdepth.load(args.model, dtype=None if args.dtype == "float32" else args.dtype)
    L = model.config.num_layers
    layers = list(range(L)) if args.layers is None else [int(x) for x in args.layers.split(",")]
    if any(not 0 <= l < L for l in layers):
        raise SystemExit(f"--layers must lie in 0..{L - 1}, got {layers}")
    row, tokens, start = study_prompt(model, args)
    identity = dict(model=args.model, row=row, tokens=len(tokens), answer_start=start, steps=args.steps)
    os.makedirs(args.state, exist_ok=True)
    log(f"GSM8K row {row}: {len(tokens)} tokens, answer from {start}; {args.steps} steps x {len(layers)} layers")
    ours = jaxdepth_side(args.dtype)
    states = {side: State(args.state, side, identity) for side in (ours, "reference")}
    if "jaxdepth" in sides:
        run_jaxdepth(model, tokens, start, layers, args.steps, states[ours])
    if "reference" in sides:
        run_reference(args.model, tokens, start, layers, args.steps, states["reference"], args.torch_threads)
    summary = report(states, layers, identity, ours)
    from jaxdepth.core.atomic import atomic_write

    name = "summary.json" if ours == "jaxdepth" else f"summary-{args.dtype}.json"
    with atomic_write(os.path.join(args.state, name), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
