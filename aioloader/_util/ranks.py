"""Which rank this process is and how many there are."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["mesh_rank", "resolve_rank"]


def resolve_rank(rank: int | None, world_size: int | None, mesh: Any = None) -> tuple[int, int]:
    """(rank, world_size): the explicit arguments when given, else this process's place in `mesh`
    (`mesh_rank`), else those of an initialised torch.distributed process group, else the RANK /
    WORLD_SIZE environment variables, else (0, 1).

    Raises ValueError naming the argument when the pair is incomplete or out of range, or given
    with a mesh.
    """
    if mesh is not None:
        if rank is not None or world_size is not None:
            raise ValueError("mesh: give the data-parallel mesh or rank and world_size, not both")
        rank, world_size = mesh_rank(mesh)
    if rank is None and world_size is None:
        rank, world_size = _detect()
    if rank is None or world_size is None:
        raise ValueError("rank and world_size must be given together (or neither)")
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    return rank, world_size


def mesh_rank(mesh: Any) -> tuple[int, int]:
    """(rank, world_size) of this process in `mesh`, the data-parallel part of a
    `torch.distributed.device_mesh.DeviceMesh` (`world_mesh["dp"]`, or several dimensions:
    `world_mesh["dp_replicate", "dp_shard"]`, numbered row-major): the processes that differ only
    in the mesh's other dimensions (tensor, pipeline, context parallel) get the same place, so they
    read the same batches, in the same order.

    Raises TypeError for what is not a DeviceMesh, ValueError when this process is not in it.
    """
    coordinate = getattr(mesh, "get_coordinate", None)
    if not callable(coordinate):
        raise TypeError(
            f"mesh: expected a torch.distributed DeviceMesh (its data-parallel part, e.g. "
            f"world_mesh['dp']), got {type(mesh).__name__}"
        )
    here = coordinate()
    if here is None:
        raise ValueError("mesh: this process is not one of the mesh's ranks")
    rank, world_size = 0, 1
    for place, size in zip(here, tuple(mesh.shape), strict=True):
        rank, world_size = rank * size + int(place), world_size * int(size)
    return rank, world_size


def _detect() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    env_rank, env_world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if env_rank is not None and env_world is not None:
        try:
            return int(env_rank), int(env_world)
        except ValueError:
            raise ValueError(
                f"RANK={env_rank!r} / WORLD_SIZE={env_world!r} are not integers"
            ) from None
    return 0, 1
