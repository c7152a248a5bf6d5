"""Run under torchrun (gloo): `save OUT CKPT STEPS [DPxTP]` takes STEPS batches on each rank of a
Loader over a mix of two key lists and saves its state with `torch.distributed.checkpoint` through
`aioloader.DataCheckpoint`; `resume OUT CKPT 0 [DPxTP]` loads it on this world size and finishes
the epoch. With DPxTP, the ranks form that device mesh and the loader shares by its "dp" part.
Each rank writes what it took (and its mesh coordinate) to OUT/<mode>-rank<r>.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import aioloader


def make(mesh: Any) -> aioloader.Loader[Any]:
    both = aioloader.mix([list(range(60)), list(range(100, 137))], [2, 1], seed=4)
    # rank, world: the mesh's "dp" part, else the process group
    return aioloader.Loader(both, batch_size=4, collate=list, mesh=mesh)


def main(mode: str, out: Path, checkpoint: str, steps: int, shape: str | None) -> None:
    dist.init_process_group("gloo")
    mesh, coordinate = None, None
    if shape is not None:
        from torch.distributed.device_mesh import init_device_mesh

        dp, tp = (int(n) for n in shape.split("x"))
        world_mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        mesh, coordinate = world_mesh["dp"], world_mesh.get_coordinate()
    taken: list[int] = []
    with make(mesh) as loader:
        if mode == "save":
            it = iter(loader)
            for _ in range(steps):
                taken += next(it)
            dcp.save({"data": aioloader.DataCheckpoint(loader)}, checkpoint_id=checkpoint)
            it.close()  # type: ignore[attr-defined]
        else:
            dcp.load({"data": aioloader.DataCheckpoint(loader)}, checkpoint_id=checkpoint)
            taken = [k for batch in loader for k in batch]
    record = taken if shape is None else {"coordinate": coordinate, "taken": taken}
    (out / f"{mode}-rank{dist.get_rank()}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0], Path(args[1]), args[2], int(args[3]) if len(args) > 3 else 0,
         args[4] if len(args) > 4 else None)  # fmt: skip
