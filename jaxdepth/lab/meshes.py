"""The device mesh a command asks for (`--mesh DATAxMODEL`, `--distributed`), shared by the
`run` and `map` commands."""

from __future__ import annotations

__all__ = [
    "mesh_from_args",
]


def mesh_from_args(args):
    """The device mesh of `--mesh DATAxMODEL` (after `--distributed` start-up), or None."""
    import jax

    from jaxdepth.core import sharding

    if args.distributed:
        sharding.initialize_distributed(
            **{
                k: v
                for k, v in (
                    ("coordinator_address", args.coordinator),
                    ("num_processes", args.num_processes),
                    ("process_id", args.process_id),
                )
                if v is not None
            }
        )
    if not args.mesh:
        return None
    mesh = sharding.mesh_from_spec(args.mesh)
    print(
        f"mesh {args.mesh} (data x model) over {jax.device_count()} devices in {jax.process_count()} "
        f"processes; this is process {jax.process_index()}"
    )
    return mesh
