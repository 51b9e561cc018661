"""Atomic file writes: a reader (or a rerun after a kill) sees the old file or the whole new one,
never half a file.

Every file jaxdepth writes (results, figures, tables) goes through `atomic_write`: the data is
written to a temporary sibling named `.tmp-<pid>-<random><suffix>`, flushed to the disk
(`fsync`), and renamed into place only when complete; the folder is then synced too, so the
rename itself survives a power cut. A writer killed mid-write leaves that temporary behind; the
next writer in the same folder removes the ones whose process is gone
(`remove_stale_temporaries`).

`folder_lock` keeps two runs from writing one results folder at once: the second one is refused
at once, told which process holds the folder. Its lock files are removed when the run ends, and
taken over from a run that was killed. A process that holds a folder may lock it again inside
(a command holds its folders for the whole command, and the study it runs locks each again), and
`locked_folders` records which folders a process locked: what an interrupted command had been
writing to.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import uuid
from typing import IO, Callable, Iterator

import filelock

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

__all__ = [
    "atomic_write",
    "remove_stale_temporaries",
    "FolderBusyError",
    "folder_lock",
    "writable",
    "locked_folders",
    "TEMP_PREFIX",
    "LOCK_NAME",
    "OWNER_NAME",
]


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
        pid = name[len(TEMP_PREFIX) :].split("-", 1)[0]
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


LOCK_NAME = ".jaxdepth.lock"  # in a locked folder while a run holds it; its owner file says who
OWNER_NAME = ".jaxdepth.lock.owner"
_CONTENDED = (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES)  # flock's "held by another" (EACCES on some filesystems)
_NO_FLOCK = (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK)  # filesystems without flock


class FolderBusyError(OSError):
    """Another process is writing the folder (raised at once, not after a wait)."""


_HELD: dict[str, int] = {}  # real path of each folder this process holds -> how many blocks hold it
_RECORDS: list[list[str]] = []  # the lists of `locked_folders` blocks now open


@contextlib.contextmanager
def folder_lock(folder: str) -> Iterator[None]:
    """Hold `folder` for this process while the block runs: an OS lock on its `.jaxdepth.lock`,
    released when the process ends, however it ends. A second holder is refused at once with a
    `FolderBusyError` naming the process, host and start time of the first. When the block ends,
    returning or raising, the lock file and its owner file are removed (a process killed outright
    leaves them behind, and the next run takes them over). Within a block that holds `folder`, the
    same process may lock it again: the inner block holds nothing more, and the folder is let go
    when the outer one ends. Folders the lock created and nothing was written to are removed
    again when it ends, so a refused or failed run leaves nothing behind."""
    key = os.path.realpath(folder)
    if key not in _HELD and not writable(folder):
        # No process can write a read-only folder: there is nothing to guard, and its results can
        # still be read (a rerun whose results all exist, a table). Writing one is refused where
        # it is tried (`jaxdepth.lab.runs.produce`).
        _HELD[key] = 1
        try:
            yield
        finally:
            del _HELD[key]
        return
    if key in _HELD:
        _HELD[key] += 1
        try:
            yield
        finally:
            _HELD[key] -= 1
        return
    created = _missing_folders(folder)
    os.makedirs(folder, exist_ok=True)
    owner = os.path.join(folder, OWNER_NAME)
    try:
        release = _lock(os.path.join(folder, LOCK_NAME), owner)
    except BaseException:
        _remove_if_empty(created)
        raise
    _HELD[key] = 1
    try:
        with atomic_write(owner, "w") as f:
            f.write(f"process {os.getpid()} on {socket.gethostname()}, since {_now()}\n")
        for record in _RECORDS:
            if folder not in record:
                record.append(folder)
        yield
    finally:
        del _HELD[key]
        try:
            with contextlib.suppress(FileNotFoundError):
                os.remove(owner)
        finally:
            release()
            # a run that wrote nothing (refused, failed, interrupted before its first result)
            # leaves no empty folders behind; a folder with anything in it stays
            _remove_if_empty(created)


def writable(folder: str) -> bool:
    """Whether this process may create files in `folder`, or, where it does not exist yet, in the
    nearest folder above it that does (False on a read-only file system or without permission)."""
    missing = _missing_folders(folder)
    nearest = os.path.dirname(missing[-1]) if missing else os.path.abspath(folder)
    return os.access(nearest, os.W_OK | os.X_OK)


def _missing_folders(folder: str) -> list[str]:
    """The folders `os.makedirs(folder)` would create, deepest first."""
    missing, path = [], os.path.abspath(folder)
    while not os.path.exists(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return missing


def _remove_if_empty(folders: list[str]) -> None:
    """Remove each of `folders` (deepest first) that is empty; stop at the first that is not."""
    for path in folders:
        try:
            os.rmdir(path)
        except OSError:  # not empty (or gone): it and the folders above it stay
            return


@contextlib.contextmanager
def locked_folders() -> Iterator[list[str]]:
    """`with locked_folders() as folders:` `folders` lists the folders `folder_lock` held within
    the block (as given, in the order first held; each once), whether or not they are still held:
    where a command's results went, for what it says when it is interrupted."""
    record: list[str] = []
    _RECORDS.append(record)
    try:
        yield record
    finally:
        # by identity: two records of the same folders are equal lists
        _RECORDS[:] = [r for r in _RECORDS if r is not record]


def _lock(path: str, owner: str) -> Callable[[], None]:
    """Lock the file `path` (created if missing) without waiting; returns the function that removes
    it and lets go. Where flock exists (POSIX), the file is removed while still held, and a
    process takes the lock only on the file that `path` names once it holds it: one that locked
    a removed file (opened before its holder removed it) lets go and tries again, so two
    processes never both hold `path`."""
    if fcntl is None:  # Windows: filelock's lock, which removes its file when released
        return _filelock(path, owner)
    while True:
        try:
            fd, created = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
        except FileExistsError:
            try:
                fd, created = os.open(path, os.O_RDWR), False
            except FileNotFoundError:  # removed by its holder meanwhile
                continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            os.close(fd)
            if error.errno in _CONTENDED:
                raise _busy(os.path.dirname(path), owner) from None
            if error.errno in _NO_FLOCK:
                if created:  # filelock's fallback there takes an existing file for a holder's
                    os.remove(path)
                return _filelock(path, owner)
            raise
        try:
            held = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            held = False
        if held:
            break
        os.close(fd)  # a file its holder removed as it let go: lock the one at `path` now

    def release():
        try:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        finally:
            os.close(fd)  # lets go of the lock

    return release


def _filelock(path: str, owner: str) -> Callable[[], None]:
    """The `filelock` package's lock, where flock is missing (Windows, and filesystems without it)."""
    lock = filelock.FileLock(path, timeout=0, is_singleton=False)
    try:
        lock.acquire()
    except filelock.Timeout:
        raise _busy(os.path.dirname(path), owner) from None
    return lock.release


def _busy(folder: str, owner: str) -> FolderBusyError:
    try:
        with open(owner) as f:
            who = f.read().strip()
    except OSError:
        who = "another process"
    return FolderBusyError(
        f"the results folder {folder} is in use by {who}: wait for that run to end, or write to another folder"
    )


def _now() -> str:
    import datetime

    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")
