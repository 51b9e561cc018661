"""Generation under many layer orders: jaxdepth decoding every configuration of a sweep together
(one vmapped program over a stack of `jaxdepth.structure` orders) against transformers'
`generate` run once per configuration, with a hook that applies it (a forward hook returning a
dropped layer's input; two modules of the layer list exchanged for a swap).

The default workload: the embedded model (SmolLM2-135M-Instruct), every single-layer drop (30)
and adjacent swap (29), 20 prompts (the 12 embedded arithmetic prompts and 8 counting
prompts), 48 new tokens each, greedy, every row run to 48 tokens on both sides (no
end-of-sequence stop). It prints each side's time and tokens per second, the process's peak
memory after each side, the configurations whose tokens agree, and writes a JSON report.

    python experiments/benchmark_generation.py --out experiments/results/generation_benchmark.json

`--configs 4 --prompts 3 --new 8` (or `--only 'drop 29,swap 0-1'`) is a check that everything
runs (under a minute after the models load). transformers reads the GGUF file (about 70 s,
excluded from the times) and needs torch and accelerate (the test extras).
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchmarking.machine import cpu_description  # noqa: E402
from benchmarking.report import log, write_json_atomic  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=20, help="prompts per configuration")
    p.add_argument("--new", type=int, default=48, help="new tokens per prompt")
    p.add_argument("--configs", type=int, default=0, help="the first N configurations only (0: all drops and swaps)")
    p.add_argument(
        "--only",
        default="",
        help="these configurations only, by name, comma-separated (e.g. 'drop 29,swap 0-1'); default: all of --configs",
    )
    p.add_argument(
        "--executor",
        choices=("grouped", "vmapped"),
        default="grouped",
        help="jaxdepth's decoding of many orders: layer-major (generate_orders) or vmap over generate",
    )
    p.add_argument(
        "--chunk", type=int, default=0, help="configurations decoded together in one call (0: 64 grouped, 8 vmapped)"
    )
    p.add_argument("--no-reference", action="store_true", help="time jaxdepth only")
    p.add_argument("--out", default="results/generation_benchmark.json")
    return p.parse_args(argv)


def prompts(count: int) -> list[str]:
    """The embedded arithmetic prompts, then counting prompts, `count` in all."""
    from jaxdepth.lab.prompts import load_prompts

    texts = [p.question for p in load_prompts("default")]
    texts += [f"{a}, {a + 1}, {a + 2}," for a in range(1, 1 + max(0, count - len(texts)))]
    return texts[:count]


def configurations(L: int, limit: int):
    """(name, order) of every single-layer drop and adjacent swap."""
    from jaxdepth import structure

    found = [(f"drop {l}", structure.drop_block(L, l, 1)) for l in range(L)]
    found += [(f"swap {l}-{l + 1}", structure.swap_pair(L, l)) for l in range(L - 1)]
    return found[:limit] if limit else found


def peak_memory_gib() -> float:
    """The process's peak resident memory so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run_jaxdepth(model, token_ids, valid, orders, new: int, chunk: int, executor: str):
    """Every order's new tokens `[configs, B, new]`, decoded `chunk` orders at a time, and
    (compile seconds, the whole sweep's seconds after compiling). `executor` 'grouped' decodes
    each chunk layer-major (`generate_orders`, one program per chunk of orders); 'vmapped' runs
    `generate` under vmap over a stack of orders (one program for every chunk; the last chunk
    padded with copies of its last order)."""
    import jax
    import jax.numpy as jnp

    from jaxdepth import generate, structure
    from jaxdepth.core.decoding import generate_orders

    L = model.config.num_layers
    pieces = [orders[i : i + chunk] for i in range(0, len(orders), chunk)]
    if executor == "grouped":
        decode = jax.jit(generate_orders, static_argnames=("config", "grouped", "max_new_tokens"))
        calls = [(structure.group_orders(structure.stack_orders(p), L),) for p in pieces]

        def lowered(grouped):
            return decode.lower(model.params, token_ids, model.config, grouped, max_new_tokens=new, valid=valid)

        def run(compiled, grouped):
            return compiled(model.params, token_ids, valid=valid).tokens
    else:

        def one(params, order):
            return generate(params, token_ids, model.config, valid=valid, max_new_tokens=new, order=order).tokens

        sweep = jax.jit(jax.vmap(one, in_axes=(None, 0)))
        padded = [p + [p[-1]] * (chunk - len(p)) for p in pieces]
        calls = [(structure.LayerOrder(*map(jnp.asarray, structure.stack_orders(p))),) for p in padded]

        def lowered(stacked):
            return sweep.lower(model.params, stacked)

        def run(compiled, stacked):
            return compiled(model.params, stacked)

    start = time.perf_counter()
    compiled = [lowered(*call).compile() for call in (calls if executor == "grouped" else calls[:1])]
    compile_s = time.perf_counter() - start
    compiled = compiled if executor == "grouped" else compiled * len(calls)
    start = time.perf_counter()
    out = [np.asarray(run(c, *call))[: len(p)] for c, call, p in zip(compiled, calls, pieces)]
    return np.concatenate(out), compile_s, time.perf_counter() - start


