"""Atomic file writes: a reader (or a rerun after a kill) sees the old file or the whole new one,
never half a file.

Every file jaxdepth writes (results, figures, tables) goes through `atomic_write`: the data is
written to a temporary sibling named `.tmp-<pid>-<random><suffix>`, flushed to the disk
(`fsync`), and renamed into place only when complete; the folder is then synced too, so the
rename itself survives a power cut. A writer killed mid-write leaves that temporary behind; the
next writer in the same folder removes the ones whose process is gone
(`remove_stale_temporaries`).

`folder_lock` keeps two runs from writing one results folder at once: the second one is refused
at once, told which process holds the folder.
"""

from __future__ import annotations

import contextlib
import os
import socket
import uuid
from typing import IO, Iterator

import filelock

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
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _sync_folder(folder)
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


def _sync_folder(folder: str) -> None:
    """fsync a folder, so that the renames into it are on the disk (a no-op where folders
    cannot be opened, as on Windows)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


LOCK_NAME = ".jaxdepth.lock"  # in a locked folder; its owner file says who holds it
OWNER_NAME = ".jaxdepth.lock.owner"


class FolderBusyError(OSError):
    """Another process is writing the folder (raised at once, not after a wait)."""


@contextlib.contextmanager
def folder_lock(folder: str) -> Iterator[None]:
    """Hold `folder` for this process while the block runs (`filelock`: an OS lock, released
    when the process ends, however it ends). A second holder is refused at once with a
    `FolderBusyError` naming the process, host and start time of the first."""
    os.makedirs(folder, exist_ok=True)
    lock = filelock.FileLock(os.path.join(folder, LOCK_NAME), timeout=0, is_singleton=False)
    owner = os.path.join(folder, OWNER_NAME)
    try:
        lock.acquire()
    except filelock.Timeout:
        try:
            with open(owner) as f:
                who = f.read().strip()
        except OSError:
            who = "another process"
        raise FolderBusyError(f"the results folder {folder} is in use by {who}: wait for that run to end, or "
                              f"write to another folder") from None
    try:
        with atomic_write(owner, "w") as f:
            f.write(f"process {os.getpid()} on {socket.gethostname()}, since {_now()}\n")
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(owner)
        lock.release()


def _now() -> str:
    import datetime

    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")
