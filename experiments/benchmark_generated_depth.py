"""Depth in what the model generates, against its hook-based form in torch: the lens of every
generated token (`jaxdepth.analyses.generated_depth`) and the search over layer programs
(`jaxdepth.analyses.layer_programs`).

The reference is transformers' own model read from the same GGUF file, run as hook-based code
runs it: batch 1, one prompt at a time.
- The lens: `generate` (greedy, every row to `--new` tokens), a forward hook on each decoder
  layer keeping its output at the newest position, and at each step the final norm and LM head
  of each layer's output, the JSD to the output and the settling depth. jaxdepth generates every
  prompt at once and reads each answer's lens from one teacher-forced forward.
- The search: the same rounds (`layer_programs.beam_search`, so the same candidates where the
  scores agree), each candidate run alone: its layers put in place as the model's layer list (a
  repeated layer a second module sharing the weights, with its own cache slot), `generate` for
  its answer and one forward for the answer's likelihood. jaxdepth scores each round's
  candidates of every prompt in batched sweeps of one shape.

Each side runs in its own process (`--side`), so each process's peak memory is its own. It
prints each side's seconds, its peak memory, the speed-up and what agrees (settling depths token
by token, the answers of the programs found), and writes a JSON report.

    python experiments/benchmark_generated_depth.py --out experiments/results/generated_depth_benchmark.json

`--prompts 2 --new 4 --rounds 1` checks that everything runs. transformers reads the GGUF file
(about 70 s, excluded from the times) and needs torch and accelerate (the test extras).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import resource
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchmarking.machine import cpu_description  # noqa: E402
from benchmarking.report import log, write_json_atomic  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=12, help="the first N embedded default prompts")
    p.add_argument("--new", type=int, default=16, help="new tokens per answer")
    p.add_argument("--rounds", type=int, default=2, help="rounds of the program search")
    p.add_argument("--keep", type=int, default=2, help="programs kept per prompt after each round")
    p.add_argument("--edits", default="skip,repeat,swap")
    p.add_argument("--side", choices=("jaxdepth", "torch"), help="run one side here (the parent runs both)")
    p.add_argument("--part-out", help="where --side writes its part")
    p.add_argument("--out", default="results/generated_depth_benchmark.json")
    return p.parse_args(argv)


def peak_memory_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def workload(args):
    """The embedded model, its default prompts (question and reference answer) and the search."""
    import jaxdepth
    from jaxdepth.analyses import layer_programs
    from jaxdepth.lab.prompts import encode, load_prompts

    model = jaxdepth.load("smollm2")
    batch = encode(model.tokenizer, load_prompts("default")[: args.prompts])
    search = layer_programs.ProgramSearch(
        rounds=args.rounds, keep=args.keep, edits=tuple(args.edits.split(",")), max_new_tokens=args.new
    )
    return model, batch, search


def jaxdepth_side(args) -> dict:
    from jaxdepth.analyses import generated_depth, layer_programs

    model, batch, search = workload(args)
    reading = generated_depth.Reading(max_new_tokens=args.new)
    decode = model.tokenizer.decode
    times = {}
    for run in ("first", "again"):  # the first run compiles; the second reuses every program
        start = time.perf_counter()
        lens = generated_depth.generated_depth(model.params, batch, model.config, decode, reading)
        times[f"lens_{run}"] = time.perf_counter() - start
        start = time.perf_counter()
        found = layer_programs.search_programs(model.params, batch, model.config, decode, search)
        times[f"search_{run}"] = time.perf_counter() - start
    return dict(
        lens_seconds=times["lens_again"],
        lens_seconds_with_compile=times["lens_first"],
        settling=lens.settling[:, 0].tolist(),
        counted=lens.counted[:, 0].tolist(),
        search_seconds=times["search_again"],
        search_seconds_with_compile=times["search_first"],
        scored=found.scored.tolist(),
        shortest=found.shortest,
        answers=found.answers,
        intact_right=found.intact_right.tolist(),
        peak_memory_gib=peak_memory_gib(),
    )


def _program_layers(layers, program):
    """The decoder layers of `program` as a new layer list: step i a shallow copy of its layer
    (the same weights) whose attention writes cache slot i, so a repeated layer keeps two."""
    import torch

    steps = []
    for i, index in enumerate(program):
        layer = copy.copy(layers[index])
        layer._modules = dict(layers[index]._modules)  # the copy's own children, the same weights
        attention = copy.copy(layers[index].self_attn)
        attention.layer_idx = i
        layer._modules["self_attn"] = attention
        steps.append(layer)
    return torch.nn.ModuleList(steps)


def torch_side(args) -> dict:
    import torch

    from jaxdepth.analyses import generated_depth, layer_programs
    from jaxdepth.analyses.answers import cut_generation, same_answer
    from jaxdepth.lab.sources import embedded_gguf_path
    from reference_torch import load_hf_model

    model, batch, search = workload(args)
    start = time.perf_counter()
    hf = load_hf_model(embedded_gguf_path("smollm2"))
    log(f"transformers read the GGUF file in {time.perf_counter() - start:.0f} s (excluded)")
    hf.generation_config.eos_token_id = None  # every answer runs to --new tokens, as jaxdepth's do
    tokenizer = model.tokenizer
    L = model.config.num_layers
    questions = [[int(t) for t in row[:a]] for row, a in zip(batch.tokens, batch.answer_start)]
    full = [[int(t) for t in row[:n]] for row, n in zip(batch.tokens, batch.lengths)]
    references = [tokenizer.decode(f[a:]) for f, a in zip(full, batch.answer_start)]
    layers = hf.model.layers

    # the lens: hooks keep each layer's output at the newest position, step by step
    kept = []
    handles = [
        layer.register_forward_hook(lambda m, a, out: kept.append(out[0] if isinstance(out, tuple) else out))
        for layer in layers
    ]

    def lens_settling(question):
        kept.clear()
        with torch.no_grad():
            hf.generate(torch.tensor([question]), max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False)
        depths = []
        for step in range(args.new):
            h = torch.stack([kept[step * L + layer][0, -1] for layer in range(L)])  # [L, D]
            logits = hf.lm_head(hf.model.norm(h)).numpy()
            jsd = np.asarray(generated_depth.jensen_shannon(logits, logits[-1:]))
            depths.append(int(generated_depth.settling_depths(jsd[:, None])[0]))
        return depths

    start = time.perf_counter()
    settling = [lens_settling(q) for q in questions]
    lens_s = time.perf_counter() - start
    for h in handles:
        h.remove()

    def run_program(program, ids, generating: bool):
        hf.model.layers = _program_layers(layers, program)
        hf.config.num_hidden_layers = len(program)
        try:
            with torch.no_grad():
                if generating:
                    out = hf.generate(
                        torch.tensor([ids]), max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False
                    )
                    return out[0, len(ids) :].tolist()
                return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
        finally:
            hf.model.layers, hf.config.num_hidden_layers = layers, L

    def score(members):
        loglik, right, texts = np.zeros(len(members)), np.zeros(len(members), bool), [None] * len(members)
        for m, (p, program) in enumerate(members):
            logp = run_program(program, full[p], generating=False)
            a = int(batch.answer_start[p])
            targets = torch.tensor(full[p][a:])
            loglik[m] = float(logp[a - 1 : len(full[p]) - 1].gather(1, targets[:, None]).sum())
            texts[m] = cut_generation(tokenizer.decode(run_program(program, questions[p], generating=True)))
            right[m] = same_answer(texts[m], references[p])
        return loglik, right, texts

    start = time.perf_counter()
    found = layer_programs.beam_search(score, len(questions), L, search)
    search_s = time.perf_counter() - start
    return dict(
        lens_seconds=lens_s,
        settling=settling,
        search_seconds=search_s,
        scored=found.scored,
        shortest=found.shortest,
        answers=found.answers,
        intact_right=found.right0.tolist(),
        peak_memory_gib=peak_memory_gib(),
    )


def run_side(side: str, args) -> dict:
    """One side in a process of its own: its report part."""
    part = f"{args.out}.{side}.json"
    command = [sys.executable, os.path.abspath(__file__), "--side", side, "--part-out", part]
    command += ["--prompts", str(args.prompts), "--new", str(args.new), "--rounds", str(args.rounds)]
    command += ["--keep", str(args.keep), "--edits", args.edits]
    subprocess.run(command, check=True)
    with open(part) as f:
        return json.load(f)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.side:
        part = jaxdepth_side(args) if args.side == "jaxdepth" else torch_side(args)
        write_json_atomic(args.part_out, part)
        return 0
    cpu = cpu_description()
    log(f"{args.prompts} prompts, {args.new} new tokens, {args.rounds} rounds keeping {args.keep}; {cpu}")
    ours, theirs = run_side("jaxdepth", args), run_side("torch", args)
    counted = np.asarray(ours["counted"], bool)
    same_depth = np.asarray(ours["settling"])[counted] == np.asarray(theirs["settling"])[counted]
    report = dict(
        cpu=cpu,
        cores=os.cpu_count(),
        python=platform.python_version(),
        workload=vars(args),
        jaxdepth=ours,
        torch=theirs,
        lens_speedup=theirs["lens_seconds"] / ours["lens_seconds"],
        lens_speedup_with_compile=theirs["lens_seconds"] / ours["lens_seconds_with_compile"],
        search_speedup=theirs["search_seconds"] / ours["search_seconds"],
        search_speedup_with_compile=theirs["search_seconds"] / ours["search_seconds_with_compile"],
        same_settling_depth=float(same_depth.mean()),
        same_candidates=ours["scored"] == theirs["scored"],
        same_shortest=[a == b for a, b in zip(ours["shortest"], theirs["shortest"])],
    )
    log(
        f"lens of generated tokens: jaxdepth {ours['lens_seconds']:.1f} s ({ours['lens_seconds_with_compile']:.1f} s "
        f"compiling included), torch {theirs['lens_seconds']:.1f} s: {report['lens_speedup']:.1f}x "
        f"({report['lens_speedup_with_compile']:.1f}x); settling depths alike for {100 * same_depth.mean():.1f}% "
        "of tokens"
    )
    log(
        f"program search: jaxdepth {ours['search_seconds']:.1f} s ({ours['search_seconds_with_compile']:.1f} s "
        f"compiling included), torch {theirs['search_seconds']:.1f} s: {report['search_speedup']:.1f}x "
        f"({report['search_speedup_with_compile']:.1f}x); candidates per round {ours['scored']} / {theirs['scored']}"
    )
    log(f"peak memory: jaxdepth {ours['peak_memory_gib']:.2f} GiB, torch {theirs['peak_memory_gib']:.2f} GiB")
    write_json_atomic(args.out, report)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
