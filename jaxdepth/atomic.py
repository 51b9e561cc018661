"""Atomic file writes: a reader (or a rerun after a kill) sees the old file or the whole new one,
never half a file.

Every file jaxdepth writes (results, figures, tables) goes through `atomic_write`: the data is
written to a temporary sibling named `.tmp-<pid>-<random><suffix>` and renamed into place only
when complete. A writer killed mid-write leaves that temporary behind; the next writer in the
same folder removes the ones whose process is gone (`remove_stale_temporaries`).
"""

from __future__ import annotations

import contextlib
import os
import uuid
from typing import IO, Iterator

TEMP_PREFIX = ".tmp-"  # + the writer's process id + "-": what a killed writer leaves behind


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "wb") -> Iterator[IO]:
    """`with atomic_write(path) as f: ...` writes `f` to a temporary sibling of `path` and renames
    it into place when the block ends without an exception; on an exception the temporary is
    removed and `path` is left as it was. `mode` is "wb" or "w". Missing folders are created, and
    the file gets the usual permissions (umask), not a temporary file's private 0600."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write writes new files only: mode 'w' or 'wb', got {mode!r}")
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    remove_stale_temporaries(folder)
    tmp = os.path.join(folder, f"{TEMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex}{os.path.splitext(path)[1]}")
    try:
        with open(tmp, mode.replace("w", "x")) as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def remove_stale_temporaries(folder: str) -> list[str]:
    """Delete the temporary files of writers that no longer run (killed mid-write) in `folder`;
    returns their names. Files of running processes, this one included, are left alone."""
    removed = []
    for name in os.listdir(folder):
        if not name.startswith(TEMP_PREFIX) or not os.path.isfile(os.path.join(folder, name)):
            continue
        pid = name[len(TEMP_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not _process_alive(int(pid)):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(folder, name))
                removed.append(name)
    return removed


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # gone, or not a process id at all
        return False
    except PermissionError:  # another user's process
        return True
    return True
