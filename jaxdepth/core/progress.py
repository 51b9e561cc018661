"""How far a long loop is, shown as the caller wants it.

Every loop over prompts, layers or steps takes `progress`: False or None shows nothing, True a
tqdm bar, and any callable `progress(total=N, desc=label, initial=k)` that returns an object with
tqdm's `update(n)` (and, optionally, `set_postfix(**values)` and `close()`) reports it: the
`tqdm.tqdm` class itself, `tqdm.rich.tqdm`, a notebook widget, or a logger of your own. The
computation says how far it is; the caller decides what that looks like.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator, Union

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
        from tqdm.auto import tqdm

        progress = tqdm
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
