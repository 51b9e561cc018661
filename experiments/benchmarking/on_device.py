"""jaxdepth against the PyTorch reference on one device, a GPU or the CPU, on random weights of a
named Hugging Face shape (`experiments/benchmark_on_device.py` is its command line).

The model is built by transformers (`Qwen2ForCausalLM` from the shape's `Qwen2Config`) on the
device, with its biases and norm weights randomised (transformers initialises them to 0 and 1);
its state dict goes through the project's own conversion table (`conversion.layout`), so both
sides hold the same weights. Timing does not depend on the weights; agreement is checked on them
all the same.

For each analysis (integrated gradients, residual erasure, layer skip) it prints, as the row
finishes: jaxdepth's first call (compile + run) and its warm calls (median of `--repeat`), each
blocked on before the clock stops; the reference's time (median of `--ref-repeat`, after
`torch.cuda.synchronize()`); their ratio; the largest difference between the two results; the
FLOPs executed and the rate. Erasure and layer skip run through the benchmark's own cases
(`benchmarking/cases/`), which also give the FLOP models and the agreement checks.

A lent GPU machine has no network, no `gguf` and no `datasets`: the module imports only the
standard library and numpy at module level (jax is imported after `XLA_PYTHON_CLIENT_MEM_FRACTION`
is set), and the token ids can be prepared on a CPU machine (`--prepare-ids`) and passed with
`--ids`.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Callable, Optional

import numpy as np

from .report import log, write_json_atomic

# Hugging Face `Qwen2Config` arguments of each shape; Qwen2 has q/k/v biases and silu MLPs.
SHAPES = {
    # a few layers and small widths, for the CPU test (a larger init range makes the attention
    # far from uniform, so the agreement check is sharp)
    "tiny": dict(
        num_hidden_layers=3,
        hidden_size=64,
        intermediate_size=128,
        vocab_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        initializer_range=0.1,
    ),
    "qwen2.5-1.5b": dict(
        num_hidden_layers=28,
        hidden_size=1536,
        intermediate_size=8960,
        vocab_size=151936,
        num_attention_heads=12,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
    ),
    "qwen2.5-7b": dict(
        num_hidden_layers=28,
        hidden_size=3584,
        intermediate_size=18944,
        vocab_size=152064,
        num_attention_heads=28,
        num_key_value_heads=4,
        tie_word_embeddings=False,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        max_position_embeddings=131072,
    ),
}

ANALYSES = ("integrated_gradients", "erasure", "layer_skip")
ALIASES = {"ig": "integrated_gradients", "skip": "layer_skip"}

# The workload of each preset. The default is sized to about 5 minutes on qwen2.5-1.5b on an H100
# (estimated from earlier timings of these analyses there), so that it fits a 15-minute lease
# with a quick run before it: IG is the studies' (256 steps x every layer on GSM8K row 0, 176
# tokens); erasure and layer skip are cut to 64 tokens, as the reference runs one forward pass
# per boundary x position (per layer x split) and its time grows with both.
PRESETS = {
    "default": dict(
        ig_steps=256,
        ig_prompts=1,
        ig_max_tokens=None,
        erasure_prompts=1,
        erasure_max_tokens=64,
        skip_prompts=2,
        skip_max_tokens=64,
        baseline_prompts=10,
        repeat=2,
        ref_repeat=1,
    ),
    "quick": dict(
        ig_steps=32,
        ig_prompts=1,
        ig_max_tokens=64,
        erasure_prompts=1,
        erasure_max_tokens=32,
        skip_prompts=1,
        skip_max_tokens=64,
        baseline_prompts=2,
        repeat=1,
        ref_repeat=1,
    ),
}

# Lengths and answer starts of GSM8K test rows 0-9 under the embedded tokenizer: random ids of
# these shapes (when no tokenizer is at hand) give the same workload as the real prompts.
GSM8K_SHAPES = [
    (176, 110),
    (121, 71),
    (318, 102),
    (130, 80),
    (268, 155),
    (283, 101),
    (205, 89),
    (315, 116),
    (349, 150),
    (270, 103),
]

EXPERIMENTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DATA = os.path.normpath(os.path.join(EXPERIMENTS, "..", "..", "shared", "data", "gsm8k_test_sample.jsonl"))
MEM_FRACTION = "0.55"  # of the GPU's memory for XLA's pool, so that torch has memory too
PEAK_SIZE = {"cuda": 8192, "cpu": 1024}  # square matmul of the peak measurement


# ----------------------------------------------------------------------------- command line


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Benchmark on one device: jaxdepth against the PyTorch reference on a "
        "GPU or the CPU, on random weights of a named Hugging Face shape.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="qwen2.5-1.5b",
        help="the Hugging Face configuration whose random weights both sides run",
    )
    p.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="the reference's torch device (auto: cuda when torch sees a GPU); jaxdepth runs on "
        "jax's default backend, which must be the same kind of device",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="the quick preset (a check that everything runs, estimated at 2-3 minutes on an H100): "
        + ", ".join(f"{k}={v}" for k, v in PRESETS["quick"].items()),
    )
    p.add_argument("--analyses", default=",".join(ANALYSES), help="comma-separated subset of " + ", ".join(ANALYSES))
    prompts = p.add_argument_group("prompts (token ids prepared without any network)")
    prompts.add_argument(
        "--ids",
        default=None,
        help="token ids prepared ahead (--prepare-ids): a .json file with token_ids and "
        "answer_starts, or a .npy int array [prompts, tokens] right-padded with -1 (its "
        "answers: the last quarter of each prompt)",
    )
    prompts.add_argument(
        "--prepare-ids",
        metavar="OUT",
        default=None,
        help="write the token ids to OUT (.json, or .npy without the answer starts) and stop",
    )
    prompts.add_argument(
        "--prompt-source",
        choices=("auto", "gsm8k", "default", "random"),
        default="auto",
        help="without --ids: GSM8K rows of --data tokenized by the embedded tokenizer; jaxdepth's "
        "embedded default prompts; or deterministic random ids of GSM8K rows 0-9's lengths "
        "(auto: the first of these that is available)",
    )
    prompts.add_argument("--data", default=DEFAULT_DATA, help="GSM8K JSONL file")
    prompts.add_argument("--seed", type=int, default=123, help="random weights, random ids and layer-skip splits")
    work = p.add_argument_group("workload (default: the default preset, or --quick's)")
    work.add_argument("--ig-steps", type=int, help="integrated-gradients steps (left Riemann)")
    work.add_argument("--ig-prompts", type=int, help="prompts for integrated gradients")
    work.add_argument("--ig-max-tokens", type=int, help="token cap for integrated gradients (0: none)")
    work.add_argument(
        "--ig-backward",
        choices=("auto", "recompute", "stored"),
        default=None,
        help="jaxdepth's IG backward, where its integrated_gradients takes a `backward` option",
    )
    work.add_argument(
        "--ig-chunks",
        default="",
        help="comma-separated gradient widths: for each, one more IG row of jaxdepth at that chunk size "
        "(compared with the same reference run), to see whether the width 'auto' picks runs at the "
        "device's best speed",
    )
    work.add_argument(
        "--precision",
        choices=("float32", "bfloat16"),
        default="float32",
        help="bfloat16: also run jaxdepth's IG on bfloat16 params, and report its attributions "
        "against the float32 run's",
    )
    work.add_argument("--erasure-prompts", type=int, help="prompts for residual erasure")
    work.add_argument("--erasure-max-tokens", type=int, help="token cap for residual erasure (0: none)")
    work.add_argument("--skip-prompts", type=int, help="prompts for layer skip")
    work.add_argument("--skip-max-tokens", type=int, help="token cap for layer skip (0: none)")
    work.add_argument(
        "--baseline-prompts",
        type=int,
        help="erasure baseline: mean residuals over the first N prompts (full length; untimed)",
    )
    work.add_argument("--repeat", type=int, help="warm jaxdepth calls per analysis (their median is reported)")
    work.add_argument("--ref-repeat", type=int, help="reference calls per analysis (their median is reported)")
    p.add_argument(
        "--tf32",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="TF32 matmuls on both sides (default: on for cuda; JAX's float32 default on NVIDIA "
        "GPUs); --no-tf32 runs both at full float32",
    )
    p.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch's intra-op threads on the CPU (default: torch's own choice)",
    )
    p.add_argument("--no-reference", action="store_true", help="time jaxdepth only (no agreement check)")
    p.add_argument("--out", default="results/benchmark_on_device.json", help="JSON report (written after every row)")
    args = p.parse_args(argv)
    preset = PRESETS["quick" if args.quick else "default"]
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("ig_max_tokens", "erasure_max_tokens", "skip_max_tokens"):
        if getattr(args, key) == 0:
            setattr(args, key, None)
    if min(args.repeat, args.ref_repeat, args.ig_steps) < 1:
        p.error("--repeat, --ref-repeat and --ig-steps must be at least 1")
    try:
        args.ig_chunks = [int(k) for k in args.ig_chunks.split(",") if k.strip()]
    except ValueError:
        p.error(f"--ig-chunks {args.ig_chunks!r}: want comma-separated integers")
    if any(k < 1 for k in args.ig_chunks):
        p.error("--ig-chunks: every width must be at least 1")
    names = [ALIASES.get(a.strip(), a.strip()) for a in args.analyses.split(",") if a.strip()]
    unknown = sorted(set(names) - set(ANALYSES))
    if unknown:
        p.error(f"unknown analyses {unknown}; known: {', '.join(ANALYSES)}")
    args.analyses = [a for a in ANALYSES if a in names]
    return args


# ----------------------------------------------------------------------------- prompts


@dataclasses.dataclass
class PromptIds:
    """Token ids of the prompts (one list per prompt, unpadded), where each answer starts, and
    what they are."""

    token_lists: list
    answer_starts: list
    source: str

    def __post_init__(self):
        if not self.token_lists or len(self.token_lists) != len(self.answer_starts):
            raise ValueError(f"{len(self.token_lists)} prompts and {len(self.answer_starts)} answer starts")
        for i, (tokens, start) in enumerate(zip(self.token_lists, self.answer_starts)):
            if len(tokens) < 2 or min(tokens) < 0:
                raise ValueError(f"prompt {i}: needs at least 2 token ids, all >= 0")
            if not 1 <= start < len(tokens):
                raise ValueError(f"prompt {i}: answer start {start} outside 1..{len(tokens) - 1}")


def last_quarter(n: int) -> int:
    """The answer start of a prompt whose answer is unknown: its last quarter stands in."""
    return n - max(1, n // 4)


def needed_prompts(args) -> int:
    """Prompts the run reads: every analysis' count, the erasure baseline's, at least 10."""
    return max(10, args.baseline_prompts, args.ig_prompts, args.erasure_prompts, args.skip_prompts)


def load_ids(path: str) -> PromptIds:
    """Token ids written by `--prepare-ids` (.json) or a plain .npy int array (-1 = padding)."""
    if path.endswith(".json"):
        with open(path) as f:
            data = json.load(f)
        if isinstance(data, list):  # a bare list of token lists
            data = {"token_ids": data}
        lists = [[int(t) for t in row] for row in data["token_ids"]]
        starts = data.get("answer_starts") or [last_quarter(len(t)) for t in lists]
        return PromptIds(lists, [int(s) for s in starts], data.get("source", path))
    if path.endswith(".npy"):
        ids = np.load(path, allow_pickle=False)
        if ids.ndim == 1:
            ids = ids[None]
        if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"{path}: want an int array [prompts, tokens], got {ids.dtype} {ids.shape}")
        lists = [[int(t) for t in row if t >= 0] for row in ids]
        return PromptIds(
            lists, [last_quarter(len(t)) for t in lists], f"{path} (answers: the last quarter of each prompt)"
        )
    raise ValueError(f"--ids {path}: want a .json or .npy file")


def save_ids(path: str, ids: PromptIds) -> None:
    """Write `ids` for `load_ids`: .json (one prompt's ids a line) or .npy (no answer starts)."""
    from jaxdepth.core.atomic import atomic_write

    if path.endswith(".npy"):
        width = max(len(t) for t in ids.token_lists)
        array = np.full((len(ids.token_lists), width), -1, np.int64)
        for i, tokens in enumerate(ids.token_lists):
            array[i, : len(tokens)] = tokens
        with atomic_write(path, "wb") as f:
            np.save(f, array)
    elif path.endswith(".json"):
        rows = ",\n".join(json.dumps(t, separators=(",", ":")) for t in ids.token_lists)
        with atomic_write(path, "w") as f:
            f.write(
                f'{{"source": {json.dumps(ids.source)},\n"answer_starts": {json.dumps(ids.answer_starts)},\n'
                f'"token_ids": [\n{rows}\n]}}\n'
            )
    else:
        raise ValueError(f"--prepare-ids {path}: want a .json or .npy file")


def embedded_tokenizer():
    """(the embedded model's tokenizer, None), or (None, why it is not available). Its ids are
    valid ids of the Qwen2.5 vocabulary."""
    try:
        import gguf
    except ImportError:
        return None, "the gguf package is not installed"
    from conversion.errors import ConversionError
    from conversion.gguf_tokenizer import gguf_tokenizer
    from jaxdepth.lab.sources import embedded_gguf_path

    try:
        return gguf_tokenizer(gguf.GGUFReader(embedded_gguf_path("smollm2"))), None
    except ConversionError as e:
        return None, str(e)


def random_ids(count: int, vocab: int, seed: int) -> PromptIds:
    rng = np.random.default_rng(seed)
    shapes = [GSM8K_SHAPES[i % len(GSM8K_SHAPES)] for i in range(count)]
    return PromptIds(
        [rng.integers(0, vocab, n).tolist() for n, _ in shapes],
        [s for _, s in shapes],
        f"deterministic random ids (seed {seed}) of the lengths and answer starts of GSM8K test rows "
        "0-9 under the embedded tokenizer",
    )


def prepare_ids(args, vocab: int) -> PromptIds:
    """The run's token ids: `--ids`, else the first available of `--prompt-source`'s choices."""
    if args.ids:
        return load_ids(args.ids)
    count, source = needed_prompts(args), args.prompt_source
    if source == "random":
        return random_ids(count, vocab, args.seed)
    tokenizer, why = embedded_tokenizer()
    if tokenizer is None:
        if source != "auto":
            raise SystemExit(f"error: --prompt-source {source} needs the embedded tokenizer: {why}")
        log(f"prompts: no embedded tokenizer ({why}): random ids instead")
        return random_ids(count, vocab, args.seed)
    from jaxdepth.lab.prompts import encode, load_prompts

    if source == "gsm8k" or (source == "auto" and os.path.isfile(args.data)):
        prompts, what = load_prompts("gsm8k", args.data, limit=count), f"GSM8K rows of {args.data}"
    else:
        prompts, what = load_prompts("default", limit=count), "jaxdepth's embedded default prompts"
    batch = encode(tokenizer, prompts)
    lengths = [int(n) for n in batch.lengths]
    return PromptIds(
        [batch.tokens[i, :n].tolist() for i, n in enumerate(lengths)],
        [int(s) for s in batch.answer_start],
        f"{what}, tokenized by the embedded tokenizer",
    )


# ----------------------------------------------------------------------------- machine


def cpu_model() -> str:
    """The CPU's model name as lscpu gives it, with its family and model numbers where lscpu
    gives them (else the model name from /proc/cpuinfo)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        fields = {}
        for line in out.splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
        if fields.get("Model name"):
            numbers = [
                f"{label} {fields[k]}" for k, label in (("CPU family", "family"), ("Model", "model")) if fields.get(k)
            ]
            return fields["Model name"] + (f" ({', '.join(numbers)})" if numbers else "")
    except (OSError, subprocess.SubprocessError):
        pass
    from .machine import cpu_description

    return cpu_description()


def resolve_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but torch sees no GPU (a CPU build of torch?)")
    return name


def synchronizer(device: str) -> Callable[[], None]:
    import torch

    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def matmul_peaks(device: str, dtypes) -> dict:
    """Best matmul FLOP/s of jax (its default backend) for each dtype and of torch (on `device`)
    in float32, the reference's dtype, under the run's matmul settings (TF32 or not): a square
    matmul, best of 5."""
    import jax
    import jax.numpy as jnp
    import torch

    n, sync, out = PEAK_SIZE[device], synchronizer(device), {}
    flops = 2.0 * n**3
    for dtype in dtypes:
        a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32).astype(dtype)
        dot = jax.jit(jnp.dot)
        dot(a, a).block_until_ready()
        out[f"jax_{dtype}"] = flops / min(_seconds(lambda: dot(a, a).block_until_ready()) for _ in range(5))
        a = None  # the device memory goes before the next dtype's matrix
    t = torch.randn(n, n, device=device)
    torch.mm(t, t)
    sync()

    def mm():
        torch.mm(t, t)
        sync()

    out["torch_float32"] = flops / min(_seconds(mm) for _ in range(5))
    return out


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# ----------------------------------------------------------------------------- the model


def build_models(shape: str, device: str, seed: int):
    """transformers' `Qwen2ForCausalLM` of `shape` with random weights, built on `device` (float32,
    eval mode, no parameter gradients), and the same weights as a jaxdepth `Model` through the
    project's conversion table."""
    import jax
    import jax.numpy as jnp
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from conversion.hf_layouts import HF_NAMES
    from conversion.layout import assemble_params
    from jaxdepth.core.config import ModelConfig
    from jaxdepth.lab.loaded_model import Model

    # sdpa: the reference's IG suffix runs attend causally without a mask only with it
    hf_config = Qwen2Config(attn_implementation="sdpa", **SHAPES[shape])
    torch.manual_seed(seed)
    with torch.device(device):  # only while constructing: the weights are made on the device
        hf = Qwen2ForCausalLM(hf_config)
    with torch.no_grad():  # transformers initialises biases to 0 and norm weights to 1
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "bias" in name:
                p.copy_(0.1 * torch.randn_like(p))
    hf.eval()
    hf.requires_grad_(False)  # gradients are only ever taken with respect to activations
    config = ModelConfig.from_hf(json.loads(hf_config.to_json_string()))  # what its config.json would hold
    state = hf.state_dict()
    params = assemble_params(config, state.keys(), lambda name: state[name].detach().cpu().numpy(), HF_NAMES)
    params = jax.tree.map(jnp.asarray, params)
    jax.block_until_ready(params)
    return hf, Model(params=params, config=config, tokenizer=None, source=f"random weights of {shape}")


