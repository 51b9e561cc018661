"""How every command that writes results runs, caches and resumes them: one way, for all five.

A command declares each result it may reuse as a `Step` (its file, its type, its identity and
how to compute it), as the suite declares its analyses, and hands it to `produce`: a saved
result whose identity matches is reused, anything else is computed and written atomically. A
command saves each step as soon as it is done, so a killed run resumes from the last step
saved. A result that grows in place (the tuned lens, checkpointed step by step) records its
identity in a file of its own instead (`check_recorded_identity`), and resumes from its last
checkpoint. `hold_folders` holds a command's results folders (`jaxdepth.core.atomic.folder_lock`)
so that a second run writing any of them is refused at once.

A result's identity is a JSON-able dict of the settings it depends on (the model, the prompts'
digest `batch_digest`, the method's settings, a format number bumped when the computation
changes); `identity_key` turns it into a short key. It is kept in the result's own
`settings["identity"]`, beside the software versions, the devices and mesh it ran on
(`devices_used`) and the seconds it took, or, for a result
type without settings, in a sidecar file `<file>.identity`: its key on the first line, then
those as JSON.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import sys
import time
from typing import Any, Callable, Iterable, Optional

import numpy as np

from jaxdepth.core.atomic import atomic_write, folder_lock, writable
from jaxdepth.core.compilation import CompileClock
from jaxdepth.core.saved_result import UnreadableResultError
from jaxdepth.core.sharding import is_writer, writer_decides

__all__ = [
    "SIDECAR",
    "Step",
    "Produced",
    "produce",
    "saved_result",
    "set_aside",
    "check_recorded_identity",
    "identity_key",
    "batch_digest",
    "devices_used",
    "software_versions",
    "hold_folders",
]

SIDECAR = ".identity"  # suffix of the identity file of a result type without settings


@dataclasses.dataclass(frozen=True, kw_only=True)
class Step:
    """One result a command may reuse, declared like an analysis of the suite.

    file: its file name in the results folder (`edge_scores.npz`). result_type: its type, a
    `jaxdepth.core.saved_result.SavedResult` subclass. identity: the settings it depends on, a
    JSON-able dict (a saved result is reused only when its identity equals this). run: () -> the
    result, computed."""

    file: str
    result_type: type
    identity: dict
    run: Callable[[], Any]


@dataclasses.dataclass(frozen=True)
class Produced:
    """What `produce` did: the `result` (None on a process other than the writer when only the
    writer had it saved), whether it was `reused`, and, when computed, the `seconds` it took and
    its `compiling` clock (`jaxdepth.core.compilation.CompileClock`)."""

    result: Any
    reused: bool
    seconds: float = 0.0
    compiling: Optional[CompileClock] = None


def produce(step: Step, folder: str) -> Produced:
    """The result of `step` in `folder`: the saved one when its identity matches, else computed,
    its identity and provenance recorded, and saved atomically (by the writer process only).
    With several processes (multi-host), process 0 (the one that writes) decides for all whether
    to reuse, so that the processes' collectives meet."""
    path = os.path.join(folder, step.file)
    saved = saved_result(path, step.identity, step.result_type)
    if writer_decides(saved is not None):
        return Produced(saved, reused=True)
    if is_writer() and not writable(folder):  # before the work, not after it: it could not be saved
        raise OSError(
            f"{folder} is read-only: {step.file} is not there with these settings, and what would be computed "
            "could not be saved; give the command another --out folder, or make this one writable"
        )
    start = time.perf_counter()
    with CompileClock() as compiling:
        result = step.run()
    seconds = time.perf_counter() - start
    # compilation and computation apart: a first run pays compiles a rerun or the persistent
    # compilation cache does not
    provenance = dict(
        versions=software_versions(),
        seconds=seconds,
        compile_seconds=compiling.seconds,
        compute_seconds=seconds - compiling.seconds,
        compilations=compiling.compilations,
        compilation_cache_hits=compiling.cache_hits,
        devices=devices_used(),
    )
    if _has_settings(step.result_type):
        result.settings.update(identity=step.identity, **provenance)
    if is_writer():
        _save(result, path, step.identity, provenance)
    return Produced(result, reused=False, seconds=seconds, compiling=compiling)