def run_reference(hf, texts, tokenizer, configs, new: int):
    """transformers' greedy generate once per configuration (left-padded batch, its cache), each
    configuration applied by a hook: `[configs, B, new]` tokens and the seconds."""
    import torch

    layers = hf.model.layers
    hf.generation_config.eos_token_id = None  # every row runs to `new` tokens, as jaxdepth's do
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    batch = tokenizer(texts, return_tensors="pt", padding=True)

    def passthrough(module, args, kwargs, output):
        h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        return h if isinstance(output, torch.Tensor) else (h, *output[1:])

    out, start = [], time.perf_counter()
    for name, _ in configs:
        kind, where = name.split(" ")
        handle = None
        if kind == "drop":
            handle = layers[int(where)].register_forward_hook(passthrough, with_kwargs=True)
        else:
            i = int(where.split("-")[0])
            layers[i], layers[i + 1] = layers[i + 1], layers[i]
        try:
            with torch.no_grad():
                tokens = hf.generate(
                    **batch,
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=False,
                    pad_token_id=tokenizer.pad_token_id,
                )
        finally:
            if handle is not None:
                handle.remove()
            else:
                layers[i], layers[i + 1] = layers[i + 1], layers[i]
        out.append(tokens[:, batch["input_ids"].shape[1] :].numpy())
    return np.stack(out), time.perf_counter() - start


def main(argv=None) -> int:
    args = parse_args(argv)
    import jaxdepth
    from jaxdepth.core.batch import make_batch

    model = jaxdepth.load("smollm2")
    texts = prompts(args.prompts)
    configs = configurations(model.config.num_layers, args.configs)
    if args.only:
        wanted = [name.strip() for name in args.only.split(",")]
        unknown = sorted(set(wanted) - {name for name, _ in configs})
        if unknown:
            raise SystemExit(
                f"no configuration named {', '.join(map(repr, unknown))}: drops are 'drop L', swaps 'swap L-L+1'"
            )
        configs = [c for c in configs if c[0] in wanted]
    ids = [model.encode(t) for t in texts]
    batch = make_batch(ids)  # right-padded to a bucket length
    token_ids, valid, width = batch.tokens, batch.valid, batch.tokens.shape[1]
    generated = len(configs) * len(texts) * args.new
    cpu = cpu_description()
    log(
        f"{len(configs)} configurations x {len(texts)} prompts ({min(map(len, ids))}-{max(map(len, ids))} tokens, "
        f"padded to {width}) x {args.new} new tokens = {generated} tokens; {cpu}, {os.cpu_count()} cores"
    )
    report = dict(
        cpu=cpu,
        cores=os.cpu_count(),
        python=platform.python_version(),
        configurations=[name for name, _ in configs],
        prompts=len(texts),
        new_tokens=args.new,
    )

    chunk = args.chunk or (64 if args.executor == "grouped" else 8)
    report["executor"], report["chunk"] = args.executor, chunk
    jax_tokens, compile_s, seconds = run_jaxdepth(
        model, token_ids, valid, [order for _, order in configs], args.new, chunk, args.executor
    )
    report["jaxdepth"] = dict(
        compile_s=compile_s,
        seconds=seconds,
        tokens_per_s=generated / seconds,
        seconds_with_compile=compile_s + seconds,
        peak_memory_gib=peak_memory_gib(),
    )
    log(
        f"jaxdepth ({args.executor}, {chunk} configurations a call): compiling {compile_s:.1f} s; every "
        f"configuration {seconds:.1f} s, {generated / seconds:.0f} tokens/s; process peak memory "
        f"{peak_memory_gib():.2f} GiB"
    )
    write_json_atomic(args.out, report)
    if args.no_reference:
        return 0

    from jaxdepth.lab.sources import embedded_gguf_path
    from reference_torch import load_hf_model

    start = time.perf_counter()
    hf = load_hf_model(embedded_gguf_path("smollm2"))
    log(f"transformers read the GGUF file in {time.perf_counter() - start:.0f} s (excluded)")
    ref_tokens, ref_seconds = run_reference(hf, texts, model.tokenizer, configs, args.new)
    same = (jax_tokens == ref_tokens).all(axis=2)  # [configs, prompts]: a whole continuation alike
    report["reference"] = dict(
        seconds=ref_seconds, tokens_per_s=generated / ref_seconds, peak_memory_gib=peak_memory_gib()
    )
    report["speedup"] = ref_seconds / seconds
    report["speedup_with_compile"] = ref_seconds / (compile_s + seconds)
    report["identical_continuations"] = dict(
        fraction=float(same.mean()),
        per_configuration={name: float(row.mean()) for (name, _), row in zip(configs, same)},
    )
    log(
        f"transformers, once per configuration: {ref_seconds:.1f} s, {generated / ref_seconds:.0f} tokens/s; "
        f"process peak memory {peak_memory_gib():.2f} GiB (both sides)"
    )
    log(
        f"jaxdepth / transformers: {ref_seconds / seconds:.2f}x ({ref_seconds / (compile_s + seconds):.2f}x counting "
        f"jaxdepth's compilation); identical continuations "
        f"{same.sum()} of {same.size} ({100 * same.mean():.1f}%)"
    )
    write_json_atomic(args.out, report)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