# ----------------------------------------------------------------------------- timing


@dataclasses.dataclass
class Timed:
    result: object
    first_s: Optional[float]  # jaxdepth's first call (compile + run); None for the reference
    runs_s: list

    @property
    def median_s(self) -> float:
        return float(statistics.median(self.runs_s))


def time_jaxdepth(fn: Callable, repeat: int) -> Timed:
    """A first call (it compiles and runs), then `repeat` warm calls; each clock stops once the
    result is on the host or ready on the device."""
    import jax

    def once():
        start = time.perf_counter()
        result = jax.block_until_ready(fn())
        return result, time.perf_counter() - start

    _, first = once()
    runs, result = [], None
    for _ in range(repeat):
        result, seconds = once()
        runs.append(seconds)
    return Timed(result, first, runs)


def time_reference(fn: Callable, repeat: int, sync: Callable) -> Timed:
    runs, result = [], None
    for _ in range(repeat):
        sync()
        start = time.perf_counter()
        result = fn()
        sync()
        runs.append(time.perf_counter() - start)
    return Timed(result, None, runs)


# ----------------------------------------------------------------------------- the run


def integrated_gradients_function():
    """jaxdepth's study IG (`integrated_gradients_of_answers(params, batch, config, *, rule, execution, ...)`;
    `integrated_gradients` in a jaxdepth before it had that name), the one place this module
    names where it lives: the benchmark runs before and after a change, on either."""
    from jaxdepth.analyses import integrated_gradients as study

    return getattr(study, "integrated_gradients_of_answers", None) or study.integrated_gradients


