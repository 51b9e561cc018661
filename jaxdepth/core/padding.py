"""How long to pad a prompt: by what the padding costs against the compilation it saves.

Every padded length is a compiled program, and every padded position costs its share of every
member of the sweep. Length buckets (`jaxdepth.core.batch.LengthBuckets`) share programs among
prompts of similar lengths at the price of padding them by about a fifth. That pays for sweeps
that run in seconds; integrated gradients run steps x layers gradients per prompt, minutes on a
CPU, where a fifth of that is far more than a compilation. `cheapest_lengths` chooses the padded
lengths of a set of prompts that minimise the estimated total: the sweep's seconds at each
prompt's padded length, plus one compilation per distinct length. On a CPU that pads studies'
prompts to about their own lengths; on a GPU, where a prompt's gradients take seconds, it
groups them. Padding never changes a result beyond float rounding: padded positions are masked.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Optional, Sequence

import jax
import numpy as np

__all__ = [
    "DeviceSpeed",
    "ChosenLengths",
    "cheapest_lengths",
    "LENGTH_MULTIPLE",
]


# Lengths are rounded up to a multiple of this at least: vector lanes and matmul tiles.
LENGTH_MULTIPLE = 8


@dataclasses.dataclass(frozen=True)
class DeviceSpeed:
    """What a device does per second for the padding choice: `flops_per_second` of a gradient
    sweep (sustained, not peak) and `compile_seconds` of one sweep program."""

    flops_per_second: float
    compile_seconds: float

    def __post_init__(self):
        if not (self.flops_per_second > 0 and self.compile_seconds >= 0):
            raise ValueError(f"a device speed needs flops_per_second > 0 and compile_seconds >= 0, got {self}")

    @classmethod
    def estimate(cls, platform: Optional[str] = None) -> "DeviceSpeed":
        """The estimate for `platform` ('cpu', 'gpu', 'tpu'; default the first device's).
        Measured: on 2 cores of an AMD EPYC (AVX-512) IG ran at 114 GFLOP/s and compiled in
        4.6 s (the embedded model; larger models compile longer), so a CPU is taken at 50 GFLOP/s
        per core and 10 s; on an H100 IG ran at 200 TFLOP/s (TF32) and compiled in 17 s
        (Qwen2.5-1.5B). A TPU is taken as a GPU."""
        platform = platform or jax.devices()[0].platform
        if platform == "cpu":
            return cls(flops_per_second=50e9 * (os.cpu_count() or 1), compile_seconds=10.0)
        return cls(flops_per_second=200e12, compile_seconds=17.0)


@dataclasses.dataclass(frozen=True)
class ChosenLengths:
    """The padded lengths chosen for a set of prompts (`cheapest_lengths`): a prompt of n tokens is
    padded to the smallest of `lengths` >= n, or beyond them to a multiple of `multiple`. It pads
    as `jaxdepth.core.batch.LengthBuckets` does (`padded`), so `PromptBatch.single` and `prompt`
    take it."""

    lengths: tuple[int, ...]
    multiple: int = LENGTH_MULTIPLE

    def __post_init__(self):
        object.__setattr__(self, "lengths", tuple(sorted({int(n) for n in self.lengths})))
        if any(n < 1 for n in self.lengths) or self.multiple < 1:
            raise ValueError(f"lengths and multiple must be positive, got {self.lengths} and {self.multiple}")

    def padded(self, length: int) -> int:
        """The padded length of a prompt of `length` tokens."""
        i = int(np.searchsorted(self.lengths, int(length)))
        if i < len(self.lengths):
            return self.lengths[i]
        return max(-(-int(length) // self.multiple), 1) * self.multiple

    def __str__(self) -> str:
        return "lengths:" + ",".join(map(str, self.lengths))


def cheapest_lengths(
    lengths: Sequence[int],
    seconds: Callable[[int], float],
    compile_seconds: float,
    multiple: int = LENGTH_MULTIPLE,
) -> ChosenLengths:
    """The padded lengths for prompts of `lengths` tokens that minimise sum over prompts of
    `seconds(padded length)` plus `compile_seconds` per distinct padded length (every length a
    multiple of `multiple`). Exact: the prompts, sorted, are cut into runs padded to their
    longest (dynamic programming over the cuts, quadratic in the distinct lengths)."""
    if len(lengths) == 0:
        raise ValueError("no prompt lengths to pad")
    rounded = -(-np.asarray(lengths, np.int64) // multiple) * multiple
    if np.any(rounded < 1):
        raise ValueError(f"prompt lengths must be positive, got {sorted(set(np.asarray(lengths).tolist()))}")
    candidates, counts = np.unique(rounded, return_counts=True)
    cost = np.array([seconds(int(n)) for n in candidates], np.float64)
    before = np.concatenate([[0], np.cumsum(counts)])  # prompts shorter than candidate j: before[j]
    best = np.zeros(len(candidates) + 1)  # best[j]: the cheapest padding of the prompts of candidates < j
    cut = np.zeros(len(candidates) + 1, np.int64)
    for j in range(1, len(candidates) + 1):  # the run i..j-1, padded to candidate j-1
        totals = [best[i] + compile_seconds + (before[j] - before[i]) * cost[j - 1] for i in range(j)]
        cut[j] = int(np.argmin(totals))
        best[j] = totals[cut[j]]
    chosen, j = [], len(candidates)
    while j > 0:
        chosen.append(int(candidates[j - 1]))
        j = cut[j]
    return ChosenLengths(tuple(chosen), multiple)
