"""`jit`: `jax.jit` with the XLA options the analyses need to run fast on CPU.

XLA:CPU hands parts of a program to the YNNPACK library. Its matrix multiplications are the
fastest XLA:CPU has, but by default it also takes over reductions and element-wise work, and
there it loses: a reduction of a product (`sum(x * y)`: every norm, cosine and KL sum here)
becomes a batched vector dot, and a reduction is fused into the matmul that feeds it. Keeping
YNNPACK to matrix multiplications made the logit lens 1.6x and the whole benchmark suite 1.35x
faster on a 2-core x86 CPU (`experiments/benchmark.py`). Other backends ignore CPU options.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxdepth.core.config import ModelConfig
from jaxdepth.core.sites import Intervention, check_layer_indices

__all__ = [
    "compiler_options",
    "cpu_info",
    "cpu_multiplies_bf16_fast",
    "has_narrow_floats",
    "check_interventions",
    "jit",
    "CompileClock",
    "use_compilation_cache",
    "CPU_COMPILER_OPTIONS",
    "CPU_NARROW_COMPILER_OPTIONS",
    "COMPILE_EVENTS",
    "BACKEND_COMPILE_EVENT",
    "CACHE_HIT_EVENT",
]


CPU_COMPILER_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"}
# Programs with bfloat16 operands (`--dtype bfloat16`, or bf16 weight matrices beside float32
# activations: `ModelWeights.with_matmul_dtype`): YNNPACK runs their matmuls at float32's speed
# or below, while XLA's own bf16 dots reach AMX's rate (an Intel Xeon with AMX, 2 cores: a
# [1024, 576] x [576, 1536] bf16 product at 580 GFLOP/s under XLA's defaults, 150 under the
# option above; float32: 150-180). `experiments/compile_options.py` measures both sets.
CPU_NARROW_COMPILER_OPTIONS: dict[str, Any] = {}


@functools.cache
def compiler_options(narrow: bool = False) -> dict[str, Any]:
    """`CPU_COMPILER_OPTIONS` (or, for programs with bfloat16 operands, `narrow`,
    `CPU_NARROW_COMPILER_OPTIONS`) when the default backend is a CPU whose XLA knows them, else
    none.

    Read at the first compilation, not at import: the backend must not start before
    `jax.distributed.initialize` has had its chance."""
    if jax.default_backend() != "cpu":
        return {}
    options = CPU_NARROW_COMPILER_OPTIONS if narrow else CPU_COMPILER_OPTIONS
    try:
        jax.jit(lambda x: x + 1, compiler_options=options).lower(1.0).compile()
    except Exception:  # an XLA without this (experimental) option: compile with its defaults
        return {}
    return dict(options)


@functools.cache
def cpu_info() -> tuple[str, frozenset]:
    """This machine's CPU model name and its feature flags, from /proc/cpuinfo (empty where the
    system has none)."""
    model, flags = "", frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not model:
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = frozenset(value.split())
                    break
    except OSError:
        pass
    return model, flags


def cpu_multiplies_bf16_fast() -> bool:
    """Whether this CPU has bf16 matrix units (Intel's AMX), where bf16 products run 3-4x
    faster than float32 ones (`--dtype bf16-matmuls`)."""
    return "amx_bf16" in cpu_info()[1]


def has_narrow_floats(tree) -> bool:
    """Whether any array of `tree` is a float narrower than 32 bits (bfloat16 weights, say)."""
    return any(
        jnp.issubdtype(leaf.dtype, jnp.floating) and jnp.finfo(leaf.dtype).bits < 32
        for leaf in jax.tree.leaves(tree)
        if hasattr(leaf, "dtype")
    )


def _is_interventions(x) -> bool:
    return isinstance(x, Intervention)


def check_interventions(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """`args` and `kwargs` of a call with every intervention among them checked against the
    model config among them (`jaxdepth.core.sites.check_layer_indices`): inside the jitted
    function the layer indices are traced and could no longer be checked. Calls without exactly
    one `ModelConfig` are left as they are."""
    configs = [v for v in (*args, *kwargs.values()) if isinstance(v, ModelConfig)]
    if len(configs) != 1 or not any(
        _is_interventions(leaf) for leaf in jax.tree.leaves((args, kwargs), is_leaf=_is_interventions)
    ):
        return args, kwargs
    L = configs[0].num_layers
    check = lambda x: check_layer_indices(x, L) if _is_interventions(x) else x
    return jax.tree.map(check, (args, kwargs), is_leaf=_is_interventions)


class _Jitted:
    """A function jitted at its first use, once the backend (and so the options) is known, with
    the options of its arguments' precision (`compiler_options(narrow=...)`). Behaves as the
    `jax.jit` object it wraps (`lower`, `_cache_size`, ...). A call first checks the layer
    indices of the interventions among its arguments (`check_interventions`)."""

    def __init__(self, fun: Callable, jit_kwargs: dict[str, Any]):
        functools.update_wrapper(self, fun)
        self._fun, self._jit_kwargs, self._jitted = fun, jit_kwargs, {}

    def _compiled(self, narrow: bool = False):
        if narrow not in self._jitted:
            options = compiler_options(narrow)
            self._jitted[narrow] = jax.jit(self._fun, compiler_options=options, **self._jit_kwargs)
        return self._jitted[narrow]

    def __call__(self, *args, **kwargs):
        args, kwargs = check_interventions(args, kwargs)
        return self._compiled(has_narrow_floats((args, kwargs)))(*args, **kwargs)

    def lower(self, *args, **kwargs):
        return self._compiled(has_narrow_floats((args, kwargs))).lower(*args, **kwargs)

    def __getattr__(self, name):
        if name in ("_fun", "_jit_kwargs", "_jitted"):  # not set yet (e.g. while copying)
            raise AttributeError(name)
        return getattr(self._compiled(), name)


def jit(fun: Callable | None = None, **jit_kwargs):
    """`jax.jit(fun, **jit_kwargs)` compiled with `compiler_options()`; usable as
    `@jit`, `@jit(static_argnames=...)` or `partial(jit, static_argnames=...)`."""
    if fun is None:
        return functools.partial(jit, **jit_kwargs)
    return _Jitted(fun, jit_kwargs)


# jax.monitoring events of one compilation: tracing to a jaxpr, lowering to MLIR, and XLA's
# compilation (or its retrieval from the persistent cache, counted apart as a cache hit).
COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
BACKEND_COMPILE_EVENT = COMPILE_EVENTS[-1]
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


class CompileClock:
    """While open (`with CompileClock() as clock:`), the compilations of this process and their
    seconds: `seconds` (tracing, lowering and XLA's compilation together), `compilations` (XLA
    compilations, persistent-cache hits included) and `cache_hits` (programs read back from the
    persistent compilation cache instead of compiled). Read from `jax.monitoring`'s events, so
    it counts every jit of the process, jaxdepth's or not."""

    def __init__(self):
        self.seconds, self.compilations, self.cache_hits = 0.0, 0, 0

    def _duration(self, event: str, seconds: float, **_) -> None:
        if event in COMPILE_EVENTS:
            self.seconds += seconds
            self.compilations += event == BACKEND_COMPILE_EVENT

    def _event(self, event: str, **_) -> None:
        self.cache_hits += event == CACHE_HIT_EVENT

    def __enter__(self) -> "CompileClock":
        jax.monitoring.register_event_duration_secs_listener(self._duration)
        jax.monitoring.register_event_listener(self._event)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self._duration)
        jax.monitoring.unregister_event_listener(self._event)


def use_compilation_cache(directory: str) -> None:
    """Keep compiled programs in `directory` (JAX's persistent compilation cache), so that a
    rerun (new settings, a resumed study, the next model size's sibling run) does not compile
    again what an earlier run compiled. A cache the user configured (`JAX_COMPILATION_CACHE_DIR`
    or `jax.config`) is left as it is. Every program is kept, however quick its compilation
    (JAX keeps only those over a second by default: a rerun would compile the rest again). Call
    it before the first compilation: JAX reads the setting once."""
    if not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", directory)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