def _takes(name: str) -> bool:
    return name in inspect.signature(integrated_gradients_function()).parameters


def ig_options(backward: Optional[str]) -> dict:
    """jaxdepth's IG options beyond the studies' defaults: `backward`, where it takes one (in an
    `Execution`, or, in a jaxdepth whose IG options were keywords, as `backward=`): the
    benchmark runs before and after a change, on either."""
    if backward is None:
        return {}
    if _takes("execution"):
        from jaxdepth.analyses.ig import Execution

        return {"execution": Execution(backward=backward, progress=False)}
    if not _takes("backward"):
        raise SystemExit("error: --ig-backward: this jaxdepth's integrated_gradients takes no `backward` option")
    return {"backward": backward}


def with_chunk(options: dict, chunk: int) -> dict:
    """`options` with jaxdepth's IG held to `chunk` gradients at a time."""
    from jaxdepth.analyses.ig import Execution

    execution = options.get("execution", Execution(progress=False))
    return {**options, "execution": dataclasses.replace(execution, chunk_size=chunk)}


def ig_plan(config, batch, steps: int, backward: Optional[str]) -> str:
    """What jaxdepth's IG chooses for each prompt of `batch` on this device, now: its padded
    length, its backward and its gradients' width."""
    from jaxdepth.analyses.ig import FixedRule
    from jaxdepth.analyses.ig.path import choose_backward, ig_memory_budget
    from jaxdepth.analyses.integrated_gradients import ig_lengths
    from jaxdepth.core.loops import stored_layers
    from jaxdepth.core.sweep import auto_chunk_size

    budget = ig_memory_budget()
    padding = ig_lengths(batch, config, FixedRule("left", steps))
    plans = []
    for i in range(len(batch)):
        T = batch.single(i, padding).tokens.shape[1]
        chosen = choose_backward(backward or "auto", config, T, budget)
        stored = stored_layers(chosen, config.num_layers)
        width = auto_chunk_size(config, T, steps, grad=True, stored=stored, memory_budget=budget)
        plans.append(f"prompt {i}: padded to {T}, backward {chosen!r}, {width} gradients at a time")
    return f"memory budget {budget / 2**30:.1f} GiB; " + "; ".join(plans)