def saved_result(path: str, identity: dict, result_type: type):
    """The result saved at `path` when it is a `result_type` saved with `identity`, else None
    (nothing there, another identity, or a file this version cannot read: recompute). A file that
    is no readable result (`UnreadableResultError`: cut short, random bytes, an array missing) is
    said on standard error and moved aside (`set_aside`), never silently overwritten."""
    from jaxdepth.lab.results import load_result

    if not os.path.isfile(path):
        return None
    if not _has_settings(result_type):
        marker = path + SIDECAR
        if not os.path.isfile(marker):
            return None
        with open(marker) as f:
            if f.readline().rstrip("\n") != identity_key(identity):
                return None
    try:
        result = load_result(path)
    except UnreadableResultError as error:
        aside = set_aside(path) if is_writer() else path
        print(f"recomputing {path}: {error.reason}; the unreadable file is kept as {aside}", file=sys.stderr)
        return None
    except Exception:
        return None
    if not isinstance(result, result_type):
        return None
    if _has_settings(result_type) and result.settings.get("identity") != json.loads(json.dumps(identity)):
        return None
    return result


def set_aside(path: str) -> str:
    """Rename the unreadable file `path` to `<path>.unreadable` (`.unreadable-2`, ... when taken)
    beside it, so that recomputing it loses nothing a person may want to look at; returns the
    new path."""
    aside, n = f"{path}.unreadable", 1
    while os.path.exists(aside):
        n += 1
        aside = f"{path}.unreadable-{n}"
    os.replace(path, aside)
    return aside


def _save(result, path: str, identity: dict, provenance: dict) -> None:
    if _has_settings(type(result)):
        result.save(path)
        return
    # The old key goes first: a run killed between the two writes must not leave a new result
    # beside the key of the old one. The sidecar's first line is the key; the provenance a
    # result with settings keeps there (versions, seconds, devices) follows as JSON.
    marker = path + SIDECAR
    if os.path.exists(marker):
        os.remove(marker)
    result.save(path)
    with atomic_write(marker, "w") as f:
        f.write(identity_key(identity) + "\n" + json.dumps(provenance) + "\n")


def _has_settings(result_type: type) -> bool:
    return dataclasses.is_dataclass(result_type) and any(f.name == "settings" for f in dataclasses.fields(result_type))


def check_recorded_identity(
    path: str, identity: dict, *, record: bool = False, what: str = "a result", names: Optional[dict] = None
) -> bool:
    """For a result that grows in place (checkpointed, resumed): whether the JSON file `path`
    records its identity. A recorded identity that differs is a ValueError, saying the folder
    "holds `what` with other <key>" (`names`: key -> how to say "other <key>"), so that such a
    result is never resumed with other settings or data. With `record`, an identity not
    recorded yet is written (atomically)."""
    wanted = json.loads(json.dumps(identity))
    if os.path.exists(path):
        with open(path) as f:
            saved = json.load(f)
        for key in wanted:
            if saved.get(key) != wanted[key]:
                other = (names or {}).get(key, f"other {key}")
                raise ValueError(
                    f"{os.path.dirname(path)} holds {what} with {other} ({saved.get(key)}, not {wanted[key]}); "
                    "use another folder or remove it"
                )
        return True
    if record:
        with atomic_write(path, "w") as f:
            json.dump(wanted, f, indent=1)
    return False


def identity_key(identity: dict) -> str:
    """A short key of an identity (16 hex digits of the SHA-256 of its sorted JSON)."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def batch_digest(batch) -> str:
    """A short digest of a `PromptBatch`'s tokens, validity and answer starts (cache identities)."""
    h = hashlib.sha256()
    for a in (batch.tokens, batch.valid, batch.answer_start):
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


def devices_used() -> dict:
    """Where a result was computed, recorded with it: the platform, the kind and number of devices
    and of processes, and the device mesh in use (`jax.set_mesh`; its axes' sizes, or None when
    the computation ran on one device without a mesh)."""
    import jax

    mesh = jax.sharding.get_abstract_mesh()
    return {
        "platform": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind,
        "device_count": jax.device_count(),
        "process_count": jax.process_count(),
        "mesh": None if mesh.empty else {name: int(size) for name, size in mesh.shape.items()},
    }


def software_versions() -> dict:
    """The versions of jax, flax and jaxdepth (as installed; "unknown" for a checkout run without
    installing it), recorded with every result."""
    import importlib.metadata

    import flax
    import jax

    try:
        ours = importlib.metadata.version("jaxdepth")
    except importlib.metadata.PackageNotFoundError:
        ours = "unknown"
    return {"jax": jax.__version__, "flax": flax.__version__, "jaxdepth": ours}


def hold_folders(folders: Iterable[str]) -> contextlib.ExitStack:
    """`with hold_folders([...]):` holds each results folder (`jaxdepth.core.atomic.folder_lock`)
    until the block ends, so that a second run writing any of them is refused at once, told
    which process holds it. With several processes (multi-host) only process 0, the one that
    writes, holds them."""
    held = contextlib.ExitStack()
    if not is_writer():
        return held
    try:
        for folder in folders:
            held.enter_context(folder_lock(folder))
    except BaseException:
        held.close()  # let go of those already held
        raise
    return held
