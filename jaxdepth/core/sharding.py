"""Placing params and sweeps on a device mesh.

The mesh has two axes: `data` (prompts and sweep members: interventions are independent, so
this axis needs no communication) and `model` (tensor parallelism: attention heads, MLP width
and vocabulary are split, so a model larger than one device fits). `PARTITION_RULES`, from
parameter names to partition specs, derives from the parameters' declaration
(`jaxdepth.core.parameters`); everything else follows from GSPMD.

Multi-host (TPU pods, several GPU hosts): call `initialize_distributed()` first on every host,
then build the mesh over `jax.devices()` as on one host.
"""

from __future__ import annotations

from typing import Optional

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxdepth.core.parameters import MODEL, partition_rules

__all__ = [
    "PARTITION_RULES",
    "make_mesh",
    "mesh_from_spec",
    "initialize_distributed",
    "param_spec",
    "param_shardings",
    "shard_params",
    "data_sharding",
    "to_host",
    "is_writer",
    "writer_decides",
]

DATA = "data"

# Parameter name (the leaf's key; per-layer weights have a leading layer axis) -> spec, one per
# row of the parameters' declaration (`jaxdepth.core.parameters.PARAMETERS`, where a new param's
# spec is declared). Column-parallel projections split their output, row-parallel ones their
# input, so each attention head / MLP unit lives on one device and only o_proj / down_proj
# outputs are reduced; the vocabulary is split in the embeddings and the LM head.
PARTITION_RULES = partition_rules()


def initialize_distributed(**kwargs) -> None:
    """Start JAX's multi-host runtime (a no-op question for one host; pass coordinator
    arguments explicitly where the cluster does not provide them)."""
    jax.distributed.initialize(**kwargs)


def make_mesh(data: Optional[int] = None, model: int = 1, devices=None) -> Mesh:
    """A `data x model` mesh over `devices` (default: all); `data` defaults to the rest."""
    devices = list(jax.devices() if devices is None else devices)
    if data is None:
        if len(devices) % model:
            raise ValueError(f"{len(devices)} devices do not divide into model={model}")
        data = len(devices) // model
    if data * model != len(devices):
        raise ValueError(f"mesh {data} x {model} needs {data * model} devices, {len(devices)} available")
    return Mesh(np.asarray(devices).reshape(data, model), (DATA, MODEL))


def mesh_from_spec(spec: str) -> Mesh:
    """The mesh of a `DATAxMODEL` command-line spec such as '4x2' or '1x8'."""
    try:
        data, model = (int(x) for x in spec.lower().split("x"))
    except ValueError:
        raise ValueError(f"a mesh must look like 4x2 (data x model), got {spec!r}") from None
    return make_mesh(data=data, model=model)


def _leaf_name(path) -> str:
    return str(getattr(path[-1], "key", path[-1]))


def param_spec(name: str, shape, mesh: Mesh) -> P:
    """The rule's spec for `name`, with any axis the mesh does not divide evenly replicated."""
    if name not in PARTITION_RULES:
        raise KeyError(f"no partition rule for parameter {name!r}; declare it in jaxdepth.core.parameters")
    spec = PARTITION_RULES[name]
    if len(spec) != len(shape):
        raise ValueError(f"partition rule for {name!r} has rank {len(spec)}, the parameter {len(shape)}")
    return P(*(axis if axis is None or shape[i] % mesh.shape[axis] == 0 else None for i, axis in enumerate(spec)))


def param_shardings(params_or_shapes, mesh: Mesh):
    """A pytree of `NamedSharding`s matching the params (arrays or ShapeDtypeStructs)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, param_spec(_leaf_name(path), x.shape, mesh)), params_or_shapes
    )


def shard_params(params, mesh: Mesh):
    """Place params on the mesh as `PARTITION_RULES` says."""
    return jax.device_put(params, param_shardings(params, mesh))


def to_host(x) -> np.ndarray:
    """A computed array as numpy on this host, whatever its sharding. An array that spans
    devices of other processes (multi-host) is gathered from them first, a collective: every
    process must make the same call."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(x)


def is_writer() -> bool:
    """Whether this process writes results, figures and tables: process 0 (of one or many)."""
    return jax.process_index() == 0


def writer_decides(flag: bool) -> bool:
    """Process 0's `flag`, on every process (itself with one process): choices that decide which
    computations run (reuse a cached result or compute it) must agree, or the processes'
    collectives never meet."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.bool_(flag)))


def data_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Leading axis on `data`, the rest replicated: for prompts and sweep members."""
    return NamedSharding(mesh, P(DATA, *([None] * (ndim - 1))))