def run_ig(params, batch, config, steps: int, options: dict):
    if not _takes("execution"):  # a jaxdepth whose IG options were keywords
        return integrated_gradients_function()(
            params, batch, config, steps=steps, rule="left", progress=False, **options
        )
    from jaxdepth.analyses.ig import Execution, FixedRule

    options = {"execution": Execution(progress=False), **options}
    return integrated_gradients_function()(params, batch, config, rule=FixedRule("left", steps), **options)


def run_layer_skip(bench, w):
    # The call the study runner makes for layer skip (its declaration's run), made here directly.
    from jaxdepth.analyses.layer_skip import Skip, layer_skip_sublayers

    return layer_skip_sublayers(
        bench.model.params, w.batch, bench.config, Skip(seed=bench.args.seed), sublayers=("layer",)
    )


def out_of_memory(e: BaseException) -> bool:
    """Whether `e` is jax's or torch's out-of-memory error: the row is skipped, the run goes on."""
    text = f"{type(e).__name__}: {e}"
    return "RESOURCE_EXHAUSTED" in text or "OutOfMemoryError" in text or "out of memory" in text.lower()


def fmt_flops(x: Optional[float]) -> str:
    """FLOPs (or, with a "/s" after it, FLOP/s) in the largest unit under the number."""
    if x is None:
        return "-"
    unit, scale = next((u, v) for u, v in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("", 1.0)) if x >= v or v == 1.0)
    return f"{x / scale:.3g} {unit}FLOP"


