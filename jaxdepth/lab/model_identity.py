"""What a model is, for its results: a fingerprint of its files (or, made in memory, its weights).

Results are keyed by the model itself, not by the name a user typed: two models whose folders
share a base name (`../a/tiny` and `other/tiny`) never share a results folder, and the same
model reached by two paths (a copy, a symlink) finds its results again. A model's results
folder is `<name>-<fingerprint>` (`jaxdepth.lab.study.results_key`): the name a person
recognises (`smollm2`, the base name of a folder, `smollm2-bfloat16` for a bf16 run) and 8 hex
digits of the fingerprint (`jaxdepth.lab.sources.model_fingerprint`).

The fingerprint is the SHA-256 of the source's own files: every file of a model folder (its
config, weights and tokenizer; hidden files and Markdown left out, as they change nothing the
model computes), the `.gguf` file, the embedded model's file in its package, or the hub
snapshot, and for a model loaded in another dtype, derived from that with the dtype
(`jaxdepth.core.weights.derived_fingerprint`). `jaxdepth.load` records it on the model
(`Model.fingerprint`); a command computes it before the model is loaded, so it can hold its
results folder before the load (a second run is refused at once). Each large file's digest is
cached under `jaxdepth.lab.sources.cache_dir()` by path, size and modification time, so a large
checkpoint is read for it once. A model made in memory (no files behind its `source`) is fingerprinted by
its params and config instead (`weights_fingerprint`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Optional

import numpy as np

from jaxdepth.core.atomic import atomic_write
from jaxdepth.core.weights import derived_fingerprint

__all__ = ["files_fingerprint", "weights_fingerprint"]

_CACHED_ABOVE = 1 << 20  # files larger than this have their digest cached (smaller ones are hashed again)


def files_fingerprint(root: str, files: list[str], dtype: Optional[str] = None, *, cache: Optional[str] = None) -> str:
    """The SHA-256 (hex) of a model's `files` (paths under `root`, as
    `jaxdepth.lab.sources.resolve_files` lists them: their names relative to `root` and their
    bytes), loaded in `dtype` (None or 'float32': as stored; another dtype makes another
    fingerprint, `jaxdepth.core.weights.derived_fingerprint`). Each large file's digest is
    cached in the folder `cache` (none: hashed anew) by its path, size and modification time."""
    h = hashlib.sha256()
    for path in files:
        h.update(os.path.relpath(path, root).encode() + b"\0" + _file_digest(path, cache).encode() + b"\0")
    return h.hexdigest() if dtype in (None, "float32") else derived_fingerprint(h.hexdigest(), dtype)


def weights_fingerprint(params, config) -> str:
    """The SHA-256 (hex) of a model's params (every leaf's path, dtype, shape and bytes) and its
    config: the fingerprint of a model that has no files behind it. Reads every weight to the
    host: meant for models built in memory, not for a checkpoint on an accelerator."""
    import jax

    h = hashlib.sha256(json.dumps(dataclasses.asdict(config), sort_keys=True, default=str).encode())
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        array = np.ascontiguousarray(np.asarray(leaf))
        h.update(f"{jax.tree_util.keystr(path)}:{array.dtype}:{array.shape}".encode())
        h.update(array.tobytes())
    return h.hexdigest()


def _file_digest(path: str, cache: Optional[str]) -> str:
    """SHA-256 of a file's bytes, cached for large files by (real path, size, modification time)."""
    st = os.stat(path)
    if cache is None or st.st_size <= _CACHED_ABOVE:
        return _hash_file(path)
    key = hashlib.sha256(f"{os.path.realpath(path)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:32]
    cached = os.path.join(cache, "digests", key)
    try:
        with open(cached) as f:
            digest = f.read().strip()
        if len(digest) == 64:
            return digest
    except OSError:
        pass
    digest = _hash_file(path)
    try:
        with atomic_write(cached, "w") as f:
            f.write(digest)
    except OSError:  # a read-only cache: the digest is computed again next time, nothing is wrong
        pass
    return digest


def _hash_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()
