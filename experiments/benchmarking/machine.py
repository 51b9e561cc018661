"""What the timings run on and how they are taken: the CPU's description, its matmul peak, the
CPU time other processes take meanwhile (`CpuMeter`), waiting for them to leave (`wait_quiet`),
and the benchmark's timed calls (`Clock`)."""

from __future__ import annotations

import dataclasses
import os
import platform
import time
from typing import Callable, Optional

import numpy as np

from .report import log


PEAK_SIZES = (2048, 4096)  # the square matmuls of the matmul peak


def matmul_peak(config=None, repeats: int = 7, sizes=PEAK_SIZES):
    """Best float32 matmul FLOP/s of jnp.dot (and of torch.mm, for the reference) on this machine:
    square matmuls of each of `sizes` (2048 and 4096), and the model's own MLP shape at 8192
    tokens ([8192, D] x [D, F], what a sweep of many members multiplies)."""
    import jax
    import jax.numpy as jnp

    shapes = {str(n): (n, n, n) for n in sizes}
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


def best_peak(before: dict, after: dict) -> dict:
    """The peak the tables use: the best of the measurements before and after the timings."""
    peaks = {k: max(before[k], after.get(k, 0)) for k in before}
    return {
        "jax": max(v for k, v in peaks.items() if k.startswith("jax")),
        "torch": max((v for k, v in peaks.items() if k.startswith("torch")), default=None),
        "before": before,
        "after": after,
    }


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
    from jaxdepth.core.compilation import cpu_info

    model, flags = cpu_info()
    model = model or platform.processor() or platform.machine()
    return f"{model} ({', '.join(f for f in VECTOR_FLAGS if f in flags) or 'vector extensions unknown'})"


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@dataclasses.dataclass
class Timing:
    """The timed calls of one function: its result, their median wall time and the most CPU
    other processes used in one of them (None: unknown); for a compiled function also its
    first call's wall time and the CPU other processes used meanwhile."""

    result: object
    run_s: float
    others: Optional[float]
    first_s: Optional[float] = None
    first_others: Optional[float] = None

    @property
    def others_all(self) -> Optional[float]:
        """The most other processes used in any call, the first included (None: unknown)."""
        return None if self.others is None or self.first_others is None else max(self.first_others, self.others)


@dataclasses.dataclass(frozen=True)
class Clock:
    """The benchmark's timed calls: `repeat` calls each, every one after waiting up to
    `quiet_s` seconds for other processes to leave the CPU (0 = do not wait); the matmul peak
    on square matmuls of `peak_sizes`."""

    quiet_s: float
    repeat: int
    peak_sizes: tuple = PEAK_SIZES

    def gate(self, what: str):
        if self.quiet_s > 0:
            waited = wait_quiet(self.quiet_s)
            if waited is None:
                log(f"  the CPU did not become quiet within {self.quiet_s:.0f} s; timing {what} anyway")
            elif waited > 5:
                log(f"  waited {waited:.0f} s for other processes to leave the CPU before {what}")

    def timed(self, what: str, fn: Callable) -> Timing:
        """`repeat` calls of `fn`: the last result, the median wall time, the most other processes used."""
        walls, busy, result = [], [], None
        for _ in range(self.repeat):
            self.gate(what)
            with CpuMeter() as m:
                result = fn()
            walls.append(m.wall)
            busy.append(m.others)
        return Timing(result, float(np.median(walls)), None if None in busy else max(busy))

    def compiled(self, what: str, fn: Callable) -> Timing:
        """A first call of `fn` (it compiles and runs), timed apart, then the `repeat` timed calls."""
        self.gate(f"{what} (first call)")
        with CpuMeter() as first:
            fn()
        timing = self.timed(what, fn)
        timing.first_s, timing.first_others = first.wall, first.others
        return timing

    def matmul_peak(self, config, again: bool = False) -> dict:
        self.gate("the matmul peak")
        peaks = matmul_peak(config, sizes=self.peak_sizes)
        log(
            f"matmul peak{' again' if again else ''} (best of 7, float32): "
            + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in peaks.items())
        )
        return peaks