def fmt_rate(x: Optional[float]) -> str:
    return "-" if x is None else fmt_flops(x) + "/s"


def fmt_s(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.1f}" if x >= 10 else f"{x:.3f}"


def make_row(
    name, w, jax_t: Timed, ref_t: Optional[Timed], agreement: list, model_flops, executed, peak, note=""
) -> dict:
    ref_s = None if ref_t is None else ref_t.median_s
    warm = jax_t.median_s
    diffs = [a["max_abs_diff"] for a in agreement if a.get("max_abs_diff") is not None]
    checked = [a["ok"] for a in agreement if a["ok"] is not None]  # None: reported, no tolerance
    return dict(
        analysis=name,
        workload=w.describe(),
        prompts=len(w.lengths),
        lengths=w.lengths,
        jax_first_s=jax_t.first_s,
        jax_warm_s=warm,
        jax_warm_runs_s=jax_t.runs_s,
        ref_s=ref_s,
        ref_runs_s=None if ref_t is None else ref_t.runs_s,
        speedup=None if ref_s is None else ref_s / warm,
        max_abs_diff=agreement[0].get("max_abs_diff") if agreement else None,
        largest_abs_diff=max(diffs) if diffs else None,
        agree=all(checked) if checked else None,
        agreement=agreement,
        model_flops=model_flops,
        executed_flops=executed,
        jax_executed_flops_per_s=None if executed is None else executed / warm,
        jax_fraction_of_peak=None if not peak or executed is None else executed / warm / peak,
        jax_model_flops_per_s=model_flops / warm,
        ref_model_flops_per_s=None if ref_s is None else model_flops / ref_s,
        note=note,
    )


