"""Converted checkpoints on disk: the params (the NNX module's state as a pure dict) saved with
orbax + `jaxdepth.json` (config, provenance) + tokenizer.

A converted folder is written to a temporary sibling and renamed into place only when complete,
so an interrupted conversion never leaves a half-written checkpoint that later looks valid.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import jax
import numpy as np

from conversion.errors import ConversionError
from conversion.transformers_import import import_transformers
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.weights import ModelWeights
from jaxdepth.core.model import check_params

__all__ = [
    "is_converted_dir",
    "save_converted",
    "restore_converted",
    "MARKER",
    "FORMAT_VERSION",
]


MARKER = "jaxdepth.json"
FORMAT_VERSION = 1


def is_converted_dir(path: str) -> bool:
    """Whether `path` is a folder `conversion` wrote (it holds the conversion's marker file)."""
    return os.path.isfile(os.path.join(path, MARKER))


def save_converted(converted: ModelWeights, out_dir: str, *, overwrite: bool = False) -> str:
    """Write `converted` to `out_dir` atomically and return its absolute path."""
    import orbax.checkpoint as ocp

    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and not overwrite:
        raise FileExistsError(f"{out_dir} already exists (pass overwrite=True / --overwrite to replace it)")
    check_params(converted.params, converted.config)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-" + os.path.basename(out_dir) + "-", dir=parent)
    try:
        checkpointer = ocp.StandardCheckpointer()
        # The params pytree is the NNX module's state as a pure dict (`Decoder.params()`): a
        # restore gives exactly what the pure functions take (and what a sharded restore targets).
        checkpointer.save(os.path.join(tmp, "params"), converted.params)
        checkpointer.wait_until_finished()
        if converted.tokenizer is not None:
            converted.tokenizer.save_pretrained(os.path.join(tmp, "tokenizer"))
        dtypes = sorted({str(x.dtype) for x in jax.tree.leaves(converted.params)})
        meta = {
            "format": FORMAT_VERSION,
            "config": converted.config.to_dict(),
            "source": converted.source,
            "dtypes": dtypes,
            "has_tokenizer": converted.tokenizer is not None,
        }
        with open(os.path.join(tmp, MARKER), "w") as f:
            json.dump(meta, f, indent=2)
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _sharded_target(config: ModelConfig, meta: dict, mesh):
    from jaxdepth.core.model import param_shapes
    from jaxdepth.core.sharding import param_shardings

    if len(meta["dtypes"]) != 1:
        raise ConversionError(f"sharded restore expects one parameter dtype, the checkpoint has {meta['dtypes']}")
    dtype = np.dtype(meta["dtypes"][0]) if meta["dtypes"][0] != "bfloat16" else jax.numpy.bfloat16
    abstract = jax.tree.map(
        lambda shape: jax.ShapeDtypeStruct(shape, dtype), param_shapes(config), is_leaf=lambda x: isinstance(x, tuple)
    )
    return jax.tree.map(
        lambda a, sharding: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
        abstract,
        param_shardings(abstract, mesh),
    )


def restore_converted(path: str, *, load_tokenizer: bool = True, mesh=None) -> ModelWeights:
    """Read a folder written by `save_converted`.

    With a `mesh`, every parameter is restored straight into its sharded layout
    (`jaxdepth.core.sharding.PARTITION_RULES`): each device reads only its own shard, so a model
    larger than any one device (or the host) can be loaded."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(path)
    marker = os.path.join(path, MARKER)
    if not os.path.isfile(marker):
        raise ConversionError(f"{path} is not a converted jaxdepth checkpoint (no {MARKER})")
    with open(marker) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT_VERSION:
        raise ConversionError(f"{marker}: format {meta.get('format')!r}, this jaxdepth reads {FORMAT_VERSION}")
    config = ModelConfig.from_dict(meta["config"])
    if mesh is None:
        params = jax.tree.map(np.asarray, ocp.StandardCheckpointer().restore(os.path.join(path, "params")))
    else:
        params = ocp.StandardCheckpointer().restore(os.path.join(path, "params"), _sharded_target(config, meta, mesh))
    check_params(params, config)
    tokenizer = None
    if load_tokenizer and meta.get("has_tokenizer"):
        tokenizer = import_transformers().AutoTokenizer.from_pretrained(os.path.join(path, "tokenizer"))
    return ModelWeights(params=params, config=config, tokenizer=tokenizer, source=meta.get("source", path))
