"""Run under torchrun (gloo): `save OUT CKPT STEPS` takes STEPS batches on each rank of a Loader over
a mix of two key lists and saves its state with `torch.distributed.checkpoint` through
`aioloader.DataCheckpoint`; `resume OUT CKPT` loads it on this world size and finishes the epoch.
Each rank writes what it took to OUT/<mode>-rank<r>.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import aioloader


def make() -> aioloader.Loader[Any]:
    both = aioloader.mix([list(range(60)), list(range(100, 137))], [2, 1], seed=4)
    return aioloader.Loader(both, batch_size=4, collate=list)  # rank, world: the process group


def main(mode: str, out: Path, checkpoint: str, steps: int) -> None:
    dist.init_process_group("gloo")
    taken: list[int] = []
    with make() as loader:
        if mode == "save":
            it = iter(loader)
            for _ in range(steps):
                taken += next(it)
            dcp.save({"data": aioloader.DataCheckpoint(loader)}, checkpoint_id=checkpoint)
            it.close()  # type: ignore[attr-defined]
        else:
            dcp.load({"data": aioloader.DataCheckpoint(loader)}, checkpoint_id=checkpoint)
            taken = [k for batch in loader for k in batch]
    (out / f"{mode}-rank{dist.get_rank()}.json").write_text(json.dumps(taken))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 0)