def print_row(row: dict) -> None:
    ratio = "-" if row["speedup"] is None else f"{row['speedup']:.2f}x"
    peak = "" if row["jax_fraction_of_peak"] is None else f", {100 * row['jax_fraction_of_peak']:.0f}% of jax's peak"
    print(f"  {row['analysis']}: {row['workload']}{row['note']}")
    print(
        f"    jaxdepth   first call {fmt_s(row['jax_first_s'])} s (compile + run); warm {fmt_s(row['jax_warm_s'])} s "
        f"(median of {len(row['jax_warm_runs_s'])}: {', '.join(fmt_s(s) for s in row['jax_warm_runs_s'])})"
    )
    if row["ref_s"] is not None:
        print(
            f"    reference  {fmt_s(row['ref_s'])} s (median of {len(row['ref_runs_s'])}); "
            f"reference / jaxdepth warm = {ratio}"
        )
    executes = (
        ""
        if row["executed_flops"] is None
        else f"jaxdepth executes {fmt_flops(row['executed_flops'])}, "
        f"{fmt_rate(row['jax_executed_flops_per_s'])} warm{peak}; "
    )
    print(
        f"    FLOPs      {executes}the reference's formulation {fmt_flops(row['model_flops'])}, "
        f"{fmt_rate(row['jax_model_flops_per_s'])} in jaxdepth's warm time"
        + ("" if row["ref_s"] is None else f", {fmt_rate(row['ref_model_flops_per_s'])} in the reference's")
    )
    for a in row["agreement"]:
        ok = "reported" if a["ok"] is None else "ok" if a["ok"] else "DIFFERS"
        if "max_abs_diff" in a:
            d = "-" if a["max_abs_diff"] is None else f"{a['max_abs_diff']:.3e}"
            s = "-" if a.get("scale") is None else f"{a['scale']:.3g}"
            print(f"    agreement  {a['quantity']:<34} max |diff| {d:>10} (scale {s}) {ok} ({a['note']})")
        else:
            print(
                f"    agreement  {a['quantity']:<34} jax {a['jaxdepth']} / reference {a['reference']} {ok} {a['note']}"
            )
    sys.stdout.flush()


