"""Run under `torchrun --nproc_per_node=4`: a 2 (data) x 2 (tensor) device mesh on gloo; each
process reads an epoch through `Loader(..., mesh=world_mesh["dp"])`, then a mix of two key lists,
packed, the same way, and writes what it took to <out>/rank<r>.json with its mesh coordinate."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import aioloader


def tokens(key: int) -> np.ndarray:
    return np.arange(key % 7 + 1, dtype=np.int64) + 100 * key


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    world_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = world_mesh["dp"]
    with aioloader.Loader(range(40), float, batch_size=4, collate=list, shuffle=True,
                          seed=3, mesh=dp) as loader:  # fmt: skip
        keys = [[int(k) for k in batch] for batch in loader]
        state = loader.state_dict()
    both = aioloader.mix([list(range(30)), list(range(100, 130))], [1, 1], seed=2)
    with aioloader.Loader(both, decode=tokens, batch_size=None, collate=None, mesh=dp) as docs, \
            aioloader.pack(docs, 8, batch_size=2, eos=-1) as packed:  # fmt: skip
        rows = [batch.tolist() for batch in packed]
    record = {"coordinate": world_mesh.get_coordinate(), "keys": keys, "rows": rows,
              "place": [state["rank"], state["world_size"]]}  # fmt: skip
    dist.barrier()
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
