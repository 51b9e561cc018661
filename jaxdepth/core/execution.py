"""How a sweep or a driver runs: one value, `Execution`, taken by every function that chunks,
reports progress, chooses a backward or meets a NaN, and the one host-side chunk loop.

Nothing in an `Execution` changes a number beyond float32 rounding (a chunk size or a backward
reorders sums, no more): it is how to run, never what to compute. Every analysis takes it as
`execution=`; a loose `chunk_size=`, `memory_budget=` or `progress=` keyword is refused with
the `Execution` that says the same (`refuse_loose_options`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import numpy as np

from jaxdepth.core.progress import ProgressLike, track
from jaxdepth.core.sharding import to_host

__all__ = [
    "Execution",
    "BACKWARDS",
    "NONFINITE",
    "check_backward",
    "check_nonfinite_option",
    "in_chunks",
    "refuse_loose_options",
    "refuse_fields",
    "refuse_moved",
    "refuse_unknown",
]

# How a gradient's backward gets the activations of the layers after the differentiated one:
# the drivers' choices ('auto' picks one of the others, or a number of stored layers, by memory).
BACKWARDS = ("auto", "recompute", "stored")
# What a NaN or an infinity in a result does: raise an error naming where, or warn and return it.
NONFINITE = ("raise", "warn")


def check_backward(backward) -> None:
    """Refuse a `backward` other than those of `BACKWARDS` or a number of stored layers (an int
    >= 0; `jaxdepth.core.loops.stored_layers` checks it against L)."""
    layers = isinstance(backward, int) and not isinstance(backward, bool) and backward >= 0
    if not layers and backward not in BACKWARDS:
        raise ValueError(f"backward must be one of {BACKWARDS} or a number of stored layers, got {backward!r}")


def check_nonfinite_option(nonfinite: str) -> None:
    """Refuse a `nonfinite` other than 'raise' or 'warn'."""
    if nonfinite not in NONFINITE:
        raise ValueError(f"nonfinite must be one of {NONFINITE}, got {nonfinite!r}")


@dataclasses.dataclass(frozen=True)
class Execution:
    """How an analysis runs; none of it changes a number beyond float32 rounding.

    chunk_size: sweep members (interventions, path points, edge sets) vmapped at once (default:
        what `memory_budget` allows, `chunk`).
    memory_budget: bytes a sweep's activations may take at once (default: a share of the free
        memory, `jaxdepth.core.sweep.available_memory_budget`; integrated gradients take a
        larger share, `jaxdepth.analyses.ig.path.IG_MEMORY_FRACTION`).
    progress: False, True or a tqdm-like callable (`jaxdepth.core.progress`).
    backward: 'stored', 'recompute', 'auto' or a number of stored layers: how a gradient's
        backward gets the later layers' activations (where an analysis differentiates).
    nonfinite: 'raise' (an error at the first NaN or infinite value, naming where) or 'warn'
        (a warning naming them all, and the values returned).
    on_layer: called with no argument as each layer of a per-layer driver finishes (a caller's
        own progress count; integrated gradients call it)."""

    chunk_size: Optional[int] = None
    memory_budget: Optional[int] = None
    progress: ProgressLike = False
    backward: object = "auto"
    nonfinite: str = "raise"
    on_layer: Optional[Callable[[], None]] = None

    def __post_init__(self):
        check_backward(self.backward)
        check_nonfinite_option(self.nonfinite)
        for name in ("chunk_size", "memory_budget"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1):
                raise ValueError(f"{name} must be a whole number >= 1 or None, got {value!r}")

    def replace(self, **changes) -> "Execution":
        """This execution with `changes` (`dataclasses.replace`)."""
        return dataclasses.replace(self, **changes)

    def budget(self, fraction: Optional[float] = None) -> int:
        """`memory_budget`, or `fraction` (default the sweeps' share) of the free memory."""
        if self.memory_budget is not None:
            return int(self.memory_budget)
        from jaxdepth.core.sweep import MEMORY_FRACTION, available_memory_budget

        return available_memory_budget(MEMORY_FRACTION if fraction is None else fraction)

    def chunk(self, n: int, member_bytes: int, *, fraction: Optional[float] = None) -> int:
        """Members per chunk of a sweep of `n` members that each take `member_bytes`:
        `chunk_size`, or as many as `budget` holds, between 1 and n."""
        if self.chunk_size is not None:
            return int(np.clip(self.chunk_size, 1, max(n, 1)))
        return int(np.clip(self.budget(fraction) // max(int(member_bytes), 1), 1, max(n, 1)))

    def layer_done(self) -> None:
        """Call `on_layer`, if set."""
        if self.on_layer is not None:
            self.on_layer()


def in_chunks(run: Callable, items, chunk: int, execution: Execution, what: str) -> np.ndarray:
    """`[n, ...]`: `run` (a vmapped, compiled call, `[chunk, ...] -> [chunk, ...]`) over the
    leading axis of `items` `chunk` at a time, as host float32 arrays. The last chunk is filled
    up with its last item, so every call has one shape (one compiled program), and the filler's
    results are dropped. A progress bar (`execution.progress`) counts the chunks as `what`."""
    items = np.asarray(items)
    out = None
    for start in track(range(0, len(items), chunk), execution.progress, what):
        part = items[start : start + chunk]
        filled = np.concatenate([part, np.repeat(part[-1:], chunk - len(part), axis=0)])
        f = np.asarray(to_host(run(filled)))
        if out is None:
            out = np.zeros((len(items),) + f.shape[1:], np.float32)
        out[start : start + len(part)] = f[: len(part)]
    return out


def _shown(value) -> str:
    """A keyword's value as a refusal shows it: a plain value as written, anything else `...`."""
    return repr(value) if isinstance(value, (bool, int, float, str, type(None))) else "..."


def refuse_fields(function: str, options: dict, value: type, shown_as: str, what: str) -> None:
    """A `TypeError` for keywords of `options` (what `function` got beyond its parameters) that
    are fields of the dataclass `value`, showing the value that says the same: "`function`()
    takes `what` as one value: `shown_as`(k=v, ...)". Other keywords pass: the caller refuses
    them after its own values (`refuse_unknown`)."""
    fields = {f.name for f in dataclasses.fields(value)}
    loose = {k: v for k, v in options.items() if k in fields}
    if loose:
        shown = ", ".join(f"{k}={_shown(v)}" for k, v in loose.items())
        raise TypeError(
            f"{function}() takes {what} as one value: {shown_as}({shown}), not {', '.join(loose)} on their own"
        )


def refuse_moved(function: str, options: dict, where: dict, values: str) -> None:
    """A `TypeError` for keywords `function` once took that now live in its values: each of
    `where` (a former keyword -> where it is now, e.g. "run=StudyRun(log=...)"), named with its
    place; `values` names those values' home. Other keywords pass (`refuse_unknown`)."""
    moved = {k: where[k] for k in options if k in where}
    if moved:
        raise TypeError(
            f"{function}() takes its options as values: "
            + "; ".join(f"{k} in {place}" for k, place in moved.items())
            + f" ({values})"
        )


def refuse_unknown(function: str, options: dict) -> None:
    """A `TypeError` naming the keywords of `options`, if any: `function` takes none of them."""
    if options:
        raise TypeError(f"{function}() got unexpected keyword arguments: {', '.join(options)}")


def refuse_loose_options(function: str, options: dict) -> None:
    """A `TypeError` for fields of `Execution` passed to `function` on their own, showing the
    `Execution` that says the same; other unknown keywords are named as such."""
    refuse_fields(function, options, Execution, "execution=jaxdepth.Execution", "how to run")
    refuse_unknown(function, options)
