"""How far a long loop is, shown as the caller wants it.

Every loop over prompts, layers or steps takes `progress`: False or None shows nothing, True a
tqdm bar, and any callable `progress(total=N, desc=label, initial=k)` that returns an object with
tqdm's `update(n)` (and, optionally, `set_postfix(**values)` and `close()`) reports it: the
`tqdm.tqdm` class itself, `tqdm.rich.tqdm`, a notebook widget, or a logger of your own. The
computation says how far it is; the caller decides what that looks like.

`True` draws tqdm's bar on a terminal (and in a notebook); where standard error is not a
terminal (a log file, a pipe, a batch job) it writes whole lines instead (`LineProgress`): one as
the loop starts, one every half minute while it runs, one when it ends, and never a carriage
return, which a log would keep as one long line of redrawn bars.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import IO, Any, Callable, Iterable, Iterator, Optional, Union

__all__ = [
    "progress_bar",
    "track",
    "LineProgress",
]


ProgressLike = Union[None, bool, Callable[..., Any]]


class _Silent:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, **values) -> None:
        pass


@contextlib.contextmanager
def progress_bar(progress: ProgressLike, *, total: int, desc: str, initial: int = 0) -> Iterator[Any]:
    """A bar of `total` steps labelled `desc` (starting at `initial`), as `progress` says (module
    docstring); closed at the end of the `with`."""
    if progress is None or progress is False:
        yield _Silent()
        return
    if progress is True:
        progress = _default_bar()
    if not callable(progress):
        raise TypeError(f"progress must be True, False, None or a tqdm-like callable, got {type(progress).__name__}")
    bar = progress(total=total, desc=desc, initial=initial)
    try:
        yield bar if hasattr(bar, "set_postfix") else _WithPostfix(bar)
    finally:
        close = getattr(bar, "close", None)
        if close is not None:
            close()


class _WithPostfix:
    """A bar without `set_postfix` (a minimal callable's): the values are dropped."""

    def __init__(self, bar):
        self.update = bar.update

    def set_postfix(self, **values) -> None:
        pass


def track(items: Iterable, progress: ProgressLike, desc: str) -> Iterator:
    """`items` (a sized iterable, e.g. a `range`), one bar step per item."""
    items = list(items) if not hasattr(items, "__len__") else items
    with progress_bar(progress, total=len(items), desc=desc) as bar:
        for item in items:
            yield item
            bar.update(1)


def _default_bar() -> Callable[..., Any]:
    """What `progress=True` draws: tqdm's bar on a terminal or in a notebook, else whole lines."""
    from tqdm.auto import tqdm

    in_notebook = any(cls.__module__ == "tqdm.notebook" for cls in tqdm.__mro__)
    stream = sys.stderr
    on_terminal = stream is not None and hasattr(stream, "isatty") and stream.isatty()
    return tqdm if in_notebook or on_terminal else LineProgress


class LineProgress:
    """A progress report in whole lines, for output that is not a terminal: `desc: k/N` as it
    starts, a line with the percentage, the time so far and the latest `set_postfix` values at
    most every `interval` seconds as it runs, and `desc: N/N in S s` (or `stopped at k/N`) when
    closed. Takes tqdm's arguments (`total`, `desc`, `initial`) and methods (`update`,
    `set_postfix`, `close`); writes to `file` (default: standard error at creation)."""

    def __init__(
        self,
        *,
        total: int,
        desc: str,
        initial: int = 0,
        file: Optional[IO[str]] = None,
        interval: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.total, self.desc, self.n = total, desc, initial
        self.file = sys.stderr if file is None else file
        self.interval, self.clock = interval, clock
        self.start = self.last = clock()
        self.postfix = ""
        self.closed = False
        self._line(f"{self.n}/{self.total}")

    def update(self, n: int = 1) -> None:
        """Count `n` more steps; a line if `interval` seconds passed since the last one."""
        self.n += n
        now = self.clock()
        if now - self.last >= self.interval and self.n < self.total:
            self.last = now
            percent = f" ({100 * self.n // self.total}%)" if self.total else ""
            self._line(f"{self.n}/{self.total}{percent}, {now - self.start:.0f} s")

    def set_postfix(self, **values) -> None:
        """Values shown on the next line (as tqdm shows them beside its bar)."""
        self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def close(self) -> None:
        """The last line: the whole count and the time it took, or where the loop stopped."""
        if self.closed:
            return
        self.closed = True
        seconds = self.clock() - self.start
        done = self.n >= self.total
        self._line(f"{self.n}/{self.total} in {seconds:.1f} s" if done else f"stopped at {self.n}/{self.total}")

    def _line(self, text: str) -> None:
        postfix = f" [{self.postfix}]" if self.postfix else ""
        print(f"{self.desc}: {text}{postfix}", file=self.file, flush=True)