def oom(report: dict, analysis: str, side: str, e: BaseException) -> None:
    first = (str(e).strip().splitlines() or [""])[0][:300]
    log(
        f"{analysis}: {side} ran out of device memory ({type(e).__name__}: {first}); "
        + ("the analysis is skipped" if side == "jaxdepth" else "its row has no reference time")
    )
    report["out_of_memory"].append(dict(analysis=analysis, side=side, error=f"{type(e).__name__}: {first}"))
    write_json_atomic(report["args"]["out"], report)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.prepare_ids:
        ids = prepare_ids(args, SHAPES[args.shape]["vocab_size"])
        save_ids(args.prepare_ids, ids)
        log(
            f"wrote {len(ids.token_lists)} prompts' token ids (lengths {[len(t) for t in ids.token_lists]}) from "
            f"{ids.source} to {args.prepare_ids}"
        )
        return 0
    wall_start = time.perf_counter()
    device = resolve_device(args.device)
    jax_was_imported = "jax" in sys.modules
    if device == "cuda":  # before jax starts its backend: its pool leaves torch the rest
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", MEM_FRACTION)
    tf32 = (device == "cuda") if args.tf32 is None else args.tf32
    import jax
    import torch

    from .case import Bench
    from .cases import erasure as erasure_case
    from .cases import executed_flops, integrated_gradients as ig_case, layer_skip as skip_case, workload_flops
    from .workload import truncate

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
    if device == "cuda" and not tf32:  # (float32 matmuls on the CPU are full float32 already)
        jax.config.update("jax_default_matmul_precision", "highest")
    backend = jax.default_backend()
    if (backend == "gpu") != (device == "cuda"):
        print(
            f"error: jax's default backend is {backend} but the reference runs on {device}: the times would "
            "compare different devices (jax's CUDA plugin missing, or a GPU hidden from torch?)",
            file=sys.stderr,
        )
        return 2
    options = ig_options(args.ig_backward)

    cpu = cpu_model()
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else None
    named = gpu or cpu
    jax_devices = [f"{d.platform}:{d.device_kind}" for d in jax.devices()]
    matmuls = (
        f"TF32 on both sides (torch allow_tf32={torch.backends.cuda.matmul.allow_tf32}; jax float32 at its "
        "default precision, TF32 on NVIDIA GPUs)"
        if tf32
        else "full float32 on both sides"
        + (" (torch allow_tf32=False; jax precision highest)" if device == "cuda" else "")
    )
    log(
        f"device: {named}" + (f" (host CPU: {cpu})" if gpu else "") + f"; torch {torch.__version__} on {device}, "
        f"jax {jax.__version__} on its {backend} backend {jax_devices}"
    )
    log(f"matmuls: {matmuls}")
    load_before = os.getloadavg()
    if device == "cpu":
        log(f"{os.cpu_count()} cores, torch with {torch.get_num_threads()} threads; load average {load_before[0]:.2f}")
        if load_before[0] > 0.5 * os.cpu_count():
            log(
                "WARNING: the machine is busy (load average above half the cores): other processes compete for "
                "the CPU and the times below are inflated by them, torch's multi-threaded ones most"
            )
    if device == "cuda":
        fraction = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
        log(
            f"XLA_PYTHON_CLIENT_MEM_FRACTION={fraction}"
            + (" (jax was imported before it was set: the pool may be jax's default)" if jax_was_imported else "")
        )

    start = time.perf_counter()
    hf, model = build_models(args.shape, device, args.seed)
    c = model.config
    build_s = time.perf_counter() - start
    log(
        f"{args.shape}: random weights built by transformers on {device} and converted by conversion.layout "
        f"in {build_s:.1f} s (excluded): L={c.num_layers}, D={c.hidden_size}, F={c.intermediate_size}, "
        f"V={c.vocab_size}, heads {c.num_heads}/{c.num_kv_heads}, tied {c.tie_word_embeddings}, "
        f"attention {hf.config._attn_implementation}"
    )

    ids = prepare_ids(args, c.vocab_size)
    folded = any(t >= c.vocab_size for tokens in ids.token_lists for t in tokens)
    if folded:
        ids.token_lists = [[t % c.vocab_size for t in tokens] for tokens in ids.token_lists]
        ids.source += f", folded into the {c.vocab_size}-token vocabulary (modulo)"
    log(f"prompts: {len(ids.token_lists)} from {ids.source}; lengths {[len(t) for t in ids.token_lists]}")

    from jaxdepth.core.batch import make_batch

    full = make_batch(ids.token_lists, ids.answer_starts, pad_id=0)
    caps = dict(
        integrated_gradients=(args.ig_prompts, args.ig_max_tokens),
        erasure=(args.erasure_prompts, args.erasure_max_tokens),
        layer_skip=(args.skip_prompts, args.skip_max_tokens),
    )
    workloads = {a: truncate(full, range(min(caps[a][0], len(full))), caps[a][1], 0, a) for a in args.analyses}
    bench = Bench(model, args)
    if "erasure" in workloads:
        erasure_case.prepare_baseline(bench, workloads["erasure"], full)
    if "layer_skip" in workloads:
        skip_case.sample_splits(bench, workloads["layer_skip"], full)

    dtypes = ["float32"] + (["bfloat16"] if args.precision == "bfloat16" else [])
    peaks = matmul_peaks(device, dtypes)
    log(
        "matmul peak (best of 5, square "
        + str(PEAK_SIZE[device])
        + "): "
        + ", ".join(f"{k} {fmt_rate(v)}" for k, v in peaks.items())
    )

    ref, sync = None, synchronizer(device)
    if not args.no_reference:
        from reference_torch import Reference

        ref = Reference(hf)

    command = sys.argv if argv is None else ["benchmark_on_device.py", *argv]
    report = dict(
        command=" ".join(command),
        args=vars(args),
        device=dict(
            name=named,
            torch_device=device,
            gpu=gpu,
            cpu=cpu,
            cores=os.cpu_count(),
            jax_backend=backend,
            jax_devices=jax_devices,
            tf32=tf32,
            matmuls=matmuls,
            xla_mem_fraction=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION") if device == "cuda" else None,
        ),
        versions=dict(
            jax=jax.__version__,
            torch=torch.__version__,
            transformers=sys.modules["transformers"].__version__,
            python=sys.version.split()[0],
        ),
        shape=args.shape,
        model_config=c.to_dict(),
        prompts=dict(source=ids.source, lengths=[len(t) for t in ids.token_lists]),
        excluded_s=dict(build_and_convert=build_s, **bench.excluded_s),
        peak_flops=peaks,
        load_average_before=load_before,
        torch_threads=torch.get_num_threads(),
        rows=[],
        out_of_memory=[],
    )
    print(f"\nROWS ({args.shape}, float32 params; {matmuls}; on {named}):", flush=True)

    def finish(row):
        report["rows"].append(row)
        print_row(row)
        write_json_atomic(args.out, report)

    steps = args.ig_steps
    for name in args.analyses:
        w = workloads[name]
        flops = workload_flops(name, c, w.lengths, splits=bench.splits, steps=steps)
        executed = executed_flops(name, c, w.batch, splits=bench.splits, steps=steps)
        if name == "integrated_gradients":
            jax_fn = lambda w=w: run_ig(model.params, w.batch, c, steps, options)  # noqa: E731
            case, note = ig_case, f"; {steps} steps x {c.num_layers} layers"
            if args.ig_backward:
                note += f"; jaxdepth's backward {args.ig_backward}"
            if args.ig_backward not in (None, "auto"):
                executed = None  # the FLOP model counts the passes of the backward 'auto' chooses
        elif name == "erasure":
            jax_fn, case = (lambda w=w: erasure_case.run_jaxdepth(bench, w)), erasure_case
            note = f"; every boundary 0..{c.num_layers} x position"
        else:
            jax_fn, case = (lambda w=w: run_layer_skip(bench, w)), skip_case
            note = f"; split positions {bench.splits}"
        if name == "integrated_gradients":
            log(f"{name}: jaxdepth's plan: {ig_plan(c, w.batch, steps, args.ig_backward)}")
        log(f"{name}: jaxdepth first call and {args.repeat} warm call(s)")
        try:
            jax_t = time_jaxdepth(jax_fn, args.repeat)
        except Exception as e:
            if not out_of_memory(e):
                raise
            oom(report, name, "jaxdepth", e)
            continue
        ref_t, agreement = None, []
        if ref is not None:
            log(f"{name}: reference, {args.ref_repeat} call(s)")
            try:
                ref_t = time_reference(lambda w=w, case=case: case.CASE.reference(ref, bench, w), args.ref_repeat, sync)
                agreement = case.CASE.agreement(jax_t.result, ref_t.result, w, c)
            except Exception as e:
                if not out_of_memory(e):
                    raise
                oom(report, name, "reference", e)
                if device == "cuda":
                    torch.cuda.empty_cache()
        finish(make_row(name, w, jax_t, ref_t, agreement, flops, executed, peaks["jax_float32"], note))
        for chunk in args.ig_chunks if name == "integrated_gradients" else ():
            log(f"{name}: jaxdepth at {chunk} gradients at a time")
            try:
                chunk_t = time_jaxdepth(
                    lambda w=w, chunk=chunk: run_ig(model.params, w.batch, c, steps, with_chunk(options, chunk)),
                    args.repeat,
                )
            except Exception as e:
                if not out_of_memory(e):
                    raise
                oom(report, f"{name}[chunk {chunk}]", "jaxdepth", e)
                continue
            finish(
                make_row(
                    f"{name}[chunk {chunk}]",
                    w,
                    chunk_t,
                    ref_t,
                    [] if ref_t is None else case.CASE.agreement(chunk_t.result, ref_t.result, w, c),
                    flops,
                    executed,
                    peaks["jax_float32"],
                    note + f"; jaxdepth's gradients {chunk} at a time",
                )
            )
        if name == "integrated_gradients" and args.precision == "bfloat16":
            from .agreement import diff_row

            low = model.astype("bfloat16")
            log("integrated_gradients: jaxdepth on bfloat16 params")
            bf_t = time_jaxdepth(lambda w=w: run_ig(low.params, w.batch, c, steps, options), args.repeat)
            diff = diff_row(
                "integrated_gradients[bfloat16]",
                "attributions vs jaxdepth float32",
                bf_t.result.attributions,
                jax_t.result.attributions,
            )
            diff.update(
                ok=None,
                relative=diff["max_abs_diff"] / max(diff["scale"], 1e-30),
                note="bfloat16 against float32: reported, no tolerance",
            )
            finish(
                make_row(
                    "integrated_gradients[bfloat16]",
                    w,
                    bf_t,
                    ref_t,
                    [diff],
                    flops,
                    executed,
                    peaks.get("jax_bfloat16"),
                    note + "; jaxdepth params in bfloat16, the reference in float32",
                )
            )
            del low

    rows = report["rows"]
    checked = [r for r in rows if r["agree"] is not None]
    report["all_agree"] = all(r["agree"] for r in checked) if checked else None
    report["benchmark_wall_s"] = time.perf_counter() - wall_start
    report["load_average_after"] = os.getloadavg()
    print(
        f"\n{'analysis':<32}{'jax 1st s':>10}{'jax warm s':>11}{'ref s':>9}{'ref/warm':>9}"
        f"{'max |diff|':>12}{'executed':>14}{'jax rate':>17}"
    )
    for r in rows:
        d = "-" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.2e}"
        ratio = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        print(
            f"{r['analysis']:<32}{fmt_s(r['jax_first_s']):>10}{fmt_s(r['jax_warm_s']):>11}{fmt_s(r['ref_s']):>9}"
            f"{ratio:>9}{d:>12}{fmt_flops(r['executed_flops']):>14}{fmt_rate(r['jax_executed_flops_per_s']):>17}"
        )
    print(f"on {named}; {matmuls}; wall time {report['benchmark_wall_s']:.0f} s (model building included)")
    write_json_atomic(args.out, report)
    print(f"wrote {args.out}")
    if report["all_agree"] is False:
        what = "; ".join(f"{a['analysis']} {a['quantity']}" for r in rows for a in r["agreement"] if a["ok"] is False)
        if tf32:
            print(
                f"NOTE: beyond the float32 tolerances under TF32 matmuls (expected: TF32 keeps 10 mantissa bits): "
                f"{what}; --no-tf32 checks agreement at full float32"
            )
            return 0
        print(f"WARNING: the implementations DISAGREE on: {what}")
        return 1
    return 0
