"""Run under `torchrun --nproc_per_node=2`: a tiny DDP model trains two epochs fed by aioloader.

Writes <out>/rank<r>.json: the keys each epoch delivered to this rank and the steps it took.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import aioloader

N_KEYS = 50


async def fetch(key: int) -> dict[str, torch.Tensor]:
    return {"x": torch.full((4,), float(key)), "key": torch.tensor(key)}


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    record: dict[str, list[list[int]] | list[int]] = {"keys": [], "steps": []}
    with aioloader.Loader(list(range(N_KEYS)), fetch, batch_size=4, shuffle=True, seed=1) as loader:
        for epoch in range(2):
            loader.set_epoch(epoch)
            keys: list[int] = []
            steps = 0
            for batch in loader:
                loss = model(batch["x"]).pow(2).mean()
                opt.zero_grad()
                loss.backward()  # all-reduce: a rank with an extra step would hang here
                opt.step()
                keys += batch["key"].tolist()
                steps += 1
            record["keys"].append(keys)  # type: ignore[arg-type]
            record["steps"].append(steps)  # type: ignore[arg-type]
    dist.barrier()
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
